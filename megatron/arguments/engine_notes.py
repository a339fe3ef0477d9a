"""Start-up notes for flags a run's engine accepts and then does not act on.

Refusals live in `megatron.compatibility.FEATURES`; these flags are not refused, because
scripts written for Megatron-LM or Megatron-DeepSpeed pass them where they change nothing
there either, but the start-up says so, naming the flag and why.
"""

from __future__ import annotations

import argparse

from megatron.layout import Engine


def note_what_the_engine_ignores(args: argparse.Namespace) -> None:
    """After the layout: a note in `args.compat_notes` for each flag without effect on it."""
    layout = args.layout
    if args.no_save_optim and layout.engine.uses_deepspeed and args.ckpt_format == "torch":
        args.compat_notes.append(
            " > --no-save-optim: no effect on DeepSpeed's checkpoint files (its engine writes "
            "the optimizer state with the weights, as in Megatron-DeepSpeed); --ckpt-format "
            "torch_dist saves the weights alone"
        )
    unsharded_schedules = layout.engine is Engine.MEGATRON_SCHEDULES and layout.sharding == "none"
    if getattr(args, "overlap_grad_reduce", False) and unsharded_schedules:
        args.compat_notes.append(
            " > --overlap-grad-reduce: no effect with Megatron's pipeline schedules without "
            "sharding (the gradients are averaged once, after the schedule); with "
            "--use-torch-fsdp2 each stage's reduce-scatter overlaps the backward"
        )
