"""Gated activations with Megatron-LM's clamp and linear offset: gpt-oss's clamped quick-GeGLU.

`act(clamp(gate, max=v)) * (clamp(up, -v, v) + offset)` over [gate | up] halves of the last
dimension, act(x) = x sigmoid(alpha x): quick-GELU (alpha 1.702, `--quick-geglu`) or SiLU
(alpha 1, `--swiglu` with `--activation-func-clamp-value` or `--glu-linear-offset`). One autograd
function that keeps only its input and computes the gradient from it (megatron-core's
`quick_geglu_back`), so the activation costs the memory of its input alone. Plain SwiGLU keeps
`fused_ops.bias_swiglu`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron.config import ModelConfig

QUICK_GELU_ALPHA = 1.702
"""quick-GELU's sigmoid slope (megatron-core's `quick_gelu`, Hugging Face's `swiglu_alpha`)."""


def _halves(x: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, ...]:
    """gate and up halves, clamped (with `limit`), and where each clamp passes the gradient."""
    gate, up = x.chunk(2, dim=-1)
    if limit is None:
        return gate, up, None, None
    gate_passes, up_passes = gate <= limit, (up >= -limit) & (up <= limit)
    return gate.clamp(max=limit), up.clamp(-limit, limit), gate_passes, up_passes


class _GatedActivation(torch.autograd.Function):
    """act(gate) * (up + offset) on clamped halves; saves only the input."""

    @staticmethod
    def forward(ctx, x, alpha, offset, limit):  # noqa: ANN001, ANN205 - autograd's signature
        ctx.save_for_backward(x)
        ctx.constants = alpha, offset, limit
        gate, up, _, _ = _halves(x, limit)
        return gate * torch.sigmoid(alpha * gate) * (up + offset)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        alpha, offset, limit = ctx.constants
        gate, up, gate_passes, up_passes = _halves(x, limit)
        sigmoid = torch.sigmoid(alpha * gate)
        d_gate = grad * sigmoid * (1 + alpha * gate * (1 - sigmoid)) * (up + offset)
        d_up = grad * gate * sigmoid
        if limit is not None:
            d_gate, d_up = d_gate * gate_passes, d_up * up_passes
        return torch.cat((d_gate, d_up), dim=-1), None, None, None


def gated_activation(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    alpha: float,
    offset: float = 0.0,
    limit: float | None = None,
) -> torch.Tensor:
    """[..., 2f] (+ bias) -> [..., f]: act(gate) * (up + offset), halves clamped by `limit`."""
    if bias is not None:
        x = x + bias
    return _GatedActivation.apply(x, alpha, offset, limit)


def activation_of(config: ModelConfig) -> Callable | None:
    """The clamped or offset gated activation (`gated_activation` of x and a bias), or None for
    GeLU and plain SwiGLU (`fused_ops`)."""
    if not config.glu_keeps_input_only:
        return None
    alpha = QUICK_GELU_ALPHA if config.activation == "quick_geglu" else 1.0
    offset, limit = config.glu_linear_offset, config.activation_clamp_value
    return functools.partial(gated_activation, alpha=alpha, offset=offset, limit=limit)
