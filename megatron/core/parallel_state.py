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
    """The groups this rank belongs to, and the ranks in each.

    The "sequence split" is whichever of context parallelism (`context_parallel`) and
    DeepSpeed-Ulysses splits each sample's tokens over `sequence_split_size` ranks (never both).
    """

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
    sequence_split_size: int = 1
    context_parallel: bool = False
    sequence_group: dist.ProcessGroup | None = None
    sequence_data_group: dist.ProcessGroup | None = None
    sequence_ranks: list[int] = field(default_factory=list)
    sequence_data_ranks: list[int] = field(default_factory=list)
    expert_parallel_size: int = 1
    expert_group: dist.ProcessGroup | None = None
    expert_data_group: dist.ProcessGroup | None = None
    expert_ranks: list[int] = field(default_factory=list)
    expert_data_ranks: list[int] = field(default_factory=list)
    stage_group: dist.ProcessGroup | None = None


_STATE: ParallelState | None = None


def generate_rank_groups(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> dict[str, list[list[int]]]:
    """All groups of each kind for a world, in Megatron-LM's order (pure: no communication).

    Ranks are numbered tensor-parallel fastest, then the sequence split (context-parallel or
    Ulysses ranks), then data parallel, then pipeline stages: rank = t + TP x (c + C x (d + DP
    x p)). With a sequence split there are also `sequence` groups (the ranks that split each
    sample) and `sequence_data` groups (those and their data-parallel peers: where gradients
    are summed and ZeRO state partitioned; Megatron-LM's data-parallel group "with context
    parallel").

    With expert parallelism (Megatron-LM's MoE, `--expert-model-parallel-size` EP above 1)
    there are also `expert` groups, EP consecutive data-parallel ranks that split each MoE
    layer's experts between them, and `expert_data` groups, the ranks that hold the same
    experts (the same position in their expert group, over the data-parallel and sequence
    ranks): where expert gradients are averaged.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    sp, cp = sequence_parallel_size, context_parallel_size
    if tp < 1 or pp < 1 or sp < 1 or cp < 1:
        raise ParallelConfigError(
            f"--tensor-model-parallel-size ({tp}), --pipeline-model-parallel-size ({pp}), "
            f"--context-parallel-size ({cp}) and --ds-sequence-parallel-size ({sp}) must be at "
            "least 1"
        )
    if sp > 1 and cp > 1:
        raise ParallelConfigError(
            f"--context-parallel-size ({cp}) with --ds-sequence-parallel-size ({sp}): choose "
            "one way to split the sequence"
        )
    if sp > 1 and (tp != 1 or pp != 1):
        raise ParallelConfigError(
            f"--ds-sequence-parallel-size ({sp}) needs --tensor-model-parallel-size 1 and "
            f"--pipeline-model-parallel-size 1, not {tp} and {pp} (DeepSpeed-Ulysses runs "
            "without them, as in Megatron-DeepSpeed)"
        )
    split = max(sp, cp)
    if world_size % (tp * pp * split) != 0:
        flag = " x --ds-sequence-parallel-size" if sp > 1 else " x --context-parallel-size"
        sizes = f"{flag} ({split})" if split > 1 else ""
        raise ParallelConfigError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp}){sizes} = {tp * pp * split}"
        )
    dp = world_size // (tp * pp * split)

    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + split * (d + dp * p))

    T, C, D, P = range(tp), range(split), range(dp), range(pp)  # noqa: N806
    groups = {
        "tensor": [[rank(t, c, d, p) for t in T] for p in P for d in D for c in C],
        "data": [[rank(t, c, d, p) for d in D] for p in P for c in C for t in T],
        "pipeline": [[rank(t, c, d, p) for p in P] for d in D for c in C for t in T],
        # A model replica: every stage's tensor-parallel ranks at one data (and split) index;
        # a sequence peer's identical weights are another replica, not counted twice.
        "model": [sorted(rank(t, c, d, p) for t in T for p in P) for d in D for c in C],
    }
    # The tied word embedding lives on the first and the last stage.
    groups["embedding"] = [sorted({group[0], group[-1]}) for group in groups["pipeline"]]
    if split > 1:
        groups["sequence"] = [[rank(t, c, d, p) for c in C] for p in P for d in D for t in T]
        groups["sequence_data"] = [
            sorted(rank(t, c, d, p) for c in C for d in D) for p in P for t in T
        ]
    if pp > 1:  # every rank of one pipeline stage (with PP = 1: the world)
        groups["stage"] = [sorted(rank(t, c, d, p) for t in T for c in C for d in D) for p in P]
    ep = expert_parallel_size
    if ep > 1:
        if dp % ep != 0:
            raise ParallelConfigError(
                f"--expert-model-parallel-size ({ep}) must divide the data-parallel size ({dp}): "
                "the experts are split over data-parallel ranks"
            )
        blocks, E = range(dp // ep), range(ep)  # noqa: N806
        # In megatron-core's order of its expert rank generator ("tp-ep-dp-pp").
        groups["expert"] = [
            [rank(t, c, b * ep + e, p) for e in E] for p in P for c in C for b in blocks for t in T
        ]
        groups["expert_data"] = [
            sorted(rank(t, c, b * ep + e, p) for c in C for b in blocks)
            for p in P
            for e in E
            for t in T
        ]
    return groups


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> ParallelState:
    """Create the TP, PP, DP, model, embedding, sequence-split (context-parallel or Ulysses)
    and expert-parallel groups; every rank must call it."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed initialized first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    all_groups = generate_rank_groups(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        sequence_parallel_size,
        context_parallel_size,
        expert_parallel_size,
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
    split = max(sequence_parallel_size, context_parallel_size)
    _STATE = ParallelState(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        data_parallel_size=world_size
        // (tensor_model_parallel_size * pipeline_model_parallel_size * split),
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
        sequence_split_size=split,
        context_parallel=context_parallel_size > 1,
        # Without a sequence split a rank holds its whole sequence, and the
        # sequence-data-parallel group is the data-parallel one (no group of one rank is made).
        sequence_group=mine.get("sequence", (None,))[0],
        sequence_data_group=mine.get("sequence_data", mine["data"])[0],
        sequence_ranks=mine.get("sequence", (None, [rank]))[1],
        sequence_data_ranks=mine.get("sequence_data", mine["data"])[1],
        # Without expert parallelism every rank holds every expert: their gradients are
        # averaged with the dense ones.
        expert_parallel_size=expert_parallel_size,
        expert_group=mine.get("expert", (None,))[0],
        expert_data_group=mine.get("expert_data", mine.get("sequence_data", mine["data"]))[0],
        expert_ranks=mine.get("expert", (None, [rank]))[1],
        expert_data_ranks=mine.get("expert_data", mine.get("sequence_data", mine["data"]))[1],
        stage_group=mine.get("stage", (None,))[0],
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


def _split_is(context_parallel: bool) -> bool:
    return (
        _STATE is not None
        and _STATE.sequence_split_size > 1
        and (_STATE.context_parallel == context_parallel)
    )


# Context parallelism (`--context-parallel-size`, Megatron-LM's names): ring attention.
def get_context_parallel_group() -> dist.ProcessGroup | None:
    """The ranks that split each sample's sequence by context parallelism; None without it."""
    return _STATE.sequence_group if _split_is(context_parallel=True) else None


def get_context_parallel_world_size() -> int:
    """`--context-parallel-size` (1 without it, or when uninitialized)."""
    return _STATE.sequence_split_size if _split_is(context_parallel=True) else 1


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group (0 without it)."""
    return _rank_in("sequence_ranks") if _split_is(context_parallel=True) else 0


# DeepSpeed-Ulysses sequence parallelism (`deepspeed_mpu` hands them to DeepSpeed under its
# names, get_sequence_parallel_*, as Megatron-DeepSpeed's mpu).
def get_ulysses_group() -> dist.ProcessGroup | None:
    """The ranks that split each sample's sequence (Ulysses); None without it."""
    return _STATE.sequence_group if _split_is(context_parallel=False) else None


def get_ulysses_world_size() -> int:
    """`--ds-sequence-parallel-size` (1 without it, or when uninitialized)."""
    return _STATE.sequence_split_size if _split_is(context_parallel=False) else 1


def get_ulysses_rank() -> int:
    """Which part of each sequence this rank holds (0 without Ulysses)."""
    return _rank_in("sequence_ranks") if _split_is(context_parallel=False) else 0


# The sequence split, whichever kind: the ranks that read the same samples.
def get_sequence_split_group() -> dist.ProcessGroup | None:
    """The context-parallel or Ulysses group; None when neither splits the sequence."""
    return None if _STATE is None else _STATE.sequence_group


def get_sequence_split_world_size() -> int:
    """Ranks splitting each sample's tokens: the context-parallel or Ulysses size, else 1."""
    return 1 if _STATE is None else _STATE.sequence_split_size


def get_sequence_split_rank() -> int:
    """This rank's index among them (0 when the sequence is whole)."""
    return _rank_in("sequence_ranks")


def get_sequence_data_parallel_group() -> dist.ProcessGroup | None:
    """Sequence-split x data-parallel ranks: where gradients are summed and ZeRO state split
    (Megatron-LM's data-parallel group with context parallel; DeepSpeed's sequence data
    parallel group); the data-parallel group when the sequence is whole."""
    return None if _STATE is None else _STATE.sequence_data_group


def get_sequence_data_parallel_world_size() -> int:
    """Ranks in the sequence-data-parallel group (1 when uninitialized)."""
    return 1 if _STATE is None else len(_STATE.sequence_data_ranks)


def get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence-data-parallel group."""
    return 0 if _STATE is None else _rank_in("sequence_data_ranks")


def get_stage_group() -> dist.ProcessGroup | None:
    """Every rank of this rank's pipeline stage (None, the whole world, at PP = 1)."""
    return _STATE.stage_group if _STATE is not None else None


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    """The ranks splitting each MoE layer's experts (None without expert parallelism)."""
    return _STATE.expert_group if _STATE is not None else None


def get_expert_model_parallel_world_size() -> int:
    """Expert-parallel size (EP, `--expert-model-parallel-size`; 1 without)."""
    return _STATE.expert_parallel_size if _STATE is not None else 1


def get_expert_model_parallel_rank() -> int:
    """This rank's position in its expert-parallel group: which experts it holds."""
    return _rank_in("expert_ranks")


def get_expert_data_parallel_group() -> dist.ProcessGroup | None:
    """The ranks holding the same experts as this one, where expert gradients are averaged."""
    return _STATE.expert_data_group if _STATE is not None else None


def get_expert_data_parallel_world_size() -> int:
    """How many ranks hold this rank's experts."""
    return len(_STATE.expert_data_ranks) if _STATE is not None else 1


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
    `mpu`, plus DeepSpeed's sequence-parallel queries when the sequence is split (Ulysses or
    context parallelism, size above 1): DeepSpeed then sums gradients over the split ranks
    and partitions ZeRO state over them and the data-parallel ranks, which both kinds need.
    (Ulysses' attention is DeepSpeed's `DistributedAttention`; context parallelism's is ours.)"""
    if get_sequence_split_world_size() == 1:
        return mpu
    return types.SimpleNamespace(
        **vars(mpu),
        get_sequence_parallel_group=get_sequence_split_group,
        get_sequence_parallel_world_size=get_sequence_split_world_size,
        get_sequence_parallel_rank=get_sequence_split_rank,
        get_sequence_data_parallel_group=get_sequence_data_parallel_group,
        get_sequence_data_parallel_world_size=get_sequence_data_parallel_world_size,
        get_sequence_data_parallel_rank=get_sequence_data_parallel_rank,
    )
