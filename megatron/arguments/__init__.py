"""The command line: Megatron's flag groups, DeepSpeed's config flags, and the checks between them.

- `parser.py`: `build_parser()` / `parse_args()`; the flag groups are in `model_flags.py`
  (model size, regularization, precision, data) and `run_flags.py` (training, learning
  rate, checkpoints, logging, distributed, DeepSpeed).
- `validation.py`: `validate_args()`, which derives what Megatron derives and turns every
  contradiction into an `ArgumentError` (`errors.py`) naming the flags.
- `ds_config.py`: the DeepSpeed JSON config reconciled with the flags typed.
- `checkpoint_args.py`: `--use-checkpoint-args`, the model's flags from the checkpoint in
  `--load`, set before validation.
- `precision.py`: what --fp16/--bf16 mean on each path, the device checks, the start-up line.

Megatron's import path is kept: `from megatron.arguments import parse_args`.
"""

from megatron.arguments.errors import ArgumentError
from megatron.arguments.parser import build_parser, parse_args, typed_flags
from megatron.arguments.validation import validate_args

__all__ = ["ArgumentError", "build_parser", "parse_args", "typed_flags", "validate_args"]
