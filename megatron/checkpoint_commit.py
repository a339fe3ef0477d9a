"""Checkpoint directories that become visible only when complete on every rank.

Every rank writes (and fsyncs) its files under `{final}.partial`; after a barrier, rank 0
renames the staging directory to its final name, fsyncs the parent, and only then rewrites
the tracker files (`latest_checkpointed_iteration.txt`, and DeepSpeed's `latest` for that
layout). A run killed at any moment therefore leaves the trackers naming the previous
complete checkpoint; a leftover `.partial` directory is never read and is cleared by the
next save of the same iteration.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from megatron.atomic_files import atomic_outputs

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER_FILENAME = "latest"
STAGING_SUFFIX = ".partial"
_REPLACED_SUFFIX = ".replaced"


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def staging_directory(final: str) -> str:
    """Where a checkpoint bound for `final` is written until every rank is done."""
    return final + STAGING_SUFFIX


def fsync_path(path: str) -> None:
    """Flush a file or directory entry to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: str) -> None:
    """fsync every directory under `root` (files are fsynced by the rank that wrote them)."""
    for directory, _, _ in os.walk(root):
        fsync_path(directory)


def begin(final: str) -> str:
    """Clear leftovers of an interrupted save of `final`; returns the staging directory.

    A collective: every rank calls it before writing.
    """
    staging = staging_directory(final)
    if _is_rank_zero():
        for leftover in (staging, final + _REPLACED_SUFFIX):
            if os.path.isdir(leftover):
                shutil.rmtree(leftover)
        os.makedirs(staging)
    _barrier()
    return staging


def commit(final: str, trackers: dict[str, str]) -> None:
    """Publish `final` from its staging directory, then write `trackers` (name -> text).

    A collective: every rank calls it once its own files are written and fsynced.
    """
    _barrier()
    if _is_rank_zero():
        staging = staging_directory(final)
        fsync_tree(staging)
        replaced = final + _REPLACED_SUFFIX
        if os.path.isdir(final):
            # Saving an iteration again (a rerun past a checkpoint that was never tracked).
            os.replace(final, replaced)
        os.replace(staging, final)
        root = os.path.dirname(final)
        fsync_path(root)
        if os.path.isdir(replaced):
            shutil.rmtree(replaced)
        for name, text in trackers.items():
            write_tracker(os.path.join(root, name), text)
    _barrier()


def write_tracker(path: str, text: str) -> None:
    """Replace a tracker file atomically (temporary name, fsync, rename, fsync directory)."""
    with atomic_outputs(path) as (partial,):
        with open(partial, "w") as handle:
            handle.write(text)
    fsync_path(os.path.dirname(path) or ".")


def read_tracker(root: str) -> tuple[int, bool] | None:
    """(iteration, release) from Megatron's tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        text = handle.read().strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise ValueError(
            f"{path}: expected an iteration number or 'release', got {text!r}"
        ) from None


def read_deepspeed_tag(root: str, name: str = DEEPSPEED_TRACKER_FILENAME) -> str | None:
    """The tag DeepSpeed's `latest` (or another tracker) file names, or None when absent."""
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        tag = handle.read().strip()
    if not tag:
        raise ValueError(f"{path} is empty; it should name a checkpoint directory")
    return tag
