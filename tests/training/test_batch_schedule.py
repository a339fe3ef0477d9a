"""`--rampup-batch-size`: Megatron's batch-size ramp, its checks, and the derived iterations."""

from __future__ import annotations

import pytest

from megatron.arguments import ArgumentError, build_parser, validate_args
from megatron.training.batch_schedule import BatchSizeSchedule
from tests.arguments.test_arguments import BASE


def test_constant_schedule_is_the_global_batch() -> None:
    schedule = BatchSizeSchedule(32, 4, 2)
    assert [schedule.at(c) for c in (0, 1000, 10**9)] == [32, 32, 32]
    assert schedule.micro_batches_at(0) == 4
    assert schedule.iterations_for(320) == 10


def test_ramp_grows_in_equal_sample_steps_then_holds() -> None:
    # start 8, +8 up to 32: three increments over 300 samples -> one every 100 samples.
    schedule = BatchSizeSchedule(32, 4, 2, (8, 8, 300))
    assert schedule.at(0) == 8
    assert schedule.at(99) == 8
    assert schedule.at(100) == 16
    assert schedule.at(200) == 24
    assert schedule.at(299) == 24
    assert schedule.at(300) == 32
    assert schedule.micro_batches_at(100) == 2
    # 8 x 13 = 104 samples reach the first step, then 16 x 7 = 112 (216), 24 x 4 = 96 (312),
    # then full batches: 1000 - 312 = 688 = 21.5 batches of 32 -> 22.
    assert schedule.iterations_for(1000) == 13 + 7 + 4 + 22


@pytest.mark.parametrize(
    ("rampup", "message"),
    [
        ((8, 5, 100), "multiple of the increment"),
        ((8, 4, 96), "multiples of --micro-batch-size x data-parallel size = 8"),
        ((64, 8, 100), "non-negative multiple"),
        ((0, 8, 100), "must be positive"),
    ],
)
def test_bad_ramps_name_the_flag(rampup: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match="--rampup-batch-size") as error:
        BatchSizeSchedule(32, 4, 2, rampup)
    assert message in str(error.value)


def _ramp_args(extra: str, world_size: int = 2):
    argv = [a for a in BASE if a not in ("--train-iters", "10")]
    parser = build_parser()
    return validate_args(parser.parse_args(argv + extra.split()), world_size)


def test_validation_derives_iterations_and_needs_train_samples() -> None:
    args = _ramp_args(
        "--rampup-batch-size 8 8 300 --global-batch-size 32 --micro-batch-size 4 "
        "--train-samples 1000"
    )
    assert args.train_iters == 46  # as iterations_for above
    with pytest.raises(ArgumentError, match="multiple of the increment"):
        _ramp_args(
            "--rampup-batch-size 8 5 300 --global-batch-size 32 --micro-batch-size 4 "
            "--train-samples 1000"
        )
    with pytest.raises(ArgumentError, match="--rampup-batch-size needs --train-samples"):
        _ramp_args(
            "--rampup-batch-size 8 8 300 --global-batch-size 32 --micro-batch-size 4 "
            "--train-iters 10"
        )
