"""Writing checkpoints onto real disks: free space before a save, one-line reasons after a failure.

A full disk, a quota or a read-only directory shows up in `torch.save` as `RuntimeError:
[enforce fail at inline_container.cc] unexpected pos ...`, which names neither the cause nor the
file. `save_torch_file` writes through a file object that keeps the `OSError` behind such a
failure, removes the half-written file, and raises that `OSError` with the path; `describe_failure`
turns it into the line the run ends with:

    --save DIR: no space left on device while writing FILE (N MB needed, M MB free)

For tests, `MEGATRON_SAVE_FAULT=ERRNO[:RANK][@N]` (e.g. `ENOSPC`, `EACCES:1@2`) makes the N-th
(default first) checkpoint file this process writes, on every rank or on global rank RANK, fail
with that error after its first bytes, as a disk that fills up mid-file would.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from megatron.atomic_files import nearest_existing

MEGABYTE = 1 << 20
FAULT_ENV = "MEGATRON_SAVE_FAULT"
# Failures for which the free space is what the user needs to know.
_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT)
_files_written = 0


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the message names --save, the file and the reason."""


def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state dict: about what `torch.save` will write."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `path` (or its parent)."""
    return shutil.disk_usage(nearest_existing(path)).free


def tree_bytes(path: str) -> int:
    """Total size of the files under the directory `path`."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(directory, name))
            except OSError:  # removed while we walked
                pass
    return total


def megabytes(size: int) -> str:
    """`size` in MB for messages: one decimal below 10 MB, whole numbers above."""
    value = size / MEGABYTE
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


class _KeepErrorWriter:
    """A file object for `torch.save` that remembers the OSError torch's writer swallows."""

    def __init__(self, handle: BinaryIO, fault: int | None) -> None:
        self.handle = handle
        self.error: OSError | None = None
        self._fault = fault

    def write(self, data: bytes) -> int:
        """Write `data`; an injected fault fails the write after the file's first bytes."""
        try:
            if self._fault is not None and self.handle.tell() > 0:
                raise OSError(self._fault, os.strerror(self._fault))
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        """Flush the underlying file."""
        self.handle.flush()


def _injected_fault() -> int | None:
    """The errno `MEGATRON_SAVE_FAULT` asks this file to fail with, if any (counts files)."""
    global _files_written
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return None
    match = re.fullmatch(r"([A-Z]+)(?::(\d+))?(?:@(\d+))?", wanted)
    code = getattr(errno, match.group(1), None) if match else None
    if not isinstance(code, int):
        raise ValueError(f"{FAULT_ENV}={wanted!r}: expected ERRNO[:RANK][@N], e.g. ENOSPC:1@2")
    this_rank = dist.get_rank() if dist.is_initialized() else 0
    if match.group(2) is not None and int(match.group(2)) != this_rank:
        return None
    _files_written += 1
    return code if _files_written == int(match.group(3) or 1) else None


def save_torch_file(state: Any, path: str, **save_options: Any) -> None:
    """`torch.save(state, path)` flushed to disk; a failed write raises its OSError, path named.

    Nothing is left at `path` after a failure.
    """
    fault = _injected_fault()
    try:
        with open(path, "wb") as handle:
            writer = _KeepErrorWriter(handle, fault)
            try:
                torch.save(state, writer, **save_options)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        if os.path.exists(path):
            os.remove(path)
        raise OSError(error.errno, error.strerror or str(error), path) from None


def _final_name(path: str) -> str:
    """`path` without the `.partial` staging-directory and `.partial-PID` temporary suffixes."""
    return re.sub(r"\.partial(-\d+)?(?=/|$)", "", str(path))


def describe_failure(error: OSError, save_dir: str, needed: int | None = None) -> str:
    """The one line a save that failed with `error` ends the run with.

    `needed`: bytes the failed file needed, reported with the free space for space errors.
    """
    reason = os.strerror(error.errno).lower() if error.errno else str(error)
    # The name the file would have had: not its staging or temporary name.
    where = f" while writing {_final_name(error.filename)}" if error.filename else ""
    text = f"--save {save_dir}: {reason}{where}"
    if error.errno in _SPACE_ERRORS:
        free = megabytes(free_bytes(error.filename or save_dir))
        size = f"{megabytes(needed)} MB needed, " if needed else ""
        text += f" ({size}{free} MB free)"
    return text


def check_free_space(save_dir: str, needed: int, iteration: int, previous: str) -> str | None:
    """A reason to refuse the save of `iteration`, or None when `save_dir` has `needed` bytes free.

    `needed` is the size of the checkpoint `previous`, which the new one will match.
    """
    free = free_bytes(save_dir)
    if free >= needed:
        return None
    return (
        f"--save {save_dir}: no space left on device for the checkpoint of iteration {iteration} "
        f"({megabytes(needed)} MB needed, as {os.path.basename(previous)}; {megabytes(free)} MB "
        "free); nothing was written"
    )
