"""Mixture-of-Experts flags (DeepSpeed-MoE, as Megatron-DeepSpeed names them) and their checks.

`--num-experts N [N ...]` above 1 replaces the MLP of every `--expert-interval`-th layer with
DeepSpeed's MoE layer over our MLP class. It runs on DeepSpeed's engine without its pipeline
engine (`--deepspeed` with `--no-pipeline-parallel`, or ZeRO-2, as Megatron-DeepSpeed's MoE
scripts run), and without `--deepspeed` on plain torch or, at PP above 1, Megatron's pipeline
schedules (there at EP 1 and TP 1: only DeepSpeed's engine reduces expert gradients over the
expert-data-parallel ranks). Where that does not hold, `settle_moe` says so in one line.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError
from megatron.arguments.parallel_flags import job_backend
from megatron.moe_config import experts_per_layer


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-DeepSpeed's MoE flags with its defaults."""
    group = parser.add_argument_group("Mixture-of-Experts (DeepSpeed-MoE)")
    group.add_argument(
        "--num-experts",
        type=int,
        nargs="+",
        default=[1],
        help="Experts per MoE layer: one value for all, or one per MoE layer; 1 keeps the "
        "dense MLP (default: %(default)s).",
    )
    group.add_argument(
        "--expert-interval",
        type=int,
        default=2,
        help="Every this many layers is an MoE layer (layers 2, 4, ... at 2; default: "
        "%(default)s).",
    )
    group.add_argument("--topk", type=int, default=1, help="Experts per token: 1 or 2.")
    group.add_argument(
        "--moe-expert-parallel-size",
        type=int,
        default=1,
        help="Data-parallel ranks each layer's experts are spread over (EP); must divide the "
        "data-parallel size and every expert count.",
    )
    group.add_argument(
        "--moe-train-capacity-factor",
        type=float,
        default=1.0,
        help="Capacity of each expert in training, as a multiple of tokens / experts.",
    )
    group.add_argument(
        "--moe-eval-capacity-factor",
        type=float,
        default=1.0,
        help="Capacity of each expert in evaluation.",
    )
    group.add_argument(
        "--moe-min-capacity",
        type=int,
        default=4,
        help="Minimum capacity of every expert, whatever the factor.",
    )
    group.add_argument(
        "--disable-moe-token-dropping",
        action="store_false",
        dest="moe_token_dropping",
        help="Keep every token (no capacity limit) instead of dropping those over capacity.",
    )
    group.add_argument(
        "--disable-moe-top2-2nd-expert-sampling",
        action="store_false",
        dest="moe_top2_2nd_expert_sampling",
        help="Top-2: take the second expert by argmax instead of sampling it in training.",
    )
    group.add_argument(
        "--moe-loss-coeff",
        type=float,
        default=0.1,
        help="Weight of the load-balancing loss added to the LM loss (logged as 'moe loss').",
    )
    group.add_argument(
        "--create-moe-param-group",
        action="store_true",
        help="Give expert parameters their own optimizer groups (DeepSpeed's MoE groups; "
        "always done under ZeRO 1-2, which needs them).",
    )
    group.add_argument(
        "--mlp-type",
        choices=["standard", "residual"],
        default="standard",
        help="residual: PR-MoE, a dense MLP beside the experts, mixed per token.",
    )
    group.add_argument(
        "--enable-expert-tensor-parallelism",
        action="store_true",
        help="Split each expert over tensor-parallel ranks; otherwise each TP rank holds "
        "whole experts.",
    )


def settle_moe(args: argparse.Namespace) -> None:
    """Check the MoE flags against the model, the layout and the engine (after the pipeline
    and ZeRO are settled); set `args.moe`, whether any layer has experts."""
    counts = list(args.num_experts or [1])
    if any(count < 1 for count in counts):
        raise ArgumentError(f"--num-experts {' '.join(map(str, counts))}: must be at least 1")
    if args.expert_interval < 1:
        raise ArgumentError(f"--expert-interval {args.expert_interval}: must be at least 1")
    # `args.moe` is DeepSpeed-MoE; Megatron-LM's MoE is `args.routed_moe` (routed_moe_flags).
    args.moe = any(count > 1 for count in counts) and not getattr(args, "routed_moe", False)
    if not args.moe:
        return
    try:
        experts_per_layer(counts, args.num_layers, args.expert_interval)
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    _gating(args)
    _layout(args, [count for count in counts if count > 1])


def _gating(args: argparse.Namespace) -> None:
    if args.topk not in (1, 2):
        raise ArgumentError(f"--topk {args.topk}: DeepSpeed-MoE routes to 1 or 2 experts")
    for flag in ("moe_train_capacity_factor", "moe_eval_capacity_factor"):
        if not getattr(args, flag) > 0:
            raise ArgumentError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be above 0"
            )
    if args.moe_min_capacity < 0:
        raise ArgumentError(f"--moe-min-capacity {args.moe_min_capacity}: must be 0 or more")
    if args.moe_loss_coeff < 0:
        raise ArgumentError(f"--moe-loss-coeff {args.moe_loss_coeff}: must be 0 or more")


def _layout(args: argparse.Namespace, counts: list[int]) -> None:
    experts = f"--num-experts {' '.join(map(str, args.num_experts))}"
    # Which engines run MoE, and with which sizes: megatron.compatibility (checked before this).
    if (args.zero_stage or 0) > 2:  # None without --deepspeed
        raise ArgumentError(
            f"{experts} with --zero-stage {args.zero_stage}: DeepSpeed-MoE supports ZeRO 0-2"
        )
    if args.tensor_model_parallel_size > 1 and job_backend(args) != "nccl":
        raise ArgumentError(
            f"{experts} with --tensor-model-parallel-size {args.tensor_model_parallel_size} "
            "needs NCCL (GPUs): DeepSpeed-MoE gathers the tensor-parallel ranks' tokens with "
            "all_gather_into_tensor, which gloo cannot run; use TP 1 on CPUs"
        )
    if args.sequence_parallel:
        raise ArgumentError(
            f"{experts} with --sequence-parallel: DeepSpeed-MoE routes whole sequences "
            "replicated over tensor-parallel ranks; drop --sequence-parallel"
        )
    ep, dp = args.moe_expert_parallel_size, args.data_parallel_size
    if ep < 1:
        raise ArgumentError(f"--moe-expert-parallel-size {ep}: must be at least 1")
    fewer = sorted({count for count in counts if count < ep})
    if fewer:
        # Megatron-DeepSpeed's PR-MoE scripts (64-way EP over 32-expert layers) were written for
        # DeepSpeed before 0.7, which spread such a layer over as many ranks as it has experts.
        args.compat_notes.append(
            f" > --moe-expert-parallel-size {ep} with {fewer[0]}-expert layers: each layer's "
            "experts spread over min(EP, its experts) ranks, as DeepSpeed before 0.7 ran it"
        )
    for count in sorted(set(counts)):
        layer_ep = min(ep, count)
        if dp % layer_ep != 0:
            raise ArgumentError(
                f"--moe-expert-parallel-size {layer_ep} must divide the data-parallel size {dp} "
                "(experts are spread over data-parallel ranks)"
            )
        if count % layer_ep != 0:
            raise ArgumentError(
                f"{experts}: {count} experts cannot be spread evenly over "
                f"--moe-expert-parallel-size {layer_ep}"
            )
