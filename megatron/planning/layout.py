"""Rank roles: which parameters, layers and micro-batches in flight each global rank has.

Ranks are placed as `megatron.core.parallel_state.generate_rank_groups` places them (the
same function the run uses), so rank r of the plan is rank r of the job. Ranks that differ
only in their data-parallel (or tensor-parallel) index hold the same amounts, so the plan
computes one `RankRole` per pipeline stage and copies it to its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.parallel_state import generate_rank_groups
from megatron.core.pipeline_parallel.layout import chunk_layer_numbers
from megatron.model.model_size import expert_parameters_per_rank, stage_tensor_sizes
from megatron.planning.inputs import PlanInputs


@dataclass(frozen=True)
class RankRole:
    """What one pipeline stage's ranks hold."""

    pp_rank: int
    layers: tuple[range, ...]
    """The global layer numbers of each model chunk on this rank."""
    first: bool
    """Holds the embedding (the first stage's chunk)."""
    last: bool
    """Holds the final norm, the output layer and the loss."""
    parameters: dict[str, int]
    """Elements by part (`embedding`, `layers`, `head`) on each rank of this stage."""
    tensor_sizes: tuple[int, ...] = ()
    """Each parameter tensor's elements (ZeRO-3 pads and keeps whole tensors by size)."""
    expert_parameters: int = 0
    """Of `num_parameters`, MoE experts' (reduced over the expert-data-parallel group)."""

    @property
    def num_layers(self) -> int:
        """Transformer layers on this rank, all chunks together."""
        return sum(len(chunk) for chunk in self.layers)

    @property
    def num_parameters(self) -> int:
        """Parameter elements on each rank of this stage."""
        return sum(self.parameters.values())


def stage_roles(inputs: PlanInputs) -> list[RankRole]:
    """One role per pipeline rank, in pipeline order."""
    config = inputs.model
    roles = []
    for pp_rank in range(inputs.pp):
        chunks = tuple(
            chunk_layer_numbers(config.num_layers, inputs.pp, inputs.virtual, pp_rank, chunk)
            for chunk in range(inputs.virtual)
        )
        first, last = pp_rank == 0, pp_rank == inputs.pp - 1
        parameters = {"embedding": 0, "layers": 0, "head": 0}
        tensors: list[int] = []
        for index, chunk in enumerate(chunks):
            part = stage_tensor_sizes(
                config,
                inputs.tp,
                chunk,
                first=first and index == 0,
                last=last and index == inputs.virtual - 1,
                ep=inputs.ep,
            )
            for name, sizes in part.items():
                parameters[name] += sum(sizes)
                tensors += sizes
        experts = sum(
            expert_parameters_per_rank(config, inputs.tp, chunk, inputs.ep) for chunk in chunks
        )
        roles.append(RankRole(pp_rank, chunks, first, last, parameters, tuple(tensors), experts))
    return roles


@dataclass(frozen=True)
class RankPlace:
    """One global rank's coordinates."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    sp_rank: int
    """The index in the sequence split: the Ulysses or context-parallel rank."""


def rank_places(inputs: PlanInputs) -> list[RankPlace]:
    """Every global rank's tensor, pipeline, data and sequence-split (Ulysses or context
    parallel) indices."""
    groups = generate_rank_groups(inputs.world_size, inputs.tp, inputs.pp, inputs.sp, inputs.cp)
    index: dict[str, dict[int, int]] = {}
    for kind in ("tensor", "pipeline", "data"):
        index[kind] = {rank: group.index(rank) for group in groups[kind] for rank in group}
    sequence = groups.get("sequence", [[rank] for rank in range(inputs.world_size)])
    index["sequence"] = {rank: group.index(rank) for group in sequence for rank in group}
    return [
        RankPlace(
            rank=rank,
            tp_rank=index["tensor"][rank],
            pp_rank=index["pipeline"][rank],
            dp_rank=index["data"][rank],
            sp_rank=index["sequence"][rank],
        )
        for rank in range(inputs.world_size)
    ]


def micro_batches_in_flight(inputs: PlanInputs, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of its
    whole stage (with interleaving, chunk forwards count 1 / virtual each).

    1F1B (Megatron's and DeepSpeed's TrainSchedule): stage r runs PP - r warm-up forwards
    before its first backward. Interleaved 1F1B: (PP - r - 1) x 2 + (V - 1) x PP warm-up
    chunk forwards plus the one in steady state (Megatron-LM's schedule).
    """
    m = inputs.micro_batches
    if inputs.pp == 1:
        return 1.0
    if inputs.virtual == 1:
        return float(min(inputs.pp - pp_rank, m))
    warmup = (inputs.pp - pp_rank - 1) * 2 + (inputs.virtual - 1) * inputs.pp
    return min(warmup + 1, m * inputs.virtual) / inputs.virtual
