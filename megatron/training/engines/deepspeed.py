"""DeepSpeed's engine and DeepSpeed's pipeline engine: the model, a bare AdamW, the LR
scheduler and Megatron's `mpu` wrapped by `deepspeed.initialize` with the reconciled config.

This is one of the few modules that import DeepSpeed. Checkpoints are DeepSpeed's layout
(`engine.save_checkpoint`), with Megatron's metadata as client state.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import replace

import torch

from megatron.checkpointing.save_load import CheckpointTarget
from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.process_groups import this_rank_groups
from megatron.deepspeed_facts import (
    deepspeed_optimizer_wrapper,
    guards_steps,
    optimizer_state_partitioned,
    skip_deepspeed_cpu_inference_comm,
)
from megatron.layout import Engine, ParallelLayout
from megatron.model import GPTModel
from megatron.training.engines.base import (
    PipelineBatch,
    TrainingEngine,
    build_optimizer,
    expert_group_of,
)
from megatron.training.engines.bf16_gradient_buffer import accumulate_in_flat_buffers
from megatron.training.engines.deepspeed_zeros import DeepSpeedZeroCount
from megatron.training.engines.overflow_check import check_overflow_in_one_read
from megatron.training.monitor import Timers
from megatron.training.scheduler import scheduler_from_args
from megatron.training.step import (
    ForwardStep,
    StepResult,
    evaluate_forward_steps,
    train_step_deepspeed,
    train_step_deepspeed_pipe,
)


class DeepSpeedEngine(TrainingEngine):
    """DeepSpeed's engine over the whole GPT, stepped micro-batch by micro-batch."""

    kind = Engine.DEEPSPEED
    zero_count: DeepSpeedZeroCount | None = None
    """`--log-num-zeros-in-grad`: counts each update's zero gradient elements."""

    @staticmethod
    def build_model(config: ModelConfig, layout: ParallelLayout) -> torch.nn.Module:
        """The whole GPT."""
        return GPTModel(config, this_rank_groups())

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        args: argparse.Namespace,
        forward_step_func: ForwardStep | None,
        pipeline_batch: PipelineBatch | None,
    ) -> DeepSpeedEngine:
        """`deepspeed.initialize(model, optimizer, lr_scheduler, mpu, config)`."""
        import deepspeed

        skip_deepspeed_cpu_inference_comm()  # before deepspeed.initialize's init_distributed

        layout = args.layout
        config = dict(args.deepspeed_config_dict)
        mpu = parallel_state.deepspeed_mpu()
        if layout.zero_stage == 3 and layout.sequence_split > 1:
            # DeepSpeed partitions a ZeRO-3 model over mpu.get_data_parallel_group(), which
            # leaves the sequence-split (Ulysses or context) ranks out: nothing would sum their
            # gradients (each rank kept its own part's). Partitioned here over the
            # sequence-data-parallel group instead.
            deepspeed.zero.Init(
                module=model,
                data_parallel_group=parallel_state.get_sequence_data_parallel_group(),
                config_dict_or_path=config,
                mpu=mpu,
                dtype=next(model.parameters()).dtype,
            )
        # fp32 ZeRO-0 hands the client optimizer the raw gradients: there our optimizer skips
        # non-finite steps and reports the norm; every DeepSpeed wrapper does it itself.
        wrapper = deepspeed_optimizer_wrapper(args)
        guard = not guards_steps(wrapper)
        if guard:
            config["gradient_clipping"] = 0.0  # the optimizer clips, so it sees the norm first
        optimizer = build_optimizer(model, args, guard, optimizer_state_partitioned(wrapper))
        scheduler = scheduler_from_args(optimizer, args)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            # The pipeline engine takes its groups from the PipelineModule's topology.
            mpu=None if cls.kind is Engine.DEEPSPEED_PIPE else mpu,
            config=config,
        )
        # One add per group where DeepSpeed adds each parameter's gradient per micro-batch;
        # one device read where it checks each gradient for inf/NaN (ZeRO-0 in bf16/fp16).
        accumulate_in_flat_buffers(optimizer)
        check_overflow_in_one_read(optimizer)
        if pipeline_batch is not None and cls.kind is Engine.DEEPSPEED_PIPE:
            engine.set_batch_fn(lambda data: pipeline_batch.batch_fn(data, args))
        created = cls(engine, optimizer, scheduler, args, forward_step_func)
        if getattr(args, "log_num_zeros_in_grad", False):
            created.zero_count = DeepSpeedZeroCount(engine, wrapper, expert_group_of(args))
        return created

    def _counted(self, result: StepResult) -> StepResult:
        """`result` with the step's zero count (a collective) under --log-num-zeros-in-grad."""
        if self.zero_count is None:
            return result
        return replace(result, num_zeros_in_grad=self.zero_count.take())

    def train_step(
        self, data_iterator: Iterator, global_batch_size: int, timers: Timers
    ) -> StepResult:
        """`engine.backward` / `engine.step` per micro-batch; DeepSpeed owns the boundary."""
        result = train_step_deepspeed(
            self.forward_step_func, data_iterator, self.model, self.args, global_batch_size, timers
        )
        return self._counted(result)

    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> dict[str, float]:
        """Forward steps through the engine (its module computes in the config's precision)."""
        micro_batches = self.args.gradient_accumulation_steps * eval_iters
        return evaluate_forward_steps(
            self.forward_step_func, data_iterator, self.model, self.args, micro_batches
        )

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """DeepSpeed recomputes its accumulation steps from the new train batch size."""
        self.model.set_train_batch_size(global_batch_size)

    def module(self) -> torch.nn.Module:
        """The engine (its parameters are the module's)."""
        return self.model

    @property
    def optimizer_state_partitioned(self) -> bool:
        """ZeRO 1-3, or a wrapper that partitions like ZeRO-1 (BF16_Optimizer)."""
        return optimizer_state_partitioned(deepspeed_optimizer_wrapper(self.args))

    def checkpoint_target(self) -> CheckpointTarget:
        """DeepSpeed's layout, written by the engine."""
        return CheckpointTarget(
            self.model,
            self.optimizer,
            self.scheduler,
            deepspeed_files=True,
            pipe_module_names=self.kind is Engine.DEEPSPEED_PIPE,
            engine_name=self.kind.value,
            background_saves=self.background_saves,
        )


class DeepSpeedPipeEngine(DeepSpeedEngine):
    """DeepSpeed's `PipelineEngine` over `GPTModelPipe` (also at PP = 1, as Megatron-DeepSpeed
    runs `--deepspeed` without `--no-pipeline-parallel`)."""

    kind = Engine.DEEPSPEED_PIPE

    @staticmethod
    def build_model(config: ModelConfig, layout: ParallelLayout) -> torch.nn.Module:
        """GPT as DeepSpeed's `PipelineModule` (this rank builds its stage's layers)."""
        from megatron.model.pipeline import GPTModelPipe

        return GPTModelPipe(config, groups=this_rank_groups())

    def train_step(
        self, data_iterator: Iterator, global_batch_size: int, timers: Timers
    ) -> StepResult:
        """One `engine.train_batch`: DeepSpeed schedules the micro-batches over the stages."""
        return self._counted(train_step_deepspeed_pipe(data_iterator, self.model, self.args))

    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> dict[str, float]:
        """`engine.eval_batch` per global batch (DeepSpeed reports the lm loss only)."""
        losses = [float(self.model.eval_batch(data_iter=data_iterator)) for _ in range(eval_iters)]
        return {"lm loss": sum(losses) / eval_iters}
