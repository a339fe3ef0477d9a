"""Megatron-LM's combined 1F1B flags, `--overlap-moe-expert-parallel-comm` and
`--delay-wgrad-compute`, and their checks (megatron-core's `TransformerConfig` rules).

The expert-parallel dispatch and combine of one micro-batch travel while another micro-batch
computes (`megatron.core.pipeline_parallel.combined_1f1b`), with the same losses and gradients
bit for bit. Megatron-LM's own rules are kept (expert parallelism, no full recomputation or
MoE recomputation, no `--moe-shared-expert-overlap`); beyond them, the all-gather dispatcher
and fp32 run here too, and at PP = 1 on the plain engine only (the compatibility table).
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError


def add_moe_overlap_flags(parser: argparse.ArgumentParser) -> None:
    """The combined 1F1B's flags (Megatron-LM's names)."""
    group = parser.add_argument_group("Expert all-to-all overlap (Megatron-LM)")
    group.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        help="Hide the MoE layers' expert-parallel dispatch and combine (forward and backward) "
        "behind another micro-batch's compute: each micro-batch's backward runs beside the "
        "next one's forward (Megatron-LM's combined 1F1B; the same results bit for bit).",
    )
    group.add_argument(
        "--delay-wgrad-compute",
        action="store_true",
        help="With --overlap-moe-expert-parallel-comm: the experts' weight gradients wait for "
        "the backward's next expert collective and run while it travels.",
    )


def settle_moe_overlap(args: argparse.Namespace) -> None:
    """Refuse, in one line each, what the combined 1F1B cannot run with (after the routed MoE
    and the layout are settled)."""
    overlap = getattr(args, "overlap_moe_expert_parallel_comm", False)
    if getattr(args, "delay_wgrad_compute", False) and not overlap:
        raise ArgumentError(
            "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (the weight "
            "gradients wait for the backward's next expert collective)"
        )
    if not overlap:
        return
    flag = "--overlap-moe-expert-parallel-comm"
    if not getattr(args, "routed_moe", False):
        raise ArgumentError(
            f"{flag} hides Megatron-LM's MoE layers' collectives: it needs --num-experts with "
            "Megatron-LM's MoE flags (--expert-model-parallel-size, --moe-router-topk, ...)"
        )
    checks = (
        (
            args.expert_model_parallel_size == 1,
            "needs --expert-model-parallel-size > 1 (with one expert-parallel rank there is no "
            "all-to-all to hide)",
        ),
        (
            args.recompute_granularity == "full",
            "with --recompute-granularity full: a recomputed layer would run its collectives "
            "again inside the backward (Megatron-LM refuses it too)",
        ),
        (
            args.recompute_granularity == "selective" and "moe" in (args.recompute_modules or []),
            "with --recompute-modules moe: a recomputed MoE layer would run its collectives "
            "again inside the backward (Megatron-LM refuses it too)",
        ),
        (
            getattr(args, "moe_shared_expert_overlap", False),
            "with --moe-shared-expert-overlap: use one overlap (Megatron-LM refuses both)",
        ),
        (
            args.layout.sharding != "none",
            "with torch FSDP2 (--use-torch-fsdp2 / --use-distributed-optimizer without "
            "--deepspeed): FSDP2 gathers and frees a layer's weights per pass, which the "
            "interleaved passes would cross",
        ),
    )
    for refused, reason in checks:
        if refused:
            raise ArgumentError(f"{flag} {reason}")
