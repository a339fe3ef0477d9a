"""Many named checks in few spawned gloo worlds, each reported to its own pytest test.

Starting a gloo world costs seconds (4 ranks on 2 cores: about 6), so the whole suite
starts one world per world size (size 1 runs in this process, in a 1-rank gloo group, as no
second process is needed): a test module opts in with `SPAWN_WORLD_SIZES` and a
module-level `spawn_body(checks, rank, world_size)`, and every collected module's body runs
in that world in turn (see `tests/core/conftest.py`). A body calls `checks.run(name, fn)`
for each check, the same names in the same order on every rank; each pytest test asserts
the outcome of one name on every rank (`Outcomes.assert_ok`).

No check can hang the world, whatever it does on one rank only:
- After each check every rank posts its outcome to the world's store and reads everyone's
  (`_Agreement`), so all ranks learn together that a check failed somewhere, or that the
  ranks are out of step (they are at different checks).
- A rank whose check failed, or that learns so, records it and leaves the world at once
  (`os._exit`): its sockets close, so a rank still waiting for it in a collective fails
  within milliseconds instead of at the collective's timeout, and leaves in turn. The suite
  then starts the world again, which skips the checks already recorded: the checks after a
  failure run and report on their own.
- A world in which no check starts or ends for `STALL_S` (a collective some rank never enters,
  a deadlock outside collectives) is killed by the supervising process after every rank
  wrote its Python stacks, which become the outcome of the check each rank was in.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from megatron.core import parallel_state
from tests.distributed import World, WorldTimeout, say_doing, world_store

BODY = "<body>"  # the body's own code, outside any check
END = "<end>"  # the agreement that closes a module's body
PROGRESS = "checks_progress"  # store counter each check's start and agreement raise
STALL_S = 300.0  # no check started or agreed anywhere in the world for this long: it is hung
# A rank waits this long at an agreement for the others; longer than STALL_S so that the
# watchdog, which prints stacks, ends a hang first.
AGREEMENT_TIMEOUT = timedelta(seconds=2 * STALL_S)
MAX_STARTS = 30  # starts of one world size; each failure costs one restart (seconds)
AT_KEY = "at/rank{rank}"  # [module, check] this rank is in; BODY between checks


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


class _Agreement:
    """One rank's side of the per-check agreement over the world's store, and its log."""

    def __init__(self, rank: int, world_size: int, log_path: str) -> None:
        self.rank, self.world_size = rank, world_size
        self.store = world_store()
        self.index = 0
        self.log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115

    def enter(self, module: str, name: str) -> None:
        """Say where this rank is: a timeout's message and the restart's bookkeeping read it."""
        self.store.set(AT_KEY.format(rank=self.rank), json.dumps([module, name]))
        say_doing(self.rank, f"{module}: {name}")
        self.store.add(PROGRESS, 1)

    def record(self, module: str, name: str, outcome: str) -> None:
        """Append one outcome to this rank's log (read by the supervising process)."""
        self.log.write(json.dumps({"module": module, "name": name, "outcome": outcome}) + "\n")
        self.log.flush()

    def agree(self, module: str, name: str, outcome: str) -> str:
        """Post this rank's outcome, read every rank's; return "ok" or leave the world."""
        prefix = f"agree/{self.index}"
        self.index += 1
        mine = {"module": module, "name": name, "ok": outcome == "ok"}
        self.store.set(f"{prefix}/{self.rank}", json.dumps(mine))
        if outcome != "ok":
            self.leave(module, name, outcome)
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size)]
        try:
            self.store.wait(keys, AGREEMENT_TIMEOUT)
        except Exception:
            missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
            self.leave(module, name, f"passed here, but ranks {missing} never reported it")
        problems = []
        for rank, key in enumerate(keys):
            theirs = json.loads(self.store.get(key))
            if (theirs["module"], theirs["name"]) != (module, name):
                problems.append(
                    f"rank {rank} was at {theirs['module']}: {theirs['name']!r} instead (the "
                    "ranks are out of step)"
                )
            elif not theirs["ok"]:
                problems.append(f"rank {rank} failed it (see its outcome)")
        if problems:
            self.leave(module, name, "passed here, but " + "; ".join(problems))
        self.record(module, name, "ok")
        self.enter(module, BODY)
        return "ok"

    def leave(self, module: str, name: str, outcome: str) -> NoReturn:
        """Record the outcome and exit now: the sockets close, so no rank waits for this one."""
        self.record(module, name, outcome)
        self.log.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class Checks:
    """The outcome of each named check run on this rank: "ok" or the error's traceback."""

    def __init__(
        self, module: str = "", agreement: _Agreement | None = None, done: Collection[str] = ()
    ) -> None:
        self.module = module
        self.agreement = agreement
        self.done = set(done)  # recorded by an earlier start of this world: skipped
        self.outcomes: dict[str, str] = {}
        self._seen: set[str] = set()

    def run(self, name: str, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)`, recording whether it raised (an AssertionError or anything else)."""
        if name in self._seen:
            raise ValueError(f"check {name!r} is run twice")
        self._seen.add(name)
        if name in self.done:
            return
        if self.agreement is not None:
            self.agreement.enter(self.module, name)
        try:
            fn(*args)
        except Exception:
            outcome = traceback.format_exc()[-3000:]
        else:
            outcome = "ok"
        if self.agreement is not None:
            outcome = self.agreement.agree(self.module, name, outcome)
        self.outcomes[name] = outcome


def _body(spec: str) -> Callable:
    """`module` (its `spawn_body`) or `module:function`."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr or "spawn_body")


def _run_body(checks: Checks, rank: int, world_size: int) -> str | None:
    """Run the body of `checks.module`; the traceback of an error outside its checks, or None."""
    try:
        _body(checks.module)(checks, rank, world_size)
    except Exception:
        return traceback.format_exc()[-3000:]
    finally:
        parallel_state.destroy_model_parallel()
    return None


def _entry(
    rank: int, world_size: int, modules: list[str], done: dict[str, list[str]], world_dir: str
) -> None:
    """Spawned per rank: run each module's body, agreeing on every check with the others."""
    agreement = _Agreement(rank, world_size, os.path.join(world_dir, f"rank{rank}.jsonl"))
    for module in modules:
        agreement.enter(module, BODY)
        error = _run_body(Checks(module, agreement, done.get(module, ())), rank, world_size)
        if error is not None:
            agreement.agree(module, BODY, error)  # leaves the world
        agreement.agree(module, END, "ok")
    agreement.log.close()


class Outcomes:
    """Every rank's check outcomes from one spawned world."""

    def __init__(self, world_size: int, per_rank: list[dict[str, str]]) -> None:
        self.world_size = world_size
        self.per_rank = per_rank

    def names(self) -> set[str]:
        """Every check name some rank recorded (BODY when the body itself failed)."""
        return {name for outcomes in self.per_rank for name in outcomes if name != END}

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


def _run_in_this_process(modules: list[str]) -> list[dict[str, dict[str, str]]]:
    """World size 1: the bodies run here, in a 1-rank gloo group torn down afterwards."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results: dict[str, dict[str, str]] = {}
    try:
        for module in modules:
            checks = Checks(module)
            error = _run_body(checks, 0, 1)
            if error is not None:
                checks.outcomes[BODY] = error
            results[module] = checks.outcomes
    finally:
        dist.destroy_process_group()
    return [results]


def _read_logs(world_size: int, world_dir: str) -> list[dict[str, dict[str, str]]]:
    """Each rank's {module: {check: outcome}} from its log (later lines win)."""
    per_rank = []
    for rank in range(world_size):
        results: dict[str, dict[str, str]] = {}
        path = os.path.join(world_dir, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as stream:
                for line in stream:
                    entry = json.loads(line)
                    results.setdefault(entry["module"], {})[entry["name"]] = entry["outcome"]
        per_rank.append(results)
    return per_rank


def _record_where_each_rank_was(
    world: World, world_dir: str, pending: list[str], outcome: str
) -> None:
    """After a hang or a crash: the check (or body) each rank was in gets `outcome`, unless
    the rank recorded that one itself before it left."""
    per_rank = _read_logs(world.world_size, world_dir)
    for rank in range(world.world_size):
        key = AT_KEY.format(rank=rank)
        if world.store.check([key]):
            module, name = json.loads(world.store.get(key))
        else:
            module, name = pending[0], BODY
        if name in per_rank[rank].get(module, {}):
            continue
        with open(os.path.join(world_dir, f"rank{rank}.jsonl"), "a", encoding="utf-8") as log:
            log.write(json.dumps({"module": module, "name": name, "outcome": outcome}) + "\n")


def _run_world(world_size: int, modules: list[str], world_dir: str, stall_s: float) -> list[dict]:
    """Run the modules' bodies in a world of `world_size`, restarting it after each failure
    (the restart skips what is recorded) until every module ended; each rank's results."""
    for start in range(MAX_STARTS):
        per_rank = _read_logs(world_size, world_dir)
        ended = {
            module
            for results in per_rank
            for module, outcomes in results.items()
            if END in outcomes or BODY in outcomes
        }
        pending = [module for module in modules if module not in ended]
        if not pending:
            return per_rank
        done = {
            module: sorted({name for results in per_rank for name in results.get(module, {})})
            for module in pending
        }
        world = World(world_size)
        try:
            world.run(_entry, pending, done, world_dir, deadline_s=stall_s, progress_key=PROGRESS)
        except WorldTimeout as hung:
            _record_where_each_rank_was(world, world_dir, pending, f"hung: {hung}"[:20000])
        except Exception as died:  # a rank crashed or was killed
            outcome = f"a rank died (world start {start + 1}): {died}"[-3000:]
            _record_where_each_rank_was(world, world_dir, pending, outcome)
    per_rank = _read_logs(world_size, world_dir)
    for results in per_rank:
        for module in modules:
            results.setdefault(module, {}).setdefault(
                BODY, f"not finished: the world was started {MAX_STARTS} times"
            )
    return per_rank


def run_suite(
    modules_by_world: dict[int, list[str]], out_dir: str, stall_s: float = STALL_S
) -> dict:
    """One spawned world per size running the listed modules' bodies: {module: {world: ...}}.

    A module is a module name (its `spawn_body`) or `module:function`. A world in which no
    check ends for `stall_s` is killed, the check each rank was in failing with the stacks.
    """
    outcomes: dict[str, dict[int, Outcomes]] = {}
    for world_size, modules in sorted(modules_by_world.items()):
        world_dir = os.path.join(out_dir, f"world{world_size}")
        os.makedirs(world_dir, exist_ok=True)
        if world_size == 1:
            per_rank = _run_in_this_process(list(modules))
        else:
            per_rank = _run_world(world_size, list(modules), world_dir, stall_s)
        for module in modules:
            by_rank = [results.get(module, {}) for results in per_rank]
            outcomes.setdefault(module, {})[world_size] = Outcomes(world_size, by_rank)
    return outcomes
