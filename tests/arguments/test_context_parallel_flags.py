"""`--context-parallel-size` / `--cp-comm-type`: Megatron-LM's meaning (data-parallel size =
world / (TP x CP x PP)), the gradient factor each engine needs, and a one-line refusal naming
the flags for each combination context parallelism does not run."""

from __future__ import annotations

import json

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.config import ModelConfig
from megatron.layout import Engine
from megatron.settled_args import with_settled

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


def _deepspeed(tmp_path, stage: int = 0) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return f"--deepspeed --deepspeed_config {path} --zero-stage {stage}"


def validated(extra: str, world_size: int = 4):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    args = validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))
    return with_settled(args, padded_vocab_size=128)  # what the tokenizer adds at start-up


def test_data_parallel_size_is_world_over_tp_cp_pp() -> None:
    args = validated("--context-parallel-size 2 --tensor-model-parallel-size 2", world_size=8)
    assert (args.context_parallel_size, args.data_parallel_size) == (2, 2)
    layout = args.layout
    assert (layout.context_parallel, layout.data_parallel, layout.sequence_split) == (2, 2, 2)
    assert layout.describe() == "TP 2 x CP 2 x PP 1 x DP 2, fp32 on plain"
    assert layout.optimizer_sharded_ranks == 4
    # DDP averages over data x context ranks, whose parts of each sequence must add up.
    assert args.layout.sequence_split_gradient_scale == 2
    assert ModelConfig.from_args(args).sequence_split_gradient_scale == 2


@pytest.mark.parametrize("stage, scale", [(0, 1), (1, 1), (2, 1), (3, 2)])
def test_deepspeed_sums_the_context_ranks_except_zero3(tmp_path, stage, scale) -> None:
    args = validated(
        f"{_deepspeed(tmp_path, stage)} --no-pipeline-parallel --context-parallel-size 2"
    )
    assert args.layout.engine is Engine.DEEPSPEED
    assert args.layout.sequence_split_gradient_scale == scale


def test_megatron_schedules_run_it() -> None:
    args = validated("--context-parallel-size 2 --pipeline-model-parallel-size 2")
    assert args.layout.engine is Engine.MEGATRON_SCHEDULES
    assert args.layout.sequence_split_gradient_scale == 2


def test_comm_type_per_layer() -> None:
    config = ModelConfig.from_args(
        validated("--context-parallel-size 2 --cp-comm-type p2p allgather")
    )
    assert config.cp_comm_types == ("p2p", "allgather")
    config = ModelConfig.from_args(validated("--context-parallel-size 2 --cp-comm-type a2a"))
    assert config.cp_comm_types == ("a2a", "a2a")


def test_any_key_value_head_count_with_p2p() -> None:
    """Where Ulysses stops at the key/value heads, the ring takes one head."""
    args = validated("--context-parallel-size 4 --num-key-value-heads 1")
    assert args.layout.context_parallel == 4


@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_windows_and_packed_documents_run_with_every_comm_type(comm_type: str) -> None:
    """Sliding windows and --reset-attention-mask's document masks across the ranks
    (tests/core/test_context_parallel.py, tests/training/test_context_parallel_runs.py)."""
    args = validated(
        f"--context-parallel-size 2 --cp-comm-type {comm_type} --window-size (8,0) "
        "--reset-attention-mask --reset-position-ids"
    )
    assert args.layout.context_parallel == 2
    config = ModelConfig.from_args(args)
    assert config.window_size == (8, 0) and config.cp_comm_types == (comm_type, comm_type)


@pytest.mark.parametrize(
    "extra, world, words",
    [
        (
            "DS --context-parallel-size 2",
            4,
            "--context-parallel-size 2 needs --no-pipeline-parallel under --deepspeed",
        ),
        (
            "--context-parallel-size 2 --ds-sequence-parallel-size 2",
            4,
            "--context-parallel-size 2 with --ds-sequence-parallel-size 2: both split",
        ),
        (
            "--context-parallel-size 4",
            6,
            "world size (6) is not divisible by --tensor-model-parallel-size (1) x "
            "--pipeline-model-parallel-size (1) x --context-parallel-size (4) = 4",
        ),
        (
            "--context-parallel-size 4 --seq-length 20 --max-position-embeddings 20",
            4,
            "--seq-length (20) is not divisible by 2 x --context-parallel-size 4",
        ),
        ("--context-parallel-size 0", 4, "--context-parallel-size (0) must be at least 1"),
        (
            "--context-parallel-size 2 --cp-comm-type a2a --num-key-value-heads 1",
            4,
            "--cp-comm-type a2a: --num-key-value-heads (1) is not divisible by tensor x "
            "context parallel size (1 x 2)",
        ),
        (
            "--context-parallel-size 2 --cp-comm-type a2a+p2p",
            4,
            "--cp-comm-type a2a+p2p / --hierarchical-context-parallel-sizes: hierarchical",
        ),
        (
            "--context-parallel-size 2 --hierarchical-context-parallel-sizes 2 1",
            4,
            "hierarchical context parallelism is not built here",
        ),
        (
            "--context-parallel-size 2 --cp-comm-type p2p p2p a2a",
            4,
            "--cp-comm-type takes one value or one per layer (2), got 3",
        ),
        (
            "--context-parallel-size 2 --num-experts 4",
            4,
            "--context-parallel-size 2 with --num-experts: Mixture-of-Experts with context",
        ),
    ],
)
def test_refusals_name_the_flags(tmp_path, extra, world, words) -> None:
    extra = extra.replace("DS", _deepspeed(tmp_path))
    with pytest.raises(ArgumentError) as error:
        validated(extra, world)
    assert words in str(error.value), str(error.value)
    assert "\n" not in str(error.value)
