"""The validated command line, read-only: `validate_args` returns a `SettledArgs`.

Once validation has settled the flags (and the layout, `args.layout`), nothing may change
them: a late assignment made the right value depend on call order (a gradient scale reset by
one settle function and overridden by another). Assigning or deleting an attribute raises
`SettledArgsError`, naming it. What is learnt after validation joins in one named step that
makes a new namespace, `with_settled(args, name=value)` (the tokenizer's vocabulary sizes), so
every holder of the old one still reads what it read before.

A `SettledArgs` is an `argparse.Namespace` for every reader (`vars`, `getattr`, pickling);
checkpoints save a plain copy of its values (`checkpointing.file_format.plain_args`).
"""

from __future__ import annotations

import argparse


class SettledArgsError(AttributeError):
    """An attribute of the validated arguments was assigned or deleted."""


class SettledArgs(argparse.Namespace):
    """An argparse namespace that refuses every change once built (see the module docstring)."""

    def __setattr__(self, name: str, value: object) -> None:
        raise SettledArgsError(
            f"args.{name} cannot be set after validate_args: the validated flags are settled "
            "(what is derived from them belongs in megatron.arguments.validation, the layout "
            "or a typed config; what is learnt later, in with_settled)"
        )

    def __delattr__(self, name: str) -> None:
        raise SettledArgsError(f"args.{name} cannot be deleted after validate_args")


def settle(args: argparse.Namespace) -> SettledArgs:
    """A read-only copy of `args` (a `SettledArgs` is returned as it is)."""
    if isinstance(args, SettledArgs):
        return args
    settled = SettledArgs.__new__(SettledArgs)
    settled.__dict__.update(vars(args))
    return settled


def with_settled(args: argparse.Namespace, **values: object) -> SettledArgs:
    """A new read-only namespace: `args` with `values` added or replaced (`args` unchanged)."""
    settled = SettledArgs.__new__(SettledArgs)
    settled.__dict__.update({**vars(args), **values})
    return settled
