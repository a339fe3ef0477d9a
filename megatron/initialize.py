"""Start-up: parse the flags, join the process group, build the parallel groups, seed.

`initialize_megatron` is the one place that turns the launcher's environment (`deepspeed`,
`torchrun`, `python -m torch.distributed.launch`, or a bare `python`) into an initialized
`torch.distributed` world with Megatron's tensor/pipeline/data-parallel groups.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import logging
import os
import random
import socket
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron.arguments import parse_args
from megatron.arguments.ds_activation_checkpointing import activation_checkpointing_line
from megatron.arguments.precision import precision_summary, precision_warnings
from megatron.arguments.validation import batch_arithmetic, format_arguments
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tp_random
from megatron.deepspeed_facts import skip_deepspeed_cpu_inference_comm
from megatron.utils import print_rank_0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single_process_environment() -> None:
    """A bare `python pretrain_gpt.py` is a world of one: give it the launcher's variables."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def timeout_new_groups_after(timeout: timedelta) -> None:
    """Give every process group made from now on without a timeout of its own `timeout`:
    the device meshes' groups (expert-parallel ones included), the embedding group, DeepSpeed's
    pipeline p2p groups. (torch's per-backend default would be 30 minutes on gloo: Megatron-LM
    users have seen an expert-parallel group ignore --distributed-timeout-minutes.)"""
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def initialize_distributed(
    backend: str, local_rank: int, use_deepspeed: bool, timeout_minutes: float = 10
) -> None:
    """Join the default process group over `backend` (nccl on GPUs, gloo on CPUs).

    A collective that waits longer than `timeout_minutes` (--distributed-timeout-minutes) for
    the other ranks fails the run instead of hanging it, in every process group.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(minutes=timeout_minutes)
    timeout_new_groups_after(timeout)
    if torch.cuda.is_available():
        # One GPU per process, picked by the launcher's local rank.
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    _single_process_environment()
    store = _store_of_this_restart(timeout)
    if store is not None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    if use_deepspeed:
        import deepspeed

        skip_deepspeed_cpu_inference_comm()
        # Adopts the group above where there is one.
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    elif store is None:
        dist.init_process_group(backend=backend, timeout=timeout)


def _store_of_this_restart(timeout: timedelta) -> dist.Store | None:
    """Under a one-node `torchrun --max-restarts`, after a restart: a store namespace of its own.

    torchrun's workers share its TCPStore across restarts without a per-attempt prefix, so a
    restarted group can read the addresses of the ranks that died, then fail to connect or hang
    (1 restart in 4 here, static or c10d rendezvous). With one agent its restart count is the
    same in every rank; with several nodes each agent counts its own, so torch's path is kept.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or os.environ.get("GROUP_WORLD_SIZE", "1") != "1"
        or restart == "0"
    ):
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"megatron/restart_{restart}", store)


def write_whole_lines() -> None:
    """Make every print in this process (ours, DeepSpeed's) reach stdout/stderr a line at once.

    Ranks share one terminal or log file. Under `python -u` / PYTHONUNBUFFERED, `print` writes
    its text and its newline separately, and piped output is otherwise flushed in 8 KB blocks
    that end mid-line; either way a DeepSpeed line (`steps_per_print`) from one rank can cut an
    iteration line from another in two. Line buffering writes each line in one call.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def enable_tf32() -> bool:
    """On NVIDIA GPUs, run fp32 matmuls and convolutions in TF32; True when it did.

    TF32 keeps fp32's range with a 10-bit mantissa on Ampere and newer tensor cores (several
    times faster); torch leaves it off for matmuls by default. Megatron runs with it on, and
    fp32 here is the precision of master weights and reductions, which it does not touch.
    """
    if not torch.cuda.is_available():
        return False
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        # torch >= 2.9's per-backend settings; its older allow_tf32 flags warn when mixed in.
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return True


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch; each pipeline stage gets `seed + 100 * stage`, as Megatron.

    The tensor-parallel stream is then seeded per TP rank (`model_parallel_cuda_manual_seed`).
    """
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tp_random.model_parallel_cuda_manual_seed(seed)


