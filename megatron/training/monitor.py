"""What the training loop reports: Megatron's log lines, timers, memory report, metric writers.

The iteration and validation lines reproduce microsoft/Megatron-DeepSpeed's `training_log` and
`evaluate_and_print_results` (megatron/training.py) character for character, and `Timers`
and `memory_report` its megatron/timers.py and megatron/utils.py `report_memory`, because users'
log parsers read them. Our own extras (progress, ETA) come after Megatron's last field so those
parsers keep working. `MetricsWriter` sends scalars to TensorBoard and/or Weights & Biases.
Nothing here decides which rank prints or writes: the caller does, as in Megatron.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron.extensions import install_hint
from megatron.model.moe_aux_loss import PER_LAYER_PREFIX

_MEGABYTE = 1024.0 * 1024.0


@dataclass
class IterationStats:
    """Everything one Megatron iteration log line shows, for the last `--log-interval` iters."""

    iteration: int
    train_iters: int
    consumed_samples: int
    consumed_tokens: int
    elapsed_ms_per_iteration: float
    learning_rate: float
    global_batch_size: int
    # e.g. {'lm loss': 3.2}, averaged over the interval; printed in this order.
    losses: dict[str, float]
    # None where the optimizer has no loss scaler; the field is then left out, as in Megatron.
    loss_scale: float | None
    # None where the engine reports no norm; the field is then left out, as in Megatron.
    grad_norm: float | None
    actual_seqlen: int
    skipped_iterations: int
    nan_iterations: int
    samples_per_second: float
    tokens_per_gpu_per_second: float
    tflops: float
    # Seconds left at the current pace; None leaves the ETA field out.
    eta_seconds: float | None = None
    # L2 norm of all parameters (--log-params-norm); None leaves the field out, as in Megatron.
    params_norm: float | None = None
    # Iterations the run will make in all, where --train-tokens ends it before --train-iters;
    # progress is counted against it. None: train_iters.
    planned_iterations: int | None = None
    # Model TFLOP/s per GPU as Megatron-LM's --log-throughput prints it; None leaves it out.
    throughput: float | None = None
    # Zero gradient elements of the last update (--log-num-zeros-in-grad); None leaves it out.
    num_zeros: float | None = None


def _format_duration(seconds: float) -> str:
    """H:MM:SS, hours unbounded (a 30-hour ETA reads 30:00:00, not '1 day, 6:00:00')."""
    total = max(0, int(round(seconds)))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def format_iteration_log(stats: IterationStats) -> str:
    """Megatron-DeepSpeed's iteration line, then ' progress: P% |' and ' ETA: H:MM:SS |'."""
    s = stats
    # Field by field as in Megatron-DeepSpeed training_log(); int() keeps '{:d}' working when
    # a caller hands over a float or numpy count.
    line = f" iteration {int(s.iteration):8d}/{int(s.train_iters):8d} |"
    line += f" consumed samples: {int(s.consumed_samples):12d} |"
    line += f" consumed tokens: {int(s.consumed_tokens):12d} |"
    line += f" elapsed time per iteration (ms): {s.elapsed_ms_per_iteration:.1f} |"
    if s.throughput is not None:  # Megatron-LM's --log-throughput field, in its place
        line += f" throughput per GPU (TFLOP/s/GPU): {s.throughput:.1f} |"
    line += f" learning rate: {s.learning_rate:.3E} |"
    line += f" global batch size: {int(s.global_batch_size):5d} |"
    for key, average in s.losses.items():
        # Megatron prints only positive averages; a NaN average fails this test too. Per-layer
        # MoE values go to TensorBoard only, as Megatron-LM's --moe-per-layer-logging.
        if average > 0.0 and not key.startswith(PER_LAYER_PREFIX):
            line += f" {key}: {average:.6E} |"
    if s.loss_scale is not None:
        line += f" loss scale: {s.loss_scale:.1f} |"
    if s.grad_norm is not None:
        line += f" grad norm: {s.grad_norm:.3f} |"
    if s.num_zeros is not None:
        line += f" num zeros: {s.num_zeros:.1f} |"
    if s.params_norm is not None:
        line += f" params norm: {s.params_norm:.3f} |"
    line += f" actual seqlen: {int(s.actual_seqlen):5d} |"
    line += f" number of skipped iterations: {int(s.skipped_iterations):3d} |"
    line += f" number of nan iterations: {int(s.nan_iterations):3d} |"
    line += f" samples per second: {s.samples_per_second:.3f} |"
    line += f" tokens per gpu per second (tgs): {s.tokens_per_gpu_per_second:.3f} |"
    line += f" TFLOPs: {s.tflops:.2f} |"
    planned = s.planned_iterations or s.train_iters
    if planned > 0:
        line += f" progress: {100.0 * s.iteration / planned:.1f}% |"
    if s.eta_seconds is not None:
        line += f" ETA: {_format_duration(s.eta_seconds)} |"
    return line


