"""Checkpoint conversion tools: reshard, and to/from Hugging Face GPT-2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from megatron.checkpointing.layouts import CheckpointConversionError

# What a bad input raises in the conversion tools: each becomes a one-line error, not a traceback.
CONVERSION_ERRORS = (CheckpointConversionError, OSError, RuntimeError, ImportError)


def run_conversion(
    convert: Callable[[argparse.Namespace], object], args: argparse.Namespace
) -> int:
    """Run `convert(args)`; 0, or 1 after a one-line `error:` on stderr for a bad input."""
    try:
        convert(args)
    except CONVERSION_ERRORS as error:
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0