def use_deepspeed_activation_checkpointing(args: argparse.Namespace) -> None:
    """Recompute with `deepspeed.checkpointing`, configured as the validated `args` say.

    The flags' fields hold the settings in effect: validation settled them with the DeepSpeed
    config's "activation_checkpointing" section (`megatron.arguments.ds_activation_checkpointing`).
    """
    tp_random.use_deepspeed_checkpointing(
        parallel_state.deepspeed_mpu(),
        num_checkpoints=args.num_layers,
        partition_activations=args.partition_activations,
        contiguous_checkpointing=args.contigious_checkpointing,
        checkpoint_in_cpu=args.checkpoint_in_cpu,
        synchronize=args.synchronize_each_layer,
        profile=args.profile_backward,
    )


def initialize_megatron(
    extra_args_provider: Callable[[argparse.ArgumentParser], object] | None = None,
    args_defaults: dict | None = None,
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """Parse and validate the flags, initialize torch.distributed, groups and seeds.

    `args_defaults` fills flags the user did not give (Megatron's `args_defaults`, e.g.
    `{"tokenizer_type": "GPT2BPETokenizer"}`). Returns the validated namespace.
    """
    write_whole_lines()
    # A fatal signal (NCCL's watchdog aborts a rank whose collective timed out; a segfault in
    # an extension) prints every thread's Python stack to stderr, where the launcher logs it.
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    args = parse_args(argv, extra_args_provider, world_size, defaults=args_defaults)
    initialize_distributed(
        args.distributed_backend,
        args.local_rank,
        # DeepSpeed-MoE's layers and DeepSpeed's all-to-alls of --cp-comm-type a2a talk over
        # deepspeed.comm on every engine.
        args.deepspeed
        or getattr(args, "moe", False)
        or (args.context_parallel_size > 1 and "a2a" in (args.cp_comm_type or [])),
        getattr(args, "distributed_timeout_minutes", 10),
    )
    if dist.get_world_size() != args.world_size:
        raise RuntimeError(
            f"the launcher started {dist.get_world_size()} processes but WORLD_SIZE said "
            f"{args.world_size}"
        )
    layout = args.layout  # the groups come from the settled layout
    parallel_state.initialize_model_parallel(
        layout.tensor_parallel,
        layout.pipeline_parallel,
        layout.ulysses,
        layout.context_parallel,
        # DeepSpeed-MoE's expert groups are DeepSpeed's own; Megatron-LM's MoE uses ours.
        layout.expert_parallel if layout.moe == "megatron" else 1,
    )
    if args.deepspeed_activation_checkpointing:
        use_deepspeed_activation_checkpointing(args)
    set_random_seed(args.seed)
    _numerics_and_logging(args)
    print_rank_0(format_arguments(args))
    print_rank_0(
        f"> initialized {args.world_size} process(es) over {args.distributed_backend}: "
        f"tensor-parallel {args.tensor_model_parallel_size} x pipeline-parallel "
        f"{args.pipeline_model_parallel_size} x data-parallel {args.data_parallel_size}"
        + (
            f" x sequence-parallel (DeepSpeed-Ulysses) {args.ds_sequence_parallel_size}"
            if args.ds_sequence_parallel_size > 1
            else ""
        )
    )
    print_rank_0(f" > layout: {args.layout.describe()}")
    print_rank_0(batch_arithmetic(args))
    if args.deepspeed_activation_checkpointing:
        print_rank_0(activation_checkpointing_line(args))
    print_rank_0(precision_summary(args, tf32=enable_tf32()))
    for line in args.compat_notes + precision_warnings(args) + args.deepspeed_config_notes:
        print_rank_0(line)
    return args


def _numerics_and_logging(args: argparse.Namespace) -> None:
    """Megatron-LM's --logging-level (Python's root logger) and
    --disable-bf16-reduced-precision-matmul (cuBLAS reduces bf16 products in fp32)."""
    if getattr(args, "logging_level", None) is not None:
        logging.getLogger().setLevel(args.logging_level)
    if getattr(args, "disable_bf16_reduced_precision_matmul", False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
