"""Typed configuration objects, built once from the parsed arguments and passed down.

Library code (core, model, data) takes these instead of reading a global `args`.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass


@dataclass
class DataConfig:
    """Where the training data is and how GPT samples are cut from it."""

    data_path: list[str]
    """A dataset prefix, or weight/prefix pairs to blend (`--data-path 0.3 a 0.7 b`)."""
    seq_length: int
    """Tokens per sample (each sample reads seq_length + 1 tokens for the shifted labels)."""
    seed: int = 1234
    """Seed of the document and sample shuffles (`--seed`)."""
    split: str = "969, 30, 1"
    """Train/valid/test weights over the documents of each dataset (`--split`)."""
    data_cache_path: str | None = None
    """Folder for the cached index arrays; default: beside each dataset (`--data-cache-path`)."""
    data_impl: str = "mmap"
    """Indexed dataset implementation; only Megatron's default `mmap` exists (`--data-impl`)."""
    mmap_warmup: bool = False
    """Read every page of the .bin once when opening it (`--mmap-warmup`)."""
    num_workers: int = 2
    """DataLoader worker processes (`--num-workers`)."""
    dataloader_type: str = "single"
    """`single` (sequential, Megatron's default) or `cyclic` (reshuffled every epoch)."""

    @classmethod
    def from_args(cls, args: Namespace) -> DataConfig:
        """Build from Megatron-style parsed arguments."""
        return cls(
            data_path=list(args.data_path),
            seq_length=args.seq_length,
            seed=args.seed,
            split=args.split,
            data_cache_path=getattr(args, "data_cache_path", None),
            data_impl=getattr(args, "data_impl", "mmap"),
            mmap_warmup=getattr(args, "mmap_warmup", False),
            num_workers=getattr(args, "num_workers", 2),
            dataloader_type=getattr(args, "dataloader_type", "single") or "single",
        )
