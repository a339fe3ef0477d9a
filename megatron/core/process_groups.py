"""The process groups a model communicates over, handed to it at construction.

megatron-core passes a process-group collection into its modules instead of having them look
the groups up; so does our GPT: `GPTModel(config, groups)` (and the pipeline forms) give every
layer that needs one its `ModelGroups`, and no module under `megatron/model/` reads
`parallel_state`. `ModelGroups()` is one process (every size 1, no groups): a model built
outside torch.distributed runs unchanged. `this_rank_groups()` gives this rank's,
sliced from the run's device mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class RankGroup:
    """One group this rank belongs to: its size, this rank's index in it, the group (None
    when the size is 1)."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class ModelGroups:
    """This rank's place in each parallel dimension the model's layers care about."""

    tensor: RankGroup = field(default_factory=RankGroup)
    """Tensor parallelism (`--tensor-model-parallel-size`): the ranks splitting each weight."""
    pipeline: RankGroup = field(default_factory=RankGroup)
    """Pipeline stages (`--pipeline-model-parallel-size`)."""
    data: RankGroup = field(default_factory=RankGroup)
    """Data parallelism: replicas of the dense weights."""
    context: RankGroup = field(default_factory=RankGroup)
    """Context parallelism (`--context-parallel-size`): ring attention over the split sequence."""
    ulysses: RankGroup = field(default_factory=RankGroup)
    """DeepSpeed-Ulysses (`--ds-sequence-parallel-size`): all-to-all attention."""
    tensor_sequence: RankGroup = field(default_factory=RankGroup)
    """The tensor x context-parallel (or Ulysses) ranks of one replica: under sequence
    parallelism they hold the tokens of one micro-batch between them (megatron-core's tp-cp)."""
    expert: RankGroup = field(default_factory=RankGroup)
    """Expert parallelism (`--expert-model-parallel-size`): which routed experts a rank holds,
    EP consecutive ranks of a pipeline stage (folded over tensor, context and data parallel)."""
    expert_data_size: int = 1
    """How many ranks hold this rank's experts (where expert gradients are averaged)."""
    sequence_data_size: int = 1
    """Data-parallel x sequence-split ranks: where dense gradients are summed."""
    stage: dist.ProcessGroup | None = None
    """Every rank of this pipeline stage (None, the whole world, at PP = 1)."""

    @property
    def sequence_split_size(self) -> int:
        """Ranks splitting each sample's tokens: context-parallel or Ulysses (never both)."""
        return max(self.context.size, self.ulysses.size)


def this_rank_groups() -> ModelGroups:
    """This rank's groups, sliced from the run's device mesh (one process's before
    `parallel_state.initialize_model_parallel`): what a model built without explicit groups
    receives, as megatron-core's modules default to its `ProcessGroupCollection` of the mpu."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return ModelGroups()

    def of(size: int, rank: int, group: dist.ProcessGroup | None) -> RankGroup:
        return RankGroup(size, rank, group if size > 1 else None)

    return ModelGroups(
        tensor=of(
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group(),
        ),
        pipeline=of(
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_group(),
        ),
        data=of(
            ps.get_data_parallel_world_size(),
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_group(),
        ),
        context=of(
            ps.get_context_parallel_world_size(),
            ps.get_context_parallel_rank(),
            ps.get_context_parallel_group(),
        ),
        ulysses=of(ps.get_ulysses_world_size(), ps.get_ulysses_rank(), ps.get_ulysses_group()),
        tensor_sequence=of(
            ps.get_tensor_and_sequence_parallel_world_size(),
            ps.get_tensor_and_sequence_parallel_rank(),
            ps.get_tensor_and_sequence_parallel_group(),
        ),
        expert=of(
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_group(),
        ),
        expert_data_size=ps.get_expert_data_parallel_world_size(),
        sequence_data_size=ps.get_sequence_data_parallel_world_size(),
        stage=ps.get_stage_group(),
    )
