"""The interface every engine implements, and what the engines share (the optimizer build).

An engine owns the model in the form it trains (a whole `GPTModel`, DeepSpeed's
`GPTModelPipe` or this rank's pipeline chunks), the optimizer and the LR scheduler, and knows
how to take one training step, evaluate, and which checkpoint layout it writes. The loop,
`pretrain()` and the checkpoint code call these methods and never ask which engine runs.
"""

from __future__ import annotations

import abc
import argparse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megatron.checkpointing import TrainState, load_checkpoint, save_checkpoint
from megatron.checkpointing.async_save import AsyncSaves
from megatron.checkpointing.save_load import CheckpointTarget
from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.layout import Engine, ParallelLayout
from megatron.training.monitor import Timers
from megatron.training.muon_optimizer import muon_optimizer
from megatron.training.optimizer import GuardedAdamW, get_param_groups, optimizer_from_args
from megatron.training.step import ForwardStep, StepResult


@dataclass(frozen=True)
class PipelineBatch:
    """What the pipeline engines need from the entry script besides the model (Megatron-
    DeepSpeed's `_megatron_batch_fn` and the schedule's loss function, typed)."""

    batch_fn: Callable[[dict, argparse.Namespace], tuple]
    """A loader batch -> ((tokens, position_ids), (labels, loss_mask)) on this rank's device."""
    loss_func: Callable[[torch.Tensor, torch.Tensor], tuple]
    """(loss_mask, per-token losses) -> (loss, {"lm loss": value, ...})."""
    per_token_loss_func: Callable[[torch.Tensor, torch.Tensor], tuple] | None = None
    """Under `--calculate-per-token-loss`: (loss_mask, per-token losses) -> (loss_sum,
    num_tokens, reported) (None: `loss_func` returns those itself)."""

    def loss_func_for(self, per_token: bool) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
        """The loss function of the run's loss normalisation."""
        if per_token and self.per_token_loss_func is not None:
            return self.per_token_loss_func
        return self.loss_func


class TrainingEngine(abc.ABC):
    """One engine: model, optimizer and scheduler, and the steps the loop takes with them."""

    kind: ClassVar[Engine]

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        args: argparse.Namespace,
        forward_step_func: ForwardStep | None = None,
    ) -> None:
        self.forward_step_func = forward_step_func
        """Megatron's `forward_step_func(data_iterator, model, args)` (whole-model engines)."""
        self.model = model
        """What Megatron's `setup_model_and_optimizer` returns as the model: the DeepSpeed
        engine, or our `PlainTrainer` / `PipelineTrainer`."""
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.args = args
        self.background_saves = AsyncSaves()
        """This run's `--async-save` save in flight (every `checkpoint_target` carries it)."""

    @property
    def layout(self) -> ParallelLayout:
        """The run's settled layout."""
        return self.args.layout

    @staticmethod
    @abc.abstractmethod
    def build_model(config: ModelConfig, layout: ParallelLayout) -> torch.nn.Module:
        """The GPT in the form this engine trains, on this rank."""

    @staticmethod
    def model_build(layout: ParallelLayout) -> AbstractContextManager:
        """The context the model provider runs in: a whole build (the plain engine's FSDP2
        sharding builds on the meta device instead)."""
        return nullcontext()

    @classmethod
    @abc.abstractmethod
    def create(
        cls,
        model: torch.nn.Module,
        args: argparse.Namespace,
        forward_step_func: ForwardStep | None,
        pipeline_batch: PipelineBatch | None,
    ) -> TrainingEngine:
        """Wrap the provider's `model` with its optimizer and scheduler."""

    @abc.abstractmethod
    def train_step(
        self, data_iterator: Iterator, global_batch_size: int, timers: Timers
    ) -> StepResult:
        """One iteration of `global_batch_size` samples."""

    @abc.abstractmethod
    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> dict[str, float]:
        """Mean reported losses over `eval_iters` global batches, averaged over DP ranks."""

    @abc.abstractmethod
    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Change the micro-batches per iteration (`--rampup-batch-size`)."""

    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """This rank's model parameters as one module (for norms)."""

    @property
    @abc.abstractmethod
    def optimizer_state_partitioned(self) -> bool:
        """Whether each data-parallel rank holds only a slice of the Adam state."""

    @abc.abstractmethod
    def checkpoint_target(self) -> CheckpointTarget:
        """What `save_checkpoint` writes and `load_checkpoint` fills."""

    def save(self, state: TrainState, args: argparse.Namespace | None = None) -> None:
        """Save `state` to `--save` in this engine's layout (a collective); `args`: other
        settled flags to save by (`--ckpt-convert-format`'s format and directory)."""
        save_checkpoint(state, self.checkpoint_target(), self.args if args is None else args)

    def load(self) -> TrainState:
        """Resume from `--load` when it holds a checkpoint; the state to continue from."""
        return load_checkpoint(self.checkpoint_target(), self.args)


