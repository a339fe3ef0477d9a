"""Training and evaluation steps of pipeline parallelism without DeepSpeed (Megatron's schedules).

A `PipelineTrainer` is the plain path's `PlainTrainer` (fp32 parameters as master weights,
half-precision compute under autocast, Megatron's fp16 loss scaling, `GuardedAdamW` clipping
with the norm over every stage) whose model is this rank's pipeline chunks, run by a
`PipelineRunner`. One step reads the global batch's micro-batches, runs them through the
1F1B (or interleaved 1F1B) schedule, sums the tied embedding's two gradients, averages the
gradients over data-parallel ranks, and steps. The loss is computed on the last stage and
sent to every stage, so each rank's log line shows what Megatron's last rank prints. MoE layers
on any stage pass their load-balancing loss into the backward themselves, at the scale the step
sets (`megatron.model.moe_aux_loss`); their 'moe loss' is summed over the stages.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron.checkpointing.sharded_states import is_sharded
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    PipelineRunner,
    average_gradients,
    broadcast_from_last_stage,
    sync_tied_embedding_grads,
)
from megatron.core.tensor_parallel.mappings import sum_over_pipeline
from megatron.model.moe_aux_loss import MOE_LOSS, moe_losses_of
from megatron.training.monitor import Timers
from megatron.training.optimizer import is_expert_param
from megatron.training.step import (
    PlainTrainer,
    StepResult,
    accumulate_reported,
    average_over_data_parallel,
    optimizer_step_tail,
    plain_step_result,
)
from megatron.training.token_loss import (
    TokenCount,
    aux_loss_factor,
    gradient_multiplier,
    split_loss_outputs,
)
from megatron.utils import current_device


class MicroBatchLoss:
    """The schedule's loss function: the user's `loss_func(loss_mask, per_token_loss)`.

    Keeps each micro-batch's reported values (for the log line) and token count (per-token
    loss, `megatron.training.token_loss`) and multiplies the loss by the fp16 loss scale of
    the step.
    """

    def __init__(self, loss_func: Callable, per_token: bool = False) -> None:
        self.loss_func = loss_func
        self.per_token = per_token
        self.scale = 1.0
        self.reported: list[dict[str, torch.Tensor]] = []
        self.tokens = TokenCount()

    def __call__(self, output: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Loss of one micro-batch on the last stage, scaled."""
        loss, num_tokens, reported = split_loss_outputs(
            self.loss_func(loss_mask, output), self.per_token
        )
        self.reported.append(reported)
        self.tokens.add(num_tokens)
        return loss.float() * self.scale

    def run(self, runner: PipelineRunner, microbatches: int, batch: tuple, train: bool) -> None:
        """`runner.run` on `batch`; the last stage then holds one reported dict per micro-batch."""
        before = len(self.reported)
        runner.run(microbatches, *batch, train=train)
        added = len(self.reported) - before
        if runner.is_last and added != microbatches:
            raise RuntimeError(
                f"the pipeline schedule computed {added} losses for {microbatches} micro-batches"
            )


@dataclass
class PipelineTrainer(PlainTrainer):
    """`PlainTrainer` over pipeline chunks: `model` is this rank's `nn.ModuleList` of chunks."""

    runner: PipelineRunner | None = None
    batch_fn: Callable | None = None
    """A micro-batch dict -> ((tokens, position_ids), (labels, loss_mask)), on the device."""
    loss: MicroBatchLoss | None = None


def _global_batch(data_iterator: Iterator, trainer: PipelineTrainer, microbatches: int) -> tuple:
    """The next `microbatches` micro-batches, concatenated: (inputs, labels, loss_mask)."""
    parts = [trainer.batch_fn(next(data_iterator)) for _ in range(microbatches)]
    inputs = tuple(torch.cat([part[0][i] for part in parts]) for i in range(len(parts[0][0])))
    labels = torch.cat([part[1][0] for part in parts])
    loss_mask = torch.cat([part[1][1] for part in parts])
    return inputs, labels, loss_mask


