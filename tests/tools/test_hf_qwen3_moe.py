"""Megatron-LM's MoE with Qwen3's attention <-> Hugging Face `Qwen3MoeForCausalLM` (issue 58).

Export: random models of our code (every weight random), exported at the state-dict level,
load with `AutoModelForCausalLM` / `AutoTokenizer` with no missing or unexpected weight and
read a prompt as ours does: the same ids and greedy tokens, logits up to the rounding of fp32
sums in another order. Two variants: top-2 of 8 experts renormalized (`norm_topk_prob`) with
the first layer dense (`mlp_only_layers`), grouped-query attention with QK norm, untied output
layer; and top-3 of 4 unnormalized (`--moe-router-pre-softmax`) in every layer, tied. Imported
back: our weights bit for bit, args building the same model. A random `Qwen3MoeForCausalLM`
saved by transformers (every other layer an MoE layer by `decoder_sparse_step` 2) imports
with its logits. What either side cannot compute is refused in one line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.checkpointing.huggingface import hf_architecture, model_config  # noqa: E402
from megatron.checkpointing.huggingface_qwen3_moe import qwen3_moe_differences  # noqa: E402
from megatron.checkpointing.shards import CheckpointConversionError  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import MERGE_FILE, VOCAB_FILE  # noqa: E402
from tests.one_line_errors import assert_one_line_error  # noqa: E402
from tests.tolerances import assert_close_reordered  # noqa: E402
from tests.tools.hf_reader import read  # noqa: E402
from tests.tools.hf_routed_moe import (  # noqa: E402
    LLAMA_STYLE,
    export_folder,
    import_folder,
    our_reading,
    random_routed_checkpoint,
    read_config,
    routed_args,
    routed_forward_terms,
)
from tests.tools.test_hf_conversion import our_logits, same_model  # noqa: E402
from tests.tools.test_hf_transformers4 import NEW_TOKENS, PROMPT  # noqa: E402
from tools.checkpoint import convert_from_hf  # noqa: E402

QWEN3_MOE = "Qwen3MoeForCausalLM"
VARIANT_ARGS = {
    "first dense, top-2": routed_args(
        {**LLAMA_STYLE, "num_layers": 3, "qk_layernorm": True, "kv_channels": 16},
        num_experts=8, moe_router_topk=2, moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=32,
    ),
    "all MoE, top-3 unnormalized, tied": routed_args(
        {**LLAMA_STYLE, "qk_layernorm": True, "untie_embeddings_and_output_weights": False},
        num_experts=4, moe_router_topk=3, moe_ffn_hidden_size=48, moe_router_pre_softmax=True,
    ),
}  # fmt: skip
ROUTED_FIELDS = ("num_experts", "moe_layers", "top_k", "ffn_hidden_size", "pre_softmax")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple]:
    """Variant -> (our random checkpoint, what our model reads from PROMPT, its export)."""
    root = tmp_path_factory.mktemp("hf_qwen3_moe")
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    found = {}
    for index, (variant, args) in enumerate(VARIANT_ARGS.items()):
        dense = random_routed_checkpoint(args)
        folder = str(root / f"variant{index}")
        assert export_folder(dense, folder) == QWEN3_MOE
        found[variant] = (dense, our_reading(dense, ids), folder)
    return found


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_reads_as_our_model_in_transformers(exports, variant):
    dense, ours, hf_dir = exports[variant]
    theirs = read(hf_dir, PROMPT, NEW_TOKENS)
    assert (theirs["architecture"], theirs["dtype"]) == (QWEN3_MOE, torch.float32)
    assert theirs["missing"] == theirs["unexpected"] == []
    assert theirs["ids"] == ours["ids"]
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"], terms=terms)
    assert theirs["greedy"] == ours["greedy"]


def test_config_json_says_what_the_model_computes(exports):
    config = read_config(exports["first dense, top-2"][2])
    expected = dict(
        model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
        head_dim=16, num_key_value_heads=2, attention_bias=False, use_sliding_window=False,
        tie_word_embeddings=False,
    )  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    other = read_config(exports["all MoE, top-3 unnormalized, tied"][2])
    assert (other["norm_topk_prob"], other["mlp_only_layers"]) == (False, [])


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_then_import_gives_our_model_back(exports, tmp_path, variant):
    dense, ours, hf_dir = exports[variant]
    back = import_folder(hf_dir, str(tmp_path / "back"))
    assert set(back.state_dict) == set(dense.state_dict)
    assert all(torch.equal(back.state_dict[name], t) for name, t in dense.state_dict.items())
    assert same_model(back.args, dense.args)
    moe, expected = model_config(back.args).routed_moe, model_config(dense.args).routed_moe
    assert all(getattr(moe, f) == getattr(expected, f) for f in ROUTED_FIELDS)
    logits = our_logits(back.state_dict, back.args, torch.tensor([ours["ids"]]))[0]
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(logits, ours["logits"], terms=terms)


def test_import_of_a_qwen3_moe_saved_by_transformers(tmp_path):
    """Every other layer an MoE layer (decoder_sparse_step 2), top-3 of 8 renormalized."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, max_position_embeddings=32, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(("norm" in name) + torch.randn_like(tensor) * 0.2)
    model.save_pretrained(str(tmp_path / "hf"))
    loaded = import_folder(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert loaded.args["moe_layer_freq"] == [0, 1, 0, 1] and loaded.args["kv_channels"] == 16
    assert loaded.args["qk_layernorm"] and not loaded.args["moe_router_pre_softmax"]
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
    ours = our_logits(loaded.state_dict, loaded.args, tokens)
    terms = routed_forward_terms(model_config(loaded.args), tokens.numel())
    assert_close_reordered(ours, expected, terms=terms)


NOT_QWEN3_MOE = {
    "no qk norm": (dict(qk_layernorm=False), "no QK norm (--qk-layernorm"),
    "expert bias": (
        dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
        "--moe-router-score-function sigmoid",
    ),
    "scaling": (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor"),
    "biases": (dict(add_bias_linear=True), "linear biases (Qwen3-MoE: none"),
}


@pytest.mark.parametrize("case", sorted(NOT_QWEN3_MOE))
def test_what_qwen3_moe_cannot_compute_is_named(case):
    changes, named = NOT_QWEN3_MOE[case]
    config = model_config({**VARIANT_ARGS["first dense, top-2"], **changes})
    assert any(named in text for text in qwen3_moe_differences(config))
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    assert "\n" not in str(error.value)


QWEN3_MOE_CONFIG = dict(
    model_type="qwen3_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
    num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32, vocab_size=300,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8,
)  # fmt: skip
NOT_IMPORTED = {
    "sliding window": (dict(use_sliding_window=True), [], "use_sliding_window=true"),
    "attention bias": (dict(attention_bias=True), [], "attention_bias=true"),
    "no MoE layer": (dict(mlp_only_layers=[0, 1]), [], "leave no MoE layer"),
    "sparse step": (dict(decoder_sparse_step=0), [], "decoder_sparse_step=0"),
    "deepspeed family": ({}, ["--moe-family", "deepspeed"], "--moe-family deepspeed"),
    "tensor parallel": ({}, ["--target-tensor-parallel-size", "2"], "--target-tensor-parallel"),
}


@pytest.mark.parametrize("case", sorted(NOT_IMPORTED))
def test_import_refuses_what_our_model_cannot_compute_in_one_line(tmp_path, capsys, case):
    changes, flags, named = NOT_IMPORTED[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**QWEN3_MOE_CONFIG, **changes}))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours"), *flags]
    assert_one_line_error(convert_from_hf.main(argv), capsys.readouterr().err, named)
    assert not (tmp_path / "ours").exists()
