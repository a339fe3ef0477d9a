"""Run pretrain_gpt.py under meters: each rank's peak tensor memory and communication bytes.

Launched in place of pretrain_gpt.py, by any launcher:

    python benchmarks/measured_run.py --measure-out DIR pretrain_gpt.py FLAGS...
    torchrun --nproc_per_node 2 benchmarks/measured_run.py --measure-out DIR pretrain_gpt.py ...
    deepspeed --num_gpus 2 benchmarks/measured_run.py --measure-out DIR pretrain_gpt.py ...

Its own options come before the script: `--measure-out DIR` (required) and `--measure-all-ops`
(let the profiler record every operator too, as the usual profiler does; slower, for
comparison). Everything else reaches pretrain_gpt's parser, the deepspeed launcher's
`--local_rank=N` (put right after this script) included. Exits with pretrain_gpt's status.

Before anything of megatron or DeepSpeed is imported it wraps torch.distributed's collectives
and DDP (`run_meters.CommMeter`) and starts the memory meter (`run_meters.MemoryMeter`); it
then marks every iteration start (wrapping the `inject_training_fault(iteration)` call that
`megatron.training.loop` makes there) and the end of `pretrain`. Iteration k's window is
[start of k, start of k+1), the last one's ends with `pretrain`. At the end each rank writes
`DIR/rank{R}.json` (`build_report`):

    {"rank", "world_size", "tp_rank", "pp_rank", "dp_rank",
     "saves": [{"iteration", "tensor_bytes_at_start", "peak_tensor_bytes"}],
     "iterations": [{"iteration", "seconds", "peak_tensor_bytes", "tensor_bytes_at_start",
                     "largest_allocations",
                     "comm_bytes": {"tensor_parallel", "data_parallel", "pipeline",
                                    "all_to_all", "total", "pipeline_received"},
                     "calls": {"OP @ GROUP": {"kind", "calls", "bytes"}}}],
     "peak_tensor_bytes_after_first",   # max over the iterations after the first (k >= 2)
     "framework_resident_bytes",        # RSS - live tensor bytes, at the start of iteration 1
     "tensor_bytes_at_start", "rss_bytes_at_start", "peak_tensor_bytes_before_first",
     "memory_events", "profiler_clock_minus_time_ns", "before_first_iteration",
     "after_last_iteration", "groups", "exit_status", "wall_seconds", "argv"}

Tensor bytes are what the allocator handed out, touched or not: DeepSpeed's 5e8-element
ZeRO-2/3 gradient bucket counts in full while most of its pages are never resident, so
`framework_resident_bytes` can come out negative. Run with --eval-iters 0: the final
evaluation would fall into the last iteration's window.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch.distributed as dist
from run_meters import (
    Call,
    CommMeter,
    GroupTable,
    MemoryMeter,
    MemoryTrace,
    live_at_peak,
    summarize_calls,
    window_peaks,
)

USAGE = (
    "usage: measured_run.py [--local_rank=N] --measure-out DIR [--measure-all-ops] "
    "SCRIPT.py [FLAGS...]"
)


def split_argv(argv: list[str]) -> tuple[dict, str, list[str]]:
    """(our options, the script, its flags) from this wrapper's command line.

    Our options and the launcher's `--local_rank` come before the script; `--local_rank`
    moves to the front of the script's flags, as if the launcher had started the script.
    """
    options: dict = {"out": None, "all_ops": False}
    passed: list[str] = []
    index = 0
    while index < len(argv) and argv[index].startswith("--"):
        arg = argv[index]
        if arg == "--measure-out" and index + 1 < len(argv):
            options["out"] = argv[index + 1]
            index += 1
        elif arg.startswith("--measure-out="):
            options["out"] = arg.split("=", 1)[1]
        elif arg == "--measure-all-ops":
            options["all_ops"] = True
        elif arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            passed.append(arg)
        elif arg in ("--local_rank", "--local-rank") and index + 1 < len(argv):
            passed += [arg, argv[index + 1]]
            index += 1
        else:
            raise SystemExit(f"error: measured_run.py: unknown option {arg}\n{USAGE}")
        index += 1
    if options["out"] is None or index >= len(argv):
        raise SystemExit(f"error: measured_run.py needs --measure-out DIR and a script\n{USAGE}")
    return options, argv[index], passed + argv[index + 1 :]


def resident_bytes() -> int:
    """This process's resident set size (psutil, else /proc/self/statm)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.Process().memory_info().rss)