# Searched for anywhere in the line: launchers prefix lines with '[default0]:' or timestamps.
_ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
_VALIDATION_RE = re.compile(r"\bvalidation loss at (.+?) \|(.*)$")


def _parse_value(text: str) -> str | float:
    """An int, a float, a percentage as a float, or (the ETA) the text itself."""
    number = text[:-1] if text.endswith("%") else text
    for kind in (int, float):
        try:
            return kind(number)
        except ValueError:
            pass
    return text


def _parse_fields(text: str, line: str) -> dict[str, str | float]:
    """'name: value' pairs from the ' |'-separated rest of a log line."""
    fields: dict[str, str | float] = {}
    for part in text.split("|"):
        part = part.strip()
        if not part:
            continue
        name, separator, value = part.partition(": ")
        if not separator:
            raise ValueError(f"field {part!r} has no 'name: value' form in {line!r}")
        fields[name] = _parse_value(value.strip())
    return fields


def parse_iteration_log(line: str) -> dict[str, str | float]:
    """Fields of an iteration line: 'iteration', 'train iters', then each printed name.

    Numbers come back as int or float ('progress' in percent), the ETA as its 'H:MM:SS' text.
    Raises ValueError on any other line.
    """
    match = _ITERATION_RE.search(line.rstrip("\r\n"))
    if match is None:
        raise ValueError(f"not a Megatron iteration log line: {line!r}")
    fields: dict[str, str | float] = {
        "iteration": int(match.group(1)),
        "train iters": int(match.group(2)),
    }
    fields.update(_parse_fields(match.group(3), line))
    if "consumed samples" not in fields:
        raise ValueError(f"not a Megatron iteration log line (no consumed samples): {line!r}")
    return fields


def format_validation_block(label: str, losses: dict[str, float]) -> str:
    """Megatron's three validation lines (dashes, losses and PPL, dashes), joined by newlines."""
    # As evaluate_and_print_results(): PPL is capped at exp(20) so a diverged loss still prints.
    string = f" validation loss at {label} | "
    for key, value in losses.items():
        string += f"{key} value: {value:.6E} | "
        string += f"{key} PPL: {math.exp(min(20, value)):.6E} | "
    dashes = "-" * (len(string) + 1)
    return f"{dashes}\n{string}\n{dashes}"


def parse_validation_line(line: str) -> dict[str, float]:
    """Values of a validation line ('lm loss value', 'lm loss PPL', ...), plus 'iteration'.

    'iteration' is there when the label starts with 'iteration N'. Raises ValueError on any
    other line, the dashed ones included.
    """
    match = _VALIDATION_RE.search(line.rstrip("\r\n"))
    if match is None:
        raise ValueError(f"not a Megatron validation loss line: {line!r}")
    values = {name: float(value) for name, value in _parse_fields(match.group(2), line).items()}
    iteration = re.match(r"iteration (\d+)\b", match.group(1))
    if iteration is not None:
        values["iteration"] = int(iteration.group(1))
    return values


def _resident_set_bytes() -> tuple[float, float]:
    """(current, peak) resident set size of this process in bytes."""
    import resource  # Unix only, as is the rest of the training stack

    # ru_maxrss is in kilobytes on Linux, in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    try:
        import psutil

        current = psutil.Process().memory_info().rss
    except ImportError:
        current = peak  # getrusage knows only the peak
    return float(current), float(max(peak, current))


