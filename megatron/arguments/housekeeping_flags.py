"""Megatron-LM's flags for what a run does beside training: profiling a window of iterations,
manual garbage collection, the throughput and zero-count fields of the log line, the logging
level, a kill switch file, stopping on a missing checkpoint, and cuBLAS's reduced-precision
bf16 reductions. Their meanings are in `megatron.training.run_hooks` (profiler, garbage
collection), the loop (kill switch), `load_checkpoint` (missing checkpoint), `count_zeros` in
`megatron.training.optimizer` (the zero count) and `megatron.initialize`.
"""

from __future__ import annotations

import argparse

from megatron.arguments.engine_refusals import refuse_what_the_engine_cannot_run
from megatron.arguments.errors import ArgumentError
from megatron.compatibility import Step


def add_housekeeping_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags, with its defaults."""
    group = parser.add_argument_group("profiling and housekeeping (Megatron-LM)")
    group.add_argument(
        "--profile",
        nargs="?",
        const="on",
        default=None,
        choices=["on", "pt", "pt-full"],
        help="Profile iterations --profile-step-start to --profile-step-end with torch.profiler; "
        "the trace (for TensorBoard's profiler or Perfetto) goes to --tensorboard-dir, else "
        "./profile_traces. Megatron-DeepSpeed's spelling: --profile pt (pt-full: also Python "
        "stacks and memory) with --profile_steps START,END.",
    )
    group.add_argument(
        "--profile_steps",
        type=str,
        default=None,
        help="Megatron-DeepSpeed's 'START,END' iterations of --profile pt.",
    )
    group.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="Accepted: --profile always uses torch.profiler here (on a GPU it also brackets "
        "the window with cudaProfilerStart/Stop for Nsight Systems, as Megatron-LM does).",
    )
    group.add_argument("--profile-step-start", type=int, default=10, help="First iteration.")
    group.add_argument("--profile-step-end", type=int, default=12, help="Last iteration.")
    group.add_argument(
        "--profile-ranks",
        type=int,
        nargs="+",
        default=[0],
        help="Global ranks that profile (default: %(default)s).",
    )
    group.add_argument(
        "--manual-gc",
        action="store_true",
        help="Disable Python's automatic garbage collection and collect every "
        "--manual-gc-interval iterations instead (and around evaluation): no collection "
        "pauses at random iterations, which stall every rank.",
    )
    group.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="With --manual-gc: iterations between collections (0: only around evaluation).",
    )
    group.add_argument(
        "--no-manual-gc-eval",
        action="store_false",
        dest="manual_gc_eval",
        help="With --manual-gc: no collection before and after evaluation.",
    )
    group.add_argument(
        "--log-throughput",
        action="store_true",
        help="Add 'throughput per GPU (TFLOP/s/GPU)' to the iteration line.",
    )
    group.add_argument(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="Count the gradient elements that are exactly zero at each update (after "
        "reduction, unscaling and clipping; each element of the model once); print 'num zeros' "
        "in the iteration line and write it to TensorBoard.",
    )
    group.add_argument(
        "--logging-level",
        type=int,
        default=None,
        help="Python logging level of the run (10 debug, 20 info, 30 warning, ...).",
    )
    group.add_argument(
        "--kill-switch-file",
        type=str,
        default=None,
        help="Stop (saving a checkpoint first, with --save) at the end of the first iteration "
        "after this file appears, on any rank.",
    )
    group.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="With --load: stop with an error when it holds no checkpoint, instead of "
        "training from scratch.",
    )
    group.add_argument(
        "--disable-bf16-reduced-precision-matmul",
        action="store_true",
        help="On GPUs, bf16 matmuls reduce in fp32 (cuBLAS's reduced-precision bf16 "
        "reductions off).",
    )


def check_housekeeping(args: argparse.Namespace) -> None:
    """Megatron-DeepSpeed's --profile_steps read into the window; one-line refusals for values
    that cannot work, and for what the engine does not run (`megatron.compatibility`)."""
    if args.profile_steps is not None:
        try:
            args.profile_step_start, args.profile_step_end = map(int, args.profile_steps.split(","))
        except ValueError:
            raise ArgumentError(
                f"--profile_steps {args.profile_steps!r}: expected START,END (e.g. 2,3)"
            ) from None
    if args.profile and args.profile_step_end < args.profile_step_start:
        raise ArgumentError(
            f"--profile-step-end {args.profile_step_end} is before --profile-step-start "
            f"{args.profile_step_start}"
        )
    # --decoupled-lr and --calculate-per-token-loss: which engines run them is the table's.
    refuse_what_the_engine_cannot_run(args, Step.HOUSEKEEPING)
    if args.manual_gc_interval < 0:
        raise ArgumentError(f"--manual-gc-interval {args.manual_gc_interval}: must be 0 or more")
