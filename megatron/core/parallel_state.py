"""The run's named device meshes, and the process groups sliced from them by name.

`initialize_model_parallel(tp, pp, sp, cp, ep)` builds one torch `DeviceMesh` with the
dimensions `MESH_DIM_NAMES` (pp, dp, cp, tp: Megatron-LM's rank order, tensor-parallel ranks
adjacent, pipeline stages outermost) and the flattened ones `FLATTENED_DIMS` (dp_cp, tp_cp,
model, stage). Every dense group is a slice of it by name, and FSDP2 and
torch.distributed.checkpoint take their meshes from it (`mesh_slice("dp_cp")`), so a
checkpoint's `mp_rank_XX_YYY` names and a launcher's node layout mean what they mean in
Megatron-LM, and a new parallel dimension is a new name here. (Megatron's embedding group, the
first and last stage of each pipeline, is the one group that is not a slice.)

Megatron-LM's MoE layers (`--expert-model-parallel-size` EP above 1) take their experts' groups
from a second mesh over the same ranks, `EXPERT_MESH_DIM_NAMES` (pp, edp, ep), megatron-core's
expert layout with expert tensor parallelism 1 ("MoE parallel folding"): the ranks of each
pipeline stage, tensor x context x data-parallel, counted as in the first mesh, form blocks
of EP consecutive ranks that split each layer's experts (`ep`), and the ranks holding the same
experts (`edp`) are where their gradients are reduced. One torch mesh cannot hold both
factorizations of a stage's ranks; both are named and sliced alike (`mesh_slice("ep")`).
The query functions mirror Megatron's names; `deepspeed_mpu()` bundles the ones DeepSpeed
calls (`deepspeed.initialize(mpu=...)`, `deepspeed.checkpointing.configure(mpu, ...)`).

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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
    tensor_sequence_group: dist.ProcessGroup | None = None
    tensor_sequence_ranks: list[int] = field(default_factory=list)
    mesh: DeviceMesh | None = None
    flattened_meshes: dict[str, DeviceMesh] = field(default_factory=dict)
    expert_mesh: DeviceMesh | None = None


_STATE: ParallelState | None = None


MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
"""The device mesh's dimensions, outermost first (Megatron-LM's rank order tp-cp-dp-pp read
from the right): pipeline stage; data-parallel replica; `cp`, the sequence split (context
parallelism or DeepSpeed-Ulysses, never both); `tp`, the tensor-parallel rank, fastest."""

FLATTENED_DIMS = {
    "dp_cp": ("dp", "cp"),  # where dense gradients are summed and ZeRO state split
    "tp_cp": ("cp", "tp"),  # the ranks sharing one replica's tokens (MoE aux-loss counts)
    "model": ("pp", "tp"),  # one model replica
    "stage": ("dp", "cp", "tp"),  # every rank of one pipeline stage
}
"""Named groups of several mesh dimensions, flattened into one (`mesh_slice("dp_cp")`)."""

EXPERT_MESH_DIM_NAMES = ("pp", "edp", "ep")
"""The expert mesh's dimensions (Megatron-LM's MoE with EP above 1), outermost first: the
pipeline stage; `edp`, the ranks holding the same experts (expert data parallel); `ep`, EP
consecutive ranks of the stage (tensor fastest, then context, then data parallel) that split
each MoE layer's experts. megatron-core's expert layout (order tp-ep-dp-pp) at expert tensor
parallelism 1: the experts folded over TP x CP x DP."""

# Each kind of group: the mesh dimensions its ranks span, and the order in which the groups
# are listed (outermost first), as megatron-core's RankGenerator lists them.
_KINDS = {
    "tensor": (("tp",), ("pp", "dp", "cp")),
    "data": (("dp",), ("pp", "cp", "tp")),
    "pipeline": (("pp",), ("dp", "cp", "tp")),
    "model": (("pp", "tp"), ("dp", "cp")),
    "sequence": (("cp",), ("pp", "dp", "tp")),
    "sequence_data": (("dp", "cp"), ("pp", "tp")),
    "stage": (("dp", "cp", "tp"), ("pp",)),
}
_EXPERT_KINDS = {
    "expert": (("ep",), ("pp", "edp")),
    "expert_data": (("edp",), ("pp", "ep")),
}


def mesh_shape(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> dict[str, int]:
    """The size of each of `MESH_DIM_NAMES` for these flags; raises `ParallelConfigError`
    (naming the flags) when they do not fit the world, the expert-parallel size included."""
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
    shape = {"pp": pp, "dp": world_size // (tp * pp * split), "cp": split, "tp": tp}
    expert_mesh_shape(shape, expert_parallel_size)  # raises if EP does not fit
    return shape


def expert_mesh_shape(shape: dict[str, int], expert_parallel_size: int) -> dict[str, int]:
    """The size of each of `EXPERT_MESH_DIM_NAMES` for the dense mesh `shape` (`mesh_shape`)
    and EP; raises `ParallelConfigError` when EP does not divide a stage's ranks."""
    ep = expert_parallel_size
    stage = shape["tp"] * shape["cp"] * shape["dp"]
    if ep < 1 or stage % ep != 0:
        raise ParallelConfigError(
            f"--expert-model-parallel-size ({ep}) must divide the ranks of a pipeline stage, "
            f"tensor x context x data-parallel size ({shape['tp']} x {shape['cp']} x "
            f"{shape['dp']} = {stage}): the experts are spread over them"
        )
    return {"pp": shape["pp"], "edp": stage // ep, "ep": ep}


def _groups_along(
    ranks: torch.Tensor,
    spans: tuple[str, ...],
    outer: tuple[str, ...],
    names: tuple[str, ...] = MESH_DIM_NAMES,
):
    """The groups of `ranks` (a tensor with dims `names`) spanning `spans`, listed in
    `outer`'s order: each group's ranks in mesh order."""
    order = [names.index(name) for name in (*outer, *spans)]
    size = 1
    for name in spans:
        size *= ranks.size(names.index(name))
    return ranks.permute(order).reshape(-1, size).tolist()


def generate_rank_groups(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> dict[str, list[list[int]]]:
    """All groups of each kind for a world, as slices of the device mesh (pure: no
    communication), in the order megatron-core's RankGenerator lists them.

    Ranks are numbered tensor-parallel fastest, then the sequence split (context-parallel or
    Ulysses ranks), then data parallel, then pipeline stages: rank = t + TP x (c + C x (d + DP
    x p)). With a sequence split there are also `sequence` groups (the ranks that split each
    sample) and `sequence_data` groups (those and their data-parallel peers: where gradients
    are summed and ZeRO state partitioned; Megatron-LM's data-parallel group "with context
    parallel").

    With expert parallelism (Megatron-LM's MoE, `--expert-model-parallel-size` EP above 1)
    there are also `expert` groups, EP consecutive ranks of a pipeline stage that split each
    MoE layer's experts between them (folded over tensor, context and data parallelism), and
    `expert_data` groups, the ranks that hold the same experts: where expert gradients are
    reduced (megatron-core's expert "ep" and "dp" groups at expert tensor parallelism 1).
    """
    shape = mesh_shape(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        sequence_parallel_size,
        context_parallel_size,
        expert_parallel_size,
    )
    ranks = torch.arange(world_size).reshape(tuple(shape.values()))
    kinds = ["tensor", "data", "pipeline", "model"]
    kinds += ["sequence", "sequence_data"] if shape["cp"] > 1 else []
    kinds += ["stage"] if shape["pp"] > 1 else []
    groups = {kind: _groups_along(ranks, *_KINDS[kind]) for kind in kinds}
    if expert_parallel_size > 1:
        expert_shape = expert_mesh_shape(shape, expert_parallel_size)
        expert_ranks = torch.arange(world_size).reshape(tuple(expert_shape.values()))
        for kind, (spans, outer) in _EXPERT_KINDS.items():
            groups[kind] = _groups_along(expert_ranks, spans, outer, EXPERT_MESH_DIM_NAMES)
    # The tied word embedding lives on the first and the last stage.
    groups["embedding"] = [sorted({group[0], group[-1]}) for group in groups["pipeline"]]
    return groups


def build_device_mesh(
    shape: dict[str, int], device_type: str, expert_parallel_size: int = 1
) -> tuple[DeviceMesh, dict[str, DeviceMesh], DeviceMesh | None]:
    """The run's named device mesh (`MESH_DIM_NAMES`), its `FLATTENED_DIMS` flattened (kept
    by name: torch deprecates slicing them back out of the root mesh), and with EP above 1 the
    expert mesh (`EXPERT_MESH_DIM_NAMES`); every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    # Every dimension gets a group of its own, also one spanning the whole world (torch would
    # hand out the default group there): the data-parallel group stays a group of its own, as
    # Megatron makes it, and a collective on it is told apart from one on the world.
    backend = dist.get_backend()
    mesh = init_device_mesh(
        device_type,
        tuple(shape.values()),
        mesh_dim_names=MESH_DIM_NAMES,
        backend_override=dict.fromkeys(MESH_DIM_NAMES, backend),
    )
    flattened = {
        name: mesh[dims]._flatten(name, backend_override=backend)
        for name, dims in FLATTENED_DIMS.items()
    }
    expert_mesh = None
    if expert_parallel_size > 1:
        expert_mesh = init_device_mesh(
            device_type,
            tuple(expert_mesh_shape(shape, expert_parallel_size).values()),
            mesh_dim_names=EXPERT_MESH_DIM_NAMES,
            backend_override=dict.fromkeys(EXPERT_MESH_DIM_NAMES, backend),
        )
    return mesh, flattened, expert_mesh


_MESHES: dict[tuple, tuple] = {}
"""The meshes (and embedding groups) built in this process, by layout shape: torch keeps every
gloo group's threads and sockets alive for the life of its default group, so a process that
builds the same layout again (tests, re-initializing) takes the groups it built already."""


def _registered(mesh: DeviceMesh) -> bool:
    """Whether `mesh`'s groups are still torch.distributed's (not destroyed since)."""
    try:
        dist.get_process_group_ranks(mesh.get_group("tp"))
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _mesh_of_this_world(shape: dict[str, int], expert_parallel_size: int) -> tuple:
    """The device mesh of `shape`, its flattened dimensions, the expert mesh (None at EP 1)
    and the groups of each pipeline's first and last stage (by their ranks), for the current
    default group (every rank must call it); built on the first call for a shape, then the
    same again. (The default group itself is not held: a run that destroys it at its end must
    be able to free it.)"""
    key = (tuple(shape.items()), expert_parallel_size, dist.get_backend(), dist.get_world_size())
    cached = _MESHES.get(key)
    if cached is not None and _registered(cached[0]):
        return cached
    for stale in [key for key, entry in _MESHES.items() if not _registered(entry[0])]:
        del _MESHES[stale]  # of an earlier default group, destroyed since
    # NCCL carries CUDA tensors only: on GPUs the mesh (and FSDP2's, DCP's slices) is CUDA's.
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh, flattened, expert_mesh = build_device_mesh(shape, device_type, expert_parallel_size)
    # The first and last stage of each pipeline: new_group is collective over the whole
    # world, so every rank creates every such group (once per distinct set of ranks).
    ranks = torch.arange(dist.get_world_size()).reshape(tuple(shape.values()))
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for pipeline in _groups_along(ranks, *_KINDS["pipeline"]):
        ends = tuple(sorted({pipeline[0], pipeline[-1]}))
        if ends not in made:
            made[ends] = dist.new_group(list(ends))
    _MESHES[key] = (mesh, flattened, expert_mesh, made)
    return _MESHES[key]


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> ParallelState:
    """Build the device meshes and take the TP, PP, DP, model, sequence-split (context-parallel
    or Ulysses) and expert-parallel groups from them by name, plus Megatron's embedding group;
    every rank must call it."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed initialized first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    shape = mesh_shape(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        sequence_parallel_size,
        context_parallel_size,
        expert_parallel_size,
    )
    mesh, flattened, expert_mesh, made = _mesh_of_this_world(shape, expert_parallel_size)

    def group(name: str) -> tuple[dist.ProcessGroup, list[int]]:
        sliced = flattened[name] if name in flattened else mesh[name]
        return sliced.get_group(), sliced.mesh.tolist()

    def expert_group(name: str) -> tuple[dist.ProcessGroup, list[int]]:
        return expert_mesh[name].get_group(), expert_mesh[name].mesh.tolist()

    embedding: tuple[dist.ProcessGroup | None, list[int]] = (None, [])
    for ends, ends_group in made.items():
        if rank in ends:
            embedding = (ends_group, list(ends))
    split, ep = shape["cp"] > 1, expert_mesh is not None
    # Without a sequence split a rank holds its whole sequence: no sequence group, and the
    # sequence-data-parallel group is the data-parallel one. Without expert parallelism every
    # rank holds every expert: their gradients are averaged with the dense ones.
    sequence_data = group("dp_cp") if split else group("dp")
    expert_data = expert_group("edp") if ep else sequence_data
    _STATE = ParallelState(
        tensor_model_parallel_size=shape["tp"],
        pipeline_model_parallel_size=shape["pp"],
        data_parallel_size=shape["dp"],
        tensor_group=group("tp")[0],
        pipeline_group=group("pp")[0],
        data_group=group("dp")[0],
        model_group=group("model")[0],
        embedding_group=embedding[0],
        tensor_ranks=group("tp")[1],
        pipeline_ranks=group("pp")[1],
        data_ranks=group("dp")[1],
        model_ranks=group("model")[1],
        embedding_ranks=embedding[1],
        sequence_split_size=shape["cp"],
        context_parallel=context_parallel_size > 1,
        sequence_group=group("cp")[0] if split else None,
        sequence_data_group=sequence_data[0],
        sequence_ranks=group("cp")[1] if split else [rank],
        sequence_data_ranks=sequence_data[1],
        tensor_sequence_group=group("tp_cp")[0] if split or shape["tp"] > 1 else None,
        tensor_sequence_ranks=group("tp_cp")[1],
        expert_parallel_size=expert_parallel_size,
        expert_group=expert_group("ep")[0] if ep else None,
        expert_data_group=expert_data[0],
        expert_ranks=expert_group("ep")[1] if ep else [rank],
        expert_data_ranks=expert_data[1],
        stage_group=group("stage")[0] if shape["pp"] > 1 else None,
        mesh=mesh,
        flattened_meshes=flattened,
        expert_mesh=expert_mesh,
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


def get_device_mesh() -> DeviceMesh:
    """The run's named device mesh (`MESH_DIM_NAMES`): torch.distributed.checkpoint slices it
    by name (`get_device_mesh()["tp"]`); `mesh_slice` also gives the flattened dimensions."""
    return get_parallel_state().mesh


def mesh_slice(name: str) -> DeviceMesh:
    """One named dimension of the run's device mesh (`MESH_DIM_NAMES`), a flattened group of
    them (`FLATTENED_DIMS`: FSDP2 shards over `mesh_slice("dp_cp")`), or of the expert mesh
    (`edp`, `ep`: Megatron-LM's MoE with EP above 1)."""
    state = get_parallel_state()
    if name in ("edp", "ep"):
        if state.expert_mesh is None:
            raise KeyError(f"mesh dimension {name!r}: this run has no expert parallelism")
        return state.expert_mesh[name]
    return state.flattened_meshes.get(name) or state.mesh[name]


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


def get_tensor_and_sequence_parallel_group() -> dist.ProcessGroup | None:
    """The tensor-parallel x sequence-split ranks of one replica (megatron-core's tp-cp
    group): together they hold its micro-batch's tokens under sequence parallelism and context
    parallelism. None when both sizes are 1."""
    return _STATE.tensor_sequence_group if _STATE is not None else None


def get_tensor_and_sequence_parallel_world_size() -> int:
    """Ranks in `get_tensor_and_sequence_parallel_group` (1 uninitialized)."""
    return len(_STATE.tensor_sequence_ranks) if _STATE is not None else 1


def get_tensor_and_sequence_parallel_rank() -> int:
    """This rank's index in `get_tensor_and_sequence_parallel_group`."""
    return 0 if _STATE is None else _rank_in("tensor_sequence_ranks")


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
