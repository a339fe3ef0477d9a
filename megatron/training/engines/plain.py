"""The plain torch engine: the whole GPT, DDP over the data-parallel group (or torch FSDP2 with
sharded data parallelism, `engines/fsdp.py`: the model then built on the meta device and each
rank's shards initialized in place), our AdamW.

fp32 parameters are the master weights; fp16/bf16 compute runs under autocast, with
Megatron's loss scaling in fp16 (`megatron.training.step.PlainTrainer`). Checkpoints are
Megatron's per-rank files.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch

from megatron.checkpointing.save_load import CheckpointTarget
from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.combined_1f1b import Combined1F1B
from megatron.core.process_groups import this_rank_groups
from megatron.core.tensor_parallel.meta_init import meta_device_build
from megatron.layout import Engine, ParallelLayout
from megatron.model import GPTModel
from megatron.model.moe import set_up_expert_groups
from megatron.model.moe_layer import attach_combined_1f1b, names_outside_data_parallel
from megatron.training.engines.base import (
    PipelineBatch,
    TrainingEngine,
    autocast_dtype,
    build_optimizer,
)
from megatron.training.engines.fsdp import shard_model
from megatron.training.monitor import Timers
from megatron.training.optimizer import loss_scaler_from_args
from megatron.training.scheduler import scheduler_from_args
from megatron.training.step import (
    ForwardStep,
    PlainTrainer,
    StepResult,
    evaluate_forward_steps,
    train_step_plain,
)
from megatron.utils import current_device


class PlainEngine(TrainingEngine):
    """`PlainTrainer` (DDP when data-parallel) stepped by `train_step_plain`."""

    kind = Engine.PLAIN

    @staticmethod
    def build_model(config: ModelConfig, layout: ParallelLayout) -> torch.nn.Module:
        """The whole GPT."""
        return GPTModel(config, this_rank_groups())

    @staticmethod
    def model_build(layout: ParallelLayout) -> AbstractContextManager:
        """Under FSDP2 sharding a meta-device build (`--init-model-with-meta-device`, always
        so here): each rank later allocates and initializes its shards only
        (`engines/fsdp.py`); otherwise a whole build."""
        return meta_device_build() if layout.sharding != "none" else nullcontext()

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        args: argparse.Namespace,
        forward_step_func: ForwardStep | None,
        pipeline_batch: PipelineBatch | None,
    ) -> PlainEngine:
        """AdamW (guarded), the scheduler, DDP over the data-parallel group when it has ranks
        (with the context-parallel ranks, whose gradients of their parts of each sequence the
        model scales so that DDP's average is their sum)."""
        if args.layout.sharding == "none":
            model.to(current_device())
        # What deepspeed.initialize does on DeepSpeed's engines.
        set_up_expert_groups(model, parallel_state.deepspeed_mpu())
        if args.layout.sharding != "none":
            # FSDP2 first: the optimizer then holds each parameter's 1/DP shard. The model,
            # built on the meta device (`model_build`), gets this rank's shards on its device,
            # initialized as a whole build's.
            model = shard_model(
                model, args.layout, args.grad_reduce_in_bf16, args.overlap_param_gather
            )
        optimizer = build_optimizer(model, args, guard=True)
        scheduler = scheduler_from_args(optimizer, args)
        if args.layout.sharding == "none" and (
            parallel_state.get_sequence_data_parallel_world_size() > 1
        ):
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, names_outside_data_parallel(model)
            )
            model = torch.nn.parallel.DistributedDataParallel(
                model,
                device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None,
                process_group=parallel_state.get_sequence_data_parallel_group(),
            )
        overlap = None
        if args.overlap_moe_expert_parallel_comm:  # Megatron-LM's combined 1F1B
            overlap = Combined1F1B(delay_weight_grads=args.delay_wgrad_compute)
            attach_combined_1f1b(model, overlap)
        trainer = PlainTrainer(
            comm_overlap=overlap,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            loss_scaler=loss_scaler_from_args(args),
            autocast_dtype=autocast_dtype(args.layout),
            gradient_accumulation_steps=args.gradient_accumulation_steps,
        )
        return cls(trainer, optimizer, scheduler, args, forward_step_func)

    def train_step(
        self, data_iterator: Iterator, global_batch_size: int, timers: Timers
    ) -> StepResult:
        """Accumulate the micro-batches' gradients, then the guarded update."""
        return train_step_plain(
            self.forward_step_func, data_iterator, self.model, self.args, global_batch_size, timers
        )

    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> dict[str, float]:
        """Forward steps under the training precision's autocast."""
        micro_batches = self.model.gradient_accumulation_steps * eval_iters
        return evaluate_forward_steps(
            self.forward_step_func,
            data_iterator,
            self.model.model,
            self.args,
            micro_batches,
            self.model.autocast,
        )

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Micro-batches per iteration = global batch / (micro-batch x data-parallel)."""
        per_step = self.args.micro_batch_size * self.args.data_parallel_size
        self.model.gradient_accumulation_steps = global_batch_size // per_step

    def module(self) -> torch.nn.Module:
        """The (DDP-wrapped) model."""
        return self.model.model

    @property
    def optimizer_state_partitioned(self) -> bool:
        """Every rank holds the whole Adam state."""
        return False

    def checkpoint_target(self) -> CheckpointTarget:
        """Megatron's per-rank files."""
        return CheckpointTarget(
            self.model,
            self.optimizer,
            self.scheduler,
            deepspeed_files=False,
            engine_name=self.kind.value,
            background_saves=self.background_saves,
        )
