"""The test worlds themselves: a check that fails on one rank cannot hang the others, and a
world that hangs anyway ends as a named failure with every rank's stack.

- In a spawned-checks world, a check that fails on rank 1 only, before a collective that rank
  0 is already waiting in, fails on both ranks: rank 0's wait ends because rank 1 left the
  world (its sockets closed), not at the collective's timeout; the checks after it, in the
  same module and in the next, run and pass.
- Every group made in a test world, the world group, ours and one made later without a
  timeout (as DeepSpeed makes its groups), times out after `COLLECTIVE_TIMEOUT`.
- `run_distributed` with one rank in a collective that the other never enters (alive, not
  failing) ends at its deadline with `WorldTimeout`, which names the function and holds both
  ranks' Python stacks: the all-reduce on one, the wait on the other.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.core.spawn_checks import BODY, run_suite
from tests.distributed import (
    COLLECTIVE_TIMEOUT,
    World,
    WorldTimeout,
    run_distributed,
    world_store,
)


def _all_reduce_counts_the_ranks(world: int) -> None:
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world


def _fails_on_rank_1_before_a_collective() -> None:
    if dist.get_rank() == 1:
        raise AssertionError("failed on rank 1 only")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes


def _groups_carry_the_harness_timeout() -> None:
    late = dist.new_group([0, 1])  # no timeout given, as DeepSpeed makes its groups
    for group in (dist.group.WORLD, parallel_state.get_tensor_model_parallel_group(), late):
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        assert timeout == COLLECTIVE_TIMEOUT, timeout


def _tensor_parallel_all_reduce() -> None:
    total = torch.ones(1)
    dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    assert total.item() == 2


def failing_rank_body(checks, rank: int, world: int) -> None:
    """A passing check, one that fails on rank 1 only, then passing checks in the same body."""
    checks.run("before", _all_reduce_counts_the_ranks, world)
    checks.run("fails on rank 1 only", _fails_on_rank_1_before_a_collective)
    checks.run("after, same module", _all_reduce_counts_the_ranks, world)
    parallel_state.initialize_model_parallel(2, 1)
    checks.run("after, tensor-parallel group", _tensor_parallel_all_reduce)
    checks.run("groups carry the harness timeout", _groups_carry_the_harness_timeout)


def next_body(checks, rank: int, world: int) -> None:
    """The next module in the same world."""
    checks.run("next module", _all_reduce_counts_the_ranks, world)


def test_a_check_failing_on_one_rank_fails_everywhere_and_the_world_goes_on(tmp_path):
    started = time.monotonic()
    bodies = [f"{__name__}:failing_rank_body", f"{__name__}:next_body"]
    outcomes = run_suite({2: bodies}, str(tmp_path))
    elapsed = time.monotonic() - started
    failing, following = outcomes[bodies[0]][2], outcomes[bodies[1]][2]
    rank0, rank1 = (per_rank["fails on rank 1 only"] for per_rank in failing.per_rank)
    assert "failed on rank 1 only" in rank1, rank1
    # Rank 0 was released by rank 1 leaving the world, not by the collective's timeout.
    assert rank0 != "ok" and "Timed out" not in rank0, rank0
    assert elapsed < COLLECTIVE_TIMEOUT.total_seconds(), elapsed
    for name in (
        "before",
        "after, same module",
        "after, tensor-parallel group",
        "groups carry the harness timeout",
    ):
        failing.assert_ok(name)
    following.assert_ok("next module")
    assert BODY not in failing.names() | following.names()


def _rank_0_enters_a_collective_alone() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 passes, and waits for rank 0 to agree


def hanging_body(checks, rank: int, world: int) -> None:
    """A check that hangs without failing anywhere, then one that passes."""
    checks.run("hangs", _rank_0_enters_a_collective_alone)
    checks.run("after the hang", _all_reduce_counts_the_ranks, world)


def test_a_hung_check_fails_with_the_stacks_and_the_world_goes_on(tmp_path):
    body = f"{__name__}:hanging_body"
    outcomes = run_suite({2: [body]}, str(tmp_path), stall_s=10)[body][2]
    outcomes.assert_ok("after the hang")
    for outcome in (per_rank["hangs"] for per_rank in outcomes.per_rank):
        assert outcome.startswith("hung: ") and "no rank reported progress within 10 s" in outcome
        rank0, rank1 = outcome.split("--- rank 0")[1].split("--- rank 1")
        assert "hanging_body: hangs" in rank0 and "all_reduce" in rank0, outcome
        assert "hanging_body: hangs" in rank1 and "in agree" in rank1, outcome


def _one_rank_waits_in_a_collective_the_other_never_enters(rank: int, world: int) -> None:
    store = world_store()
    store.add("arrived", 1)
    while store.add("arrived", 0) < world:  # both ranks are at their blocking point
        time.sleep(0.05)
    store.add("ready", 1)  # progress: the watchdog's deadline restarts from here
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        threading.Event().wait()  # alive and never failing, never entering the all-reduce


def test_a_hung_world_fails_with_every_ranks_stack():
    world = World(2)
    started = time.monotonic()
    with pytest.raises(WorldTimeout) as raised:
        world.run(
            _one_rank_waits_in_a_collective_the_other_never_enters,
            deadline_s=10,
            progress_key="ready",
        )
    message = str(raised.value)
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT.total_seconds()
    assert "_one_rank_waits_in_a_collective_the_other_never_enters on 2 ranks" in message
    rank0, rank1 = message.split("--- rank 0")[1].split("--- rank 1")
    assert "all_reduce" in rank0 and "test_spawn_checks.py" in rank0, message
    assert "in wait" in rank1 and "test_spawn_checks.py" in rank1, message


class _InterruptedOnceReady(World):
    """A world whose supervision is interrupted (as pytest-timeout does) once both ranks block."""

    def progress(self, key: str) -> int:
        ready = super().progress(key)
        if ready == self.world_size:
            raise KeyboardInterrupt
        return ready


def test_an_interrupted_world_prints_every_ranks_stack(capfd):
    with pytest.raises(KeyboardInterrupt):
        _InterruptedOnceReady(2).run(
            _one_rank_waits_in_a_collective_the_other_never_enters,
            deadline_s=COLLECTIVE_TIMEOUT.total_seconds(),
            progress_key="ready",
        )
    printed = capfd.readouterr().err
    rank0, rank1 = printed.split("--- rank 0")[1].split("--- rank 1")
    for stack in (rank0, rank1):
        assert "_one_rank_waits_in_a_collective_the_other_never_enters" in stack, printed


def test_run_distributed_has_a_deadline():
    with pytest.raises(WorldTimeout, match="the world did not end within 5 s"):
        run_distributed(_sleeps_forever, 2, deadline_s=5)


def _sleeps_forever(rank: int, world: int) -> None:
    threading.Event().wait()
