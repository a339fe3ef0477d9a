"""`--mtp-num-layers` and `--mtp-loss-scaling-factor` (Megatron-LM's flags and defaults), and
what multi-token prediction does not run with, refused in one line naming the flag."""

from __future__ import annotations

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.config import ModelConfig
from megatron.deepseek_config import MTPConfig
from megatron.settled_args import with_settled

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 1 --lr 1e-4 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --position-embedding-type rope"
)


def validated(extra: str = "", world_size: int = 1):  # noqa: ANN201
    """The validated namespace of BASE + `extra`; ArgumentError escapes."""
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def model_config(extra: str = "") -> ModelConfig:
    return ModelConfig.from_args(with_settled(validated(extra), padded_vocab_size=128))


def test_defaults_and_config() -> None:
    assert validated("--mtp-num-layers 2").mtp_loss_scaling_factor == 0.1  # Megatron-LM's
    config = model_config("--mtp-num-layers 2")
    assert config.mtp == MTPConfig(num_layers=2, loss_scaling_factor=0.1)
    assert not config.compile_whole_model  # the MTP losses leave through autograd hooks
    assert model_config().mtp is None
    assert model_config("--mtp-num-layers 1 --calculate-per-token-loss").mtp.per_token_loss


@pytest.mark.parametrize(
    ("extra", "world_size", "named"),
    [
        ("--mtp-num-layers 0", 1, "--mtp-num-layers 0"),
        ("--mtp-num-layers 1 --context-parallel-size 2", 2, "--context-parallel-size"),
        ("--mtp-num-layers 1 --deepspeed", 1, "--mtp-num-layers 1 does not run on DeepSpeed's"),
        (
            "--mtp-num-layers 1 --pipeline-model-parallel-size 2 --position-embedding-type "
            "learned_absolute",
            2,
            "learned absolute position embeddings",
        ),
    ],
)
def test_refused_in_one_line(extra: str, world_size: int, named: str) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(extra, world_size)
    message = str(refused.value)
    assert named in message and "\n" not in message, message


def test_runs_on_the_other_engines() -> None:
    assert validated("--mtp-num-layers 1 --deepspeed --no-pipeline-parallel").mtp_num_layers == 1
    assert validated("--mtp-num-layers 1 --pipeline-model-parallel-size 2", 2).mtp_num_layers == 1


def test_recompute_modules_flag() -> None:
    """Megatron-LM's --recompute-modules (here with the flags tests of the DeepSeek-V3 recipe's
    other new flags): the list reaches the model under selective recomputation, core_attn by
    default, and without selective recomputation it is noted as without effect."""
    config = model_config("--recompute-granularity selective --recompute-modules mlp moe layernorm")
    assert (config.recompute_granularity, config.recompute_modules) == (
        "selective",
        ("mlp", "moe", "layernorm"),
    )
    assert model_config("--recompute-activations").recompute_modules == ("core_attn",)
    args = validated("--recompute-modules mlp")
    assert any("--recompute-modules mlp: accepted; no effect" in n for n in args.compat_notes)
    with pytest.raises(SystemExit):
        validated("--recompute-modules attention")  # not one of Megatron-LM's choices
