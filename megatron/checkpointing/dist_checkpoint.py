"""Megatron-LM's `torch_dist` checkpoint format on torch.distributed.checkpoint (DCP).

`--ckpt-format torch_dist` writes `iter_XXXXXXX/` as DCP does (`.metadata` and one
`__R_0.distcp` file per writing rank) plus `common.pt` (the run's args, counters, scheduler,
loss scaler and optimizer hyperparameters, written by rank 0) and Megatron-LM's
`metadata.json`, under the same trackers and crash-safe commit as the `torch` format.

Every tensor is saved once under a layout-free name with its global shape, each rank writing
its own slice: a tensor-parallel shard is a DTensor sharded over the tensor-parallel group
(SwiGLU's [gate; up] rows as a [2, F, ...] tensor, so each rank's two blocks are one slice);
layers carry their global numbers (pipeline stages and virtual chunks renumbered), the tied
output copy of the word embeddings is the embeddings; replicas (data, context and sequence
parallel ranks, the tied copy) are written once (DCP's deduplication). Adam's moments and
step are saved the same way under `optimizer.state.{name}.{key}`. So a checkpoint loads into
any TP x PP (x virtual stages) x DP x CP layout of the same model, with or without FSDP2
sharding (an FSDP2 rank writes and reads its own rows of its tensor-parallel shard, one or
two boxes of the global tensor: `megatron.checkpointing.fsdp_slices`). Vocabulary matrices
padded to another size (`--make-vocab-size-divisible-by` x TP) load their common rows.

Each rank's random generators are saved under `rng_state.rank{R}` and restored when the
layout is the one that saved them; otherwise they keep their seeds and a line says so.

What is read from and written into a run goes through a holder of its tensors
(`megatron.checkpointing.whole_tensors`): the plain engine's module and optimizer (FSDP2-
sharded or not), or DeepSpeed's engine (`megatron.checkpointing.deepspeed_tensors`).
"""

from __future__ import annotations

import argparse
import io
import json
import os

import torch
from torch import nn

from megatron.checkpointing.disk import save_torch_file
from megatron.checkpointing.file_format import SAFE_GLOBALS, enum_member, load_file
from megatron.checkpointing.fsdp_slices import (
    ShardedLayout,
    chunk_rows,
    sharded_slices,
    stored_tensor,
)
from megatron.checkpointing.pipeline_stages import HEAD_WEIGHT, chunk_layers, renumber_layers
from megatron.checkpointing.rng_state import capture_rng_state, restore_rng_state
from megatron.checkpointing.shapes import WORD_EMBEDDINGS
from megatron.checkpointing.whole_tensors import WholeTensors
from megatron.core import parallel_state
from megatron.model.sharding import declared_splits
from megatron.utils import print_rank_0

COMMON_FILE = "common.pt"
FORMAT_FILE = "metadata.json"  # Megatron-LM's name: which backend wrote the directory
DCP_METADATA = ".metadata"


class DistCheckpointError(ValueError):
    """A torch_dist checkpoint this run cannot load; the message names the file and tensor."""


def is_dist_checkpoint(directory: str) -> bool:
    """Whether `directory` was written in the torch_dist format (its DCP metadata is there)."""
    return os.path.isfile(os.path.join(directory, DCP_METADATA))


def _layout_key(layout) -> dict:  # noqa: ANN001 - megatron.layout.ParallelLayout
    """What must match for per-rank state (random generators) to mean the same rank."""
    return {
        "world_size": layout.world_size,
        "tensor_parallel": layout.tensor_parallel,
        "pipeline_parallel": layout.pipeline_parallel,
        "virtual_pipeline": layout.virtual_pipeline,
        "context_parallel": layout.context_parallel,
        "data_parallel": layout.data_parallel,
    }