class IterationMarks:
    """Marks where each iteration starts (and where the last one ends) on both meters."""

    def __init__(self, memory: MemoryMeter, comm: CommMeter) -> None:
        self.memory = memory
        self.comm = comm
        self.starts: list[tuple[int, int]] = []
        """(iteration, time.time_ns()) at each start, to check the profiler's clock."""
        self.end_ns: int | None = None
        self.rss_at_first: int | None = None
        self.table: GroupTable | None = None
        self.ranks: dict[str, int] = {}
        self.saves: list[int] = []
        """The iterations whose checkpoint saves were marked (`save_started`, `save_ended`)."""

    def begin(self, iteration: int) -> None:
        """Iteration `iteration` starts now."""
        if not self.starts:
            self._snapshot_groups()
        self.starts.append((iteration, time.time_ns()))
        self.memory.mark(f"iteration {iteration}")
        self.comm.iteration = iteration
        if self.rss_at_first is None:
            self.rss_at_first = resident_bytes()

    def save_started(self, iteration: int) -> None:
        """The loop starts saving the checkpoint of `iteration` now; its collectives are the
        save's, not the iteration's (whose bytes the planner predicts)."""
        self.saves.append(iteration)
        self.memory.mark(f"save {iteration}")
        self.comm.iteration = f"save {iteration}"

    def save_ended(self, iteration: int) -> None:
        """That save returned (a background one: staged, its write going on)."""
        self.memory.mark(f"saved {iteration}")
        self.comm.iteration = iteration

    def end(self) -> None:
        """The last iteration (and `pretrain`) ended now."""
        self.end_ns = time.time_ns()
        self.memory.mark("end")
        self.comm.iteration = None

    def _snapshot_groups(self) -> None:
        # Taken while the groups exist: pretrain_gpt.main() forgets them before it returns.
        from megatron.core import parallel_state

        self.table = GroupTable.from_parallel_state()
        self.ranks = {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
        }


def launcher_ranks() -> dict[str, int]:
    """rank and world_size as the launcher set them (before or after torch.distributed)."""
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "tp_rank": 0,
        "pp_rank": 0,
        "dp_rank": 0,
    }


def build_report(marks: IterationMarks, trace: MemoryTrace, calls: list[Call]) -> dict:
    """The rank's JSON report: per-iteration peaks, comm bytes and seconds; framework memory."""
    ranks = marks.ranks or launcher_ranks()
    table = marks.table or GroupTable([("world", tuple(range(ranks["world_size"])))])
    iterations = [k for k, _ in marks.starts]
    labels = [f"iteration {k}" for k in iterations] + (["end"] if marks.end_ns else [])
    bounds = [trace.marks[label] for label in labels if label in trace.marks]
    peaks, levels = window_peaks(trace.times, trace.deltas, bounds) if bounds else ([], [])
    clock = [t for _, t in marks.starts] + ([marks.end_ns] if marks.end_ns else [])
    cuts = np.searchsorted(trace.times, bounds)
    rows = []
    for index, k in enumerate(iterations):
        window = trace.deltas[cuts[index] : cuts[index + 1]] if index + 1 < len(cuts) else []
        row = {
            "iteration": k,
            "seconds": (clock[index + 1] - clock[index]) / 1e9 if index + 1 < len(clock) else None,
            "peak_tensor_bytes": peaks[index] if index < len(peaks) else None,
            "tensor_bytes_at_start": levels[index] if index < len(levels) else None,
            # What to look at first when a peak is off: e.g. a bucket DeepSpeed allocates.
            "largest_allocations": sorted((int(n) for n in window if n > 0), reverse=True)[:3],
        }
        row.update(summarize_calls([c for c in calls if c.iteration == k], table))
        rows.append(row)
    after_first = [row["peak_tensor_bytes"] for row in rows[1:] if row["peak_tensor_bytes"]]
    at_start = levels[0] if levels else None
    live = trace.live_bytes()
    setup = live[: np.searchsorted(trace.times, bounds[0])] if bounds else live
    # Profiler clock vs time.time_ns(): each marker against the time taken just before it.
    skews = [
        trace.marks[f"iteration {k}"] - t
        for k, t in marks.starts
        if f"iteration {k}" in trace.marks
    ]
    return {
        **ranks,
        "iterations": rows,
        "saves": _save_windows(marks, trace),
        "peak_tensor_bytes_after_first": max(after_first) if after_first else None,
        "framework_resident_bytes": (
            marks.rss_at_first - at_start if marks.rss_at_first and at_start is not None else None
        ),
        "tensor_bytes_at_start": at_start,
        "rss_bytes_at_start": marks.rss_at_first,
        "peak_tensor_bytes_before_first": int(setup.max()) if len(setup) else None,
        "memory_events": trace.counts,
        "profiler_clock_minus_time_ns": {"min": min(skews), "max": max(skews)} if skews else None,
        "before_first_iteration": summarize_calls([c for c in calls if c.iteration == 0], table),
        "after_last_iteration": summarize_calls([c for c in calls if c.iteration is None], table),
        "groups": {name: list(ranks) for name, ranks in table.groups},
    }


