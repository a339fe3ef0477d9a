"""One spawned gloo world per world size for the whole tests/core session.

A test module that defines `SPAWN_WORLD_SIZES` and `spawn_body(checks, rank, world_size)` has
its body run in each of those worlds; the `spawned_suite` fixture starts each world once,
running the bodies of every collected module that asks for it (see spawn_checks.py).
"""

from __future__ import annotations

import pytest

from tests.core.spawn_checks import run_suite


@pytest.fixture(scope="session")
def spawned_suite(request, tmp_path_factory) -> dict:
    """{module name: {world size: Outcomes}} for every collected module with a spawn body."""
    modules_by_world: dict[int, list[str]] = {}
    seen = set()
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for world_size in getattr(module, "SPAWN_WORLD_SIZES", ()):
            modules_by_world.setdefault(world_size, []).append(module.__name__)
    return run_suite(modules_by_world, str(tmp_path_factory.mktemp("spawned")))
