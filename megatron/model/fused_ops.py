"""The transformer layer's elementwise work as fusible functions, and `torch.compile` plumbing.

Megatron fuses two elementwise chains per residual branch with TorchScript:
`bias_gelu` (the MLP's bias add and GeLU; `bias_swiglu` with `--swiglu`) and
`bias_dropout_add` (the branch's bias add, dropout and residual add). Here they are plain
torch functions. Under `--torch-compile` they sit inside the compiled graph (the whole model
at TP=1, each layer otherwise) and inductor turns each into one kernel; in an eager run on a
GPU, `--bias-gelu-fusion` / `--bias-dropout-fusion` (both on by default, as in Megatron)
compile just these functions, as Megatron Core's `jit_fuser` does. On the CPU eager runs them
unfused: a compiled kernel there has not been measured to pay for its compile time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """GeLU(x + bias): the MLP's activation (`approximate`: "tanh", Megatron's, or "none")."""
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate=approximate)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of x + bias, whose last dimension is [gate | up] (`--swiglu`)."""
    if bias is not None:
        x = x + bias
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """residual + dropout(x + bias): the end of each residual branch."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


@functools.cache
def fused(function: Callable) -> Callable:
    """`function` compiled into one kernel (compiled once, with dynamic shapes)."""
    return torch.compile(function, dynamic=True)


def fuse_eagerly(tensor: torch.Tensor, enabled: bool) -> bool:
    """Whether an eager run should call the compiled form of a fusible function on `tensor`.

    Only on a GPU, only when its fusion flag is on, and never inside a region that is itself
    being compiled (there inductor fuses the plain function with its neighbours).
    """
    return enabled and tensor.is_cuda and not torch.compiler.is_compiling()
