"""This rank's slices of the global tensors of a torch_dist checkpoint under FSDP2.

FSDP2 (`fully_shard`, megatron.training.engines.fsdp) keeps each parameter as a DTensor over
the data(-x-context)-parallel mesh whose global tensor is this tensor-parallel (or expert-
parallel) rank's shard; a rank holds rows [start, stop) of that shard (torch.chunk's rule,
dim 0). Adam's moments are DTensors of the same kind. A checkpoint saves the global tensor
(all tensor-parallel shards together, SwiGLU's [gate; up] rows as [2, F, ...]:
megatron.checkpointing.dist_checkpoint), so the rank's rows are one box of it, or two where
they cross from SwiGLU's gate rows into its up rows.

Each rank writes and reads its boxes only, through torch's `ShardedTensor` (as megatron-core
hands its shards to torch.distributed.checkpoint): local shards are views of the rank's own
memory, read into in place, and the global metadata every rank's boxes, computed from the
layout without communication. Nothing is gathered: a save or load costs the rank its own
slices (DCP copies a slice whose storage is larger than it before writing).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.model.sharding import Split

# torch marks ShardedTensor's tensor methods deprecated in favour of DTensor, and DCP itself
# calls them (`.size()`) on every ShardedTensor it plans: a line per tensor and save. DTensor
# cannot say what these are (a slice of a tensor-parallel shard, two blocks across SwiGLU's
# halves), and DCP reads both alike.
warnings.filterwarnings(
    "ignore",
    message="Please use DTensor instead and we are deprecating ShardedTensor",
    category=FutureWarning,
)


@dataclass(frozen=True)
class Box:
    """A block of a global tensor held by one rank: where it starts and its sizes, and which
    rows of the rank's local slice it is (`half`: SwiGLU's 0 gate or 1 up block, else None)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rows: tuple[int, int]
    half: int | None = None


