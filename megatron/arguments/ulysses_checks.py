"""`--ds-sequence-parallel-size`: DeepSpeed-Ulysses with Megatron-DeepSpeed's rules.

S ranks split every sample's sequence; attention runs head-split between DeepSpeed's
all-to-alls, so the heads (query and key/value) and the sequence must divide by S. As in
Megatron-DeepSpeed it runs on DeepSpeed's plain engine (`--deepspeed --no-pipeline-parallel`)
at TP = PP = 1: DeepSpeed's engine and ZeRO sum the gradients over the sequence ranks, which
its pipeline engine and our DDP path do not.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError


def settle_ulysses(args: argparse.Namespace) -> None:
    """Refuse, in one line each, what DeepSpeed-Ulysses cannot run with (size 1: nothing)."""
    sp = args.ds_sequence_parallel_size
    if sp == 1:
        return
    flag = f"--ds-sequence-parallel-size {sp}"
    # Which engines run DeepSpeed-Ulysses: megatron.compatibility (checked before this).
    for value, name in (
        (args.seq_length, "--seq-length"),
        (args.num_attention_heads, "--num-attention-heads"),
        (args.num_key_value_heads, "--num-key-value-heads"),
    ):
        if value % sp != 0:
            raise ArgumentError(
                f"{name} ({value}) is not divisible by {flag}: each rank holds 1/{sp} of the "
                f"sequence, then 1/{sp} of the heads inside attention"
            )
    if args.moe:
        raise ArgumentError(
            f"{flag} with --num-experts: Mixture-of-Experts with DeepSpeed-Ulysses is not "
            "built here (each rank would add its own load-balancing loss)"
        )
    if args.zero_stage == 3:
        check_zero3_reduce_scatter(args, flag)


def check_zero3_reduce_scatter(args: argparse.Namespace, flag: str) -> None:
    """ZeRO-3's reduce-scatter averages gradients over all sequence x data ranks, where the
    sequence ranks' parts must add up (ZeRO 1-2 and its own bucketed all-reduce divide by the
    data-parallel size only): the gradient each rank back-propagates from its part of the
    losses is S times its share (`Engine.sequence_split_gradient_scale`), so the average is
    the sum. Its other reduction, without reduce-scatter, would then be S times too large, so
    it is refused rather than guessed per bucket."""
    zero = (args.deepspeed_config_dict or {}).get("zero_optimization", {})
    if zero.get("reduce_scatter", True) is False:
        raise ArgumentError(
            f'"zero_optimization.reduce_scatter": false with ZeRO-3 and {flag}: DeepSpeed then '
            "reduces some gradient buckets by sum and others by average over the sequence "
            "ranks; leave reduce_scatter on (its default)"
        )
