"""Small helpers shared across the package: rank-aware printing, GPT masks."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def is_rank_0() -> bool:
    """True on global rank 0, or when torch.distributed is not initialized."""
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def write_line(message: str) -> None:
    """Print `message` and its newline in one write, so lines of other ranks never split it."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (Megatron's `print_rank_0`), flushed at once."""
    if is_rank_0():
        write_line(message)


def is_last_rank() -> bool:
    """True on the last global rank (it holds the loss under pipeline parallelism)."""
    if not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    """Print on the last global rank only (Megatron's `print_rank_last`), flushed at once."""
    if is_last_rank():
        write_line(message)


def document_ids_from_tokens(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """[b, s] ids -> [b, s] int32 document index: it counts the end-of-document tokens before
    each position, so an end-of-document token belongs to the document it ends."""
    ends = (tokens == eod_token).to(torch.int32)
    return (ends.cumsum(dim=1) - ends).to(torch.int32)


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Megatron's left-to-right masks for a [b, s] batch of token ids.

    Returns `(attention_mask, loss_mask, position_ids)`. `attention_mask` is None for plain
    causal attention (the kernels apply causality themselves), else, with
    `reset_attention_mask`, the document ids [b, s] of the documents packed into each sample
    (`megatron.model.document_mask`: Megatron's bool [b, 1, s, s] mask is
    `DocumentMask(ids).dense(s, s, device)`, which the model never has to build).
    `loss_mask` zeroes the end-of-document tokens with `eod_mask_loss`; `position_ids`
    restart after every end-of-document token with `reset_position_ids`.
    """
    batch, seq = tokens.shape
    loss_mask = torch.ones((batch, seq), dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(seq, dtype=torch.long, device=tokens.device)
    position_ids = position_ids.unsqueeze(0).expand(batch, seq).clone()
    if not (reset_position_ids or reset_attention_mask):
        return None, loss_mask, position_ids
    document_ids = document_ids_from_tokens(tokens, eod_token)
    if reset_position_ids:
        # Each token's distance from its document's first token.
        first = torch.zeros_like(position_ids)
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        first[starts] = position_ids[starts]
        position_ids = position_ids - first.cummax(dim=1).values
    return (document_ids if reset_attention_mask else None), loss_mask, position_ids


def current_device() -> torch.device:
    """This process's GPU when CUDA is available (set by the launcher's local rank), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
