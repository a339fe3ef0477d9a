"""`run_distributed(fn, world_size)`: run a test body in several gloo processes on CPU."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: object) -> None:
    """Call `fn(rank, world_size, *args)` in `world_size` spawned gloo processes.

    `fn` must be a module-level function; an exception in any rank fails the call. The
    processes see no GPU, also on a GPU machine: with one visible, the RNG tracker would drive
    the CUDA generator while these CPU tensors draw from the CPU one, and DeepSpeed would put
    rank r's pipeline stage on `cuda:r`, which one GPU does not have.
    """
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the spawned processes
    try:
        mp.spawn(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
