"""Megatron-LM's two loss normalisations, and its three-value `loss_func` contract.

A `loss_func(output_tensor)` returns either Megatron's `(loss, reported)`, the micro-batch's
mean loss, or Megatron-LM's `(loss_sum, num_tokens, reported)`: the sum over the micro-batch's
unmasked tokens and their count (its reported values are `[sum, count]` pairs, which the log
line divides after summing them over micro-batches and data-parallel ranks).

By default each micro-batch's mean loss weighs the same: the step backpropagates
`loss / micro-batches` and data parallelism averages the gradients. With
`--calculate-per-token-loss` every unmasked token of the global batch weighs the same: the
step backpropagates the sums, counts the tokens, and once the gradients are reduced divides
them by the global count (`gradient_multiplier`), as megatron-core's
`finalize_model_grads(num_tokens=...)` does. The MoE layers' auxiliary losses keep the weight
they have by default (Megatron-LM multiplies them by the micro-batch's tokens, which the
division by the global count cancels): `aux_loss_factor`.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.utils import current_device


class LossContractError(ValueError):
    """A loss function's return value does not fit the loss normalisation asked for."""


def split_loss_outputs(
    outputs: tuple, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """`loss_func`'s return value -> (loss to backpropagate, token count or None, reported).

    Without `per_token` the loss is the micro-batch's mean (a three-value return is divided
    by its count, as Megatron-LM's schedule does); with it, the sum over the tokens.
    """
    if len(outputs) == 3:
        loss, num_tokens, reported = outputs
        if not per_token:
            loss = loss / torch.clamp(num_tokens, min=1)
        return loss, num_tokens, reported
    if len(outputs) != 2:
        raise LossContractError(
            f"loss_func returned {len(outputs)} values: expected (loss, reported) or "
            "(loss_sum, num_tokens, reported)"
        )
    if per_token:
        raise LossContractError(
            "--calculate-per-token-loss needs a loss_func that returns (loss_sum, num_tokens, "
            "reported), as Megatron-LM's pretrain_gpt.py does; this one returned (loss, reported)"
        )
    loss, reported = outputs
    return loss, None, reported


def aux_loss_factor(args: argparse.Namespace) -> float:
    """What the MoE auxiliary losses' backward scale is multiplied by under per-token loss:
    the tokens of one micro-batch (Megatron-LM's router multiplies its loss by its local
    tokens times the tensor x context ranks splitting them: the same number)."""
    return float(args.micro_batch_size * args.seq_length)


class TokenCount:
    """The unmasked tokens of one step's micro-batches on this rank (per-token loss only)."""

    def __init__(self) -> None:
        self.local = 0

    def add(self, num_tokens: torch.Tensor | None) -> None:
        """One micro-batch's count (None: a mean loss, nothing to count)."""
        if num_tokens is not None:
            self.local += int(num_tokens)

    def global_count(self) -> int:
        """The step's tokens summed over the data-parallel ranks (a collective of the
        data-parallel group; context-parallel ranks see the same whole sequences)."""
        total = torch.tensor(self.local, dtype=torch.int64, device=current_device())
        if dist.is_initialized() and parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return int(total)


def gradient_multiplier(global_count: int, mean_over: int, micro_batches_divided: int = 1) -> float:
    """The factor that turns the reduced gradients into those of the loss summed over tokens
    and divided by `global_count`, the step's tokens.

    `mean_over`: the data-parallel ranks the gradient reduction averaged over;
    `micro_batches_divided`: what the schedule already divided the gradients by (torch's
    pipelining divides them by the micro-batches).
    """
    return mean_over * micro_batches_divided / max(global_count, 1)
