"""Megatron-LM's sharded-data-parallel flags: what each spelling means here (the layout's
`sharding`, run on torch FSDP2), and a one-line refusal naming the flag for each combination
that is not built or that FSDP2 cannot express."""

from __future__ import annotations

import json

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.layout import Engine

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


def validated(extra: str, world_size: int = 4):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


@pytest.mark.parametrize(
    "flags, sharding",
    [
        ("", "none"),
        ("--use-distributed-optimizer", "optim_grads"),
        ("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather", "optim_grads"),
        ("--use-torch-fsdp2", "optim_grads_params"),
        ("--use-megatron-fsdp", "none"),  # Megatron-LM's default strategy: no_shard
        ("--use-megatron-fsdp --data-parallel-sharding-strategy no_shard", "none"),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "optim_grads"),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
            "--use-distributed-optimizer",
            "optim_grads_params",
        ),
        ("--use-custom-fsdp --data-parallel-sharding-strategy optim_grads", "optim_grads"),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard "
            "--use-distributed-optimizer",
            "optim_grads",
        ),
        ("--use-distributed-optimizer --bf16 --grad-reduce-in-bf16", "optim_grads"),
        ("--use-distributed-optimizer --context-parallel-size 2", "optim_grads"),
        ("--use-torch-fsdp2 --pipeline-model-parallel-size 2", "optim_grads_params"),
    ],
)
def test_each_spelling_means_one_strategy(flags: str, sharding: str) -> None:
    layout = validated(flags).layout
    engine = Engine.MEGATRON_SCHEDULES if layout.pipelined else Engine.PLAIN
    assert layout.engine is engine and layout.sharding == sharding
    if sharding != "none":
        assert layout.describe().endswith(f"FSDP2 {sharding} on {engine.value}")


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim",
            "--data-parallel-sharding-strategy optim: ZeRO-1 (whole gradients, sharded "
            "optimizer state) has no torch FSDP2 setting",
        ),
        (
            "--data-parallel-sharding-strategy optim_grads",
            "--data-parallel-sharding-strategy optim_grads needs --use-megatron-fsdp",
        ),
        ("DS --use-distributed-optimizer", "--use-distributed-optimizer with --deepspeed"),
        ("DS --use-torch-fsdp2", "--use-torch-fsdp2 with --deepspeed: DeepSpeed shards with ZeRO"),
        ("--grad-reduce-in-bf16 --bf16", "--grad-reduce-in-bf16 needs --bf16 and sharded"),
        ("--use-distributed-optimizer --grad-reduce-in-bf16", "--grad-reduce-in-bf16 needs"),
        (
            "--use-distributed-optimizer --num-experts 4",
            "--use-distributed-optimizer with --num-experts 4: FSDP2 over expert layers is not "
            "built here",
        ),
    ],
)
def test_refusals_name_the_flag(tmp_path, extra: str, words: str) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    extra = extra.replace("DS", f"--deepspeed --deepspeed_config {config}")
    with pytest.raises(ArgumentError) as error:
        validated(extra)
    assert words in str(error.value), str(error.value)
    assert "\n" not in str(error.value)
