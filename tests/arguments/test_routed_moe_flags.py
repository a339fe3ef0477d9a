"""Megatron-LM's MoE flags: which MoE a command line asks for, their meanings in the model
config and layout, and the one-line refusals (two families mixed, sizes that cannot hold, the
parts not built here, engines that do not run it)."""

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
MIXTRAL_MOE = (
    "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss "
    "--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
)


def validated(extra: str, world_size: int = 2):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    args = validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))
    args = with_settled(args, padded_vocab_size=128)
    return args


def refusal(extra: str, world_size: int = 2) -> str:
    with pytest.raises(ArgumentError) as refused:
        validated(extra, world_size)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_mixtral_flags_reach_the_model_and_layout() -> None:
    args = validated(MIXTRAL_MOE + " --expert-model-parallel-size 4", world_size=8)
    routed = ModelConfig.from_args(args).routed_moe
    assert args.routed_moe and not args.moe  # Megatron-LM's MoE, not DeepSpeed-MoE
    assert ModelConfig.from_args(args).moe is None
    assert (routed.num_experts, routed.top_k, routed.aux_loss_coeff) == (8, 2, 1e-2)
    assert (routed.dispatcher, routed.grouped_gemm, routed.capacity_factor) == (
        "alltoall",
        True,
        None,  # dropless
    )
    assert routed.moe_layers == (True,) * 4  # --moe-layer-freq 1: every layer
    assert args.layout.moe == "megatron" and args.layout.expert_parallel == 4
    assert args.layout.describe() == "TP 1 x PP 1 x DP 8 x EP 4, fp32 on plain"


def test_megatron_lm_defaults_and_the_other_router_flags() -> None:
    args = validated(
        "--num-experts 4 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-bias-update-rate 1e-2 --moe-router-topk-scaling-factor 2.5 "
        "--moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-ffn-hidden-size 32 "
        "--moe-shared-expert-intermediate-size 48 --moe-router-load-balancing-type seq_aux_loss "
        "--moe-expert-capacity-factor 1.25 --moe-token-drop-policy position "
        "--moe-layer-freq ([0]+[1]*3) --moe-permute-fusion --moe-pad-expert-input-to-capacity"
    )
    routed = ModelConfig.from_args(args).routed_moe
    assert routed.moe_layers == (False, True, True, True)
    assert (routed.top_k, routed.dispatcher, routed.aux_loss_coeff) == (2, "allgather", 0.0)
    assert (routed.score_function, routed.expert_bias, routed.bias_update_rate) == (
        "sigmoid",
        True,
        1e-2,
    )
    assert (routed.topk_scaling_factor, routed.router_dtype, routed.z_loss_coeff) == (
        2.5,
        "fp32",
        1e-3,
    )
    assert (routed.ffn_hidden_size, routed.shared_expert_ffn_hidden_size) == (32, 48)
    assert (routed.load_balancing, routed.capacity_factor, routed.drop_policy) == (
        "seq_aux_loss",
        1.25,
        "position",
    )
    assert any("--moe-permute-fusion: accepted" in note for note in args.compat_notes)
    padded = "--moe-pad-expert-input-to-capacity: accepted; no effect here (Megatron-LM pads"
    assert any(note.startswith(" > " + padded) for note in args.compat_notes)
    assert validated("--num-experts 4 --moe-layer-freq 2").routed_moe
    layers = ModelConfig.from_args(validated("--num-experts 4 --moe-layer-freq 2")).routed_moe
    assert layers.moe_layers == (True, False, True, False)  # layers 1, 3 (Megatron-LM's rule)


def test_num_experts_alone_stays_deepspeed_moe() -> None:
    args = validated("--num-experts 4")
    assert args.moe and not args.routed_moe and args.layout.moe == "deepspeed"