def memory_report(name: str, rank: int) -> str:
    """Megatron's report_memory line: CUDA allocator numbers, or the process RSS on CPU."""
    string = f"[Rank {rank}] (after {name}) memory (MB)"
    # Numbers as '{}' of a float, as Megatron prints them.
    if torch.cuda.is_available():
        string += f" | allocated: {torch.cuda.memory_allocated() / _MEGABYTE}"
        string += f" | max allocated: {torch.cuda.max_memory_allocated() / _MEGABYTE}"
        string += f" | reserved: {torch.cuda.memory_reserved() / _MEGABYTE}"
        string += f" | max reserved: {torch.cuda.max_memory_reserved() / _MEGABYTE}"
    else:
        current, peak = _resident_set_bytes()
        string += f" | rss: {current / _MEGABYTE} | max rss: {peak / _MEGABYTE}"
    return string


def _synchronize() -> None:
    """Wait for queued CUDA work so a timer measures it, not just its launch."""
    # is_initialized(): a CPU-only run on a GPU host should not create a CUDA context here.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _distributed() -> bool:
    """Whether torch.distributed is up (else everything is one rank)."""
    return dist.is_available() and dist.is_initialized()


class Timer:
    """A named wall-clock timer that accumulates start/stop spans, as Megatron's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._start_time = time.perf_counter()
        # None is the global group.
        self.barrier_group: dist.ProcessGroup | None = None

    def _barrier(self, barrier: bool) -> None:
        if barrier and _distributed():
            dist.barrier(group=self.barrier_group)

    def start(self, barrier: bool = False) -> None:
        """Start timing; with barrier=True every rank of barrier_group must call it too."""
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        self._barrier(barrier)
        _synchronize()
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the span to the elapsed total."""
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        self._barrier(barrier)
        _synchronize()
        span = time.perf_counter() - self._start_time
        self._elapsed += span
        self._active_time += span
        self._started = False

    def reset(self) -> None:
        """Clear the elapsed total and stop the timer (active_time is kept)."""
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated so far, a running span included; the timer keeps running."""
        started = self._started
        if started:
            self.stop(barrier=barrier)
        elapsed = self._elapsed
        if reset:
            self.reset()
        if started:
            self.start(barrier=barrier)
        return elapsed

    def active_time(self) -> float:
        """Seconds this timer has run since it was created, across resets."""
        return self._active_time


class _NoOpTimer(Timer):
    """Stands in for timers above the log level: start/stop cost nothing."""

    def __init__(self) -> None:
        super().__init__("no-op timer")

    def start(self, barrier: bool = False) -> None:
        """Do nothing."""

    def stop(self, barrier: bool = False) -> None:
        """Do nothing."""

    def reset(self) -> None:
        """Do nothing."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Raise: a timer filtered out by the log level measured nothing (as Megatron)."""
        raise RuntimeError("a no-op timer (above --timing-log-level) has no elapsed time")

    def active_time(self) -> float:
        """Raise, as elapsed()."""
        return self.elapsed()


