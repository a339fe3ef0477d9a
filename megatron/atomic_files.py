"""Output files that appear under their final names only when complete.

Everything is written under `{path}.partial-{pid}`, flushed to disk, then renamed; on any
error the partial files are removed, so an interrupted run never leaves a half-written file
under a final name and never touches what an earlier run wrote there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def nearest_existing(path: str) -> str:
    """`path` (made absolute) if it exists, else its closest ancestor that does."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def partial_path(path: str) -> str:
    """The temporary name `path` is written under until it is complete."""
    return f"{path}.partial-{os.getpid()}"


def publish(partials: list[str], finals: list[str]) -> None:
    """fsync every partial file, then rename each to its final name, in order."""
    for path in partials:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    for partial, final in zip(partials, finals):
        os.replace(partial, final)


def discard(partials: list[str]) -> None:
    """Remove whichever partial files exist."""
    for path in partials:
        if os.path.exists(path):
            os.remove(path)


@contextmanager
def atomic_outputs(*paths: str) -> Iterator[list[str]]:
    """Yield partial paths for `paths`; publish them on success, remove them on any error."""
    partials = [partial_path(path) for path in paths]
    try:
        yield partials
        publish(partials, list(paths))
    finally:
        discard(partials)
