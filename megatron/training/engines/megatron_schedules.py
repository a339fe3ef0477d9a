"""Megatron's pipeline schedules without DeepSpeed: this rank's chunks on
torch.distributed.pipelining (1F1B, or interleaved with virtual stages), our AdamW; with
sharded data parallelism each chunk is an FSDP2 module (`engines/fsdp.py`).

The update is the plain engine's (`megatron.training.step.optimizer_step_tail`); checkpoints
are Megatron's per-rank files, one model entry per chunk.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import PipelineRunner, initialize_tied_embedding
from megatron.core.process_groups import this_rank_groups
from megatron.layout import Engine, ParallelLayout
from megatron.model.moe import set_up_expert_groups
from megatron.model.pipeline_chunks import activation_shape, build_pipeline_chunks
from megatron.training.engines.base import PipelineBatch, autocast_dtype, build_optimizer
from megatron.training.engines.fsdp import shard_model
from megatron.training.engines.plain import PlainEngine
from megatron.training.megatron_schedules_step import (
    MicroBatchLoss,
    PipelineTrainer,
    evaluate_megatron_schedules,
    train_step_megatron_schedules,
)
from megatron.training.monitor import Timers
from megatron.training.optimizer import loss_scaler_from_args
from megatron.training.scheduler import scheduler_from_args
from megatron.training.step import ForwardStep, StepResult
from megatron.utils import current_device


class MegatronSchedulesEngine(PlainEngine):
    """A `PipelineTrainer` over this rank's chunks, stepped by the schedule; the batch ramp,
    the parameters, the whole Adam state and Megatron's files are the plain engine's."""

    kind = Engine.MEGATRON_SCHEDULES

    @staticmethod
    def build_model(config: ModelConfig, layout: ParallelLayout) -> torch.nn.Module:
        """This rank's model chunks (`layout.virtual_pipeline` of them)."""
        return build_pipeline_chunks(
            config,
            parallel_state.get_pipeline_model_parallel_rank(),
            layout.pipeline_parallel,
            layout.virtual_pipeline,
            this_rank_groups(),
        )

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        args: argparse.Namespace,
        forward_step_func: ForwardStep | None,
        pipeline_batch: PipelineBatch | None,
    ) -> MegatronSchedulesEngine:
        """Tie the embedding across stages, AdamW (guarded), the scheduler and the runner."""
        if pipeline_batch is None:
            raise ValueError("Megatron's pipeline schedules need the entry script's PipelineBatch")
        if args.layout.sharding == "none":
            model.to(current_device())
        # What deepspeed.initialize does on DeepSpeed's engines.
        set_up_expert_groups(model, parallel_state.deepspeed_mpu())
        if args.layout.sharding != "none":
            # Before the optimizer; each chunk's shards on this rank's device, initialized
            # there (built on the meta device: `model_build`).
            model = shard_model(
                model, args.layout, args.grad_reduce_in_bf16, args.overlap_param_gather
            )
        # The head copy starts equal to the embedding (shard by shard under FSDP2: both ends
        # shard the same shape over equal data-parallel groups).
        initialize_tied_embedding(model)
        optimizer = build_optimizer(model, args, guard=True)
        scheduler = scheduler_from_args(optimizer, args)
        per_token = bool(getattr(args, "calculate_per_token_loss", False))
        loss = MicroBatchLoss(pipeline_batch.loss_func_for(per_token), per_token)
        trainer = PipelineTrainer(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            loss_scaler=loss_scaler_from_args(args),
            autocast_dtype=autocast_dtype(args.layout),
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            runner=PipelineRunner(
                model,
                loss,
                current_device(),
                (args.micro_batch_size, args.seq_length),
                activation_shape(
                    model[0].config, args.micro_batch_size, args.seq_length, model[0].groups
                ),
                model[0].config.torch_dtype,
            ),
            batch_fn=lambda data: pipeline_batch.batch_fn(data, args),
            loss=loss,
        )
        return cls(trainer, optimizer, scheduler, args)

    def train_step(
        self, data_iterator: Iterator, global_batch_size: int, timers: Timers
    ) -> StepResult:
        """The global batch through the schedule, then the plain engine's update."""
        return train_step_megatron_schedules(
            data_iterator, self.model, self.args, global_batch_size, timers
        )

    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> dict[str, float]:
        """Forward-only schedules; every stage gets the last stage's losses."""
        return evaluate_megatron_schedules(data_iterator, self.model, eval_iters)