class Timers:
    """Megatron's timers: named, with a log level; synchronize CUDA when present."""

    MAX_LOG_LEVEL = 2
    LOG_OPTIONS = ("max", "minmax", "all")

    def __init__(self, log_level: int, log_option: str = "minmax") -> None:
        if not 0 <= log_level <= self.MAX_LOG_LEVEL:
            raise ValueError(f"--timing-log-level must be 0..{self.MAX_LOG_LEVEL}, got {log_level}")
        if log_option not in self.LOG_OPTIONS:
            raise ValueError(
                f"--timing-log-option must be one of {self.LOG_OPTIONS}, got {log_option!r}"
            )
        self.log_level = log_level
        self.log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._no_op = _NoOpTimer()

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        """The timer `name`, created on first use; a no-op one when log_level > self.log_level.

        As Megatron: a later call without log_level returns the existing timer, and a first
        call without one uses level 2, so `timers('x').stop()` after a filtered
        `timers('x', log_level=1).start()` stays a no-op.
        """
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer {name!r} was created with log level {self._log_levels[name]}, "
                    f"asked for {log_level}"
                )
            return self._timers[name]
        if log_level is None:
            log_level = self.MAX_LOG_LEVEL
        if log_level > self.MAX_LOG_LEVEL:
            raise ValueError(f"timer log level {log_level} is above {self.MAX_LOG_LEVEL}")
        if log_level > self.log_level:
            return self._no_op
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _gather(
        self, names: list[str], reset: bool, barrier: bool, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        """[ranks, names] elapsed seconds, 0 where a rank lacks the timer; all ranks call it."""
        world_size, device = 1, None
        if _distributed():
            if barrier:
                dist.barrier(group=group)
            world_size = dist.get_world_size(group)
            if dist.get_backend(group) == "nccl":  # NCCL gathers only CUDA tensors
                device = torch.device("cuda", torch.cuda.current_device())
        local = torch.zeros(len(names), dtype=torch.float, device=device)
        for index, name in enumerate(names):
            if name in self._timers:
                local[index] = self._timers[name].elapsed(reset=reset)
        if world_size == 1:
            return local.view(1, -1).cpu()
        # A plain all_gather (not Megatron's all_gather_into_tensor) so gloo works on CPU.
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=group)
        return torch.stack(gathered).cpu()

    def log(
        self,
        names: list[str],
        normalizer: float = 1.0,
        reset: bool = True,
        group: dist.ProcessGroup | None = None,
        barrier: bool = False,
    ) -> str | None:
        """Megatron's timing report in ms (per `normalizer` iterations); None if none timed.

        Every rank of `group` must call it (it gathers); the caller prints it on one rank.
        """
        if normalizer <= 0.0:
            raise ValueError(f"timer normalizer must be positive, got {normalizer}")
        # As Megatron: seconds / (normalizer / 1000) are milliseconds per iteration.
        times, divisor = self._gather(names, reset, barrier, group), normalizer / 1000.0
        if self.log_option == "all":
            return _all_ranks_string(times, names, divisor)
        min_max = _min_max(times, names, divisor)
        if not min_max:
            return None
        string = "(min, max) time across ranks (ms):"
        for name, (low, high) in min_max.items():
            label = (name + " ").ljust(48, ".")
            if self.log_option == "max":
                string += f"\n    {label}: {high:.2f}"
            else:
                string += f"\n    {label}: ({low:.2f}, {high:.2f})"
        return string

    def write(
        self,
        names: list[str],
        writer: Any,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = False,
        group: dist.ProcessGroup | None = None,
        barrier: bool = False,
    ) -> None:
        """Add each timer's max over ranks (seconds / normalizer) as '{name}-time' to writer.

        Every rank must call it (it gathers); pass writer=None on the ranks that do not write.
        """
        if normalizer <= 0.0:
            raise ValueError(f"timer normalizer must be positive, got {normalizer}")
        min_max = _min_max(self._gather(names, reset, barrier, group), names, normalizer)
        if writer is not None:
            for name, (_, high) in min_max.items():
                writer.add_scalar(name + "-time", high, iteration)


def _min_max(times: torch.Tensor, names: list[str], divisor: float) -> dict[str, tuple]:
    """name -> (min, max) / divisor over the ranks that ran the timer."""
    result = {}
    for index, name in enumerate(names):
        # Ranks that never ran the timer report 0: leave them out, as Megatron.
        timed = times[:, index][times[:, index] > 0.0]
        if timed.numel() > 0:
            result[name] = (timed.min().item() / divisor, timed.max().item() / divisor)
    return result


def _all_ranks_string(times: torch.Tensor, names: list[str], divisor: float) -> str | None:
    """Megatron's 'all' option: every rank's time for every timer it ran."""
    string = "times across ranks (ms):"
    for index, name in enumerate(names):
        ranks = [rank for rank in range(times.shape[0]) if times[rank, index] > 0]
        if ranks:
            string += f"\n  {name}:"
        for rank in ranks:
            string += f"\n     rank {rank:2d}: {times[rank, index].item() / divisor:.2f}"
    return None if string == "times across ranks (ms):" else string


