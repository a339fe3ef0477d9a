"""Sharded data parallelism without DeepSpeed: Megatron-LM's flags, run on torch's FSDP2.

What each spelling means here (`args.data_parallel_sharding`, the layout's `sharding`; FSDP2
`fully_shard` over the data(-x-context) ranks):

- no flag, or `--use-megatron-fsdp --data-parallel-sharding-strategy no_shard`: DDP (ZeRO-0);
- `--use-distributed-optimizer`, or `--use-megatron-fsdp --data-parallel-sharding-strategy
  optim_grads`: `optim_grads`, the ZeRO-2 pattern (FSDP2 `reshard_after_forward=False`);
- `--use-torch-fsdp2`, or `--use-megatron-fsdp --data-parallel-sharding-strategy
  optim_grads_params`: `optim_grads_params`, the ZeRO-3 pattern (`reshard_after_forward=True`).

Under both, the fp32 master weights and Adam's moments are 1/DP per rank and the gradients
are reduce-scattered (averaged, as DDP's all-reduce). `optim` (ZeRO-1: whole gradients,
sharded optimizer) has no FSDP2 setting: FSDP2 always reduce-scatters; it is refused in one
line. With `--bf16` / `--fp16` the parameters are all-gathered in that precision
(`MixedPrecisionPolicy.param_dtype`) and the gradients reduced in fp32, or in bf16 with
`--grad-reduce-in-bf16`.
"""

from __future__ import annotations

import argparse

from megatron.arguments.engine_refusals import refuse_what_the_engine_cannot_run
from megatron.arguments.errors import ArgumentError
from megatron.compatibility import Step
from megatron.layout import ParallelLayout

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def add_sharding_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's distributed-optimizer and FSDP flags."""
    group = parser.add_argument_group("sharded data parallelism (FSDP2, without DeepSpeed)")
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Megatron-LM's distributed optimizer: fp32 master weights and Adam state sharded "
        "over data-parallel ranks, gradients reduce-scattered, parameters all-gathered (ZeRO-2 "
        "pattern; torch FSDP2 with reshard_after_forward=False).",
    )
    group.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="Parameters sharded too (ZeRO-3 pattern): torch FSDP2, reshard_after_forward=True.",
    )
    group.add_argument(
        "--use-megatron-fsdp",
        "--use-custom-fsdp",
        dest="use_megatron_fsdp",
        action="store_true",
        help="Megatron-LM's FSDP, run here on torch FSDP2 with --data-parallel-sharding-strategy.",
    )
    group.add_argument(
        "--data-parallel-sharding-strategy",
        choices=STRATEGIES,
        default="no_shard",
        help="With --use-megatron-fsdp: no_shard (DDP), optim_grads (ZeRO-2 pattern), "
        "optim_grads_params (ZeRO-3 pattern); optim (ZeRO-1) is refused: FSDP2 always "
        "reduce-scatters gradients.",
    )
    group.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Overlap the gradient reduce-scatter with the backward pass: FSDP2 always does "
        "(on its own stream on GPU), so this changes nothing; accepted for Megatron-LM's "
        "scripts.",
    )
    group.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="Issue each layer's parameter all-gather as soon as the previous layer's is "
        "copied out (FSDP2's explicit forward prefetch) instead of when the layer starts.",
    )
    group.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="Accumulate micro-batch gradients and reduce them in bf16 (FSDP2's "
        "reduce_dtype) instead of fp32, as Megatron-LM; needs --bf16 and sharding.",
    )
    for flag, what in (
        ("--megatron-fsdp-grad-comm-dtype", "the gradients' reduction"),
        ("--megatron-fsdp-main-grads-dtype", "the accumulated (main) gradients"),
    ):
        group.add_argument(
            flag,
            choices=["fp32", "bf16", "fp16", "auto"],
            default="auto",
            help=f"With --use-megatron-fsdp: the dtype of {what}. torch FSDP2 keeps both in "
            "its one reduce dtype: bf16 means --grad-reduce-in-bf16, fp32 and auto the fp32 "
            "default; fp16 is refused.",
        )


def settle_sharding(args: argparse.Namespace) -> None:
    """`args.data_parallel_sharding`: "none", "optim_grads" or "optim_grads_params", from the
    flags; their contradictions refused in one line each (before the layout is built)."""
    strategy = "no_shard"
    if args.use_megatron_fsdp:
        strategy = args.data_parallel_sharding_strategy
    elif args.data_parallel_sharding_strategy != "no_shard":
        raise ArgumentError(
            f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} needs "
            "--use-megatron-fsdp (as in Megatron-LM)"
        )
    if strategy == "optim":
        raise ArgumentError(
            "--data-parallel-sharding-strategy optim: ZeRO-1 (whole gradients, sharded "
            "optimizer state) has no torch FSDP2 setting, which always reduce-scatters "
            "gradients; use optim_grads (the same updates, gradients sharded too) or "
            "--deepspeed --zero-stage 1"
        )
    if args.use_torch_fsdp2:
        strategy = "optim_grads_params"
    if strategy == "no_shard" and args.use_distributed_optimizer:
        strategy = "optim_grads"
    args.data_parallel_sharding = {"no_shard": "none"}.get(strategy, strategy)
    # Which engines shard with FSDP2 is the table's; refused here, before the sharding's own
    # settings. `validate_args` settles the layout later: its engine and sharding already are.
    refuse_what_the_engine_cannot_run(args, Step.SHARDING, ParallelLayout.from_args(args))
    sharded = args.data_parallel_sharding != "none"
    _megatron_fsdp_grad_dtypes(args)
    if args.grad_reduce_in_bf16 and not (sharded and args.bf16):
        raise ArgumentError(
            "--grad-reduce-in-bf16 needs --bf16 and sharded data parallelism "
            "(--use-distributed-optimizer, --use-torch-fsdp2 or --use-megatron-fsdp)"
        )


def _megatron_fsdp_grad_dtypes(args: argparse.Namespace) -> None:
    """Megatron-FSDP's gradient dtypes onto FSDP2's one reduce dtype (ignored without
    --use-megatron-fsdp, as Megatron-LM ignores them)."""
    dtypes = {
        "--megatron-fsdp-grad-comm-dtype": args.megatron_fsdp_grad_comm_dtype,
        "--megatron-fsdp-main-grads-dtype": args.megatron_fsdp_main_grads_dtype,
    }
    if not args.use_megatron_fsdp:
        return
    for flag, dtype in dtypes.items():
        if dtype == "fp16":
            raise ArgumentError(
                f"{flag} fp16: torch FSDP2 (which runs --use-megatron-fsdp here) reduces in "
                "fp32 or, with --grad-reduce-in-bf16, bf16"
            )
    if "bf16" in dtypes.values():
        args.grad_reduce_in_bf16 = True
