"""Megatron-LM's gpt-oss flags (issue 58): what they set in the model's config, what
`--enable-gpt-oss` stands for, their one-line refusals, and `--use-checkpoint-args` keeping
them."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.arguments import ArgumentError, parse_args
from megatron.config import ModelConfig
from megatron.settled_args import with_settled
from megatron.yarn_config import YarnConfig, gpt_oss_yarn
from tests.arguments.test_mla_flags import validated
from tests.conftest import MERGE_FILE, VOCAB_FILE

GPT_OSS = (
    "--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 "
    "--softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2 "
    "--position-embedding-type yarn --rotary-scaling-factor 32 "
    "--yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int"
)


def _config(extra: str) -> ModelConfig:
    return ModelConfig.from_args(with_settled(validated(extra), padded_vocab_size=128))


def test_the_flags_mean_gpt_oss_layers() -> None:
    config = _config(GPT_OSS)
    assert (config.activation, config.glu_linear_offset, config.activation_clamp_value) == (
        "quick_geglu",
        1.0,
        7.0,
    )
    assert config.softmax_type == "learnable" and config.glu_keeps_input_only
    assert [config.layer_window(n) for n in (1, 2)] == [(127, 0), None]
    assert config.position_embedding_type == "yarn" and config.rotary
    assert config.yarn == YarnConfig(
        scaling_factor=32.0, original_max_position_embeddings=4096, round_to_int=False
    )
    pattern = _config("--window-size 7,0 --window-attn-skip-freq [1,0]").window_attn_skip_freq
    assert pattern == (1, 0)
    assert _config("").yarn is None and _config("").softmax_type == "vanilla"


def test_enable_gpt_oss_sets_megatron_lms_yarn_over_the_command_line() -> None:
    """As Megatron-LM's ModelOpt builder: yarn positions with its values, whatever
    --position-embedding-type and --rotary-scaling-factor say."""
    config = _config("--enable-gpt-oss --position-embedding-type rope --rotary-scaling-factor 4")
    assert config.position_embedding_type == "yarn" and config.yarn == gpt_oss_yarn()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--softmax-type learnable --multi-latent-attention", "--multi-latent-attention"),
        ("--quick-geglu --swiglu", "--quick-geglu and --swiglu"),
        ("--glu-linear-offset 1.0", "--glu-linear-offset 1.0 applies to a gated activation"),
        ("--swiglu --activation-func-clamp-value -1", "must be positive"),
        ("--window-size 7,0 --window-attn-skip-freq [1,0,1]", "the pattern has 3 entries"),
        ("--window-attn-skip-freq 0", "--window-attn-skip-freq 0"),
        ("--rope-type yarn", "--position-embedding-type yarn"),
    ],
)
def test_what_cannot_run_stops_in_one_line(extra: str, message: str) -> None:
    with pytest.raises(ArgumentError) as error:
        validated(extra)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--context-parallel-size 2", "--context-parallel-size"),
        ("--ds-sequence-parallel-size 2", "DeepSpeed-Ulysses"),
    ],
)
def test_sinks_with_a_split_sequence_are_refused_in_one_line(extra: str, message: str) -> None:
    with pytest.raises(ArgumentError) as error:
        validated(f"--softmax-type off-by-one {extra}", world_size=2)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_use_checkpoint_args_keeps_every_gpt_oss_flag(tmp_path) -> None:
    """A checkpoint saved with gpt-oss's flags resumes from them alone."""
    args = validated(GPT_OSS)
    directory = tmp_path / "iter_0000005" / "mp_rank_00"
    directory.mkdir(parents=True)
    content = {"args": argparse.Namespace(**vars(args)), "checkpoint_version": 3.0, "iteration": 5}
    torch.save(content, directory / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    argv = (
        f"--micro-batch-size 1 --train-iters 10 --lr 1e-3 --dry-run --vocab-file {VOCAB_FILE} "
        f"--merge-file {MERGE_FILE} --load {tmp_path} --use-checkpoint-args"
    ).split()
    resumed = parse_args(argv, world_size=1)
    for name in (
        "quick_geglu",
        "glu_linear_offset",
        "activation_func_clamp_value",
        "softmax_type",
        "window_size",
        "window_attn_skip_freq",
        "position_embedding_type",
        "rotary_scaling_factor",
        "yarn_original_max_position_embeddings",
        "yarn_correction_range_round_to_int",
    ):
        assert getattr(resumed, name) == getattr(args, name), name
