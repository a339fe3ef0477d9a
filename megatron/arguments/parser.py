"""Megatron's command-line flags, DeepSpeed's config flags, and the checks between them.

`parse_args()` builds the parser from flag groups with Megatron-LM / Megatron-DeepSpeed names
and defaults, adds `deepspeed.add_config_arguments` (`--deepspeed`, `--deepspeed_config`),
and returns the namespace after `validate_args`, which also reconciles the DeepSpeed config
with the flags the user typed (`megatron.arguments.ds_config`). Library code never reads
this namespace: it is turned into typed configs (`megatron.config`) at the edge. The flag
groups live in `model_flags.py` and `run_flags.py`; every flag needs a `help=`:
docs/arguments.md is generated from this parser by tools/write_arguments_doc.py.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Sequence

from megatron.arguments import (
    checkpoint_args,
    checkpoint_format_flags,
    compat_flags,
    fp8_flags,
    gpt_oss_flags,
    housekeeping_flags,
    mla_flags,
    model_flags,
    moe_flags,
    moe_overlap_flags,
    mtp_flags,
    muon_flags,
    parallel_flags,
    routed_moe_flags,
    run_flags,
    sharding_flags,
    v1_flags,
)
from megatron.arguments.errors import ArgumentError
from megatron.arguments.precision import check_precision_on_this_machine
from megatron.arguments.validation import validate_args
from megatron.settled_args import with_settled

__all__ = ["ArgumentError", "build_parser", "parse_args", "typed_flags", "validate_args"]


FLAG_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    model_flags.add_model_size_flags,
    mla_flags.add_mla_flags,
    gpt_oss_flags.add_gpt_oss_flags,
    mtp_flags.add_mtp_flags,
    model_flags.add_regularization_flags,
    muon_flags.add_muon_flags,
    run_flags.add_training_flags,
    run_flags.add_learning_rate_flags,
    model_flags.add_mixed_precision_flags,
    fp8_flags.add_fp8_flags,
    model_flags.add_data_flags,
    run_flags.add_checkpointing_flags,
    checkpoint_args.add_checkpoint_args_flags,
    checkpoint_format_flags.add_checkpoint_format_flags,
    run_flags.add_logging_flags,
    run_flags.add_dry_run_flags,
    parallel_flags.add_distributed_flags,
    parallel_flags.add_deepspeed_flags,
    sharding_flags.add_sharding_flags,
    moe_flags.add_moe_flags,
    routed_moe_flags.add_routed_moe_flags,
    moe_overlap_flags.add_moe_overlap_flags,
    housekeeping_flags.add_housekeeping_flags,
    v1_flags.add_v1_flags,
    compat_flags.add_compat_flags,
)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `prog: error: ...`, without the usage wall.

    The usage of ~350 flags buries the one line that matters (`unrecognized arguments: ...`,
    `invalid choice: ...`); `--help` still prints it.
    """

    def error(self, message: str) -> None:  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.ArgumentParser:
    """The full parser: Megatron's groups, the caller's extras, then DeepSpeed's flags."""
    parser = OneLineErrorParser(
        description="Megatron-style GPT pretraining with DeepSpeed", allow_abbrev=False
    )
    for add_group in FLAG_GROUPS:
        add_group(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    import deepspeed

    return deepspeed.add_config_arguments(parser)


def typed_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """Dest names of the flags present in `argv` (so a default never contradicts the config)."""
    # Re-parse with every default suppressed: only the flags the user typed reach the namespace.
    bare = copy.deepcopy(parser)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    bare._defaults.clear()  # set_defaults() values too: they are not typed either
    return set(vars(bare.parse_args(argv)))


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], object] | None = None,
    world_size: int | None = None,
    defaults: dict | None = None,
) -> argparse.Namespace:
    """Parse and validate; bad combinations exit with `error: ...` naming the flags.

    `defaults` (Megatron's `args_defaults`) replace flag defaults; they do not count as typed.
    With `--use-checkpoint-args` the checkpoint in `--load` supplies the model's flags first
    (`megatron.arguments.checkpoint_args`).
    """
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if getattr(args, "dry_run", False) and args.dry_run_world_size is not None:
        if args.dry_run_world_size < 1:
            parser.exit(
                2,
                f"error: --dry-run-world-size must be at least 1, not {args.dry_run_world_size}\n",
            )
        world_size = args.dry_run_world_size  # a plan for that many ranks, from one process
    try:
        typed = typed_flags(parser, argv)
        notes = []
        if args.use_checkpoint_args:  # the model's flags from --load, before validation
            notes = checkpoint_args.load_args_from_checkpoint(args, parser, typed)
        args = validate_args(args, world_size, typed)
        # Printed at start-up with the other notes.
        args = with_settled(args, compat_notes=notes + args.compat_notes)
        if not args.dry_run:  # a dry run plans for the job's devices, not this machine's
            check_precision_on_this_machine(args)  # the devices, apart from the flags' logic
        return args
    except ArgumentError as error:
        parser.exit(2, f"error: {error}\n")
