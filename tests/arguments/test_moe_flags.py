"""Megatron-DeepSpeed's MoE flags: their meanings reach the model config, MoE runs on
DeepSpeed's engine and without DeepSpeed (plain torch, Megatron's pipeline schedules), and every
layout DeepSpeed-MoE cannot run is refused in one line naming the flags."""

from __future__ import annotations

import json

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.config import ModelConfig
from megatron.layout import Engine
from megatron.settled_args import with_settled

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


@pytest.fixture
def deepspeed(tmp_path):
    def config(stage: int = 0) -> str:
        path = tmp_path / f"ds{stage}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        return f"--deepspeed --deepspeed_config {path}"

    return config


def validated(extra: str, world_size: int = 2):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    args = validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))
    args = with_settled(args, padded_vocab_size=128)
    return args


def test_megatron_deepspeed_meanings_reach_the_model(deepspeed) -> None:
    args = validated(
        f"{deepspeed()} --no-pipeline-parallel --num-experts 4 --moe-expert-parallel-size 2 "
        "--topk 2 --moe-train-capacity-factor 1.5 --moe-min-capacity 2 "
        "--disable-moe-token-dropping --disable-moe-top2-2nd-expert-sampling --mlp-type residual"
    )
    moe = ModelConfig.from_args(args).moe
    assert args.moe and moe.experts_per_layer == (1, 4, 1, 4)  # --expert-interval 2
    assert (moe.expert_parallel_size, moe.top_k, moe.train_capacity_factor) == (2, 2, 1.5)
    assert (moe.min_capacity, moe.drop_tokens, moe.top2_2nd_expert_sampling) == (2, False, False)
    assert moe.residual and not moe.expert_tensor_parallel


def test_per_layer_counts_and_interval(deepspeed) -> None:
    args = validated(f"{deepspeed(2)} --num-experts 2 4 8 16 --expert-interval 1")
    assert ModelConfig.from_args(args).moe.experts_per_layer == (2, 4, 8, 16)
    assert args.layout.engine is Engine.DEEPSPEED  # ZeRO-2 runs on DeepSpeed's plain engine


def test_layers_with_fewer_experts_than_ep_spread_over_their_experts(deepspeed) -> None:
    args = validated(
        f"{deepspeed()} --no-pipeline-parallel --num-experts 2 4 --expert-interval 2 "
        "--moe-expert-parallel-size 4",
        world_size=4,
    )
    assert any("min(EP, its experts)" in note for note in args.compat_notes)


@pytest.mark.parametrize("pipeline", [1, 2])
def test_moe_runs_without_deepspeed(pipeline: int) -> None:
    """Plain torch (PP 1) and Megatron's pipeline schedules (PP 2) take MoE at EP 1, TP 1."""
    args = validated(
        f"--num-experts 4 --topk 2 --moe-loss-coeff 0.25 --pipeline-model-parallel-size {pipeline}"
        " --global-batch-size 4",
        world_size=2,
    )
    moe = ModelConfig.from_args(args).moe
    engine = Engine.MEGATRON_SCHEDULES if pipeline > 1 else Engine.PLAIN
    assert args.moe and not args.deepspeed and args.layout.engine is engine
    assert (moe.experts_per_layer, moe.top_k, moe.loss_coeff) == ((1, 4, 1, 4), 2, 0.25)


def test_one_expert_is_a_dense_model(deepspeed) -> None:
    args = validated("--num-experts 1 --moe-loss-coeff 0.5 --topk 1")
    assert not args.moe and ModelConfig.from_args(args).moe is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "--num-experts 4 --moe-expert-parallel-size 2",
            "--moe-expert-parallel-size 2 needs --deepspeed --no-pipeline-parallel",
        ),
        (
            "--num-experts 4 --pipeline-model-parallel-size 2 --moe-expert-parallel-size 2",
            "--moe-expert-parallel-size 2 needs --deepspeed --no-pipeline-parallel",
        ),
        (
            "--num-experts 4 --tensor-model-parallel-size 2",
            "--num-experts 4 with --tensor-model-parallel-size 2 needs --deepspeed",
        ),
        ("{ds} --num-experts 4", "--num-experts 4 needs --no-pipeline-parallel"),
        (
            "{ds} --num-experts 4 --pipeline-model-parallel-size 2",
            "--num-experts 4 needs --no-pipeline-parallel (DeepSpeed's engine), or no --deepspeed",
        ),
        ("{ds3} --num-experts 4", "--num-experts 4 with --zero-stage 3: DeepSpeed-MoE supports"),
        (
            "{ds} --no-pipeline-parallel --num-experts 4 --tensor-model-parallel-size 2 "
            "--distributed-backend gloo",
            "--num-experts 4 with --tensor-model-parallel-size 2 needs NCCL (GPUs)",
        ),
        (
            "{ds} --no-pipeline-parallel --num-experts 4 --tensor-model-parallel-size 2 "
            "--distributed-backend nccl --sequence-parallel",
            "--num-experts 4 with --sequence-parallel",
        ),
        (
            "{ds} --no-pipeline-parallel --num-experts 4 --moe-expert-parallel-size 4",
            "--moe-expert-parallel-size 4 must divide the data-parallel size 2",
        ),
        (
            "{ds} --no-pipeline-parallel --num-experts 3 --moe-expert-parallel-size 2",
            "--num-experts 3: 3 experts cannot be spread evenly over --moe-expert-parallel-size 2",
        ),
        ("{ds} --no-pipeline-parallel --num-experts 4 --topk 3", "--topk 3: DeepSpeed-MoE routes"),
        (
            "{ds} --no-pipeline-parallel --num-experts 4 --moe-train-capacity-factor 0",
            "--moe-train-capacity-factor 0.0: must be above 0",
        ),
        (
            "{ds} --no-pipeline-parallel --num-experts 4 8 8",
            "--num-experts lists 3 values for 2 MoE layers",
        ),
        ("--num-experts 0", "--num-experts 0: must be at least 1"),
    ],
)
def test_layouts_deepspeed_moe_cannot_run_are_one_line(deepspeed, extra, message) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(extra.format(ds=deepspeed(), ds3=deepspeed(3)))
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_dry_run_plans_moe_with_tensor_parallelism_for_the_jobs_gpus(deepspeed) -> None:
    """On a host without GPUs, a dry run of MoE at TP=2 plans for the job's NCCL machines
    instead of refusing it for this host's missing NCCL (issue 36, defect 3); with
    --distributed-backend gloo it is still refused."""
    moe = f"{deepspeed()} --no-pipeline-parallel --num-experts 4 --tensor-model-parallel-size 2"
    args = validated(f"{moe} --dry-run --dry-run-world-size 4", world_size=4)
    assert args.moe and args.distributed_backend == "nccl"
    with pytest.raises(ArgumentError, match="needs NCCL"):
        validated(f"{moe} --distributed-backend gloo --dry-run --dry-run-world-size 4", 4)
