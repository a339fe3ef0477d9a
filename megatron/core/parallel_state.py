"""Tensor, pipeline and data parallel process groups, held in one object.

`initialize_model_parallel(tp, pp, sp)` splits the world into groups in Megatron's rank order
(tensor-parallel ranks adjacent, then data parallel, then pipeline stages outermost), so a
checkpoint's `mp_rank_XX_YYY` names and a launcher's node layout mean what they mean in
Megatron-LM. The query functions mirror Megatron's names; `deepspeed_mpu()` bundles the ones
DeepSpeed calls (`deepspeed.initialize(mpu=...)`, `deepspeed.checkpointing.configure(mpu, ...)`).

DeepSpeed-Ulysses (`--ds-sequence-parallel-size S`, Megatron-DeepSpeed's layout, TP = PP = 1):
S adjacent ranks form a sequence-parallel group that splits each sample's tokens; the
data-parallel groups take every S-th rank, so a sequence group's ranks read the same samples;
and the sequence-data-parallel group (all S x DP ranks of a replica) is where DeepSpeed sums
gradients and partitions ZeRO state. ("Sequence parallel" in these names is DeepSpeed's kind;
Megatron's tensor-parallel `--sequence-parallel` is a property of the tensor group.)

Before initialization every query answers as a single process would (rank 0 of size 1), so
the model runs unchanged without torch.distributed.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch.distributed as dist


class ParallelConfigError(ValueError):
    """The requested parallel sizes do not fit the world (message names the flags)."""


@dataclass
class ParallelState:
    """The groups this rank belongs to, and the ranks in each."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    tensor_group: dist.ProcessGroup
    pipeline_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    model_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None
    tensor_ranks: list[int]
    pipeline_ranks: list[int]
    data_ranks: list[int]
    model_ranks: list[int]
    embedding_ranks: list[int] = field(default_factory=list)
    sequence_parallel_size: int = 1
    sequence_group: dist.ProcessGroup | None = None
    sequence_data_group: dist.ProcessGroup | None = None
    sequence_ranks: list[int] = field(default_factory=list)
    sequence_data_ranks: list[int] = field(default_factory=list)


_STATE: ParallelState | None = None


def generate_rank_groups(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    sequence_parallel_size: int = 1,
) -> dict[str, list[list[int]]]:
    """All groups of each kind for a world, in Megatron's order (pure: no communication)."""
    tp, pp, sp = tensor_model_parallel_size, pipeline_model_parallel_size, sequence_parallel_size
    if tp < 1 or pp < 1 or sp < 1:
        raise ParallelConfigError(
            f"--tensor-model-parallel-size ({tp}), --pipeline-model-parallel-size ({pp}) and "
            f"--ds-sequence-parallel-size ({sp}) must be at least 1"
        )
    if sp > 1:
        return _ulysses_rank_groups(world_size, tp, pp, sp)
    if world_size % (tp * pp) != 0:
        raise ParallelConfigError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}"
        )
    dp = world_size // (tp * pp)
    ranks_per_stage = world_size // pp
    tensor = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    data = [
        list(range(stage * ranks_per_stage + offset, (stage + 1) * ranks_per_stage, tp))
        for stage in range(pp)
        for offset in range(tp)
    ]
    pipeline = [list(range(first, world_size, ranks_per_stage)) for first in range(ranks_per_stage)]
    # A model replica: every stage's data-parallel peers at the same data-parallel index.
    model = [
        sorted(rank for group in data for rank in group if group.index(rank) == dp_index)
        for dp_index in range(dp)
    ]
    # The tied word embedding lives on the first and the last stage.
    embedding = [sorted({group[0], group[-1]}) for group in pipeline]
    return {
        "tensor": tensor,
        "data": data,
        "pipeline": pipeline,
        "model": model,
        "embedding": embedding,
    }