class _TensorParallelView:
    """Wraps this rank's tensor-parallel shards as slices of the global tensors (DTensors),
    split as the chunks' layers declared (`megatron.model.sharding`)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        # The run's mesh sliced by name; the local shards sit on its device (DTensor would copy
        # a tensor on another device, and a load would then fill the copy).
        tensor_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
        expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
        self.mesh = parallel_state.mesh_slice("tp") if tensor_parallel else None
        # Megatron-LM's stacked experts: rank r of the expert-parallel group holds the r-th
        # block of experts, a slice along dim 0 of the whole stack.
        self.expert_mesh = parallel_state.mesh_slice("ep") if expert_parallel else None
        # Chunk-local names: the same name in two chunks is the same kind of tensor.
        self.splits = {
            name: split for chunk in chunks for name, split in declared_splits(chunk).items()
        }

    def global_view(
        self, local_name: str, tensor: torch.Tensor, saved_shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """`tensor` (this rank's shard of `local_name`) as a slice of the global tensor;
        `saved_shape`: the saved tensor's, where its vocabulary rows differ (FSDP2 only)."""
        split = self.splits[local_name]
        dim = split.tensor_dim
        if tensor.dim() == 0:  # Adam's step
            return tensor
        from torch.distributed.tensor import DTensor, Shard

        if isinstance(tensor, DTensor):  # FSDP2: this data-parallel rank's rows of the shard
            return self._fsdp_slices(local_name, tensor, saved_shape)
        if self.expert_mesh is not None and split.expert_dim is not None:
            shard = Shard(split.expert_dim)
            return DTensor.from_local(tensor, self.expert_mesh, [shard], run_check=False)
        if split.swiglu:  # [gate_r; up_r] -> [2, F/TP, ...], sharded on dim 1
            tensor = tensor.view(2, tensor.size(0) // 2, *tensor.shape[1:])
            dim = 1
        if dim is None or self.mesh is None:
            return tensor
        return DTensor.from_local(tensor, self.mesh, [Shard(dim)], run_check=False)

    def _fsdp_slices(self, local_name: str, tensor, saved_shape) -> object:  # noqa: ANN001
        """An FSDP2 DTensor's local rows as slices of the global tensor (`fsdp_slices`)."""
        split, mesh = self.splits[local_name], tensor.device_mesh
        if self.expert_mesh is not None and split.expert_dim is not None:
            dim, ranks = split.expert_dim, self.expert_mesh
        elif self.mesh is not None and split.tensor_dim is not None:
            dim, ranks = split.tensor_dim, self.mesh
        else:
            dim, ranks = None, None
        layout = ShardedLayout(
            tuple(tensor.shape), split, dim, ranks.size() if ranks is not None else 1
        )
        rows = chunk_rows(tensor.size(0), mesh.get_local_rank(), mesh.size())
        (chunk,) = tensor.__create_chunk_list__()  # FSDP2's own record of this rank's rows
        if (chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]) != rows and rows[0] < rows[1]:
            raise DistCheckpointError(
                f"{local_name}: FSDP2 holds rows {chunk.offsets[0]}.. ({chunk.sizes[0]}) here, "
                f"not torch.chunk's {rows}: this torch shards otherwise than "
                "megatron.checkpointing.fsdp_slices assumes"
            )
        shard_rank = ranks.get_local_rank() if ranks is not None else 0
        local = stored_tensor(tensor.to_local())
        return sharded_slices(local, layout, shard_rank, rows, mesh.size(), saved_shape)


def first_failure(error: BaseException) -> str:
    """One line for a DCP read or write that failed: its report (`CheckpointException`, a
    BaseException) holds each failed rank's (exception, traceback); the lowest rank's is given."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return (str(error).splitlines() or [type(error).__name__])[0]
    rank = min(failures)
    cause = failures[rank]
    if isinstance(cause, tuple):  # (exception, its traceback's frames)
        cause = cause[0]
    return f"rank {rank}: {cause!r:.300}"


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _model_entries(holder: WholeTensors, args: argparse.Namespace) -> list[tuple]:
    """(name in `module`, chunk index, name in the chunk, global name) of each saved tensor:
    every chunk's state dict entry (parameters and persistent buffers)."""
    chunks = holder.chunks()
    renamed = holder.global_names()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    prefix = isinstance(holder.module, nn.ModuleList)
    entries, seen = [], set()
    for index, chunk in enumerate(chunks):
        layers = chunk_layers(
            args.num_layers, args.layout.pipeline_parallel, len(chunks), pp_rank, index
        )
        for local in chunk.state_dict():
            name = WORD_EMBEDDINGS if local == HEAD_WEIGHT else renamed[index].get(local, local)
            (name,) = renumber_layers({name: None}, layers.start)
            if name in seen:
                raise DistCheckpointError(f"two model chunks of this rank hold {name}")
            seen.add(name)
            entries.append((f"{index}.{local}" if prefix else local, index, local, name))
    return entries


def _optimizer_key(name: str, key: str) -> str:
    return f"optimizer.state.{name}.{key}"


def _rng_key(rank: int) -> str:
    return f"rng_state.rank{rank}"


def _encoded(value: object) -> torch.Tensor:
    """`value` (random generator states) as the bytes of its torch.save, in a uint8 tensor:
    DCP unpickles byte items with weights_only=False, tensors it only copies."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decoded(tensor: torch.Tensor) -> object:
    """What `_encoded` encoded, read as checkpoint files are (weights_only, allow-listed)."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(io.BytesIO(tensor.numpy().tobytes()), weights_only=True)


class _SafeReader:
    """DCP's FileSystemReader whose `.metadata` is unpickled allowing only DCP's metadata
    classes, torch sizes and dtypes: nothing in a checkpoint can run code."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "ChunkStorageMetadata", "TensorStorageMetadata", "TensorProperties",
            "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        # megatron-core keeps its ranks' save plans in the metadata.
        "torch.distributed.checkpoint.planner": {
            "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
        },
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }  # fmt: skip
    # megatron-core core_v0.14 and v0.15 pickled its subclasses of two of them, each adding one
    # field (`mcore_data`, then an attribute of torch's class); later releases write torch's.
    _MEGATRON_CORE = {
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"):
            ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"):
            ("torch.distributed.checkpoint.planner", "SavePlan"),
    }  # fmt: skip

    @classmethod
    def create(cls, directory: str):  # noqa: ANN206 - a torch FileSystemReader
        """A FileSystemReader of `directory` with the restricted metadata unpickler."""
        import pickle

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import StorageMeta

        allowed, megatron_core = cls._ALLOWED, cls._MEGATRON_CORE

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> object:
                module, name = megatron_core.get((module, name), (module, name))
                if module == "builtins" and name == "getattr":  # an enum member, Python 3.11.2
                    return enum_member
                dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
                if (
                    dtype
                    or (module == "torch" and name == "Size")
                    or name in allowed.get(module, ())
                ):
                    return super().find_class(module, name)
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

        class Reader(dcp.FileSystemReader):
            def read_metadata(self, *args: object, **kwargs: object):  # noqa: ANN202
                path = os.path.join(directory, DCP_METADATA)
                with open(path, "rb") as handle:
                    metadata = Unpickler(handle).load()
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        return Reader(directory)


def save_dist_checkpoint(
    directory: str,
    holder: WholeTensors,
    common: dict,
    args: argparse.Namespace,
    save_optimizer: bool = True,
    save_rng: bool = True,
    background: tuple | None = None,
) -> object:
    """Write this rank's part of a torch_dist checkpoint into `directory` (a collective on
    every rank): `holder`'s weights, and its optimizer state with `save_optimizer`. `common`
    (args, counters, scheduler and loss-scaler state) goes to `common.pt` from rank 0.

    `background` (`--async-save`: a process group and a DCP stager that keeps its staging
    buffers): stage a copy into those buffers and write it from a thread that
    coordinates over that group; returns the write's Future (None when written already)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    states = holder.model_states()
    view = _TensorParallelView(holder.chunks())
    tensors: dict[str, object] = {}
    optimizer_states = holder.optimizer_states() if save_optimizer else {}
    for module_name, index, local, name in _model_entries(holder, args):
        tensors[name] = view.global_view(local, states[index][local])
        for key, value in optimizer_states.get(module_name, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:  # Adam's moments: the weight's slice
                value = view.global_view(local, value)
            tensors[_optimizer_key(name, key)] = value
    if save_rng:
        tensors[_rng_key(dist.get_rank())] = _encoded(capture_rng_state())
    if dist.get_rank() == 0:  # small: written now, before the tensors
        common = dict(common, layout=_layout_key(args.layout))
        if save_optimizer:
            common["optimizer_param_groups"] = holder.parameter_groups()
        save_torch_file(common, os.path.join(directory, COMMON_FILE))
        with open(os.path.join(directory, FORMAT_FILE), "w") as out:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, out)
            out.flush()
            os.fsync(out.fileno())
    if background is None:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True))
        return None
    group, stager = background
    writer = dcp.FileSystemWriter(directory, sync_files=True)
    return dcp.async_save(tensors, storage_writer=writer, process_group=group, async_stager=stager)


