"""The NaN/skip guard: a NaN loss skips the update everywhere and leaves no trace.

In iteration POISONED (of ITERATIONS) the per-token losses of one rank are multiplied by NaN
(the plain / DeepSpeed forward step's output; on the pipeline engine, the loss mask its batch
function returns), so the loss and every gradient are NaN. Each engine must then report the
iteration as NaN and skipped, leave every rank's weights bit-exact as they were and the LR
scheduler where it was, and train the next iteration normally: exactly as a twin run that
never saw the poisoned batch (same layout, that batch removed from the data), which shows
the optimizer state (Adam moments, step count) was not touched either.

Engines: plain torch (GuardedAdamW), DeepSpeed fp32 ZeRO-0 (GuardedAdamW under the engine),
ZeRO-1 and ZeRO-2 (DeepSpeed's own overflow check), and the pipeline engine with ZeRO-0 and
ZeRO-1; at DP=1, and at DP=2 with only the last rank poisoned (plus PP=2, whose last stage
holds the loss). `TrainingLoop.train` stops with `TrainingStopped` after
--max-consecutive-skipped-iterations bad iterations in a row, and only then.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.training.harness import (
    GLOBAL_BATCH,
    Layout,
    dense_state_dict,
    sample_tokens,
    spawn_jobs,
)

ITERATIONS, POISONED = 4, 3
LOOP_ITERS, MAX_CONSECUTIVE = 8, 3

ENGINES = [
    Layout("plain", 1, micro_batch=4),
    Layout("ZeRO-0", 1, micro_batch=4, zero=0),
    Layout("ZeRO-1", 1, micro_batch=4, zero=1),
    Layout("ZeRO-2", 1, micro_batch=4, zero=2),
    Layout("pipeline ZeRO-0", 1, micro_batch=2, zero=0, pipeline_engine=True),
    Layout("pipeline ZeRO-1", 1, micro_batch=2, zero=1, pipeline_engine=True),
    Layout("plain DP=2", 2, micro_batch=2),
    Layout("ZeRO-0 DP=2", 2, micro_batch=2, zero=0),
    Layout("ZeRO-1 DP=2", 2, micro_batch=2, zero=1),
    Layout("ZeRO-2 DP=2", 2, micro_batch=2, zero=2),
    Layout("pipeline ZeRO-0 DP=2", 2, micro_batch=1, zero=0, pipeline_engine=True),
    Layout("pipeline ZeRO-1 DP=2", 2, micro_batch=1, zero=1, pipeline_engine=True),
    Layout("pipeline ZeRO-0 PP=2", 2, micro_batch=2, pp=2, zero=0, pipeline_engine=True),
    Layout("pipeline ZeRO-1 PP=2", 2, micro_batch=2, pp=2, zero=1, pipeline_engine=True),
]
LOOP_ENGINES = [ENGINES[0], ENGINES[2], ENGINES[4]]  # plain, ZeRO-1, pipeline ZeRO-0
ALWAYS_BAD = tuple(range(1, LOOP_ITERS + 1))
TWO_BAD_THEN_GOOD = (1, 2, 4, 5, 7, 8)  # never MAX_CONSECUTIVE in a row


def _jobs(world_size: int) -> list:
    jobs = []
    for layout in [x for x in ENGINES if x.world_size == world_size]:
        poisoned = dict(
            iterations=ITERATIONS,
            poison_at=POISONED,
            poison_ranks=(world_size - 1,),
            keep_weights=True,
        )
        twin = dict(iterations=ITERATIONS - 1, drop_batch=POISONED, keep_weights=True)
        jobs.append((("poisoned", layout.name), "steps", layout, poisoned))
        jobs.append((("twin", layout.name), "steps", layout, twin))
    if world_size == 1:
        for layout in LOOP_ENGINES:
            for pattern in (ALWAYS_BAD, TWO_BAD_THEN_GOOD):
                loop = dict(
                    bad_iterations=pattern,
                    train_iters=LOOP_ITERS,
                    max_consecutive=MAX_CONSECUTIVE,
                )
                jobs.append((("loop", layout.name, pattern), "loop", layout, loop))
    return jobs


def _world(world_size: int) -> dict[tuple, list[dict]]:
    samples = sample_tokens(LOOP_ITERS * GLOBAL_BATCH)
    return spawn_jobs(world_size, _jobs(world_size), dense_state_dict(), samples)


@pytest.fixture(scope="module")
def world1() -> dict[tuple, list[dict]]:
    """{job key: [record]} of the 1-rank jobs."""
    return _world(1)


@pytest.fixture(scope="module")
def world2() -> dict[tuple, list[dict]]:
    """{job key: [record per rank]} of the 2-rank jobs."""
    return _world(2)


def records_of(request, kind: str, layout: Layout, *key: object) -> list[dict]:
    """Per-rank records of one job (spawning its world on first use)."""
    return request.getfixturevalue(f"world{layout.world_size}")[(kind, layout.name, *key)]


def _engine_ids():
    return [pytest.param(layout, id=layout.name) for layout in ENGINES]


def weights_equal(a: dict, b: dict) -> bool:
    """Bit-exact equality of two local weight snapshots."""
    assert a.keys() == b.keys() and a
    return all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("layout", _engine_ids())
def test_poisoned_iteration_is_reported_nan_and_skipped(request, layout):
    """Only the poisoned iteration is NaN and skipped, on every rank (even unpoisoned ones)."""
    records = records_of(request, "poisoned", layout)
    assert len(records) == layout.world_size
    for record in records:
        for number, iteration in enumerate(record["iterations"], start=1):
            result = iteration.result
            bad = number == POISONED
            where = f"rank {record['rank']}, iteration {number}"
            assert result.nan is bad and result.skipped is bad, where
            assert math.isnan(result.losses["lm loss"]) is bad, where


@pytest.mark.parametrize("layout", _engine_ids())
def test_skipped_iteration_keeps_weights_bit_exact(request, layout):
    """Weights after the skipped iteration are the weights before it, bit for bit."""
    for record in records_of(request, "poisoned", layout):
        before = record["iterations"][POISONED - 2].weights
        after = record["iterations"][POISONED - 1].weights
        assert weights_equal(before, after), f"rank {record['rank']}"
        # The iteration before did update them (so the comparison can see a change).
        earlier = record["iterations"][POISONED - 3].weights
        assert not weights_equal(earlier, before), f"rank {record['rank']}"


@pytest.mark.parametrize("layout", _engine_ids())
def test_skipped_iteration_does_not_advance_the_scheduler(request, layout):
    """scheduler.num_steps (samples) and the LR stay put on the skipped iteration only."""
    for record in records_of(request, "poisoned", layout):
        steps = [record["initial_scheduler_steps"]]
        steps += [iteration.scheduler_steps for iteration in record["iterations"]]
        for number in range(1, ITERATIONS + 1):
            advance = 0 if number == POISONED else GLOBAL_BATCH
            assert steps[number] == steps[number - 1] + advance, f"iteration {number}"
        lrs = [iteration.lr for iteration in record["iterations"]]
        assert lrs[POISONED - 1] == lrs[POISONED - 2]


@pytest.mark.parametrize("layout", _engine_ids())
def test_next_iteration_trains_normally(request, layout):
    """After the skip: a finite loss, an applied step, weights that change."""
    for record in records_of(request, "poisoned", layout):
        skipped, following = record["iterations"][POISONED - 1], record["iterations"][POISONED]
        result = following.result
        assert not result.skipped and not result.nan
        assert math.isfinite(result.losses["lm loss"])
        assert math.isfinite(float(result.grad_norm))
        assert not weights_equal(skipped.weights, following.weights)


@pytest.mark.parametrize("layout", _engine_ids())
def test_skipped_iteration_leaves_no_trace(request, layout):
    """The run equals its twin that never saw the poisoned batch: same losses after the skip,
    same weights bit for bit (so the optimizer state did not move either)."""
    poisoned_run = records_of(request, "poisoned", layout)
    twin_run = records_of(request, "twin", layout)
    assert len(poisoned_run) == len(twin_run) == layout.world_size
    for poisoned, twin in zip(poisoned_run, twin_run):
        kept = [it for n, it in enumerate(poisoned["iterations"], start=1) if n != POISONED]
        assert len(kept) == len(twin["iterations"])
        for ours, theirs in zip(kept, twin["iterations"]):
            assert ours.result.losses == theirs.result.losses
            assert ours.scheduler_steps == theirs.scheduler_steps
            assert weights_equal(ours.weights, theirs.weights)


@pytest.mark.parametrize("layout", [pytest.param(x, id=x.name) for x in LOOP_ENGINES])
def test_training_loop_stops_after_consecutive_bad_iterations(request, layout):
    """Always-NaN losses: TrainingStopped at iteration MAX_CONSECUTIVE, naming the flag."""
    record = records_of(request, "loop", layout, ALWAYS_BAD)[0]
    assert record["stopped"] is not None, "the loop ran on through NaN losses"
    assert "--max-consecutive-skipped-iterations" in record["stopped"]
    state = record["state"]
    assert state["iteration"] == MAX_CONSECUTIVE
    assert state["skipped_iterations"] == state["nan_iterations"] == MAX_CONSECUTIVE


@pytest.mark.parametrize("layout", [pytest.param(x, id=x.name) for x in LOOP_ENGINES])
def test_training_loop_counts_only_bad_iterations_in_a_row(request, layout):
    """Bad iterations separated by good ones never stop the run; all are counted."""
    record = records_of(request, "loop", layout, TWO_BAD_THEN_GOOD)[0]
    assert record["stopped"] is None
    state = record["state"]
    assert state["iteration"] == LOOP_ITERS
    assert state["skipped_iterations"] == state["nan_iterations"] == len(TWO_BAD_THEN_GOOD)
    assert state["consecutive_bad_iterations"] == 2  # iterations 7 and 8
