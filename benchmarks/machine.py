"""Machine facts the benchmarks print in their headers (for RESULTS.md), how busy the
machine was while they measured, and small helpers the multi-process benchmarks share.

Imported by the benchmark scripts as a sibling module: `python benchmarks/X.py` puts this
folder first on `sys.path`.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket

# A timed step is disturbed when other processes used more than this many cores on average.
OTHERS_MAX_CORES = 0.1


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, as `uptime` prints them."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used (busy + steal, /proc/stat); NaN when
    unknown."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # up to steal, not guests


def other_cores(step: tuple[dict, ...] | list[dict]) -> float:
    """Cores that other processes used on average during one step, from every rank's record
    of it: `own_cpu` (the rank's `time.process_time()` delta), and rank 0's `machine_cpu`
    (the `machine_busy_seconds()` delta) over its `step` = [start, end] window."""
    own = sum(r["own_cpu"] for r in step)
    return (step[0]["machine_cpu"] - own) / (step[0]["step"][1] - step[0]["step"][0])


def undisturbed(steps: list) -> tuple[list, str]:
    """The steps (each a tuple of every rank's record, as `other_cores` takes) during which
    other processes used at most `OTHERS_MAX_CORES`, when at least 3 remain, else all of them;
    and what was kept: "kept/total" or "all N (noisy)"."""
    quiet = [step for step in steps if not other_cores(step) > OTHERS_MAX_CORES]
    if len(quiet) >= 3:
        return quiet, f"{len(quiet)}/{len(steps)}"
    return steps, f"all {len(steps)} (noisy)"


def describe_machine(processes: str) -> str:
    """The header line: software versions, `processes` (how the benchmark runs), the CPU and
    the load average now."""
    import deepspeed
    import torch

    return (
        f"python {platform.python_version()}, torch {torch.__version__}, deepspeed "
        f"{deepspeed.__version__}, gloo, {processes}; cpu: {cpu_model()}, {os.cpu_count()} "
        f"logical cores, {platform.machine()}; load average at start {load_average()}"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def format_ms(seconds: float) -> str:
    """Seconds as whole milliseconds: "123 ms"."""
    return f"{seconds * 1e3:.0f} ms"


# The GPT shape flags the training-step benchmarks share (their dests, in this order).
MODEL_SHAPE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
    "vocab_size",
)


def add_model_shape_flags(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """`--num-layers` ... `--vocab-size` (every name of `MODEL_SHAPE`), with `defaults`."""
    for name in MODEL_SHAPE:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name])


def model_shape(cli: argparse.Namespace) -> dict[str, int]:
    """The `MODEL_SHAPE` values of parsed benchmark flags."""
    return {name: getattr(cli, name) for name in MODEL_SHAPE}
