"""Megatron-LM's checkpoint-format flags: `--ckpt-format torch|torch_dist` and its companions.

`torch` (the default here, as in Megatron-DeepSpeed) is Megatron's per-rank files (DeepSpeed's
own layout on its engine);
`torch_dist` (Megatron-LM's default) and its alias `torch_dcp` write one torch.distributed.
checkpoint directory that loads at any parallel layout (`megatron.checkpointing.
dist_checkpoint`). Loading always detects the format it finds, so `--auto-detect-ckpt-format`
is what happens anyway. Megatron-LM's tuning flags for its own writer (fully parallel save and
load, constant structure) are accepted without effect: DCP writes each replicated tensor once,
spread over the ranks holding it, and each rank reads only its slices. Which engines write
`torch_dist` is in `megatron.compatibility`.
"""

from __future__ import annotations

import argparse
import os

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
        help="torch: Megatron's per-rank files (the default here without sharding; refused "
        "with FSDP2 sharding, whose whole tensors they would gather); torch_dist (or "
        "torch_dcp, the default with --use-distributed-optimizer / --use-torch-fsdp2): "
        "one torch.distributed.checkpoint directory, each tensor saved once with its global "
        "shape, loadable at any TP, PP, virtual-stage, DP, CP and FSDP2 layout with the "
        "optimizer state, on either engine (DeepSpeed's: its fp32 master weights and Adam "
        "state, at ZeRO 1-3 or fp32, without its pipeline engine); fsdp_dtensor is refused.",
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
        help="Megatron-LM's handling of torch_dist tensors the model and checkpoint do not "
        "share: a tensor the checkpoint lacks ends the run naming it, or keeps this model's "
        "values (log_all: listed; ignore_all); extra tensors in the checkpoint are ignored "
        "(assume_ok_unexpected, the default; ignore_all), listed (log_unexpected, log_all) or "
        "end the run (raise_unexpected, raise_all). return_* (API callers') are refused.",
    )
    group.add_argument(
        "--async-save",
        action="store_true",
        help="Write torch_dist checkpoints in the background: each rank stages a CPU copy and "
        "training goes on; the checkpoint is committed (trackers) once every rank's write "
        "is done, polled each iteration; at most one in flight. Needs --ckpt-format "
        "torch_dist, as in Megatron-LM.",
    )
    group.add_argument(
        "--ckpt-convert-format",
        choices=("torch", "torch_dist"),
        default=None,
        help="Megatron-LM's conversion: load --load as usual (at this command's layout), "
        "write it in this format to --ckpt-convert-save/FORMAT, optimizer state included, "
        "and exit without training. With --deepspeed, torch means DeepSpeed's own layout.",
    )
    group.add_argument(
        "--ckpt-convert-save",
        default=None,
        help="Where --ckpt-convert-format writes (into its FORMAT subdirectory, which must "
        "not hold a checkpoint yet).",
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
    sharded = getattr(args, "data_parallel_sharding", "none") != "none"
    if chosen is None:
        # Megatron-LM's default; under FSDP2 also the only format that stays sharded.
        chosen = "torch_dist" if args.use_dist_ckpt or sharded else "torch"
    if chosen == "torch" and sharded:
        raise ArgumentError(
            f"--ckpt-format torch with {_sharding_flag(args)}: Megatron's per-rank files hold "
            "whole tensors, gathered from every data-parallel shard onto each rank (the whole "
            "model and Adam state in one device's memory); use --ckpt-format torch_dist (the "
            "default with sharding), which each rank writes from its own shards and which "
            "loads at any layout, with or without sharding"
        )
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
    if args.dist_ckpt_strictness.startswith("return"):
        raise ArgumentError(
            f"--dist-ckpt-strictness {args.dist_ckpt_strictness}: megatron-core returns the "
            "mismatched keys to an API caller; a training run logs them: log_unexpected or "
            "log_all"
        )
    args.ckpt_format = "torch" if chosen == "torch" else "torch_dist"
    if args.async_save and args.ckpt_format != "torch_dist":
        raise ArgumentError(
            "--async-save needs --ckpt-format torch_dist (as in Megatron-LM): the per-rank "
            "torch files are written synchronously"
        )


def _sharding_flag(args: argparse.Namespace) -> str:
    """The flag that turned on FSDP2 sharding, as the user wrote it."""
    if args.use_torch_fsdp2:
        return "--use-torch-fsdp2"
    if args.use_megatron_fsdp:
        return (
            f"--use-megatron-fsdp --data-parallel-sharding-strategy {args.data_parallel_sharding}"
        )
    return "--use-distributed-optimizer"


def settle_checkpoint_conversion(args: argparse.Namespace) -> None:
    """`--ckpt-convert-format` / `--ckpt-convert-save`, as Megatron-LM checks them, plus
    what would lose data: an existing checkpoint in the destination is never overwritten."""
    convert, destination = args.ckpt_convert_format, args.ckpt_convert_save
    if convert is None:
        if destination is not None:
            raise ArgumentError("--ckpt-convert-save needs --ckpt-convert-format torch|torch_dist")
        return
    if destination is None:
        raise ArgumentError(f"--ckpt-convert-format {convert} needs --ckpt-convert-save DIR")
    if not args.load:
        raise ArgumentError(f"--ckpt-convert-format {convert} needs --load (what to convert)")
    if args.finetune or args.no_load_optim:
        flag = "--finetune" if args.finetune else "--no-load-optim"
        raise ArgumentError(
            f"--ckpt-convert-format {convert} with {flag}: the conversion keeps the optimizer "
            f"state and counters; drop {flag}"
        )
    if convert == "torch" and getattr(args, "data_parallel_sharding", "none") != "none":
        raise ArgumentError(
            f"--ckpt-convert-format torch with {_sharding_flag(args)}: Megatron's per-rank "
            "files would gather the whole model and Adam state onto each rank; convert without "
            "the sharding flag (the checkpoint loads unsharded at any data-parallel size)"
        )
    if getattr(args, "dry_run", False):
        return  # planning only: the directories are the real run's business
    from megatron.checkpointing.layouts import holds_checkpoint

    if not holds_checkpoint(args.load):
        raise ArgumentError(
            f"--ckpt-convert-format {convert}: --load {args.load} holds no checkpoint"
        )
    written = os.path.join(destination, convert)
    if holds_checkpoint(written):
        raise ArgumentError(
            f"--ckpt-convert-save {destination}: {written} already holds a checkpoint; "
            "choose another directory (nothing is overwritten)"
        )
