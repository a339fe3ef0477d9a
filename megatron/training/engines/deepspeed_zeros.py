"""Megatron's zero count (`--log-num-zeros-in-grad`) on DeepSpeed's engines.

DeepSpeed's optimizer wrappers own the gradients: each hands its fp32 gradients (reduced over
the data-parallel ranks, unscaled and clipped) to the client AdamW on tensors of its own, and
frees them after the update. A step pre-hook on that AdamW counts the zeros there, each
parameter's apart, where the wrapper (`megatron.deepspeed_facts.OptimizerWrapper`) keeps them
(DeepSpeed 0.19.8's attributes):

- none (fp32 ZeRO-0): our `GuardedAdamW` steps the parameters and counts them itself;
- FP16_UnfusedOptimizer (fp16, and bf16 at ZeRO-0): a whole fp32 copy of each parameter,
  `fp32_groups` beside `fp16_groups`, on every rank;
- BF16_Optimizer and ZeRO 1-2: one flat fp32 partition per param group
  (`fp32_groups_flat_partition`, `single_partition_of_fp32_groups`); each parameter's
  `_hp_mapping.hp_fragment_address` is the slice holding this rank's fragment of it (the
  alignment padding belongs to no parameter);
- ZeRO-3: one flat fp32 partition per sub-group (`fp32_partitioned_groups_flat`), each
  parameter's partition at `grad_position`, the last rank's padded past the parameter's end.

The counts are then summed as the gradient norm's squares (`model_wide_sum`): over the
data-parallel ranks where the wrapper partitions, and over the model-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.deepspeed_facts import OptimizerWrapper, optimizer_state_partitioned
from megatron.training.optimizer import model_wide_sum, zeros_in
from megatron.utils import current_device

_HP_PARTITIONS = {
    OptimizerWrapper.BF16: "fp32_groups_flat_partition",
    OptimizerWrapper.ZERO: "single_partition_of_fp32_groups",
}
"""Where the wrappers linking `_hp_mapping` keep their flat fp32 partitions, by group."""


class DeepSpeedZeroCount:
    """Counts the zero gradient elements of each update of a DeepSpeed engine."""

    def __init__(
        self,
        engine: Any,  # a DeepSpeedEngine or PipelineEngine
        wrapper: OptimizerWrapper,
        expert_parallel_group: Callable[[str], object] | None,
    ) -> None:
        self.engine = engine
        self.wrapper = wrapper
        self.expert_parallel_group = expert_parallel_group
        self._counts: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        if wrapper is not OptimizerWrapper.CLIENT:
            # ZeRO 1-2 step the client AdamW once per param group, ZeRO-3 once per sub-group.
            engine.optimizer.optimizer.register_step_pre_hook(self._before_update)

    def _before_update(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        """Count the zeros of the gradients the wrapper hands to this AdamW step."""
        stepped = {
            id(tensor)
            for group in optimizer.param_groups
            for tensor in group["params"]
            if tensor.grad is not None
        }
        for param, grad in self._gradients(stepped):
            self._counts.append((param, zeros_in(grad)))

    def _gradients(self, stepped: set[int]) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, this rank's fp32 gradient of it) in the tensors `stepped`."""
        wrapper = self.engine.optimizer
        if self.wrapper is OptimizerWrapper.FP16_UNFUSED:
            for params, copies in zip(wrapper.fp16_groups, wrapper.fp32_groups):
                for param, copy in zip(params, copies):
                    # As Megatron: a parameter without a gradient is not counted.
                    if id(copy) in stepped and param.grad is not None:
                        yield param, copy.grad
            return
        if self.wrapper is OptimizerWrapper.ZERO3:
            yield from _zero3_gradients(wrapper, self.engine.module, stepped)
            return
        partitions = getattr(wrapper, _HP_PARTITIONS[self.wrapper])
        for param in self.engine.module.parameters():
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:  # no fragment of it in this rank's partition
                continue
            partition = partitions[mapping.param_group_index]
            if id(partition) in stepped:
                address = mapping.hp_fragment_address
                yield param, partition.grad.narrow(0, address.start, address.numel)

    def take(self) -> float | None:
        """The last update's count over the whole model; None when the update was skipped.

        Every rank calls it after each step (a collective)."""
        counts, self._counts = self._counts, []
        if not self.engine.was_step_applied():
            return None
        if self.wrapper is OptimizerWrapper.CLIENT:
            return self.engine.optimizer.num_zeros
        shards = None
        if optimizer_state_partitioned(self.wrapper):
            shards = parallel_state.get_sequence_data_parallel_group()  # DeepSpeed's partitions
        total = model_wide_sum(
            counts,
            current_device(),
            torch.float64,
            parallel_state.get_model_parallel_group(),
            self.expert_parallel_group,
            shards,
        )
        return total.item()


def _zero3_gradients(
    wrapper: Any, module: torch.nn.Module, stepped: set[int]
) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """ZeRO-3: each parameter's partition in its sub-group's flat fp32 gradient, without the
    padding of the last rank's partition."""
    for param in module.parameters():
        position = wrapper.grad_position.get(wrapper.get_param_id(param))
        if position is None:  # not trained
            continue
        sub_group, offset, size = position
        partition = wrapper.fp32_partitioned_groups_flat[sub_group]
        if id(partition) not in stepped:
            continue
        rank = dist.get_rank(group=param.ds_process_group)
        elements = max(0, min(size, param.ds_numel - rank * size))
        yield param, partition.grad.narrow(0, offset, elements)
