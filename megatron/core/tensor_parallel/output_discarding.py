"""Recomputation that also frees the checkpointed function's output (megatron-core's
`CheckpointWithoutOutput`, what `--recompute-modules layernorm / moe_act / mla_up_proj` use).

A plain checkpoint frees what a function keeps inside, but its output lives on wherever the
next operation saves it for its own backward (a norm's output is the next matmul's saved
input). Here the output's storage is released once that next operation has run, and refilled
in place, by recomputing the function, when the backward reaches `hook_tensor`, the first
tensor after it whose gradient arrives before the output is needed:

    recompute = OutputDiscardingCheckpoint()
    normed = recompute.checkpoint(norm, hidden)
    out = attention(normed)                      # saves `normed` for its backward
    recompute.discard_output_and_register_recompute(out)

The forward runs without gradients; its inputs are saved; the recomputation replays the
forward's random streams and autocast (`random.replaying`), and the backward through the
function then runs on the recomputed graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron.core.tensor_parallel.random import capture_random_state, replaying


class _Function(torch.autograd.Function):
    """The checkpointed function's node: forward without a graph, backward on the
    recomputation's."""

    @staticmethod
    def forward(ctx, run_function, owner, *inputs):  # noqa: ANN001, ANN205
        """`run_function(*inputs)` without gradients; the inputs are kept for the recompute."""
        with torch.no_grad():
            outputs = run_function(*inputs)
        if not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError("OutputDiscardingCheckpoint takes tensor inputs only")
        ctx.save_for_backward(*inputs)
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        """Backward through the recomputed outputs (made by the hook before this runs)."""
        if ctx.recomputed is None:
            raise RuntimeError(
                "the discarded output was not recomputed: its hook tensor's gradient never came"
            )
        inputs, outputs = ctx.recomputed
        ctx.recomputed = None
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(t.grad for t in inputs))


class OutputDiscardingCheckpoint:
    """One use: `checkpoint`, then `discard_output_and_register_recompute` (module docstring)."""

    def __init__(self) -> None:
        self.ctx = None
        self.run_function: Callable[..., Any] | None = None
        self.random_state = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def checkpoint(self, run_function: Callable[..., Any], *inputs: Any) -> Any:
        """`run_function(*inputs)`, recomputed in the backward (a tensor or tuple of them)."""
        self.run_function = run_function
        self.random_state = capture_random_state()
        outputs = _Function.apply(run_function, self, *inputs)
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        self.ctx.recomputed = None
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage now; recompute it when `hook_tensor`'s gradient comes."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad: torch.Tensor) -> None:
        """Rerun the function on the saved inputs and refill the outputs' storage in place."""
        ctx = self.ctx
        if ctx is None or self.run_function is None:
            return
        needs_grad = ctx.needs_input_grad[2:]  # (the function and this object come first)
        inputs = tuple(
            t.detach().requires_grad_(grad) for t, grad in zip(ctx.saved_tensors, needs_grad)
        )
        with replaying(self.random_state):
            outputs = self.run_function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        with torch.no_grad():
            for kept, again in zip(self.outputs, outputs, strict=True):
                kept.untyped_storage().resize_(again.untyped_storage().size())
                kept.untyped_storage().copy_(again.untyped_storage())
        ctx.recomputed = (inputs, outputs)
        self.ctx = self.run_function = self.random_state = None
        self.outputs = ()
