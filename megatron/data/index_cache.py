"""Build-once, load-many cache of numpy index arrays shared by all ranks of a run.

One rank builds and saves the arrays while the others wait at a barrier; every file is
written under a temporary name and renamed, so a crash never leaves a half-written array
under the final name. Ranks that still see no cache after the barrier (node-local disks)
build it themselves: the build is deterministic, so every copy is identical.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch.distributed as dist

from megatron.atomic_files import atomic_outputs


def cache_paths(stem: str, names: tuple[str, ...]) -> dict[str, str]:
    """The .npy path of every array name."""
    return {name: f"{stem}_{name}.npy" for name in names}


def _save_atomically(path: str, write: Callable) -> None:
    with atomic_outputs(path) as (partial,), open(partial, "wb") as stream:
        write(stream)


def save_arrays(stem: str, arrays: dict[str, np.ndarray], description: str) -> None:
    """Write the description and every array under its final name, each atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    _save_atomically(f"{stem}_description.json", lambda s: s.write(description.encode()))
    for name, path in cache_paths(stem, tuple(arrays)).items():
        _save_atomically(path, lambda s, array=arrays[name]: np.save(s, array, allow_pickle=False))


def load_or_build_arrays(
    stem: str,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
    description: str,
    group: dist.ProcessGroup | None = None,
) -> dict[str, np.ndarray]:
    """Memory-mapped arrays from `{stem}_{name}.npy`, built by rank 0 of `group` if missing."""
    paths = cache_paths(stem, names)

    def complete() -> bool:
        return all(os.path.isfile(path) for path in paths.values())

    distributed = dist.is_available() and dist.is_initialized()
    if (not distributed or dist.get_rank(group) == 0) and not complete():
        save_arrays(stem, build(), description)
    if distributed:
        dist.barrier(group=group)
    if not complete():
        save_arrays(stem, build(), description)
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}
