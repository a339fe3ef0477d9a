"""The patterns DeepSpeed's `ds_to_universal` merges our tensor-parallel shards by, read off the
splits the layers declare (checkpointing/deepspeed_engine.py `universal_checkpoint_info`),
against Megatron-DeepSpeed's rules written by parameter name (`megatron_deepspeed_patterns`,
the table this code held before: the oracle): every parameter of each model falls in the same
categories, for the whole GPT's names and for DeepSpeed's `PipelineModule`'s, and every
pattern matches a parameter (DeepSpeed refuses one that matches none)."""

from __future__ import annotations

import re

import pytest
from deepspeed.checkpoint.constants import (
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    VOCABULARY_PARAMETER_PATTERNS,
)

from megatron.arguments import build_parser, validate_args
from megatron.checkpointing.deepspeed_engine import universal_checkpoint_info
from megatron.config import ModelConfig
from megatron.model.pipeline import gpt_to_pipeline_name
from megatron.model.sharding import model_splits
from megatron.settled_args import with_settled

BASE = (
    "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --tensor-model-parallel-size 2"
)
MODELS = {
    "gpt2": "",
    "llama": (
        "--swiglu --normalization RMSNorm --use-rotary-position-embeddings "
        "--no-position-embedding --disable-bias-linear --untie-embeddings-and-output-weights "
        "--num-key-value-heads 2"
    ),
    "qk-layernorm": "--qk-layernorm --untie-embeddings-and-output-weights",
}
CATEGORIES = (
    VOCABULARY_PARAMETER_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
)


def megatron_deepspeed_patterns(args, pipe: bool) -> dict[str, list[str]]:
    """Megatron-DeepSpeed's rules by parameter name (the oracle)."""
    layer = r"\d+\." if pipe else r"language_model\.encoder\.layers\.\d+\."
    untied = args.untie_embeddings_and_output_weights
    if pipe:
        embedding = r"0\." if untied else r"tied_modules\.embed\."
    else:
        embedding = r"language_model\.embedding\."
    vocabulary = [embedding + r"word_embeddings\.weight"]
    if untied:
        vocabulary.append(r"\d+\.lm_head\." if pipe else r"language_model\.output_layer\.")
    final_norm = r"\d+\.(weight|bias)$" if pipe else r"language_model\.encoder\.final_layernorm\."
    replicated = [layer + r"(input|post_attention)_layernorm\.", final_norm]
    if args.qk_layernorm:
        replicated.append(layer + r"self_attention\.(q|k)_layernorm\.")
    if args.add_position_embedding and not args.use_rotary_position_embeddings:
        replicated.append(embedding + r"position_embeddings\.weight")
    if args.add_bias_linear:
        replicated += [layer + r"self_attention\.dense\.bias", layer + r"mlp\.dense_4h_to_h\.bias"]
    patterns = {
        VOCABULARY_PARAMETER_PATTERNS: vocabulary,
        TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [
            layer + r"self_attention\.dense\.weight",
            layer + r"mlp\.dense_4h_to_h\.weight",
        ],
    }
    if args.swiglu:
        patterns[PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = [layer + r"mlp\.dense_h_to_4h\."]
    return patterns


def _categories(patterns: dict, name: str) -> set[str]:
    return {key for key in CATEGORIES if any(re.match(p, name) for p in patterns.get(key, ()))}


@pytest.mark.parametrize("pipe", [False, True], ids=["gpt", "pipeline-module"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_parameter_is_merged_as_megatron_deepspeed_merges_it(model: str, pipe: bool):
    args = validate_args(build_parser().parse_args(f"{BASE} {MODELS[model]}".split()), 2)
    args = with_settled(args, padded_vocab_size=256, true_vocab_size=250)
    config = ModelConfig.from_args(args)
    names = list(model_splits(config, parameters_only=True))
    if pipe:
        tied = not config.untie_embeddings_and_output_weights
        names = [gpt_to_pipeline_name(name, config.num_layers, tied) for name in names]
    info = universal_checkpoint_info(args, pipe)
    expected = megatron_deepspeed_patterns(args, pipe)
    for name in names:
        assert _categories(info, name) == _categories(expected, name), name
    for key in CATEGORIES:
        for pattern in info.get(key, ()):
            assert any(re.match(pattern, name) for name in names), pattern
    assert (info["original_vocab_size"], info["padded_vocab_size"]) == (250, 256)


def test_at_tp_1_only_the_vocabulary_is_named():
    args = validate_args(build_parser().parse_args(BASE.replace("size 2", "size 1").split()), 1)
    args = with_settled(args, padded_vocab_size=256, true_vocab_size=250)
    info = universal_checkpoint_info(args, False)
    assert info[VOCABULARY_PARAMETER_PATTERNS] == [
        r"language_model\.embedding\.word_embeddings\.weight$"
    ]
    assert not any(key in info for key in CATEGORIES[1:])
