"""Many named checks in few spawned gloo worlds, each reported to its own pytest test.

Starting a gloo world costs seconds (4 ranks on 2 cores: about 6), so the whole suite
starts one world per world size (size 1 runs in this process, in a 1-rank gloo group, as no
second process is needed): a test module opts in with `SPAWN_WORLD_SIZES` and a
module-level `spawn_body(checks, rank, world_size)`, and every collected module's body runs
in that world in turn (see `tests/core/conftest.py`). A body calls `checks.run(name, fn)`
for each check; every rank records "ok" or the error it got, and each pytest test asserts
the outcome of one name on every rank (`Outcomes.assert_ok`).

A check must fail the same way on every rank, or at least only after its last collective,
so that the other ranks never wait for a collective that does not come.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from collections.abc import Callable

import torch.distributed as dist

from megatron.core import parallel_state
from tests.distributed import run_distributed

BODY = "<body>"


def run_checks_per_layout(
    checks: Checks, world: int, layouts: list[tuple[int, int]], table: dict[str, tuple]
) -> None:
    """Run every `table` check (name -> (fn, *args)) at each (world, tp) layout of `world`."""
    for world_size, tp in layouts:
        if world_size == world:
            parallel_state.initialize_model_parallel(tp, 1)
            for name, (fn, *args) in table.items():
                checks.run(f"tp={tp} {name}", fn, *args)
            parallel_state.destroy_model_parallel()


class Checks:
    """The outcome of each named check run on this rank: "ok" or the error's traceback."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def run(self, name: str, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)`, recording whether it raised (an AssertionError or anything else)."""
        if name in self.outcomes:
            raise ValueError(f"check {name!r} is run twice")
        try:
            fn(*args)
        except Exception:
            self.outcomes[name] = traceback.format_exc()[-3000:]
        else:
            self.outcomes[name] = "ok"


def _entry(rank: int, world_size: int, modules: list[str], out_dir: str) -> None:
    """Spawned per rank: run each module's body, then write this rank's outcomes as JSON."""
    results = {}
    for module in modules:
        checks = Checks()
        try:
            importlib.import_module(module).spawn_body(checks, rank, world_size)
        except Exception:
            checks.outcomes[BODY] = traceback.format_exc()[-3000:]
        finally:
            parallel_state.destroy_model_parallel()
        results[module] = checks.outcomes
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as out:
        json.dump(results, out)


class Outcomes:
    """Every rank's check outcomes from one spawned world."""

    def __init__(self, world_size: int, per_rank: list[dict[str, str]]) -> None:
        self.world_size = world_size
        self.per_rank = per_rank

    def names(self) -> set[str]:
        """Every check name some rank recorded."""
        return {name for outcomes in self.per_rank for name in outcomes}

    def assert_ok(self, name: str) -> None:
        """Fail unless every rank ran check `name` and it passed there."""
        problems = []
        for rank, outcomes in enumerate(self.per_rank):
            if name not in outcomes:
                hint = outcomes.get(BODY, "the body never ran it")
                problems.append(f"rank {rank}: check {name!r} missing; {hint}")
            elif outcomes[name] != "ok":
                problems.append(f"rank {rank}: {outcomes[name]}")
        assert not problems, f"world size {self.world_size}:\n" + "\n".join(problems)


def _run_in_this_process(modules: list[str], out_dir: str) -> None:
    """World size 1: the bodies run here, in a 1-rank gloo group torn down afterwards."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _entry(0, 1, modules, out_dir)
    finally:
        dist.destroy_process_group()


def run_suite(modules_by_world: dict[int, list[str]], out_dir: str) -> dict:
    """One spawned world per size running the listed modules' bodies: {module: {world: ...}}."""
    outcomes: dict[str, dict[int, Outcomes]] = {}
    for world_size, modules in sorted(modules_by_world.items()):
        world_dir = os.path.join(out_dir, f"world{world_size}")
        os.makedirs(world_dir, exist_ok=True)
        if world_size == 1:
            _run_in_this_process(list(modules), world_dir)
        else:
            run_distributed(_entry, world_size, list(modules), world_dir)
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(world_dir, f"rank{rank}.json"), encoding="utf-8") as stream:
                per_rank.append(json.load(stream))
        for module in modules:
            by_rank = [results.get(module, {}) for results in per_rank]
            outcomes.setdefault(module, {})[world_size] = Outcomes(world_size, by_rank)
    return outcomes
