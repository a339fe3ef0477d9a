"""How pytest-xdist shares the suite between workers (`-n 2 --dist loadfile`, as
scripts/run_tests.sh runs it).

- One scheduling group per test file, so a file's module-scoped fixtures (a trained
  checkpoint, a reference run) are built once, on one worker; and one group for every module
  that runs its checks in the tests/core spawned worlds (a module-level `SPAWN_WORLD_SIZES`):
  those worlds start once per session, on the worker that runs the group
  (tests/core/conftest.py).
- The longest groups first (seconds per file from tests/durations.json, which
  scripts/test_durations.py writes from a full run's JUnit report), so that neither worker is
  left with a long file at the end. A file missing from it counts as `UNKNOWN_FILE_S`; a
  stale figure only changes the order in which files run, never which tests run.

The grouping is xdist's `loadfile` scheduler with its scope function replaced (xdist's own
`loadgroup` marks stopped taking effect with pytest 9.2: pytest-xdist issue #1386).
"""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
from xdist.scheduler import LoadFileScheduling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DURATIONS = os.path.join(ROOT, "tests", "durations.json")
UNKNOWN_FILE_S = 5.0
SPAWNED_SUITE_GROUP = "tests/core spawned worlds"


@functools.cache
def group_of(path: str) -> str:
    """The scheduling group of the test file `path` (relative to the repository root)."""
    try:
        with open(os.path.join(ROOT, path), encoding="utf-8") as file:
            source = file.read()
    except OSError:
        return path
    return SPAWNED_SUITE_GROUP if re.search(r"^SPAWN_WORLD_SIZES\b", source, re.M) else path


class FileGroupScheduling(LoadFileScheduling):
    """xdist's per-file scheduling, with the spawned-world modules as one group."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid.split("::", 1)[0])


def longest_groups_first(items: list[pytest.Item]) -> None:
    """Sort `items` (in place, stably) by their group's recorded seconds, longest first."""
    with open(DURATIONS, encoding="utf-8") as file:
        seconds = json.load(file)
    cost: dict[str, float] = {}
    for path in {item.nodeid.split("::", 1)[0] for item in items}:
        group = group_of(path)
        cost[group] = cost.get(group, 0.0) + seconds.get(path, UNKNOWN_FILE_S)
    items.sort(key=lambda item: -cost[group_of(item.nodeid.split("::", 1)[0])])
