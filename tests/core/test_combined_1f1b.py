"""Megatron-LM's combined 1F1B turn-taking (`megatron.core.pipeline_parallel.combined_1f1b`):
which pass computes when, in one process with stand-in collectives.

A forward and a backward each log what they compute and "launch" collectives (objects that
log their wait); the order of the log is what the schedule promises: each pass hands the turn
over right after a launch and waits for its collective only once the other pass launched its
next one, the backward's deferred weight gradients run behind its next collective, and a pass
that fails ends the other's turns instead of leaving it waiting.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron.core.pipeline_parallel.combined_1f1b import (
    Combined1F1B,
    with_deferred_weight_grads,
)


class Collective:
    """A launched collective that logs when it is waited for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def backward_pass(overlap: Combined1F1B, log: list[str], steps: int):
    """compute b0, launch cb0, compute b1, launch cb1, ..., compute b{steps}."""

    def run() -> None:
        for step in range(steps):
            log.append(f"b{step}")
            overlap.hide([Collective(log, f"cb{step}")], backward=True)
        log.append(f"b{steps}")

    return run


def forward_pass(overlap: Combined1F1B, log: list[str], steps: int) -> None:
    for step in range(steps):
        log.append(f"f{step}")
        overlap.hide([Collective(log, f"cf{step}")], backward=False)
    log.append(f"f{steps}")


def test_each_collective_travels_while_the_other_pass_computes() -> None:
    overlap, log = Combined1F1B(), []
    forward_pass(overlap, log, 2)  # the first micro-batch: nobody to hand turns to
    overlap.start_backward(backward_pass(overlap, log, 2))
    forward_pass(overlap, log, 2)
    overlap.finish_backward()
    assert log == [
        *["f0", "wait cf0", "f1", "wait cf1", "f2"],
        # backward of micro-batch 1 beside the forward of micro-batch 2
        "b0",  # then cb0 launched: the forward computes f0 while it travels
        "f0",  # cf0 launched: the backward waits for cb0, computes b1, launches cb1
        *["wait cb0", "b1"],
        *["wait cf0", "f1"],
        *["wait cb1", "b2"],  # the backward's end hands the turn back for good
        *["wait cf1", "f2"],
    ]
    assert overlap.timing.collectives == 4 + 2


def test_a_backward_longer_than_the_forward_finishes_alone() -> None:
    overlap, log = Combined1F1B(), []
    overlap.start_backward(backward_pass(overlap, log, 3))
    forward_pass(overlap, log, 1)
    log.append("forward done")
    overlap.finish_backward()
    assert log == [
        *["b0", "f0", "wait cb0", "b1", "wait cf0", "f1", "forward done"],
        *["wait cb1", "b2", "wait cb2", "b3"],
    ]


def test_deferred_weight_grads_run_behind_the_next_backward_collective() -> None:
    overlap, log = Combined1F1B(delay_weight_grads=True), []

    def backward() -> None:
        log.append("dgrad")
        overlap.defer(lambda: log.append("wgrad"))
        overlap.hide([Collective(log, "dispatch^T")], backward=True)
        overlap.defer(lambda: log.append("last wgrad"))

    overlap.start_backward(backward)
    forward_pass(overlap, log, 0)
    overlap.finish_backward()
    assert log == ["dgrad", "wgrad", "f0", "wait dispatch^T", "last wgrad"]


def test_a_failing_backward_raises_on_the_training_thread() -> None:
    overlap, log = Combined1F1B(), []

    def backward() -> None:
        overlap.hide([Collective(log, "cb0")], backward=True)
        raise ValueError("the backward failed")

    overlap.start_backward(backward)
    forward_pass(overlap, log, 2)  # its turns end with the backward
    with pytest.raises(ValueError, match="the backward failed"):
        overlap.finish_backward()
    overlap.start_backward(lambda: log.append("next"))  # usable again
    overlap.finish_backward()
    assert log[-1] == "next"


def test_an_abandoned_backward_is_not_waited_for() -> None:
    overlap, log, released = Combined1F1B(), [], threading.Event()

    def backward() -> None:
        overlap.hide([Collective(log, "cb0")], backward=True)
        released.set()  # runs on once the training thread gave up

    overlap.start_backward(backward)
    (thread,) = [t for t in threading.enumerate() if t.name == "combined-1f1b-backward"]
    overlap.abandon_backward()  # the forward failed while this backward waited for its turn
    assert released.wait(timeout=60)
    thread.join(timeout=60)
    assert not thread.is_alive() and log == ["wait cb0"]


def test_deferred_weight_grads_equal_autograd_bit_for_bit() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    rows = torch.randn(5, 8)
    plain_input = rows.clone().requires_grad_()
    (layer(plain_input) ** 2).sum().backward()
    expected = [param.grad.clone() for param in layer.parameters()] + [plain_input.grad]
    layer.zero_grad(set_to_none=True)

    overlap = Combined1F1B(delay_weight_grads=True)
    delayed_input = rows.clone().requires_grad_()
    output = with_deferred_weight_grads(overlap, layer, list(layer.parameters()), delayed_input)
    (output**2).sum().backward()
    assert all(param.grad is None for param in layer.parameters())  # deferred
    assert torch.equal(delayed_input.grad, expected[-1])
    overlap.run_deferred_weight_grads()
    for param, grad in zip(layer.parameters(), expected, strict=False):
        assert torch.equal(param.grad, grad)