def _save_windows(marks: IterationMarks, trace: MemoryTrace) -> list[dict]:
    """Each marked save's live tensor bytes as it started and at its peak."""
    saves = []
    for k in marks.saves:
        bounds = [trace.marks.get(f"save {k}"), trace.marks.get(f"saved {k}")]
        if None in bounds:
            continue
        (peak,), (at_start, _) = window_peaks(trace.times, trace.deltas, bounds)
        saves.append({"iteration": k, "tensor_bytes_at_start": at_start, "peak_tensor_bytes": peak})
    return saves


def _mark_saves(original: Callable, marks: IterationMarks) -> Callable:
    """`TrainingLoop._save`, marking where each save starts and returns."""

    def _save(self, state) -> None:  # noqa: ANN001
        marks.save_started(state.iteration)
        try:
            original(self, state)
        finally:
            marks.save_ended(state.iteration)

    return _save


def _mark_starts(original: Callable[[int], None], marks: IterationMarks) -> Callable[[int], None]:
    """`inject_training_fault`, which the loop calls as each iteration begins, marking it."""

    def inject_training_fault(iteration: int) -> None:
        marks.begin(iteration)
        original(iteration)

    return inject_training_fault


def _mark_end(original: Callable, marks: IterationMarks) -> Callable:
    """`pretrain`, marking the end of the last iteration when it returns or raises."""

    def pretrain(*args: object, **kwargs: object) -> object:
        try:
            return original(*args, **kwargs)
        finally:
            marks.end()

    return pretrain


def run(out_dir: str, script: str, flags: list[str], all_ops: bool = False) -> int:
    """Run `script`'s `main()` with `flags` under the meters; write this rank's report."""
    repo_root = os.path.dirname(os.path.abspath(script))
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    comm = CommMeter()
    comm.install()
    memory = MemoryMeter(record_ops=all_ops)
    memory.start()  # before the script builds anything: the running sum starts from zero
    marks = IterationMarks(memory, comm)
    loop = importlib.import_module("megatron.training.loop")
    loop.inject_training_fault = _mark_starts(loop.inject_training_fault, marks)
    loop.TrainingLoop._save = _mark_saves(loop.TrainingLoop._save, marks)
    module = importlib.import_module(os.path.splitext(os.path.basename(script))[0])
    module.pretrain = _mark_end(module.pretrain, marks)
    sys.argv = [script, *flags]
    started = time.time()
    status = 1
    try:
        status = module.main()
    finally:
        trace = memory.stop()
        comm.uninstall()
        report = build_report(marks, trace, comm.calls)
        if all_ops and marks.starts:
            # The last iteration's window, on the profiler's clock: its start to the end.
            last = trace.marks.get(f"iteration {marks.starts[-1][0]}", 0)
            report["peak_live_by_op"] = live_at_peak(
                memory.events, memory.origins, last, trace.marks.get("end", 2**62)
            )
        report.update(exit_status=status, wall_seconds=time.time() - started, argv=sys.argv)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"rank{report['rank']}.json")
        with open(path + ".tmp", "w") as file:
            json.dump(report, file, indent=1)
        os.replace(path + ".tmp", path)
    return status


def main() -> int:
    """Entry point: split the command line, run the script under the meters."""
    options, script, flags = split_argv(sys.argv[1:])
    return run(options["out"], script, flags, options["all_ops"])


if __name__ == "__main__":
    sys.exit(main())
