"""One training iteration (a global batch) on the plain torch engine, DeepSpeed's engine and
DeepSpeed's pipeline engine (Megatron's schedules: `megatron_schedules_step.py`), and the
optimizer-step tail the plain engine shares with Megatron's schedules. Each step returns a
`StepResult` the loop logs; `megatron.training.engines` picks which one runs.

The forward-step contract is Megatron's: `forward_step_func(data_iterator, model, args)`
returns `(output_tensor, loss_func)` and `loss_func(output_tensor)` returns
`(loss, {"lm loss": value, ...})`, or Megatron-LM's `(loss_sum, num_tokens, reported)`
(`megatron.training.token_loss`, which also holds `--calculate-per-token-loss`). The MoE
layers' load-balancing losses reach the backward through the model
(`megatron.model.moe_aux_loss`); their 'moe loss' joins the reported values once per step.
The reported values are averaged here over the micro-batches and the data-parallel ranks
([sum, count] pairs: summed, then divided).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.combined_1f1b import Combined1F1B
from megatron.core.tensor_parallel.layers import sum_sharded_sequence_parallel_grads
from megatron.model.moe_aux_loss import moe_losses_of, scale_aux_losses_like
from megatron.model.moe_layer import finish_moe_backward, update_expert_biases
from megatron.training.monitor import Timers
from megatron.training.token_loss import (
    TokenCount,
    aux_loss_factor,
    gradient_multiplier,
    split_loss_outputs,
)
from megatron.utils import current_device

ForwardStep = Callable[[Iterator, torch.nn.Module, argparse.Namespace], tuple]

# Stands in when the caller passes no timers: every timer it hands out is a no-op.
_NO_TIMERS = Timers(0)


@dataclass
class StepResult:
    """What one iteration reports: losses, whether the update was skipped, norms, scale."""

    losses: dict[str, float]
    """Reported values averaged over micro-batches and data-parallel ranks."""
    skipped: bool
    """The optimizer did not update the weights (fp16 overflow or non-finite gradients)."""
    nan: bool
    """Some reported loss was NaN or infinite."""
    grad_norm: float | None
    """Global gradient L2 norm before clipping, when the engine measures it."""
    loss_scale: float | None
    """Current fp16 loss scale; None without fp16."""
    num_zeros_in_grad: float | None = None
    """Zero gradient elements of the update, over the whole model (`--log-num-zeros-in-grad`,
    Megatron's count_zeros_fp32); None when not counted or the update was skipped."""


def average_over_data_parallel(sums: dict[str, torch.Tensor], count: int) -> dict[str, float]:
    """Average per-rank sums of `count` micro-batches over the data-parallel group; a value
    summed as a [sum, count] pair (Megatron-LM's per-token reporting) is its sum / count."""
    return PendingAverages(sums, count).result()


class PendingAverages:
    """`average_over_data_parallel` in two halves: the all-reduce and the copy to the host
    are queued when made, read by `result()`.

    On a GPU the copy goes to pinned memory behind an event, so made before the optimizer
    step and read after it, the read waits for the losses only: the iteration's one device
    sync stays the gradient norm's (the clip and the skip decision need it on the host), and
    nothing after the step stops the host from queueing the next iteration.
    """

    def __init__(self, sums: dict[str, torch.Tensor], count: int) -> None:
        self.names = sorted(sums)
        self.count = count
        self.sizes = [sums[name].numel() for name in self.names]
        self.host: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        if not sums:
            return
        parts = [sums[name].detach().float().reshape(-1) for name in self.names]
        values = torch.cat(parts).to(current_device())
        if dist.is_initialized() and parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
        if values.is_cuda:
            self.host = values.to("cpu", non_blocking=True)  # pinned, behind the event
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = values

    def result(self) -> dict[str, float]:
        """{name: the average}: the sums over the ranks, per micro-batch and rank (or per
        token, for [sum, count] pairs)."""
        if self.host is None:
            return {}
        if self.ready is not None:
            self.ready.synchronize()
        totals = self.host.tolist()  # one read for every value
        ranks = parallel_state.get_data_parallel_world_size()
        averaged, start = {}, 0
        for name, size in zip(self.names, self.sizes):
            total = totals[start : start + size]
            start += size
            if len(total) == 2:
                averaged[name] = total[0] / max(total[1], 1.0)
            else:
                averaged[name] = total[0] / (self.count * ranks)
        return averaged


def accumulate_reported(sums: dict[str, torch.Tensor], reported: dict[str, torch.Tensor]) -> None:
    """Add one micro-batch's reported values (detached, fp32) to the running sums."""
    for name, value in reported.items():
        value = value.detach().float()
        sums[name] = sums[name] + value if name in sums else value


def losses_are_nan(losses: dict[str, float]) -> bool:
    """Whether some reported value is NaN or infinite."""
    return not all(math.isfinite(value) for value in losses.values())


def deepspeed_grad_norm(engine) -> float | None:  # noqa: ANN001 - a DeepSpeedEngine
    """The engine's pre-clipping gradient norm as a float; None after a skipped step."""
    if not engine.was_step_applied():
        return None  # as Megatron: no norm for an update that did not happen
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def deepspeed_loss_scale(engine) -> float | None:  # noqa: ANN001 - a DeepSpeedEngine
    """The engine's current fp16 loss scale, or None when it does not scale losses."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    scale = getattr(optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(optimizer, "loss_scale", None)
    return float(scale) if scale is not None else None


def deepspeed_step_result(engine, losses: dict[str, float]) -> StepResult:  # noqa: ANN001
    """A DeepSpeed engine's step (`engine`, after its boundary `step`) reporting `losses`."""
    return StepResult(
        losses=losses,
        skipped=not engine.was_step_applied(),
        nan=losses_are_nan(losses),
        grad_norm=deepspeed_grad_norm(engine),
        loss_scale=deepspeed_loss_scale(engine),
    )


def train_step_deepspeed(
    forward_step_func: ForwardStep,
    data_iterator: Iterator,
    engine,  # noqa: ANN001 - a DeepSpeedEngine
    args: argparse.Namespace,
    global_batch_size: int | None = None,
    timers: Timers | None = None,
) -> StepResult:
    """Micro-batches through `engine.backward` / `engine.step`; DeepSpeed owns the boundary.

    `global_batch_size` (default `--global-batch-size`) is this iteration's size under
    `--rampup-batch-size`; the LR schedule advances by it. `timers` gets Megatron's level-1
    'forward-backward' and 'optimizer' (the boundary's `engine.step`) timers.
    """
    increment = global_batch_size or args.global_batch_size
    timers = timers or _NO_TIMERS
    forward_backward, optimizer_step = timers("forward-backward", 1), timers("optimizer", 1)
    sums: dict[str, torch.Tensor] = {}
    micro_batches = engine.gradient_accumulation_steps()
    forward_backward.start()
    moe_losses = moe_losses_of(engine.module)
    moe_losses.start()
    for index in range(micro_batches):
        output, loss_func = forward_step_func(data_iterator, engine, args)
        loss, _, reported = split_loss_outputs(loss_func(output), per_token=False)
        # The MoE losses get what DeepSpeed scales `loss` by.
        scale_aux_losses_like(loss, moe_losses)
        engine.backward(loss)  # scales by 1/accumulation steps itself
        accumulate_reported(sums, reported)
        if index == micro_batches - 1:  # the boundary: this engine.step updates the weights
            forward_backward.stop()
            optimizer_step.start()
            accumulate_reported(sums, moe_losses.pop())
            # Queued before the update, read after it: no device sync of its own.
            losses = PendingAverages(sums, micro_batches)
            # Megatron-LM's MoE at EP 1 (DeepSpeed reduces the experts with the rest): the
            # routers' expert biases move before the update, as on the other engines.
            update_expert_biases(engine.module)
        # The scheduler counts samples; DeepSpeed passes lr_kwargs on at the boundary only.
        engine.step(lr_kwargs={"increment": increment})
    optimizer_step.stop()
    return deepspeed_step_result(engine, losses.result())


def train_step_deepspeed_pipe(
    data_iterator: Iterator,
    engine,  # noqa: ANN001 - a deepspeed PipelineEngine
    args: argparse.Namespace,
) -> StepResult:
    """One `engine.train_batch`: DeepSpeed schedules forward/backward over the stages."""
    loss = engine.train_batch(data_iter=data_iterator)
    # DeepSpeed averages the loss over micro-batches and data-parallel ranks and broadcasts
    # it from the last stage to every stage.
    losses = {"lm loss": float(loss)}
    return deepspeed_step_result(engine, losses)


@dataclass
class PlainTrainer:
    """The plain-torch path: the (DDP-wrapped) model, optimizer, scheduler, fp16 scaler."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    loss_scaler: object | None
    autocast_dtype: torch.dtype | None
    gradient_accumulation_steps: int
    comm_overlap: Combined1F1B | None = field(default=None, kw_only=True)
    """Megatron-LM's combined 1F1B (`--overlap-moe-expert-parallel-comm`): each micro-batch's
    backward runs beside the next one's forward (`train_step_plain`)."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for --fp16/--bf16: half-precision compute over the fp32 parameters.

        The parameters are fp32 on this path (`megatron.config.model_params_dtype`): they are
        the master weights AdamW steps, and their gradients come back in fp32.
        """
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(current_device().type, dtype=self.autocast_dtype)

    def expect_synced_backward(self) -> None:
        """What DDP's forward does when it syncs gradients, done after a forward it ran under
        `no_sync`: its reducer then averages the gradients in the next backward, as it would
        have. The combined 1F1B's last micro-batch needs it: its forward ran beside the
        previous micro-batch's backward, which DDP's reducer must not count."""
        model = self.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        model.require_forward_param_sync = True  # buffers broadcast at the next forward
        model.logger.set_runtime_stats_and_log()
        model.reducer.prepare_for_forward()
        model.reducer.prepare_for_backward([])  # find_unused_parameters is off

    def no_sync(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce (FSDP2's reduce-scatter) on all but the last
        micro-batch."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # an FSDP2 module
            self.model.set_requires_gradient_sync(last_micro_batch)
            return contextlib.nullcontext()
        if last_micro_batch or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()


def train_step_plain(
    forward_step_func: ForwardStep,
    data_iterator: Iterator,
    trainer: PlainTrainer,
    args: argparse.Namespace,
    global_batch_size: int | None = None,
    timers: Timers | None = None,
) -> StepResult:
    """Accumulate micro-batch gradients, unscale, then clip and step unless non-finite.

    With `trainer.comm_overlap` (Megatron-LM's combined 1F1B) each micro-batch's backward runs
    beside the next one's forward; DDP averages in the last one's, as without it. `timers`
    gets Megatron's level-1 'forward-backward' and 'optimizer' timers.
    """
    timers = timers or _NO_TIMERS
    sums: dict[str, torch.Tensor] = {}
    micro_batches = trainer.gradient_accumulation_steps
    scale = trainer.loss_scaler.scale if trainer.loss_scaler is not None else 1.0
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    # Per-token loss backpropagates sums; the division comes once the step's tokens are known.
    divisor = 1 if per_token else micro_batches
    tokens = TokenCount()
    timers("forward-backward", 1).start()
    moe_losses = moe_losses_of(trainer.model)
    moe_losses.start()
    overlap = trainer.comm_overlap
    try:
        for index in range(micro_batches):
            # Under the combined 1F1B every forward skips DDP's set-up for its gradient sync:
            # the previous backward still runs beside it (`expect_synced_backward`).
            with trainer.no_sync(index == micro_batches - 1 and overlap is None):
                with trainer.autocast():
                    output, loss_func = forward_step_func(data_iterator, trainer.model, args)
                    loss, num_tokens, reported = split_loss_outputs(loss_func(output), per_token)
                factor = aux_loss_factor(args) if per_token else 1.0
                scale_aux_losses_like(loss, moe_losses, factor)
                scaled = loss.float() * (scale / divisor)
                if overlap is None:
                    scaled.backward()
                else:  # the previous micro-batch's backward ran beside this forward
                    overlap.finish_backward()
                    if index == micro_batches - 1:
                        trainer.expect_synced_backward()
                    overlap.start_backward(scaled.backward)
            tokens.add(num_tokens)
            accumulate_reported(sums, reported)
        if overlap is not None:
            overlap.finish_backward()
    except BaseException:
        if overlap is not None:  # nothing may wait for a turn this thread will not give
            overlap.abandon_backward()
        raise
    accumulate_reported(sums, moe_losses.pop())
    # Queued now, read after the step: no device sync of its own (PendingAverages).
    losses = PendingAverages(sums, micro_batches)
    timers("forward-backward").stop()
    timers("optimizer", 1).start()
    params = [param for group in trainer.optimizer.param_groups for param in group["params"]]
    multiplier = 1.0
    if per_token:  # DDP, FSDP2 and the expert reduction averaged over the data-parallel ranks
        multiplier = gradient_multiplier(
            tokens.global_count(), parallel_state.get_data_parallel_world_size()
        )
    skipped = optimizer_step_tail(
        trainer, params, scale, global_batch_size or args.global_batch_size, multiplier
    )
    timers("optimizer").stop()
    return plain_step_result(trainer, losses.result(), skipped)


def plain_step_result(trainer: PlainTrainer, losses: dict[str, float], skipped: bool) -> StepResult:
    """The plain engine's and Megatron's schedules' step reporting `losses`, after
    `optimizer_step_tail` (the loss scale after the update, as Megatron logs it)."""
    return StepResult(
        losses=losses,
        skipped=skipped,
        nan=losses_are_nan(losses),
        grad_norm=None if skipped else trainer.optimizer.grad_norm,
        loss_scale=trainer.loss_scaler.scale if trainer.loss_scaler is not None else None,
        num_zeros_in_grad=None if skipped else trainer.optimizer.num_zeros,
    )


def optimizer_step_tail(
    trainer: PlainTrainer,
    params: list[torch.Tensor],
    scale: float,
    increment: int,
    multiplier: float = 1.0,
) -> bool:
    """After the backward of the plain engine and of Megatron's schedules: unscale the fp16
    gradients (and multiply them by `multiplier`: per-token loss's division), step (our
    optimizer clips and refuses non-finite gradients, `GuardedAdamW`), update the loss scale,
    advance the LR schedule by `increment` samples unless skipped, and clear the gradients.
    Returns whether the update was skipped."""
    sum_sharded_sequence_parallel_grads(params)  # FSDP2 with Megatron's sequence parallelism
    # Megatron-LM's MoE: expert gradients over their own ranks, the routers' expert biases.
    finish_moe_backward(trainer.model)
    if scale != 1.0 or multiplier != 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(multiplier / scale)
    trainer.optimizer.step()
    skipped = bool(trainer.optimizer.overflow)
    if trainer.loss_scaler is not None:
        trainer.loss_scaler.update(skipped)
    if not skipped:
        trainer.scheduler.step(increment=increment)
    trainer.optimizer.zero_grad(set_to_none=True)
    return skipped


def evaluate_forward_steps(
    forward_step_func: ForwardStep,
    data_iterator: Iterator,
    module: torch.nn.Module,
    args: argparse.Namespace,
    micro_batches: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, float]:
    """Mean reported losses of `micro_batches` forward steps without gradients, averaged over
    the data-parallel ranks (the plain engine's and DeepSpeed's evaluation)."""
    module.eval()
    sums: dict[str, torch.Tensor] = {}
    moe_losses = moe_losses_of(module)
    moe_losses.start()
    with torch.no_grad():
        for _ in range(micro_batches):
            with autocast():
                output, loss_func = forward_step_func(data_iterator, module, args)
                reported = loss_func(output)[-1]
            accumulate_reported(sums, reported)
    accumulate_reported(sums, moe_losses.pop())
    module.train()
    return average_over_data_parallel(sums, micro_batches)