def _ulysses_rank_groups(world_size: int, tp: int, pp: int, sp: int) -> dict[str, list[list[int]]]:
    """Megatron-DeepSpeed's groups with DeepSpeed-Ulysses, which it runs at TP = PP = 1."""
    if tp != 1 or pp != 1:
        raise ParallelConfigError(
            f"--ds-sequence-parallel-size ({sp}) needs --tensor-model-parallel-size 1 and "
            f"--pipeline-model-parallel-size 1, not {tp} and {pp} (DeepSpeed-Ulysses runs "
            "without them, as in Megatron-DeepSpeed)"
        )
    if world_size % sp != 0:
        raise ParallelConfigError(
            f"world size ({world_size}) is not divisible by --ds-sequence-parallel-size ({sp})"
        )
    alone = [[rank] for rank in range(world_size)]
    return {
        "tensor": alone,
        "data": [list(range(first, world_size, sp)) for first in range(sp)],
        "pipeline": alone,
        # One rank is a whole replica's weights: DeepSpeed reduces norms over this group, and
        # counting a sequence peer's identical weights again would double them.
        "model": alone,
        "embedding": alone,
        "sequence": [list(range(first, first + sp)) for first in range(0, world_size, sp)],
        "sequence_data": [list(range(world_size))],
    }


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    sequence_parallel_size: int = 1,
) -> ParallelState:
    """Create the TP, PP, DP, model, embedding and (Ulysses) sequence groups; every rank
    must call it."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed initialized first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    all_groups = generate_rank_groups(
        world_size, tensor_model_parallel_size, pipeline_model_parallel_size, sequence_parallel_size
    )
    mine: dict[str, tuple[dist.ProcessGroup | None, list[int]]] = {}
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for kind, groups in all_groups.items():
        for ranks in groups:
            # new_group is collective over the whole world: every rank creates every group,
            # once per distinct set of ranks.
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = (made[tuple(ranks)], ranks)
    embedding_group, embedding_ranks = mine.get("embedding", (None, []))
    _STATE = ParallelState(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        data_parallel_size=world_size
        // (tensor_model_parallel_size * pipeline_model_parallel_size * sequence_parallel_size),
        tensor_group=mine["tensor"][0],
        pipeline_group=mine["pipeline"][0],
        data_group=mine["data"][0],
        model_group=mine["model"][0],
        embedding_group=embedding_group,
        tensor_ranks=mine["tensor"][1],
        pipeline_ranks=mine["pipeline"][1],
        data_ranks=mine["data"][1],
        model_ranks=mine["model"][1],
        embedding_ranks=embedding_ranks,
        sequence_parallel_size=sequence_parallel_size,
        # Without Ulysses a rank holds its whole sequence, and the sequence-data-parallel
        # group is the data-parallel one (no group of one rank is made for it).
        sequence_group=mine.get("sequence", (None,))[0],
        sequence_data_group=mine.get("sequence_data", mine["data"])[0],
        sequence_ranks=mine.get("sequence", (None, [rank]))[1],
        sequence_data_ranks=mine.get("sequence_data", mine["data"])[1],
    )
    return _STATE


def model_parallel_is_initialized() -> bool:
    """True once `initialize_model_parallel` has run in this process."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the groups (tests, or re-initializing with other sizes)."""
    global _STATE
    _STATE = None


def get_parallel_state() -> ParallelState:
    """The state object; raises if `initialize_model_parallel` has not run."""
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized")
    return _STATE


def _rank_in(ranks_attr: str) -> int:
    if _STATE is None:
        return 0
    return getattr(_STATE, ranks_attr).index(dist.get_rank())


# Tensor model parallel.
def get_tensor_model_parallel_group() -> dist.ProcessGroup | None:
    """The group of ranks that split each layer's weights; None when uninitialized."""
    return None if _STATE is None else _STATE.tensor_group


def get_tensor_model_parallel_world_size() -> int:
    """Number of tensor-parallel ranks (1 when uninitialized)."""
    return 1 if _STATE is None else _STATE.tensor_model_parallel_size


def get_tensor_model_parallel_rank() -> int:
    """This rank's index within its tensor-parallel group."""
    return _rank_in("tensor_ranks")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank in this tensor-parallel group (broadcast source)."""
    return 0 if _STATE is None else _STATE.tensor_ranks[0]


# Pipeline model parallel.
def get_pipeline_model_parallel_group() -> dist.ProcessGroup | None:
    """The group of ranks holding the successive stages of one model replica."""
    return None if _STATE is None else _STATE.pipeline_group


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages (1 when uninitialized)."""
    return 1 if _STATE is None else _STATE.pipeline_model_parallel_size


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return _rank_in("pipeline_ranks")


def is_pipeline_first_stage() -> bool:
    """True on the stage that holds the input embedding."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """True on the stage that computes the logits and the loss."""
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_embedding_group() -> dist.ProcessGroup | None:
    """The first and last stages of this pipeline, which share the tied word embedding."""
    return None if _STATE is None else _STATE.embedding_group


# Data parallel.
def get_data_parallel_group() -> dist.ProcessGroup | None:
    """The ranks holding identical model shards, which average their gradients."""
    return None if _STATE is None else _STATE.data_group


def get_data_parallel_group_ranks() -> list[int]:
    """Global ranks in this data-parallel group."""
    return [0] if _STATE is None else list(_STATE.data_ranks)


def get_data_parallel_world_size() -> int:
    """Number of data-parallel replicas (1 when uninitialized)."""
    return 1 if _STATE is None else _STATE.data_parallel_size


def get_data_parallel_rank() -> int:
    """This rank's index among the data-parallel replicas."""
    return _rank_in("data_ranks")


