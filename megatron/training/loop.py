"""The iteration loop: step, count, log Megatron's line, evaluate, save, exit on time.

`TrainingLoop.train` runs iterations until `--train-iters` (or `--train-tokens`),
`--exit-interval` or `--exit-duration-in-mins`, saving a checkpoint before any exit when
`--save` is given.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.checkpointing import TrainState
from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.model.model_size import flops_per_token
from megatron.training.batch_schedule import BatchSizeSchedule
from megatron.training.engines import TrainingEngine
from megatron.training.fault_injection import inject_training_fault
from megatron.training.monitor import (
    IterationStats,
    MetricsWriter,
    Timers,
    format_iteration_log,
    memory_report,
)
from megatron.training.run_hooks import RunHooks
from megatron.training.signal_handler import ExitSignalHandler
from megatron.training.step import StepResult
from megatron.training.training_log import (
    TIMERS_TO_LOG,
    add_scalar_vs,
    optimizer_state_stats,
    params_l2_norm,
    write_optimizer_state_stats,
    write_training_scalars,
)
from megatron.utils import current_device, print_rank_0, print_rank_last, write_line


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many consecutive skipped or NaN iterations)."""


@dataclass
class _Interval:
    """What the log line averages over the iterations since the last one."""

    loss_sums: dict[str, float] = field(default_factory=dict)
    counted: int = 0
    iterations: int = 0
    skipped: int = 0
    nan: int = 0
    samples: int = 0

    def add(self, result: StepResult, global_batch_size: int) -> None:
        self.iterations += 1
        self.samples += global_batch_size
        self.skipped += int(result.skipped)
        self.nan += int(result.nan)
        if result.skipped or result.nan:
            return  # as Megatron: losses of skipped iterations are not averaged in
        self.counted += 1
        for name, value in result.losses.items():
            self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value


def training_continues(state: TrainState, train_iters: int, train_tokens: int | None) -> bool:
    """Megatron-DeepSpeed's loop condition: iterations left and, with --train-tokens, tokens."""
    return state.iteration < train_iters and (
        train_tokens is None or state.consumed_train_tokens < train_tokens
    )


def iterations_left(
    state: TrainState, train_iters: int, train_tokens: int | None, tokens: int
) -> int:
    """Iterations before `training_continues` says stop, at `tokens` per iteration."""
    left = train_iters - state.iteration
    if train_tokens is not None:
        left = min(left, max(0, math.ceil((train_tokens - state.consumed_train_tokens) / tokens)))
    return left


