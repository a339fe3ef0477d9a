"""The suite's cache folder (`.cache/` in the repository) and its lock: what one test run
builds once (environments, downloads, oracles) and later runs reuse. Standard library only:
scripts/run_tests.sh uses it before the test environment exists (tests/base_env.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
CACHE_DIR = os.path.join(REPO_ROOT, ".cache")


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold `.cache/{name}.lock` exclusively: two pytest-xdist workers (or two test runs) that
    would build the same cached folder build it once, the second finding it done."""
    os.makedirs(CACHE_DIR, exist_ok=True)
    with open(os.path.join(CACHE_DIR, f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