def _moe_loss_over_stages(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    """This step's 'moe loss' (and Megatron-LM's named MoE losses) of every stage's MoE layers,
    summed over the stages, with the last stage's 'mtp_k loss'; {} for a dense model without
    multi-token prediction. A collective of the pipeline group with MoE layers."""
    stage = moe_losses_of(trainer.model).pop()
    config = trainer.model[0].config
    if config.moe is None and config.routed_moe is None:
        return stage  # {} or, on the last stage, multi-token prediction's 'mtp_k loss'
    # A stage may hold no MoE layer (--expert-interval, --moe-layer-freq): it adds nothing.
    local = {name: float(value) for name, value in stage.items()}
    local.setdefault(MOE_LOSS, 0.0)
    device = current_device()
    return {
        name: torch.tensor(value, device=device) for name, value in sum_over_pipeline(local).items()
    }


def _reported(trainer: PipelineTrainer, microbatches: int) -> dict[str, float]:
    """The micro-batches' reported values, averaged over them and the data-parallel ranks of
    the last stage (with the MoE loss of every stage), then sent to every stage."""
    losses: dict[str, float] = {}
    moe_loss = _moe_loss_over_stages(trainer)
    if parallel_state.is_pipeline_last_stage():
        sums: dict[str, torch.Tensor] = {}
        for reported in trainer.loss.reported:
            accumulate_reported(sums, reported)
        accumulate_reported(sums, moe_loss)
        losses = average_over_data_parallel(sums, microbatches)
    trainer.loss.reported = []
    return broadcast_from_last_stage(losses)


def train_step_megatron_schedules(
    data_iterator: Iterator,
    trainer: PipelineTrainer,
    args: argparse.Namespace,
    global_batch_size: int | None = None,
    timers: Timers | None = None,
) -> StepResult:
    """One global batch through the pipeline schedule, then the plain path's update."""
    timers = timers or Timers(0)
    microbatches = trainer.gradient_accumulation_steps
    scale = trainer.loss_scaler.scale if trainer.loss_scaler is not None else 1.0
    timers("forward-backward", 1).start()
    batch = _global_batch(data_iterator, trainer, microbatches)
    trainer.loss.scale = scale
    trainer.loss.tokens = TokenCount()
    # The last stage's loss is multiplied by `scale` (torch divides the gradients by the
    # micro-batches afterwards): every stage's MoE losses get the same (per-token loss: times
    # a micro-batch's tokens, which the division by the step's tokens cancels).
    per_token = trainer.loss.per_token
    moe_losses = moe_losses_of(trainer.model)
    moe_losses.set_backward_scale(scale * (aux_loss_factor(args) if per_token else 1.0))
    moe_losses.start()
    with trainer.autocast():
        trainer.loss.run(trainer.runner, microbatches, batch, train=True)
    timers("forward-backward").stop()
    timers("optimizer", 1).start()
    sync_tied_embedding_grads(trainer.model)
    params = [param for group in trainer.optimizer.param_groups for param in group["params"]]
    # Over data x context ranks (each context rank's part is scaled so the average sums them);
    # FSDP2 chunks were reduce-scattered by torch's stages already.
    if not any(is_sharded(chunk) for chunk in trainer.model):
        # With expert parallelism the experts' gradients are reduced apart (moe_layer.py).
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            params = [param for param in params if not is_expert_param(param)]
        average_gradients(params, parallel_state.get_sequence_data_parallel_group())
        params = [param for group in trainer.optimizer.param_groups for param in group["params"]]
    multiplier = 1.0
    if per_token:  # the last stage counted the tokens; every stage divides by them
        count = broadcast_from_last_stage({"tokens": trainer.loss.tokens.global_count()})
        multiplier = gradient_multiplier(
            int(count["tokens"]), parallel_state.get_data_parallel_world_size(), microbatches
        )
    # Clips with the norm over every stage and tensor-parallel rank; skips a non-finite step.
    skipped = optimizer_step_tail(
        trainer, params, scale, global_batch_size or args.global_batch_size, multiplier
    )
    timers("optimizer").stop()
    return plain_step_result(trainer, _reported(trainer, microbatches), skipped)


def evaluate_megatron_schedules(
    data_iterator: Iterator, trainer: PipelineTrainer, eval_iters: int
) -> dict[str, float]:
    """Mean reported losses over `eval_iters` global batches, forward only, every stage."""
    microbatches = trainer.gradient_accumulation_steps
    trainer.loss.scale = 1.0
    trainer.loss.reported = []
    moe_losses_of(trainer.model).start()
    trainer.model.eval()
    try:
        for _ in range(eval_iters):
            batch = _global_batch(data_iterator, trainer, microbatches)
            with trainer.autocast():
                trainer.loss.run(trainer.runner, microbatches, batch, train=False)
    finally:
        trainer.model.train()
    return _reported(trainer, microbatches * eval_iters)
