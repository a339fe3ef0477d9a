"""Start a benchmark's worlds of ranks as fresh processes forked from a server that imported the
benchmark once (multiprocessing's forkserver), rather than spawned: a spawned rank imports
torch, DeepSpeed and megatron again, 2-3 s of CPU each, before its first step.

The server starts at the first `start_world` call, with this process's environment at that
moment, and imports `__main__` (the benchmark script, and so what it imports) and `preload`.
Set what torch and DeepSpeed read at import (OMP_NUM_THREADS, DS_ACCELERATOR,
CUDA_VISIBLE_DEVICES) before that call; what differs between worlds (MASTER_PORT) goes in
`env`, set in each rank before it runs. The timed steps are the same as in spawned processes:
each rank is a new process that has only imported modules.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import torch.multiprocessing as mp

START_METHOD = "forkserver"


def multiprocessing_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of the worlds' processes (for their barriers and queues)."""
    return multiprocessing.get_context(START_METHOD)


def start_world(
    fn: Callable[..., None],
    args: tuple,
    nprocs: int,
    env: dict[str, str] | None = None,
    join: bool = True,
    preload: tuple[str, ...] = (),
) -> mp.ProcessContext | None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join)`: rank r runs
    `fn(r, *args)` with `env` set first, in a process forked from the benchmark's server."""
    multiprocessing.set_forkserver_preload(["__main__", *preload])
    return mp.start_processes(
        _rank, (fn, dict(env or {}), args), nprocs=nprocs, join=join, start_method=START_METHOD
    )


def _rank(rank: int, fn: Callable[..., None], env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)
    fn(rank, *args)