def _any_rank(flag: bool) -> bool:
    """True if `flag` is set on any rank (one small all-reduce)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class TrainingLoop:
    """Runs iterations and owns the logging, evaluation, checkpoint and exit cadence."""

    def __init__(
        self,
        args: argparse.Namespace,
        engine: TrainingEngine,
        timers: Timers,
        writer: MetricsWriter | None,
    ) -> None:
        self.args = args
        self.engine = engine
        self.scheduler = engine.scheduler
        self.timers = timers
        self.writer = writer
        self.evaluate: Callable[[str, Iterator, TrainState], dict] | None = None
        self._last = StepResult({}, False, False, None, None)
        self._params_norm: float | None = None
        # Known alike on every rank (the writer lives on the last one only): whether the
        # collectives behind the TensorBoard / W&B scalars run at all.
        self._writing = bool(args.tensorboard_dir or args.wandb_project)
        self._global_batch_size = args.global_batch_size
        self.batch_schedule = BatchSizeSchedule(
            args.global_batch_size,
            args.micro_batch_size,
            args.data_parallel_size,
            tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
        )
        self.start_time = time.time()
        self.predicted_peak_bytes: int | None = None
        """This rank's peak as `--dry-run` predicts it, shown in the memory line."""
        self.exit_signal: ExitSignalHandler | None = None
        self.stopped_by_signal = False
        self.hooks = RunHooks(args)  # --profile, --manual-gc
        config = ModelConfig.from_args(args)
        # Training FLOPs per token (forward + backward = 3x forward): per layer
        # 2*h*3p (QKV) + 4*s*p (scores, context) + 2*p*h (proj) + 4*h*f (MLP), plus 2*h*V for
        # the logits (model_size.flops_per_token); full recompute runs the forward again.
        self.flops_per_token = flops_per_token(config, args.seq_length)
        if args.recompute_granularity == "full":
            self.flops_per_token = self.flops_per_token * 4 // 3

    def step(self, data_iterator: Iterator, global_batch_size: int | None = None) -> StepResult:
        """One iteration on whichever engine this run uses, at `global_batch_size` samples."""
        args = self.args
        global_batch_size = global_batch_size or args.global_batch_size
        if global_batch_size != self._global_batch_size:
            self._set_global_batch_size(global_batch_size)
        return self.engine.train_step(data_iterator, global_batch_size, self.timers)

    def _set_global_batch_size(self, global_batch_size: int) -> None:
        """Change the number of micro-batches per iteration (--rampup-batch-size)."""
        self.engine.set_global_batch_size(global_batch_size)
        # DeepSpeed's pipeline engine steps the scheduler without arguments.
        self.scheduler.default_increment = global_batch_size
        self._global_batch_size = global_batch_size

    def train(self, train_iter: Iterator, valid_iter: Iterator | None, state: TrainState) -> None:
        """Iterate until the end of training or an exit condition; save before exiting."""
        if not self.args.exit_signal_handler:
            self._train(train_iter, valid_iter, state)
            return
        with ExitSignalHandler() as self.exit_signal:
            self._train(train_iter, valid_iter, state)

    def _train(self, train_iter: Iterator, valid_iter: Iterator | None, state: TrainState) -> None:
        self.hooks.start_training()
        try:
            self._iterate(train_iter, valid_iter, state)
        except TrainingStopped:
            # Every rank stops here together: the save in flight is committed first.
            self.engine.background_saves.finish()
            raise
        finally:
            self.hooks.stop_profiler()  # a run stopped inside the window still writes it

    def _iterate(
        self, train_iter: Iterator, valid_iter: Iterator | None, state: TrainState
    ) -> None:
        args = self.args
        interval = _Interval()
        saved_at = state.iteration
        interval_timer = self.timers("interval-time", 0)
        interval_timer.start()
        memory_reported = False
        while training_continues(state, args.train_iters, args.train_tokens):
            global_batch_size = self.batch_schedule.at(state.consumed_train_samples)
            # Whichever engine steps the scheduler (ours, DeepSpeed's, the pipeline's) reads the
            # tokens consumed before this iteration, as Megatron-DeepSpeed's args do.
            self.scheduler.consumed_train_tokens = state.consumed_train_tokens
            inject_training_fault(state.iteration + 1)
            self.hooks.before_iteration(state.iteration + 1)
            self.timers("train-step", 1).start()
            result = self.step(train_iter, global_batch_size)
            self.timers("train-step", 1).stop()
            state.iteration += 1
            self.hooks.after_iteration(state.iteration)
            state.consumed_train_samples += global_batch_size
            state.consumed_train_tokens += global_batch_size * args.seq_length
            self._count(result, state)
            interval.add(result, global_batch_size)
            self._last = result
            self._params_norm = self._measure_params_norm(state)
            self._write_scalars(result, state, interval.iterations)
            if state.iteration % args.log_interval == 0:
                elapsed = interval_timer.elapsed(reset=True)
                self._log(interval, state, elapsed)
                interval = _Interval()
                if not memory_reported:
                    self._report_memory(state.iteration)
                    memory_reported = True
            if args.eval_interval and state.iteration % args.eval_interval == 0 and valid_iter:
                if args.eval_iters > 0 and self.evaluate is not None:
                    self.hooks.around_evaluation()
                    self.evaluate(f"iteration {state.iteration}", valid_iter, state)
                    self.hooks.around_evaluation()
                    state.consumed_valid_samples += args.eval_iters * args.global_batch_size
            if args.save and state.iteration % args.save_interval == 0:
                self._save(state)
                saved_at = state.iteration
            elif getattr(args, "async_save", False):
                # Commit a background save once every rank has written it.
                self.engine.background_saves.poll()
            if self._should_exit(state):
                break
        if args.save and saved_at != state.iteration:
            self._save(state)
        self.engine.background_saves.finish()  # committed before the run ends

    def _report_memory(self, iteration: int) -> None:
        """Megatron's memory line from every data-parallel rank 0 (one per TP x PP rank, as
        its report_memory), with this rank's predicted peak (`--dry-run`) at the end."""
        if parallel_state.get_data_parallel_rank() != 0:
            return
        line = memory_report(f"{iteration} iterations", dist.get_rank())
        if self.predicted_peak_bytes is not None:
            line += f" | predicted peak: {self.predicted_peak_bytes / 2**20}"
        write_line(line)

    def _count(self, result: StepResult, state: TrainState) -> None:
        state.skipped_iterations += int(result.skipped)
        state.nan_iterations += int(result.nan)
        if result.skipped or result.nan:
            state.consecutive_bad_iterations += 1
        else:
            state.consecutive_bad_iterations = 0
        limit = self.args.max_consecutive_skipped_iterations
        if state.consecutive_bad_iterations >= limit:
            raise TrainingStopped(
                f"stopping at iteration {state.iteration}: {limit} consecutive iterations were "
                f"skipped or had a NaN/inf loss (last loss {result.losses}, loss scale "
                f"{result.loss_scale}); lower --lr, check the data, or raise "
                "--max-consecutive-skipped-iterations"
            )

    def _log(self, interval: _Interval, state: TrainState, elapsed: float) -> None:
        args = self.args
        per_iteration = elapsed / max(interval.iterations, 1)
        tokens_per_iteration = self._global_batch_size * args.seq_length
        left = iterations_left(
            state, args.train_iters, getattr(args, "train_tokens", None), tokens_per_iteration
        )
        samples_per_second = interval.samples / max(elapsed, 1e-9)
        tokens_per_second = samples_per_second * args.seq_length
        world = dist.get_world_size() if dist.is_initialized() else 1
        losses = {
            name: total / max(interval.counted, 1) for name, total in interval.loss_sums.items()
        }
        stats = IterationStats(
            iteration=state.iteration,
            train_iters=args.train_iters,
            consumed_samples=state.consumed_train_samples,
            consumed_tokens=state.consumed_train_tokens,
            elapsed_ms_per_iteration=per_iteration * 1000.0,
            learning_rate=self.scheduler.get_lr(),
            global_batch_size=self._global_batch_size,
            losses=losses,
            # Megatron prints 1.0 when nothing scales the loss; parsers expect the field.
            loss_scale=1.0 if self._last.loss_scale is None else self._last.loss_scale,
            grad_norm=self._last.grad_norm,
            num_zeros=self._last.num_zeros_in_grad,
            params_norm=self._params_norm,
            actual_seqlen=args.seq_length,
            skipped_iterations=interval.skipped,
            nan_iterations=interval.nan,
            samples_per_second=samples_per_second,
            tokens_per_gpu_per_second=tokens_per_second / world,
            tflops=self.flops_per_token * tokens_per_second / world / 1e12,
            throughput=(
                self.flops_per_token * tokens_per_second / world / 1e12
                if getattr(args, "log_throughput", False)
                else None
            ),
            eta_seconds=left * per_iteration,
            planned_iterations=state.iteration + left,
        )
        print_rank_last(format_iteration_log(stats))
        normalizer = max(interval.iterations, 1)
        if self.writer is not None:
            self.writer.add_scalars(
                {
                    "samples-per-second": samples_per_second,
                    "tokens-per-gpu-per-second": tokens_per_second / world,
                    "iteration-time": per_iteration,
                },
                state.iteration,
            )
            if args.log_timers_to_tensorboard:
                add_scalar_vs(self.writer, "iteration-time/iteration-time", per_iteration, state)
        if self.timers.log_level > 0:
            # As Megatron: the report resets the timers, also when only TensorBoard reads them
            # (--log-timers-to-tensorboard without --timing-log-level).
            text = self.timers.log(list(TIMERS_TO_LOG), normalizer=normalizer)
            if text and args.timing_log_level > 0:
                print_rank_last(text)

    def _measure_params_norm(self, state: TrainState) -> float | None:
        """The whole model's parameter norm (--log-params-norm) when a log or write is due."""
        args = self.args
        if not args.log_params_norm:
            return None
        written = self._writing and state.iteration % args.tensorboard_log_interval == 0
        if not (written or state.iteration % args.log_interval == 0):
            return None
        return params_l2_norm(self.engine.module().parameters())

    def _write_scalars(self, result: StepResult, state: TrainState, iterations: int) -> None:
        """Megatron's per-iteration TensorBoard block; `iterations` since the last log line.

        Every rank calls it: the timers and optimizer-state numbers are collectives.
        """
        args = self.args
        if not self._writing or state.iteration % args.tensorboard_log_interval != 0:
            return
        if args.log_timers_to_tensorboard:
            # Max over ranks; only the writer's rank writes.
            self.timers.write(list(TIMERS_TO_LOG), self.writer, state.iteration, iterations)
        if self.writer is not None:
            write_training_scalars(
                self.writer,
                args,
                state,
                result,
                self.scheduler.get_lr(),
                self._global_batch_size,
                self._params_norm,
            )
        if args.log_optimizer_states_to_tensorboard:
            partitioned = self.engine.optimizer_state_partitioned
            stats = optimizer_state_stats(self.engine.optimizer, partitioned)
            if self.writer is not None:
                write_optimizer_state_stats(self.writer, stats, state)

    def _save(self, state: TrainState) -> None:
        # As Megatron-LM: how long training stood still for the save (with --async-save, the
        # staging only), logged as its timers are.
        timer = self.timers("save-checkpoint", 0)
        timer.start(barrier=True)
        self.engine.save(state)
        timer.stop(barrier=True)
        report = self.timers.log(["save-checkpoint"])
        if report is not None:
            print_rank_0(report)

    def _should_exit(self, state: TrainState) -> bool:
        args = self.args
        if self.exit_signal is not None and _any_rank(self.exit_signal.received):
            print_rank_0(
                f"exiting program at iteration {state.iteration} after receiving SIGTERM "
                "(--exit-signal-handler)"
            )
            self.stopped_by_signal = True
            return True
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            print_rank_0(f"exiting program at iteration {state.iteration} (--exit-interval)")
            return True
        kill_switch = getattr(args, "kill_switch_file", None)
        if kill_switch and _any_rank(os.path.exists(kill_switch)):
            print_rank_0(
                f"exiting program at iteration {state.iteration}: {kill_switch} exists "
                "(--kill-switch-file)"
            )
            return True
        if args.exit_duration_in_mins:
            minutes = (time.time() - self.start_time) / 60.0
            if _any_rank(minutes > args.exit_duration_in_mins):
                print_rank_0(
                    f"exiting program after {minutes:.1f} minutes (--exit-duration-in-mins)"
                )
                return True
        return False