# Model parallel (tensor x pipeline): the ranks of one replica.
def get_model_parallel_group() -> dist.ProcessGroup | None:
    """All ranks of one model replica (TP x PP); DeepSpeed reduces norms and overflow here."""
    return None if _STATE is None else _STATE.model_group


def get_model_parallel_world_size() -> int:
    """Megatron's legacy name: the tensor-parallel size (DeepSpeed names `mp_rank_XX` by it)."""
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    """Megatron's legacy name: the tensor-parallel rank."""
    return get_tensor_model_parallel_rank()


# DeepSpeed-Ulysses sequence parallelism (`deepspeed_mpu` hands them to DeepSpeed under its
# names, get_sequence_parallel_*, as Megatron-DeepSpeed's mpu).
def get_ulysses_group() -> dist.ProcessGroup | None:
    """The ranks that split each sample's sequence (Ulysses); None when uninitialized."""
    return None if _STATE is None else _STATE.sequence_group


def get_ulysses_world_size() -> int:
    """`--ds-sequence-parallel-size` (1 when uninitialized)."""
    return 1 if _STATE is None else _STATE.sequence_parallel_size


def get_ulysses_rank() -> int:
    """Which part of each sequence this rank holds (0 when uninitialized)."""
    return _rank_in("sequence_ranks")


def get_ulysses_data_parallel_group() -> dist.ProcessGroup | None:
    """Sequence x data parallel ranks: where gradients are reduced and ZeRO state split."""
    return None if _STATE is None else _STATE.sequence_data_group


def get_ulysses_data_parallel_world_size() -> int:
    """Ranks in the sequence-data-parallel group (1 when uninitialized)."""
    return 1 if _STATE is None else len(_STATE.sequence_data_ranks)


def get_ulysses_data_parallel_rank() -> int:
    """This rank's index in the sequence-data-parallel group."""
    return 0 if _STATE is None else _rank_in("sequence_data_ranks")


# What DeepSpeed calls on `mpu`. The sequence-parallel queries are added only under Ulysses
# (`deepspeed_mpu`): DeepSpeed reads their presence as Ulysses sequence parallelism.
mpu = types.SimpleNamespace(
    get_model_parallel_group=get_model_parallel_group,
    get_model_parallel_rank=get_model_parallel_rank,
    get_model_parallel_world_size=get_model_parallel_world_size,
    get_tensor_model_parallel_group=get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank=get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size=get_tensor_model_parallel_world_size,
    get_tensor_model_parallel_src_rank=get_tensor_model_parallel_src_rank,
    get_data_parallel_group=get_data_parallel_group,
    get_data_parallel_group_ranks=get_data_parallel_group_ranks,
    get_data_parallel_rank=get_data_parallel_rank,
    get_data_parallel_world_size=get_data_parallel_world_size,
    get_pipeline_model_parallel_group=get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank=get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size=get_pipeline_model_parallel_world_size,
    get_pipe_parallel_group=get_pipeline_model_parallel_group,
    get_pipe_parallel_rank=get_pipeline_model_parallel_rank,
    get_pipe_parallel_world_size=get_pipeline_model_parallel_world_size,
    get_slice_parallel_group=get_tensor_model_parallel_group,
    get_slice_parallel_rank=get_tensor_model_parallel_rank,
    get_slice_parallel_world_size=get_tensor_model_parallel_world_size,
)
"""What every run passes to DeepSpeed as its `mpu` (see `deepspeed_mpu`)."""


def deepspeed_mpu() -> types.SimpleNamespace:
    """The object to pass as `deepspeed.initialize(mpu=...)` and `checkpointing.configure(mpu)`:
    `mpu`, plus DeepSpeed's sequence-parallel queries when Ulysses is on (size above 1)."""
    if get_ulysses_world_size() == 1:
        return mpu
    return types.SimpleNamespace(
        **vars(mpu),
        get_sequence_parallel_group=get_ulysses_group,
        get_sequence_parallel_world_size=get_ulysses_world_size,
        get_sequence_parallel_rank=get_ulysses_rank,
        get_sequence_data_parallel_group=get_ulysses_data_parallel_group,
        get_sequence_data_parallel_world_size=get_ulysses_data_parallel_world_size,
        get_sequence_data_parallel_rank=get_ulysses_data_parallel_rank,
    )
