"""What a piece of code allocates in tensors, counted deterministically on any device.

CPU memory has no allocator statistics to read (torch.cuda.max_memory_allocated has no CPU
twin), and a process's resident size moves with the allocator's caching and the machine; a
test needs a count that is the same on every run. `AllocationMeter` is a TorchDispatchMode
that sees every new storage an op dispatched inside it returns (not a view of its inputs):
their total (`allocated`, an upper bound of what the code held at once), the bytes of them
still alive and the peak of that (`live`, `peak`: each storage counts until it is freed), and
the largest single one (`largest`). Memory made outside torch's dispatcher (a `torch.load` of
raw bytes, numpy) is not seen; the callers' bounds say so where it matters.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(value: object) -> torch.UntypedStorage | None:
    """The storage of a tensor with memory of its own (parameters too), else None (a meta
    tensor, a wrapper such as a DTensor, whose inner tensors the dispatcher shows this mode
    separately, or a storage FSDP2 swapped out)."""
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return None
    try:
        storage = value.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return storage


class AllocationMeter(TorchDispatchMode):
    """The tensor storage created inside it: `allocated` (all of it), `live` and `peak` (what
    is still alive, and its largest value), `largest` (the largest single storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = self.live = self.peak = self.largest = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        """Run `func`, then count its outputs' storages that none of its inputs had."""
        out = func(*args, **(kwargs or {}))
        seen = {s.data_ptr() for s in map(_storage, tree_leaves((args, kwargs))) if s is not None}
        for storage in map(_storage, tree_leaves(out)):
            if storage is None or storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            self.allocated += storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, storage.nbytes())
            # The storage object is preserved with its tensor: its finalizer runs at the free.
            weakref.finalize(storage, self._freed, storage.nbytes())
        return out
