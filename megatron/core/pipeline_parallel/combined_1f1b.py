"""Megatron-LM's combined 1F1B (`--overlap-moe-expert-parallel-comm`): the expert-parallel
collectives of one micro-batch travel while another micro-batch computes.

Megatron core splits each transformer layer into nodes (attention, dispatch, experts, combine)
and runs micro-batch i+1's forward nodes beside micro-batch i's backward nodes on two CUDA
streams. Here the two passes keep their own code: the backward of micro-batch i is the plain
`loss.backward()` of autograd, run on a helper thread, while the forward of micro-batch i+1 runs
on the training thread. `Combined1F1B` lets exactly one of them compute at a time and hands the
turn over at the expert-parallel collectives: whoever launches one (asynchronously: gloo's
worker threads on CPUs, NCCL's stream on GPUs) passes the turn to the other pass and waits for
its collective only once the other launches its next one (or ends). So, layer after layer,

    backward: ... | combine^T in flight | experts^T   | dispatch^T in flight | attention^T ...
    forward:  ... | attention + router | dispatch in flight | experts | combine in flight ...

every dispatch and combine of one pass, forward or backward, overlaps the next compute of the
other, Megatron-LM's pairing. Only the order of work changes, never an operation: each pass is
the same graph run by the same autograd engine, the turns fall at the same points on every
rank (the collectives of every group are issued in one order), so the losses and gradients
are bit for bit those of the flags off.

With `--delay-wgrad-compute` (`delay_weight_grads`) the routed experts compute their input
gradient first; their weight gradient (torch.distributed.pipelining's zero-bubble split,
`stage_backward_input` / `stage_backward_weight`) waits for the backward's next collective and
runs while it travels, so the dispatch's transpose leaves earlier (Megatron-LM's
`backward_dw`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

FORWARD, BACKWARD = "forward", "backward"

# How often a pass waiting for its turn checks that the other is still alive (seconds).
_POLL_S = 1.0


@dataclass
class ExposedTime:
    """What the expert collectives cost the passes (`Combined1F1B.timing`): `blocked`, the
    seconds spent waiting for them once the turn came back (the part nothing hid; a pass
    without a partner waits for the whole collective), over `collectives` of them. Against
    the same run's blocking collectives without the overlap it gives the share hidden
    (benchmarks/moe_combined_1f1b.py)."""

    blocked: float = 0.0
    collectives: int = 0


class Combined1F1B:
    """Runs each micro-batch's backward beside the next micro-batch's forward, one computing at
    a time, handing the turn over at the expert-parallel collectives (the module docstring).

    The step calls `start_backward(backward)` after a micro-batch's forward and
    `finish_backward()` after the next one's (and after the last); the MoE layers call
    `hide(works, ...)` right after launching a collective. A pass without a partner (the first
    forward, the last backward, evaluation) just waits for its collectives.
    """

    def __init__(self, delay_weight_grads: bool = False) -> None:
        self.delay_weight_grads = delay_weight_grads
        self.timing = ExposedTime()
        self._turns = threading.Condition()
        self._turn = FORWARD
        self._thread: threading.Thread | None = None
        self._backward_running = False
        self._forward_open = False  # the training thread may still hand the backward turns
        self._error: BaseException | None = None
        self._deferred: list[Callable[[], object]] = []

    def start_backward(self, backward: Callable[[], object]) -> None:
        """Run `backward()` (one micro-batch's) on the helper thread; returns once it hands the
        turn back at its first collective, or ends."""
        if self._thread is not None:
            raise RuntimeError("Combined1F1B: a backward is running; finish_backward() first")
        self._error, self._forward_open, self._turn = None, True, BACKWARD
        self._backward_running = True
        self._thread = threading.Thread(
            target=self._run_backward, args=(backward,), name="combined-1f1b-backward", daemon=True
        )
        self._thread.start()
        self._wait_for_turn(FORWARD)

    def finish_backward(self) -> None:
        """Let the running backward (if any) go on alone to its end; raise what it raised."""
        thread = self._thread
        if thread is None:
            return
        with self._turns:
            self._forward_open, self._turn = False, BACKWARD
            self._turns.notify_all()
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def abandon_backward(self) -> None:
        """After the training thread failed: let the backward go on without waiting for it
        (its collectives may never complete), so nothing waits for a turn that never comes."""
        with self._turns:
            self._forward_open, self._turn = False, BACKWARD
            self._turns.notify_all()
        self._thread = None

    def hide(self, works: Iterable, backward: bool) -> None:
        """Called right after launching the collectives `works` (`async_op` handles): the other
        pass computes until its next collective, then `works` are waited for."""
        if backward:
            self.run_deferred_weight_grads()  # they travel behind the weight gradients too
        me = BACKWARD if backward else FORWARD
        if self._has_partner(me):
            with self._turns:
                self._turn = FORWARD if backward else BACKWARD
                self._turns.notify_all()
            self._wait_for_turn(me)
        waiting = time.perf_counter()
        for work in works:
            work.wait()
        self.timing.blocked += time.perf_counter() - waiting
        self.timing.collectives += 1

    def defer(self, weight_grads: Callable[[], object]) -> None:
        """Run `weight_grads()` at the backward's next collective (or at its end)."""
        self._deferred.append(weight_grads)

    def run_deferred_weight_grads(self) -> None:
        """The deferred weight gradients, in the order they were deferred."""
        deferred, self._deferred = self._deferred, []
        for weight_grads in deferred:
            weight_grads()

    def _has_partner(self, me: str) -> bool:
        with self._turns:
            return self._backward_running if me == FORWARD else self._forward_open

    def _run_backward(self, backward: Callable[[], object]) -> None:
        try:
            backward()
            self.run_deferred_weight_grads()
        except BaseException as error:  # re-raised by finish_backward on the training thread
            self._error = error
            self._deferred = []
        finally:
            with self._turns:
                self._backward_running, self._turn = False, FORWARD
                self._turns.notify_all()

    def _wait_for_turn(self, me: str) -> None:
        with self._turns:
            while self._turn != me:
                # The timeout only re-checks; a thread that died mid-turn is not waited for.
                self._turns.wait(_POLL_S)
                thread = self._thread
                if me == FORWARD and (thread is None or not thread.is_alive()):
                    self._turn = FORWARD


class _DeferredWeightGradient(torch.autograd.Function):
    """`function(*inputs)`, whose backward computes the inputs' gradients and defers the
    weight gradients of `params` to `overlap` (torch's zero-bubble split)."""

    @staticmethod
    def forward(ctx, overlap, function, params, *inputs):  # noqa: ANN001, ANN205
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad():
            outputs = function(*leaves)
        single = isinstance(outputs, torch.Tensor)
        outputs = (outputs,) if single else tuple(outputs)
        ctx.overlap, ctx.params, ctx.graph = overlap, params, (leaves, outputs)
        return outputs[0].detach() if single else tuple(out.detach() for out in outputs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )

        leaves, outputs = ctx.graph
        ctx.graph = None
        params = ctx.params
        # Autograd runs a backward without grad mode; torch's split reads the graph's nodes.
        with torch.enable_grad():
            input_grads, groups = stage_backward_input(list(outputs), list(grads), leaves, params)

        def weight_grads() -> None:
            with torch.enable_grad():
                stage_backward_weight(params, groups)

        ctx.overlap.defer(weight_grads)
        return (None, None, None, *input_grads)


def with_deferred_weight_grads(
    overlap: Combined1F1B,
    function: Callable[..., torch.Tensor],
    params: Sequence[torch.nn.Parameter],
    *inputs: torch.Tensor,
) -> torch.Tensor:
    """`function(*inputs)` whose weight gradients (of `params`) the backward defers to
    `overlap`'s next collective (`--delay-wgrad-compute`)."""
    params = [param for param in params if param.requires_grad]
    return _DeferredWeightGradient.apply(overlap, function, params, *inputs)