def build_optimizer(  # noqa: ANN201
    model: torch.nn.Module, args: argparse.Namespace, guard: bool, flattened: bool = False
):
    """A bare AdamW over Megatron's param groups (no weight decay on biases and norms), or
    with `--optimizer muon` Megatron-LM's Muon and AdamW (`megatron.training.muon_optimizer`;
    DeepSpeed's own Muon when its wrapper is `flattened`: parameters in flat partitions).

    With `guard`, our optimizer itself clips, measures the norm and refuses non-finite
    gradients: the paths where nothing else does (plain torch, DeepSpeed fp32 ZeRO-0). There it
    also counts the zero gradient elements (`--log-num-zeros-in-grad`).
    """
    groups = _param_groups(model, args)
    if args.optimizer == "muon":
        settings = _guard_settings(args) if guard else None
        optimizer = muon_optimizer(model, groups, args, settings, deepspeed_partitions=flattened)
    elif not guard:
        # DeepSpeed recognises torch's own AdamW (its ZeRO code paths are tested with it).
        return optimizer_from_args(model, args, groups)
    else:
        optimizer = GuardedAdamW(
            groups,
            lr=args.lr,
            weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            **_guard_settings(args),
        )
    if guard:
        optimizer.counts_zeros = bool(getattr(args, "log_num_zeros_in_grad", False))
    return optimizer


def _guard_settings(args: argparse.Namespace) -> dict:
    """What our guarded optimizers clip to and sum the gradient norm over."""
    return dict(
        clip_grad=args.clip_grad,
        guard=True,
        model_parallel_group=parallel_state.get_model_parallel_group(),
        expert_parallel_group=expert_group_of(args),
        # FSDP2 (sharded data parallelism): each rank holds a shard of every gradient.
        shard_group=(
            parallel_state.get_sequence_data_parallel_group()
            if getattr(getattr(args, "layout", None), "sharding", "none") != "none"
            else None
        ),
    )


def _param_groups(model: torch.nn.Module, args: argparse.Namespace) -> list[dict]:
    """Megatron's groups; with MoE, DeepSpeed's expert groups split off when asked
    (`--create-moe-param-group`) or needed (ZeRO 1-2 reduces and partitions experts apart)."""
    decoupled = None
    if getattr(args, "decoupled_lr", None) is not None:
        decoupled = (args.decoupled_lr, args.decoupled_min_lr)
    groups = get_param_groups(model, decoupled)
    zero_stage = args.zero_stage or 0  # None without --deepspeed
    if getattr(args, "moe", False) and (args.create_moe_param_group or zero_stage > 0):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return groups


def expert_group_of(args: argparse.Namespace) -> Callable[[str], object] | None:
    """How the gradient norm finds the group spreading an expert parameter: DeepSpeed's
    groups by name (DeepSpeed-MoE), ours (Megatron-LM's MoE with EP above 1), or None."""
    if getattr(args, "moe", False):
        return _expert_parallel_group
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return lambda name: parallel_state.get_expert_model_parallel_group()
    return None


def _expert_parallel_group(name: str):  # noqa: ANN202 - a torch process group
    """DeepSpeed's expert-parallel group `name` (made by `deepspeed.initialize`)."""
    from deepspeed.utils import groups

    return groups._get_expert_parallel_group(name)


def autocast_dtype(layout: ParallelLayout) -> torch.dtype | None:
    """The half precision the plain engines compute in under autocast (None in fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(layout.precision)