def read_common(directory: str) -> tuple[str, dict]:
    """(path, contents) of a torch_dist checkpoint's `common.pt`."""
    path = os.path.join(directory, COMMON_FILE)
    if not os.path.isfile(path):
        raise DistCheckpointError(f"{path} is missing: {directory} is not a complete checkpoint")
    return path, load_file(path)


TOLERATES_MISSING = ("log_all", "ignore_all")
"""--dist-ckpt-strictness choices under which a model tensor the checkpoint lacks keeps this
model's values (megatron-core's: logged, or not)."""


class _Requests:
    """The tensors a load asks DCP for, checked against the checkpoint's metadata first."""

    def __init__(
        self,
        directory: str,
        metadata: dict,
        view: _TensorParallelView,
        strictness: str = "assume_ok_unexpected",
    ):
        self.directory, self.metadata, self.view = directory, metadata, view
        self.strictness = strictness
        self.tensors: dict[str, object] = {}
        self.vocab_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.missing: list[str] = []

    def add(self, key: str, local_name: str, tensor: torch.Tensor) -> bool:
        """Read `key` into `tensor`, this rank's shard of `local_name` (in place); False
        where the checkpoint lacks it and the strictness keeps this model's values."""
        saved = self.metadata.get(key)
        if saved is None or not hasattr(saved, "size"):
            if self.strictness in TOLERATES_MISSING:
                self.missing.append(key)
                return False
            raise DistCheckpointError(
                f"{self.directory} has no tensor {key} (--dist-ckpt-strictness log_all keeps "
                "this model's values for what the checkpoint lacks)"
            )
        request = self.view.global_view(local_name, tensor)
        if tuple(saved.size) == tuple(request.shape):
            self.tensors[key] = request
            return True
        vocab = self.view.splits[local_name].vocab
        if vocab and tuple(saved.size[1:]) == tuple(tensor.shape[1:]) and _is_dtensor(tensor):
            # FSDP2, padded to another multiple: this rank's rows that the saved matrix has.
            with torch.no_grad():
                stored_tensor(tensor.to_local()).zero_()
            self.tensors[key] = self.view.global_view(local_name, tensor, tuple(saved.size))
            return True
        if vocab and tuple(saved.size[1:]) == tuple(tensor.shape[1:]):
            # Padded to another multiple: read the whole saved matrix, keep this rank's rows.
            whole = torch.zeros(tuple(saved.size), dtype=tensor.dtype)
            self.tensors[key] = whole
            self.vocab_copies.append((whole, tensor))
            return True
        raise DistCheckpointError(
            f"{self.directory}: tensor {key} has shape {tuple(saved.size)} there, this "
            f"model's is {tuple(request.shape)}"
        )

    def load(self) -> None:
        """Read every requested tensor, then place the vocabulary rows."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(self.tensors, storage_reader=_SafeReader.create(self.directory))
        except CheckpointException as error:  # some rank failed to read: its first line
            raise DistCheckpointError(
                f"{self.directory}: reading failed: {first_failure(error)}"
            ) from None
        rows = parallel_state.get_tensor_model_parallel_rank()
        for whole, shard in self.vocab_copies:
            start = rows * shard.size(0)
            kept = max(0, min(shard.size(0), whole.size(0) - start))
            with torch.no_grad():
                shard.zero_()
                shard[:kept].copy_(whole[start : start + kept])


def load_dist_checkpoint(
    directory: str,
    holder: WholeTensors,
    args: argparse.Namespace,
    load_optimizer: bool = True,
    load_rng: bool = True,
) -> bool:
    """Load a torch_dist checkpoint into `holder`'s model (and optimizer with
    `load_optimizer`); a collective on every rank. Returns whether optimizer state was loaded."""
    import torch.distributed as dist

    _, common = read_common(directory)
    metadata = _checked_metadata(directory).state_dict_metadata
    if any(key.startswith("decoder.layers.") for key in metadata):
        raise DistCheckpointError(
            f"{directory} is Megatron-LM's (megatron-core's) torch_dist checkpoint: write it in "
            "this run's layout with tools/checkpoint/reshard.py --load ROOT --save NEW_DIR "
            "--target-tensor-parallel-size TP (weights; --true-vocab-size if asked), then "
            "--load NEW_DIR"
        )
    states = holder.load_targets()
    strictness = getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    requests = _Requests(directory, metadata, _TensorParallelView(holder.chunks()), strictness)
    entries = _model_entries(holder, args)
    for _, index, local, name in entries:
        if not requests.add(name, local, states[index][local]):
            del states[index][local]  # not read: the model keeps its own
    _check_unexpected(directory, metadata, {name for *_, name in entries}, strictness)
    if requests.missing and strictness == "log_all":
        print_rank_0(
            f"> {directory} lacks {len(requests.missing)} of this model's tensors, which keep "
            f"their values (--dist-ckpt-strictness log_all): {', '.join(requests.missing)}"
        )

    params = dict(holder.module.named_parameters())
    moments: dict[str, dict[str, torch.Tensor]] | None = None
    saved_groups = common.get("optimizer_param_groups")
    load_optimizer = load_optimizer and saved_groups is not None
    if load_optimizer:
        here = len(holder.parameter_groups())
        if len(saved_groups) != here:
            raise DistCheckpointError(
                f"{directory}/{COMMON_FILE}: {len(saved_groups)} optimizer parameter groups "
                f"there, {here} here; add --no-load-optim"
            )
        moments = {}
        for module_name, index, local, name in entries:
            if module_name not in params:
                continue  # a buffer
            keys = [key for key in ("step", "exp_avg", "exp_avg_sq", "momentum_buffer")
                    if _optimizer_key(name, key) in metadata]  # fmt: skip
            if not keys:
                continue  # never stepped
            like = states[index][local]
            # Adam's step is a CPU scalar (torch's default), its moments (and Muon's momentum,
            # --optimizer muon) sit with the weight.
            moments[module_name] = {
                key: torch.zeros((), dtype=torch.float32)
                if key == "step"
                else torch.zeros_like(like, dtype=torch.float32)  # FSDP2: its DTensor shard
                for key in keys
            }
            for key, tensor in moments[module_name].items():
                requests.add(_optimizer_key(name, key), local, tensor)

    rng_key = _rng_key(dist.get_rank())
    same_layout = common.get("layout") == _layout_key(args.layout)
    if load_rng and same_layout and rng_key in metadata:
        requests.tensors[rng_key] = torch.empty(tuple(metadata[rng_key].size), dtype=torch.uint8)
    requests.load()
    holder.put(states, moments, saved_groups if load_optimizer else None)
    if rng_key in requests.tensors:
        restore_rng_state(_decoded(requests.tensors[rng_key]))
    elif load_rng:
        why = "saved without them" if same_layout else f"saved at {common.get('layout')}"
        print_rank_0(f"> {directory}: {why}; random generators keep their seeds")
    return load_optimizer


def _check_unexpected(directory: str, metadata: dict, expected: set[str], strictness: str) -> None:
    """Model tensors the checkpoint holds and this model (on any rank) does not: ignored
    (assume_ok_unexpected, ignore_all), listed (log_unexpected, log_all) or refused
    (raise_unexpected, raise_all), as megatron-core's `StrictHandling`."""
    if strictness in ("assume_ok_unexpected", "ignore_all"):
        return
    import torch.distributed as dist

    local = set(expected)
    if dist.is_initialized() and dist.get_world_size() > 1:  # other stages hold other layers
        everyone: list[set[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        local = set().union(*everyone)
    unexpected = sorted(
        key for key in metadata
        if not key.startswith(("optimizer.state.", "rng_state.")) and key not in local
    )  # fmt: skip
    if not unexpected:
        return
    if strictness.startswith("raise"):
        raise DistCheckpointError(
            f"{directory} holds {len(unexpected)} tensors this model has not, "
            f"{unexpected[0]} first (--dist-ckpt-strictness {strictness})"
        )
    print_rank_0(
        f"> {directory} holds {len(unexpected)} tensors this model has not, ignored "
        f"(--dist-ckpt-strictness {strictness}): {', '.join(unexpected)}"
    )


def _checked_metadata(directory: str):  # noqa: ANN202 - DCP's Metadata
    """DCP's metadata of `directory`, after checking that every file it names is there and
    long enough (a missing shard or a torn write is one line naming the file)."""

    try:
        metadata = _SafeReader.create(directory).read_metadata()
    except Exception as error:  # noqa: BLE001 - whatever unpickling a torn file raises
        raise DistCheckpointError(
            f"{os.path.join(directory, DCP_METADATA)} cannot be read ({error!r:.200})"
        ) from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise DistCheckpointError(f"{path} is missing: the checkpoint is incomplete")
        if os.path.getsize(path) < end:
            raise DistCheckpointError(
                f"{path} holds {os.path.getsize(path)} bytes, its index needs {end}: a torn "
                "write; resume from an earlier checkpoint"
            )
    return metadata