def _wandb_credentials_found() -> bool:
    """Whether W&B has an API key (env or ~/.netrc for its host) or an identity token file."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host or "api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _init_wandb(project: str, name: str | None, save_dir: str | None, config: dict | None):
    """Start a W&B run without ever prompting: offline when no credentials are configured."""
    try:
        import wandb
    except ImportError as error:
        raise RuntimeError(
            f"--wandb-project needs the wandb package: {install_hint('wandb', 'wandb')}"
        ) from error
    env_mode = os.environ.get("WANDB_MODE")
    has_credentials = _wandb_credentials_found()
    mode = None  # wandb reads WANDB_MODE itself
    if not env_mode and not has_credentials:
        mode = "offline"
    elif env_mode in ("online", "run") and not has_credentials:
        # wandb would prompt for a key on a terminal (or fail without one); say what to do.
        raise RuntimeError(
            f"WANDB_MODE={env_mode} but no W&B API key was found (WANDB_API_KEY, ~/.netrc): "
            "run `wandb login`, or unset WANDB_MODE to log offline"
        )
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    # wandb rejects values JSON cannot encode (a torch.dtype in vars(args)): store their str().
    config = json.loads(json.dumps(config or {}, default=str))
    run = wandb.init(project=project, name=name, dir=save_dir, config=config, mode=mode)
    if mode == "offline":
        run_dir = os.path.dirname(run.dir)  # run.dir is the run's files/ folder
        print(
            f"wandb: no API key found (WANDB_API_KEY, ~/.netrc), logging offline to {run_dir}; "
            f"upload later with `wandb sync {run_dir}`",
            flush=True,
        )
    return run


class MetricsWriter:
    """TensorBoard (--tensorboard-dir) and/or W&B (--wandb-project) scalars.

    Every method is a no-op when neither is configured.
    """

    def __init__(
        self,
        tensorboard_dir: str | None,
        wandb_project: str | None,
        wandb_exp_name: str | None = None,
        wandb_save_dir: str | None = None,
        config: dict | None = None,
        queue_size: int = 1000,
    ) -> None:
        self._tensorboard = None
        self._wandb_run = None
        self._wandb_step = -1
        self._warned_step_order = False
        # W&B metrics already plotted against a custom x axis (Megatron's 'vs tokens' curves).
        self._wandb_axes: set[str] = set()
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError(
                    "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
                ) from error
            self._tensorboard = SummaryWriter(log_dir=tensorboard_dir, max_queue=queue_size)
        if wandb_project:
            self._wandb_run = _init_wandb(wandb_project, wandb_exp_name, wandb_save_dir, config)

    @property
    def enabled(self) -> bool:
        """Whether any backend is open."""
        return self._tensorboard is not None or self._wandb_run is not None

    def _wandb_log(self, values: dict[str, float], step: int) -> None:
        # W&B drops (with a warning each time) points at a step below its last one, e.g.
        # Megatron's 'vs samples' curves; skip them here and say so once.
        if step < self._wandb_step:
            if not self._warned_step_order:
                self._warned_step_order = True
                print(
                    f"wandb: skipping {sorted(values)} at step {step} (below step "
                    f"{self._wandb_step}); W&B steps must not decrease, TensorBoard keeps them",
                    flush=True,
                )
            return
        self._wandb_step = step
        self._wandb_run.log(values, step=step)

    def _wandb_log_against(self, values: dict[str, float], step: int, x_axis: str) -> None:
        # As Megatron's interop logger: W&B plots these against the metric `x_axis`, logged
        # with them at the current iteration, so W&B's own step never goes back.
        for name in (x_axis, *values):
            if name not in self._wandb_axes:
                self._wandb_axes.add(name)
                if name == x_axis:
                    self._wandb_run.define_metric(name)
                else:
                    self._wandb_run.define_metric(name, step_metric=x_axis)
        self._wandb_run.log({**values, x_axis: step}, step=max(self._wandb_step, 0))

    def add_scalar(self, name: str, value: float, step: int, x_axis: str | None = None) -> None:
        """Record one scalar at step (see add_scalars for x_axis)."""
        self.add_scalars({name: value}, step, x_axis)

    def add_scalars(self, values: dict[str, float], step: int, x_axis: str | None = None) -> None:
        """Record several scalars at step (separate TensorBoard tags, not one 'run' each).

        `x_axis` names what `step` counts when it is not the iteration (Megatron's 'Samples',
        'Tokens'): TensorBoard takes it as the step all the same, W&B as that axis's value.
        """
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb_run is not None and values:
            floats = {name: float(value) for name, value in values.items()}
            if x_axis is None:
                self._wandb_log(floats, step)
            else:
                self._wandb_log_against(floats, step, x_axis)

    def add_text(self, name: str, text: str, step: int = 0) -> None:
        """Record a text (TensorBoard text tab; the W&B run summary)."""
        if self._tensorboard is not None:
            self._tensorboard.add_text(name, text, global_step=step)
        if self._wandb_run is not None:
            self._wandb_run.summary[name] = text

    def flush(self) -> None:
        """Write pending TensorBoard events to disk (W&B streams on its own)."""
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        """Flush and close every backend; later calls do nothing."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
