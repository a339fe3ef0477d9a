"""The pipeline layout flags: which engine runs the stages, virtual stages, Megatron's rules.

`--pipeline-model-parallel-size` above 1 runs on DeepSpeed's pipeline engine under
`--deepspeed` (as Megatron-DeepSpeed), else on Megatron's 1F1B schedule over
torch.distributed.pipelining (`Engine.MEGATRON_SCHEDULES`), where virtual stages
(`--virtual-pipeline-model-parallel-size`, or Megatron-DeepSpeed's
`--num-layers-per-virtual-pipeline-stage`) select the interleaved schedule.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError, flag_name
from megatron.layout import Engine, engine_of


def _virtual_size(args: argparse.Namespace) -> int | None:
    """Megatron's `virtual_pipeline_model_parallel_size` from either spelling (None: off)."""
    virtual = getattr(args, "virtual_pipeline_model_parallel_size", None)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    pp = args.pipeline_model_parallel_size
    if per_stage is not None:
        if per_stage < 1 or args.num_layers % (pp * per_stage) != 0:
            raise ArgumentError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage}: --num-layers "
                f"({args.num_layers}) must be a multiple of it x --pipeline-model-parallel-size "
                f"({pp})"
            )
        from_layers = args.num_layers // pp // per_stage
        if virtual is not None and virtual != from_layers:
            raise ArgumentError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage} means "
                f"--virtual-pipeline-model-parallel-size {from_layers}, not {virtual}"
            )
        virtual = from_layers
    if virtual is not None and virtual < 1:
        raise ArgumentError(f"--virtual-pipeline-model-parallel-size {virtual}: must be at least 1")
    return virtual if virtual and virtual > 1 else None


def settle_pipeline(args: argparse.Namespace) -> None:
    """Check the pipeline flags against each other and set
    `virtual_pipeline_model_parallel_size` (None without interleaving, as Megatron)."""
    pp = args.pipeline_model_parallel_size
    pp_flag = f"{flag_name(args, 'pipeline_model_parallel_size')} {pp}"
    virtual = _virtual_size(args)
    if virtual and pp == 1:
        raise ArgumentError(
            f"--virtual-pipeline-model-parallel-size {virtual} needs "
            "--pipeline-model-parallel-size above 1 (virtual stages split pipeline stages)"
        )
    if args.num_layers % (pp * (virtual or 1)) != 0:
        what = f"{pp_flag} x {virtual} virtual stages" if virtual else pp_flag
        raise ArgumentError(
            f"--num-layers ({args.num_layers}) is not divisible by {what}: every stage holds "
            "the same number of layers"
        )
    args.virtual_pipeline_model_parallel_size = virtual
    if virtual and engine_of(args) is Engine.MEGATRON_SCHEDULES:
        per_step = args.micro_batch_size * args.data_parallel_size
        sizes = [args.global_batch_size]
        if args.rampup_batch_size:  # every size of the ramp runs the same schedule
            start, increment = (int(value) for value in args.rampup_batch_size[:2])
            sizes = list(range(start, args.global_batch_size, max(increment, 1))) + sizes
        for size in sizes:
            _interleaved_microbatches(args, size // per_step, size)


def _interleaved_microbatches(args: argparse.Namespace, count: int, global_batch: int) -> None:
    """Megatron's rule for the interleaved schedule: micro-batches a multiple of the stages.

    (The plain 1F1B takes any number: with fewer micro-batches than stages it runs them all
    forward, then all backward, as Megatron's 1F1B does then.)
    """
    pp = args.pipeline_model_parallel_size
    if count % pp != 0:
        raise ArgumentError(
            f"a global batch of {global_batch} is {count} micro-batches of "
            f"{flag_name(args, 'micro_batch_size')} {args.micro_batch_size} x data-parallel size "
            f"{args.data_parallel_size}; the interleaved schedule needs a multiple of "
            f"--pipeline-model-parallel-size ({pp})"
        )
