"""What a piece of code allocates in tensors, counted deterministically on any device.

CPU memory has no allocator statistics to read (torch.cuda.max_memory_allocated has no CPU
twin), and a process's resident size moves with the allocator's caching and the machine; a
test needs a count that is the same on every run. `AllocationMeter` is a TorchDispatchMode
that adds up the storage bytes of every tensor an op dispatched inside it returns in new
memory (not a view of its inputs): an upper bound of what the code held at once, and at the
same time a record of the largest single allocation. Memory made outside torch's dispatcher
(a `torch.load` of raw bytes, numpy) is not seen; the callers' bounds say so where it matters.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(values: object) -> set[int]:
    """The data pointers of the plain tensors' storages among `values` (nested)."""
    found = set()
    for value in tree_leaves(values):
        if type(value) is torch.Tensor and value.device.type != "meta":
            found.add(value.untyped_storage().data_ptr())
    return found


class AllocationMeter(TorchDispatchMode):
    """Counts the bytes of new tensor storage created inside it (`allocated`) and the largest
    one (`largest`), per op outputs; views and in-place results are not new memory."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        """Run `func`, then count its outputs' storages that none of its inputs had."""
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        seen = set()
        for value in tree_leaves(out):
            if type(value) is not torch.Tensor or value.device.type == "meta":
                continue
            storage = value.untyped_storage()
            if storage.data_ptr() in inputs or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            self.allocated += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
        return out
