"""The distributed and DeepSpeed flag groups: the parallel layout (tensor, pipeline with
Megatron's virtual stages, data), the backend, and DeepSpeed's engine, ZeRO and activation
checkpointing flags."""

from __future__ import annotations

import argparse
import os


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """The distributed flags."""
    group = parser.add_argument_group("parallelism")
    group.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10,
        help="How long a collective may wait for the other ranks before the run fails (each "
        "surviving rank then names the collective and writes its stack; fractions allowed).",
    )
    group.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="GPUs each layer is split across."
    )
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline stages the layers are split into: with --deepspeed on DeepSpeed's "
        "pipeline engine, without it on Megatron's 1F1B schedule (torch.distributed.pipelining).",
    )
    group.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help="Model chunks (virtual stages) per pipeline rank: Megatron's interleaved 1F1B "
        "schedule, without --deepspeed; the micro-batches per step must be a multiple of "
        "--pipeline-model-parallel-size (Megatron-LM's flag).",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual stage: sets --virtual-pipeline-model-parallel-size to "
        "num-layers / pipeline size / this (Megatron-DeepSpeed's flag).",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Split layer-norm and dropout activations along the sequence across "
        "tensor-parallel ranks; ignored with one tensor-parallel rank.",
    )
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Context parallelism (Megatron-LM's flag): ranks that split each sample's tokens, "
        "load-balanced for the causal mask, attention exchanging keys and values "
        "(--cp-comm-type); any number of key/value heads; data-parallel size = world / (TP x "
        "PP x this).",
    )
    group.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["p2p"],
        choices=["p2p", "a2a", "allgather", "a2a+p2p"],
        help="How context-parallel attention exchanges keys and values, one value or one per "
        "layer: p2p (ring attention, sends overlapped with attention), allgather (all-gather "
        "K/V), a2a (all-to-all to whole sequences of 1/CP of the heads). a2a+p2p "
        "(hierarchical) is refused.",
    )
    group.add_argument(
        "--hierarchical-context-parallel-sizes",
        type=int,
        nargs="+",
        default=None,
        help="Megatron-LM's sizes for --cp-comm-type a2a+p2p; refused (not built here).",
    )
    group.add_argument(
        "--ds-sequence-parallel-size",
        type=int,
        default=1,
        help="DeepSpeed-Ulysses: ranks that split each sample's tokens, attention running "
        "head-split between all-to-alls (Megatron-DeepSpeed's flag; needs --deepspeed "
        "--no-pipeline-parallel and TP = PP = 1); data-parallel size = world / it.",
    )
    group.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="torch.distributed backend; nccl when a GPU is present, gloo otherwise.",
    )
    group.add_argument(
        "--no-pipeline-parallel",
        action="store_true",
        help="With --deepspeed, use DeepSpeed's plain engine instead of its pipeline engine "
        "(pipeline size 1 only; for more stages drop --deepspeed: Megatron's schedules).",
    )
    group.add_argument(
        "--local-rank",
        "--local_rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", "0")),
        dest="local_rank",
        help="This process's GPU on its node, set by the launcher (deepspeed passes "
        "--local_rank, torchrun sets LOCAL_RANK); default: $LOCAL_RANK, else 0.",
    )


def add_deepspeed_flags(parser: argparse.ArgumentParser) -> None:
    """The deepspeed flags."""
    group = parser.add_argument_group("DeepSpeed ZeRO and activation checkpointing")
    group.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="ZeRO stage (zero_optimization.stage); the config's, else 0, when unset; "
        "--deepspeed only.",
    )
    for option, key, kind, what in _ZERO_TUNING_FLAGS:
        group.add_argument(
            option,
            default=None,
            help=f"{what} (zero_optimization.{key}; Megatron-LM v1.1.5's flag): fills the "
            "DeepSpeed config where it is silent; --deepspeed only.",
            **kind,
        )
    group.add_argument(
        "--deepspeed-activation-checkpointing",
        action="store_true",
        help="Recompute activations with deepspeed.checkpointing, configured by the next flags "
        "and the DeepSpeed config's activation_checkpointing section (a typed flag wins); "
        "without this flag that section has no effect.",
    )
    for option, key, what in _ACTIVATION_CHECKPOINTING_FLAGS:
        group.add_argument(
            option,
            action="store_true",
            help=f"{what}. With --deepspeed-activation-checkpointing, unset takes the "
            f"DeepSpeed config's activation_checkpointing.{key}.",
        )


# Megatron-LM v1.1.5's ZeRO flags: option, DeepSpeed key, argparse kind, meaning. Unset is
# None, so a flag not given never overrides the config or DeepSpeed's default.
_SIZE, _SWITCH = {"type": int, "metavar": "N"}, {"action": "store_true"}
_ZERO_TUNING_FLAGS = (
    ("--zero-reduce-bucket-size", "reduce_bucket_size", _SIZE, "Elements per reduction bucket"),
    (
        "--zero-allgather-bucket-size",
        "allgather_bucket_size",
        _SIZE,
        "Elements per parameter all-gather bucket",
    ),
    (
        "--zero-contigious-gradients",
        "contiguous_gradients",
        _SWITCH,
        "Copy gradients to one buffer",
    ),
    ("--zero-reduce-scatter", "reduce_scatter", _SWITCH, "Average gradients by reduce-scatter"),
)
# DeepSpeed activation checkpointing: option, key of the config's section, meaning.
_ACTIVATION_CHECKPOINTING_FLAGS = (
    (
        "--partition-activations",
        "partition_activations",
        "Split checkpointed activations across tensor-parallel ranks (as "
        "--distribute-saved-activations)",
    ),
    ("--checkpoint-in-cpu", "cpu_checkpointing", "Keep activation checkpoints in CPU memory"),
    (
        "--contigious-checkpointing",
        "contiguous_memory_optimization",
        "Copy activation checkpoints into one contiguous buffer; needs partitioned activations "
        "(Megatron-DeepSpeed's spelling)",
    ),
    (
        "--synchronize-each-layer",
        "synchronize_checkpoint_boundary",
        "Synchronize the device at the start and end of each checkpointed layer",
    ),
    ("--profile-backward", "profile", "Time the forward and backward of checkpointed layers"),
)


def job_backend(args: argparse.Namespace) -> str:
    """The job's torch.distributed backend: --distributed-backend, else NCCL on GPUs and gloo
    on CPUs; a dry run plans for the job's GPU machines (NCCL), whatever this host has."""
    import torch

    if getattr(args, "distributed_backend", None):
        return args.distributed_backend
    return "nccl" if getattr(args, "dry_run", False) or torch.cuda.is_available() else "gloo"
