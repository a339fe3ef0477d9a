"""`ArgumentError`: the one exception for bad flags, shared by the validation and the ds_config."""

from __future__ import annotations

import argparse


class ArgumentError(ValueError):
    """Flags that contradict each other or the world size (message names them)."""


def flag_name(args: argparse.Namespace, dest: str) -> str:
    """The flag messages name for setting `dest`: the user's spelling (a Megatron-LM v1 flag,
    recorded in `args.flag_spellings`) or Megatron's (`micro_batch_size` -> --micro-batch-size)."""
    spellings = getattr(args, "flag_spellings", None) or {}
    return spellings.get(dest, "--" + dest.replace("_", "-"))
