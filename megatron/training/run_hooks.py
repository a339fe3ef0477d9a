"""What the training loop does around its iterations besides training (Megatron-LM's flags):
profile a window of iterations (`--profile`) and collect garbage by hand (`--manual-gc`).

The profiler starts before iteration `--profile-step-start` and stops after
`--profile-step-end` on the ranks of `--profile-ranks`; torch.profiler records CPU and (on a
GPU) CUDA activity with shapes, and `tensorboard_trace_handler` writes one
`*.pt.trace.json` per rank into `--tensorboard-dir` (else `./profile_traces`): TensorBoard's
profiler plugin and Perfetto (ui.perfetto.dev) open it. On a GPU the window is also bracketed
by `cudaProfilerStart/Stop`, so `nsys profile --capture-range=cudaProfilerApi` records the same
iterations, as with Megatron-LM.

`--manual-gc` turns Python's automatic collection off (a collection then never pauses one
rank at a random moment while the others wait in a collective) and collects every
`--manual-gc-interval` iterations and around evaluation instead.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist

from megatron.utils import print_rank_0

DEFAULT_TRACE_DIR = "profile_traces"


class RunHooks:
    """The profiler window and manual garbage collection of one run (no-ops when off)."""

    def __init__(self, args: argparse.Namespace) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        profile = getattr(args, "profile", None)  # "on", or Megatron-DeepSpeed's "pt"/"pt-full"
        self.profile = profile is not None and rank in args.profile_ranks
        self.full = profile == "pt-full"
        self.start = getattr(args, "profile_step_start", 0)
        self.end = getattr(args, "profile_step_end", 0)
        self.trace_dir = getattr(args, "tensorboard_dir", None) or DEFAULT_TRACE_DIR
        self.manual_gc = bool(getattr(args, "manual_gc", False))
        self.gc_interval = getattr(args, "manual_gc_interval", 0)
        self.gc_around_eval = getattr(args, "manual_gc_eval", True)
        self._profiler: torch.profiler.profile | None = None

    def start_training(self) -> None:
        """Before the first iteration: hand garbage collection over to the loop."""
        if self.manual_gc:
            gc.disable()
            gc.collect()

    def before_iteration(self, iteration: int) -> None:
        """Before iteration `iteration` (counted from 1) runs."""
        if self.profile and iteration == self.start and self._profiler is None:
            os.makedirs(self.trace_dir, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.cudart().cudaProfilerStart()
            self._profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                with_stack=self.full,
                profile_memory=self.full,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir),
            )
            self._profiler.__enter__()

    def after_iteration(self, iteration: int) -> None:
        """After iteration `iteration`: end the profiler window, collect garbage."""
        if self._profiler is not None and iteration >= self.end:
            self.stop_profiler()
            print_rank_0(
                f"> profiled iterations {self.start}-{self.end}: trace in {self.trace_dir}"
            )
        if self.manual_gc and self.gc_interval and iteration % self.gc_interval == 0:
            gc.collect()

    def around_evaluation(self) -> None:
        """Before and after an evaluation (with --manual-gc and its eval collection)."""
        if self.manual_gc and self.gc_around_eval:
            gc.collect()

    def stop_profiler(self) -> None:
        """End the window now (also when training stops inside it): the trace is written."""
        if self._profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        self._profiler.__exit__(None, None, None)
        self._profiler = None
