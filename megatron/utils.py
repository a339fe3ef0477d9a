"""Small helpers shared across the package: rank-aware printing."""

from __future__ import annotations

import torch.distributed as dist


def is_rank_0() -> bool:
    """True on global rank 0, or when torch.distributed is not initialized."""
    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (Megatron's `print_rank_0`), flushed at once."""
    if is_rank_0():
        print(message, flush=True)