@pytest.mark.parametrize(
    "extra, world_size, words",
    [
        ("--num-experts 4 --moe-router-topk 2 --topk 2", 2, ["--moe-router-topk", "--topk"]),
        ("--num-experts 4 2 --moe-router-topk 2", 2, ["one expert count"]),
        ("--moe-router-topk 2", 2, ["--moe-router-topk", "without --num-experts"]),
        ("--num-experts 4 --moe-router-topk 5", 2, ["--moe-router-topk 5", "1 to 4"]),
        ("--num-experts 6 --expert-model-parallel-size 4", 4, ["--expert-model-parallel-size 4"]),
        ("--num-experts 4 --expert-model-parallel-size 4", 2, ["1 x 1 x 2 = 2"]),
        ("--num-experts 4 --moe-layer-freq [1,0]", 2, ["--moe-layer-freq", "--num-layers is 4"]),
        ("--num-experts 4 --moe-router-load-balancing-type sinkhorn", 2, ["sinkhorn", "not built"]),
        (
            "--num-experts 4 --moe-router-topk 2 --tensor-model-parallel-size 2",
            2,
            ["--expert-tensor-parallel-size 1", "default"],
        ),
        (
            "--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1",
            2,
            ["--tensor-model-parallel-size 2 needs --sequence-parallel"],
        ),
        (
            "--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 "
            "--sequence-parallel",
            2,
            ["--expert-tensor-parallel-size 2", "not built"],
        ),
        ("--num-experts 4 --moe-router-num-groups 2", 2, ["--moe-router-group-topk", "both"]),
        (
            "--num-experts 6 --moe-router-num-groups 4 --moe-router-group-topk 2",
            2,
            ["--moe-router-num-groups 4", "--num-experts 6"],
        ),
        (
            "--num-experts 8 --moe-router-num-groups 4 --moe-router-group-topk 5",
            2,
            ["--moe-router-group-topk 5", "1 to 4"],
        ),
        (
            "--num-experts 8 --moe-router-topk 3 --moe-router-num-groups 4 "
            "--moe-router-group-topk 2",
            2,
            ["--moe-router-topk 3", "multiple"],
        ),
    ],
)
def test_refused_in_one_line(extra: str, world_size: int, words: list[str]) -> None:
    message = refusal(extra, world_size)
    for word in words:
        assert word in message, message


def test_engines(tmp_path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    deepspeed = f"--deepspeed --deepspeed_config {config}"
    pipe = refusal(f"{MIXTRAL_MOE} {deepspeed}")
    assert "--no-pipeline-parallel" in pipe and "pipeline engine" in pipe
    ep = refusal(f"{MIXTRAL_MOE} {deepspeed} --no-pipeline-parallel --expert-model-parallel-size 2")
    assert "--expert-model-parallel-size 2" in ep and "DeepSpeed's engine" in ep
    at_ep1 = validated(f"{MIXTRAL_MOE} {deepspeed} --no-pipeline-parallel")
    assert at_ep1.layout.engine is Engine.DEEPSPEED and at_ep1.routed_moe
    schedules = validated(
        f"{MIXTRAL_MOE} --pipeline-model-parallel-size 2 --expert-model-parallel-size 2", 4
    )
    assert schedules.layout.describe() == "TP 1 x PP 2 x DP 2 x EP 2, fp32 on megatron_schedules"
    # The distributed optimizer: FSDP2, the experts sharded over the ranks holding them.
    sharded = validated(f"{MIXTRAL_MOE} --expert-model-parallel-size 2 --use-distributed-optimizer")
    assert (
        sharded.layout.describe() == "TP 1 x PP 1 x DP 2 x EP 2, fp32, FSDP2 optim_grads on plain"
    )


def test_deepseek_v3_routing_flags() -> None:
    """Group-limited routing and forced balancing reach the router; flex runs as alltoall with
    a start-up note naming its GPU kernels; Megatron-LM's first-k-dense expression reads."""
    args = validated(
        "--num-experts 8 --moe-router-topk 4 --moe-router-num-groups 4 --moe-router-group-topk 2 "
        "--moe-router-force-load-balancing --moe-token-dispatcher-type flex "
        "--moe-flex-dispatcher-backend hybridep --moe-layer-freq [0]*1+[1]*3"
    )
    routed = ModelConfig.from_args(args).routed_moe
    assert (routed.num_groups, routed.group_topk, routed.force_load_balancing) == (4, 2, True)
    assert routed.dispatcher == "alltoall"
    assert routed.moe_layers == (False, True, True, True)
    notes = [note for note in args.compat_notes if "--moe-token-dispatcher-type flex" in note]
    assert len(notes) == 1 and "runs as alltoall" in notes[0] and "HybridEP" in notes[0]
    unused = validated("--num-experts 4 --moe-flex-dispatcher-backend deepep").compat_notes
    assert any("--moe-flex-dispatcher-backend deepep: accepted; no effect" in n for n in unused)
