"""Megatron-LM's checkpoint-format flags: `--ckpt-format torch|torch_dist` and its companions.

`torch` (the default here, as in Megatron-DeepSpeed) is Megatron's per-rank files;
`torch_dist` (Megatron-LM's default) and its alias `torch_dcp` write one torch.distributed.
checkpoint directory that loads at any parallel layout (`megatron.checkpointing.
dist_checkpoint`). Loading always detects the format it finds, so `--auto-detect-ckpt-format`
is what happens anyway. Megatron-LM's tuning flags for its own writer (fully parallel save and
load, constant structure) are accepted without effect: DCP writes each replicated tensor once,
spread over the ranks holding it, and each rank reads only its slices.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError

FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
STRICTNESS = (
    "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
    "return_unexpected", "return_all", "ignore_all",
)  # fmt: skip


def add_checkpoint_format_flags(parser: argparse.ArgumentParser) -> None:
    """`--ckpt-format` and Megatron-LM's distributed-checkpoint flags."""
    group = parser.add_argument_group("checkpoint format")
    group.add_argument(
        "--ckpt-format",
        choices=FORMATS,
        default=None,
        help="torch: Megatron's per-rank files (the default here); torch_dist (or torch_dcp): "
        "one torch.distributed.checkpoint directory, each tensor saved once with its global "
        "shape, loadable at any TP, PP, virtual-stage, DP, CP and FSDP2 layout with the "
        "optimizer state; fsdp_dtensor is refused. Not with --deepspeed (DeepSpeed's engine "
        "writes its own).",
    )
    group.add_argument(
        "--use-dist-ckpt",
        action="store_true",
        help="Megatron-LM's older spelling of --ckpt-format torch_dist (its default now).",
    )
    group.add_argument(
        "--dist-ckpt-format",
        default=None,
        help="Megatron-LM's deprecated backend choice: torch_dist is accepted (the only one "
        "built), zarr refused.",
    )
    group.add_argument(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="Loading detects the checkpoint's format (torch or torch_dist) here in any case.",
    )
    group.add_argument(
        "--dist-ckpt-strictness",
        choices=STRICTNESS,
        default="assume_ok_unexpected",
        help="Megatron-LM's handling of keys the model and checkpoint do not share: here a "
        "tensor the model needs and the checkpoint lacks ends the run in one line naming it, "
        "and extra tensors in the checkpoint are ignored (assume_ok_unexpected, the default); "
        "the other choices are refused.",
    )
    group.add_argument(
        "--async-save",
        action="store_true",
        help="Write torch_dist checkpoints in the background: each rank stages a CPU copy and "
        "training goes on; the checkpoint is committed (trackers) once every rank's write "
        "is done, polled each iteration; at most one in flight. Needs --ckpt-format "
        "torch_dist, as in Megatron-LM.",
    )
    for flag in (
        "--ckpt-fully-parallel-save",
        "--no-ckpt-fully-parallel-save",
        "--ckpt-fully-parallel-load",
        "--ckpt-assume-constant-structure",
    ):
        group.add_argument(
            flag,
            action="store_true",
            help="Accepted without effect: torch.distributed.checkpoint writes each "
            "replicated tensor once, spread over its holders, and each rank reads its slices.",
        )


def settle_checkpoint_format(args: argparse.Namespace) -> None:
    """`args.ckpt_format`: "torch" or "torch_dist"; refusals in one line each."""
    chosen = args.ckpt_format
    if chosen is None:
        chosen = "torch_dist" if args.use_dist_ckpt else "torch"
    if chosen == "fsdp_dtensor":
        raise ArgumentError(
            "--ckpt-format fsdp_dtensor: Megatron-FSDP's own format is not built here; "
            "--ckpt-format torch_dist saves FSDP2 runs at any layout"
        )
    if args.dist_ckpt_format not in (None, "torch_dist"):
        raise ArgumentError(
            f"--dist-ckpt-format {args.dist_ckpt_format}: only torch_dist "
            "(torch.distributed.checkpoint) is built here"
        )
    if args.dist_ckpt_strictness != "assume_ok_unexpected":
        raise ArgumentError(
            f"--dist-ckpt-strictness {args.dist_ckpt_strictness}: only assume_ok_unexpected "
            "is built (missing tensors end the run naming them; extra ones are ignored)"
        )
    args.ckpt_format = "torch" if chosen == "torch" else "torch_dist"
    if args.async_save and args.ckpt_format != "torch_dist":
        raise ArgumentError(
            "--async-save needs --ckpt-format torch_dist (as in Megatron-LM): the per-rank "
            "torch files are written synchronously"
        )
    if args.ckpt_format == "torch_dist" and args.deepspeed:
        raise ArgumentError(
            "--ckpt-format torch_dist with --deepspeed: DeepSpeed's engine writes its own "
            "checkpoints (resharded by its universal checkpoint); drop --ckpt-format, or drop "
            "--deepspeed"
        )


def refuse_dist_checkpoint_experts(args: argparse.Namespace, experts: str | None) -> None:
    """torch_dist with MoE layers (`experts`: their flags, or None) is not built: one line."""
    if experts is not None and args.ckpt_format == "torch_dist":
        raise ArgumentError(
            f"--ckpt-format torch_dist with {experts}: expert layers are not saved in "
            "torch_dist yet; use --ckpt-format torch"
        )
