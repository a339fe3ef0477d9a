"""Megatron-LM's Muon flags: their defaults, where `--optimizer muon` runs, and a one-line
refusal naming the flag for each combination that is not built or would change its meaning."""

from __future__ import annotations

import json

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.training.muon import MuonConfig

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --train-iters 10 --lr 1e-3 "
    "--optimizer muon"
)
# DeepSpeed's Muon's update as Megatron-LM flags (megatron.arguments.muon_flags.DEEPSPEED_MUON).
DEEPSPEED_MUON = (
    "--muon-nesterov --muon-coefficient-type simple --muon-scale-mode shape_scaling "
    "--muon-no-split-qkv --clip-grad 0"
)


def validated(extra: str, world_size: int = 1):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_megatron_lm_defaults():
    """The flags' defaults are Megatron-LM's (arguments.py), read into the typed config."""
    args = validated("")
    config = MuonConfig.from_args(args)
    assert config == MuonConfig(qkv_split=(16, 16, 16))  # h=64, 4 heads of 16, no GQA
    assert (config.momentum, config.nesterov, config.coefficient_type) == (0.9, False, "quintic")
    assert (config.scale_mode, config.extra_scale_factor) == ("spectral", 1.0)
    assert (config.fp32_matmul_prec, config.tp_mode, config.num_ns_steps) == (
        "medium",
        "duplicated",
        5,
    )
    assert args.muon_scalar_optimizer == "adam"


def test_flags_reach_the_config():
    args = validated(
        "--muon-momentum 0.95 --muon-use-nesterov --muon-coefficient-type polar_express "
        "--muon-num-ns-steps 8 --muon-scale-mode unit_rms_norm --muon-extra-scale-factor 0.2 "
        "--muon-fp32-matmul-prec high --muon-tp-mode blockwise --muon-no-split-qkv "
        "--num-attention-heads 8 --group-query-attention --num-query-groups 2"
    )
    assert MuonConfig.from_args(args) == MuonConfig(
        momentum=0.95,
        nesterov=True,
        coefficient_type="polar_express",
        num_ns_steps=8,
        scale_mode="unit_rms_norm",
        extra_scale_factor=0.2,
        fp32_matmul_prec="high",
        tp_mode="blockwise",
        qkv_split=None,
    )
    grouped = MuonConfig.from_args(
        validated("--num-attention-heads 8 --group-query-attention --num-query-groups 2")
    )
    assert grouped.qkv_split == (32, 8, 8)  # 4 query heads of 8 per group, then k and v


def test_distributed_optimizer_spellings_run_muon_with_whole_state():
    """Megatron-LM's layer-wise distributed Muon is not built: the same updates, whole state."""
    for flags in ("--use-distributed-optimizer", "--optimizer dist_muon"):
        args = validated(flags, world_size=2)
        assert args.optimizer == "muon" and args.layout.sharding == "none"
        assert any("layer-wise" in note for note in args.compat_notes)


@pytest.mark.parametrize(
    "flags, named",
    [
        ("--fp16", "--fp16"),
        ("--use-torch-fsdp2", "--use-torch-fsdp2"),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "--use-megatron"),
        ("--muon-scalar-optimizer lion", "--muon-scalar-optimizer lion"),
        ("--muon-coefficient-type custom", "--muon-coefficient-type custom"),
        ("--muon-num-ns-steps 0", "--muon-num-ns-steps"),
        ("--muon-coefficient-type cubic5 --muon-num-ns-steps 4", "--muon-num-ns-steps 5"),
        ("--deepspeed --zero-stage 0 --ckpt-format torch_dist", "--ckpt-format torch_dist"),
        (f"--deepspeed --zero-stage 1 --bf16 {DEEPSPEED_MUON}", "BF16_Optimizer"),
    ],
)
def test_refused_in_one_line(flags: str, named: str):
    with pytest.raises(ArgumentError, match=named) as error:
        validated(flags, world_size=2)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_client_optimizer_runs_every_flag(zero: int):
    """fp32 ZeRO-0 hands whole parameters to our Muon: every flag is accepted. ZeRO-1
    flattens them: DeepSpeed's Muon runs, and Megatron-LM's default flags differ from it."""
    if zero == 0:
        assert validated(f"--deepspeed --zero-stage {zero}").layout.zero_stage == 0
        return
    with pytest.raises(ArgumentError) as error:
        validated(f"--deepspeed --zero-stage {zero}")
    message = str(error.value)
    assert "DeepSpeed's Muon" in message and "\n" not in message
    for flag in DEEPSPEED_MUON.split("--")[1:]:
        assert "--" + flag.strip() in message


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_zero_runs_its_muon_with_its_flags(zero: int, tmp_path):
    """With DeepSpeed's Muon's flags (and, at ZeRO-3, reduce_scatter off as it requires)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": zero, "reduce_scatter": False}}))
    flags = f"--deepspeed --no-pipeline-parallel --zero-stage {zero} {DEEPSPEED_MUON}"
    if zero == 3:
        with pytest.raises(ArgumentError, match="reduce_scatter"):
            validated(flags)
    flags += f" --deepspeed_config {config}"
    assert validated(flags).layout.zero_stage == zero
    with pytest.raises(ArgumentError, match="--muon-tp-mode blockwise"):
        validated(flags + " --tensor-model-parallel-size 2", world_size=2)