@dataclass(frozen=True)
class ShardedLayout:
    """How one tensor-parallel (or expert-parallel) shard of shape `shape` sits in its global
    tensor: `split` as the layer declared it, split over `size` ranks along `dim` (None:
    whole on every rank)."""

    shape: tuple[int, ...]
    split: Split
    dim: int | None
    size: int

    def global_shape(self) -> tuple[int, ...]:
        """The saved tensor's shape."""
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] *= self.size
        if self.split.swiglu:  # [gate; up] rows -> [2, F, ...]
            shape = [2, shape[0] // 2, *shape[1:]]
        return tuple(shape)

    def boxes(self, rank: int, rows: tuple[int, int]) -> list[Box]:
        """The boxes of the global tensor that rows [start, stop) of shard `rank` are."""
        start, stop = rows
        if start >= stop:
            return []
        if self.split.swiglu:
            return self._swiglu_boxes(rank, start, stop)
        offsets = [0] * len(self.shape)
        offsets[0] = start
        if self.dim is not None:
            offsets[self.dim] += rank * self.shape[self.dim]
        sizes = (stop - start, *self.shape[1:])
        return [Box(tuple(offsets), sizes, rows)]

    def _swiglu_boxes(self, rank: int, start: int, stop: int) -> list[Box]:
        # The shard is [gate_r; up_r], h rows each; global [2, F, ...], rank r's rows of each
        # half at r * h (split on dim 0, or whole: r = 0).
        half = self.shape[0] // 2
        base = rank * half if self.dim is not None else 0
        boxes = []
        for which, (low, high) in enumerate(((0, half), (half, 2 * half))):
            first, last = max(start, low), min(stop, high)
            if first < last:
                offsets = (which, base + first - low, *([0] * (len(self.shape) - 1)))
                sizes = (1, last - first, *self.shape[1:])
                boxes.append(Box(offsets, sizes, (first, last), which))
        return boxes


def stored_tensor(local: torch.Tensor) -> torch.Tensor:
    """What a checkpoint stores of an FSDP2 shard: the shard itself, or the one tensor inside a
    subclass wrapping it (`--fp8-param-gather`: torchao's weight that casts to FP8 before the
    all-gather holds the fp32 shard); read and filled in place either way."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(local):
        inner, _ = local.__tensor_flatten__()
        if len(inner) != 1:
            raise TypeError(f"a {type(local).__name__} shard holds {inner}: not one tensor to save")
        local = getattr(local, inner[0])
    return local


def chunk_rows(length: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, stop) of `length` that rank `rank` of `world` holds under FSDP2 (torch.chunk:
    ceil(length / world) rows each, the last ranks fewer or none)."""
    per_rank = -(-length // world)
    start = min(rank * per_rank, length)
    return start, min(start + per_rank, length)


def _global_metadata(layout: ShardedLayout, world: int, keep_rows: int | None) -> list[Box]:
    """Every rank's boxes (each distinct box once: replicas hold the same ones), cut at
    `keep_rows` rows of dim 0 when the saved tensor has fewer (a vocabulary padded less)."""
    boxes = {}
    for rank in range(layout.size if layout.dim is not None else 1):
        for data_rank in range(world):
            for box in layout.boxes(rank, chunk_rows(layout.shape[0], data_rank, world)):
                box = _cut(box, keep_rows)
                if box is not None:
                    boxes[box.offsets] = box
    return list(boxes.values())


def _cut(box: Box, keep_rows: int | None) -> Box | None:
    """`box` without its rows at or past `keep_rows` (dim 0), None when nothing is left."""
    if keep_rows is None or box.offsets[0] + box.sizes[0] <= keep_rows:
        return box
    kept = keep_rows - box.offsets[0]
    if kept <= 0:
        return None
    start = box.rows[0]
    return Box(box.offsets, (kept, *box.sizes[1:]), (start, start + kept), box.half)


def sharded_slices(
    local: torch.Tensor,
    layout: ShardedLayout,
    rank: int,
    rows: tuple[int, int],
    world: int,
    saved_shape: tuple[int, ...] | None = None,
) -> object:
    """A torch `ShardedTensor` of the global tensor whose local shards are views of `local`
    (rows `rows` of shard `rank`, FSDP2's slice on a data-parallel rank of `world`): what DCP
    writes from and reads into. `saved_shape` (loading a vocabulary padded to fewer rows):
    the saved tensor's shape; this rank's rows past it are not read (zero them first)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
    )
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    shape = saved_shape or layout.global_shape()
    keep_rows = shape[0] if saved_shape is not None else None
    here = dist.get_rank()
    elsewhere = (here + 1) % dist.get_world_size()  # any other rank: only the boxes count
    device = str(local.device)

    def metadata(box: Box, holder: int) -> object:
        return ShardMetadata(list(box.offsets), list(box.sizes), f"rank:{holder}/{device}")

    mine = [b for b in (_cut(b, keep_rows) for b in layout.boxes(rank, rows)) if b is not None]
    shards = [Shard(_view(local, box, rows[0]), metadata(box, here)) for box in mine]
    others = [
        metadata(box, elsewhere)
        for box in _global_metadata(layout, world, keep_rows)
        if box.offsets not in {b.offsets for b in mine}
    ]
    whole_rows = layout.global_shape()[0]
    if keep_rows is not None and keep_rows > whole_rows:  # saved rows no rank here holds
        extra = (keep_rows - whole_rows, *shape[1:])
        others.append(
            metadata(Box((whole_rows, *[0] * (len(shape) - 1)), extra, (0, 0)), elsewhere)
        )
    properties = TensorProperties(dtype=local.dtype, requires_grad=False)
    global_metadata = ShardedTensorMetadata(
        [shard.metadata for shard in shards] + others, torch.Size(shape), properties
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_metadata)


def _view(local: torch.Tensor, box: Box, first_row: int) -> torch.Tensor:
    """The rows of `local` (which starts at row `first_row` of its shard) that `box` is."""
    view = local.detach()[box.rows[0] - first_row : box.rows[1] - first_row]
    return view.unsqueeze(0) if box.half is not None else view


def staged_copy(sharded: object, buffers: list[torch.Tensor], pin: bool) -> object:
    """`sharded` (a `sharded_slices` result) with its local shards copied into host buffers:
    `buffers`, this key's from the last save (reused when their shapes match, else replaced
    in place), pinned with `pin`. What `--async-save` hands its writing thread."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
    )

    def on_host(metadata: object) -> object:
        rank = metadata.placement.rank()
        return ShardMetadata(metadata.shard_offsets, metadata.shard_sizes, f"rank:{rank}/cpu")

    shards = []
    for index, shard in enumerate(sharded.local_shards()):
        source = shard.tensor
        if index == len(buffers):
            buffers.append(torch.empty(0))
        buffer = buffers[index]
        if buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
            buffers[index] = buffer
        buffer.copy_(source)
        shards.append(Shard(buffer, on_host(shard.metadata)))
    metadata = sharded.metadata()
    host = ShardedTensorMetadata(
        [on_host(each) for each in metadata.shards_metadata],
        metadata.size,
        metadata.tensor_properties,
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, host)
