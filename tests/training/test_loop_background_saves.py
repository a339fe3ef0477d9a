"""The loop commits the `--async-save` save in flight before a run that stops early ends.

`TrainingLoop.train` with a stub step whose every result is NaN and skipped: at
--max-consecutive-skipped-iterations it raises `TrainingStopped` (every rank does, at the same
iteration), and by then it has asked the engine's background saves to finish (commit) the save
in flight, as a normal end does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.arguments import build_parser, validate_args
from megatron.checkpointing import TrainState
from megatron.settled_args import with_settled
from megatron.training.loop import TrainingLoop, TrainingStopped
from megatron.training.monitor import Timers
from megatron.training.scheduler import scheduler_from_args
from megatron.training.step import StepResult


class _RecordedSaves:
    """The engine's background saves, recording what the loop asks of them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def poll(self) -> None:
        self.calls.append("poll")

    def finish(self) -> None:
        self.calls.append("finish")


def _loop(extra: str) -> tuple[TrainingLoop, _RecordedSaves]:
    argv = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 2 --train-iters 10 --lr 1e-3 "
        "--log-interval 1000 --eval-interval 0 " + extra
    ).split()
    args = with_settled(validate_args(build_parser().parse_args(argv), 1), padded_vocab_size=128)
    scheduler = scheduler_from_args(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), args)
    saves = _RecordedSaves()
    engine = SimpleNamespace(scheduler=scheduler, background_saves=saves)
    return TrainingLoop(args, engine, Timers(0), None), saves


def test_a_run_stopped_by_bad_iterations_commits_its_background_save_first(monkeypatch):
    loop, saves = _loop("--max-consecutive-skipped-iterations 3")

    def bad_step(data_iterator, global_batch_size=None):  # noqa: ANN001, ANN202
        saves.calls.append("step")
        return StepResult({"lm loss": float("nan")}, True, True, None, None)

    monkeypatch.setattr(loop, "step", bad_step)
    state = TrainState()
    with pytest.raises(TrainingStopped, match="--max-consecutive-skipped-iterations"):
        loop.train(iter(()), None, state)
    assert state.iteration == 3
    assert saves.calls == ["step", "step", "step", "finish"]


def test_a_run_that_ends_normally_commits_its_background_save_at_the_end(monkeypatch):
    loop, saves = _loop("--train-iters 2")

    def good_step(data_iterator, global_batch_size=None):  # noqa: ANN001, ANN202
        saves.calls.append("step")
        return StepResult({"lm loss": 1.0}, False, False, None, None)

    monkeypatch.setattr(loop, "step", good_step)
    loop.train(iter(()), None, TrainState())
    assert saves.calls == ["step", "step", "finish"]
