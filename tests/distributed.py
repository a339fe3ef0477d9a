"""Gloo worlds on CPU for tests: `run_distributed(fn, world_size)` and the `World` it runs in.

A world never hangs the suite. Its collectives (the world group and every group made in it
without a timeout of its own, DeepSpeed's included) raise after `COLLECTIVE_TIMEOUT`, not
gloo's 30 minutes; and this process supervises the ranks: when they run past a deadline (a
total one, or one that restarts whenever the ranks report progress), it has each rank write
every thread's Python stack (faulthandler on SIGUSR1), kills the world, and raises
`WorldTimeout` with those stacks, naming the function and what each rank last said it was
doing.

The rendezvous store is a TCPStore served by this process on a port the kernel picks, so no
port can be taken by another process between choosing and binding it; ranks reach it with
`world_store()` (the spawned-checks harness agrees on each check's outcome through it).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import numpy
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

# Long enough for the slowest legitimate wait in a test world on a loaded 2-core machine
# (one rank building a model while the other waits at the next collective), short enough
# that a collective nobody else enters fails the test in minutes instead of half an hour.
COLLECTIVE_TIMEOUT = timedelta(seconds=180)
# A plain `run_distributed` call that takes longer than this has hung.
DEFAULT_DEADLINE_S = 600.0
# With a progress counter, the time the ranks get to start (spawn, import) before the first
# progress is due: a loaded machine is slow to start a world, which is not a hang.
STARTUP_S = 120.0
# How long a rank's stack dump may take to reach its file after SIGUSR1.
STACK_DUMP_WAIT_S = 2.0
HOST = "127.0.0.1"
# What the fork server that starts every world's ranks imports once: a rank forked from it
# starts in milliseconds instead of importing torch, DeepSpeed and megatron for seconds.
WORLD_PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",
    "deepspeed",
    "pytest",
    "megatron.core.parallel_state",
    "megatron.model",
    "megatron.training.engines.deepspeed",
    "tests.distributed",
)
# Store key each rank may set to say what it is doing (`say_doing`), for the timeout message.
DOING_KEY = "doing/rank{rank}"

_STORE: dist.Store | None = None
_STACK_FILE = None  # kept open (and referenced) for faulthandler


class WorldTimeout(AssertionError):
    """A world ran past its deadline; the message holds every rank's Python stacks."""


# Under pytest-xdist each worker draws ports from its own block below Linux's ephemeral range
# (32768-60999), so two workers never pick the same free port between its check and its use.
_WORKER_PORT_BASE, _WORKER_PORT_BLOCK = 20000, 1500


def worker_ports() -> range | None:
    """This pytest-xdist worker's block of ports (`free_port` draws from it); None without
    xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not (worker.startswith("gw") and worker[2:].isdigit()):
        return None
    start = _WORKER_PORT_BASE + int(worker[2:]) * _WORKER_PORT_BLOCK
    return range(start, start + _WORKER_PORT_BLOCK)


def free_port() -> int:
    """A TCP port nobody listens on right now (for launchers that take a port number)."""
    ports = worker_ports()
    if ports is not None:
        for port in random.sample(ports, 200):
            with socket.socket() as sock:
                try:
                    sock.bind((HOST, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def world_store() -> dist.Store:
    """This rank's client of the world's TCPStore (only inside a spawned rank)."""
    if _STORE is None:
        raise RuntimeError("world_store() is only available inside a rank of a World")
    return _STORE


@contextlib.contextmanager
def shared_directory() -> Iterator[str]:
    """A temporary directory every rank of the default group writes into (rank 0 makes it and
    tells the others), removed once every rank has left the block (a collective)."""
    shared = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    try:
        yield shared[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(shared[0], ignore_errors=True)


def say_doing(rank: int, what: str) -> None:
    """Record what this rank is doing now; a timeout's message quotes it."""
    world_store().set(DOING_KEY.format(rank=rank), what)


def _worker(
    rank: int,
    fn: Callable,
    world_size: int,
    port: int,
    stack_dir: str,
    env: dict[str, str],
    args: tuple,
) -> None:
    global _STORE, _STACK_FILE
    # Forked from the fork server, which has its own (older) environment and random states.
    os.environ.clear()
    os.environ.update(env)
    random.seed()
    numpy.random.seed()
    _STACK_FILE = open(os.path.join(stack_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)
    # As megatron.initialize does: groups made later without a timeout get this one.
    distributed_c10d.default_pg_timeout = COLLECTIVE_TIMEOUT
    os.environ.update(
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    _STORE = dist.TCPStore(HOST, port, world_size, False, timeout=COLLECTIVE_TIMEOUT)
    from megatron.deepspeed_facts import skip_deepspeed_cpu_inference_comm

    skip_deepspeed_cpu_inference_comm()  # as runs do; bodies may call deepspeed.init_distributed
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("world", _STORE),
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


class World:
    """A store served by this process for one spawned gloo world, and its supervision."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.store = dist.TCPStore(HOST, 0, None, True, wait_for_workers=False)

    def progress(self, key: str) -> int:
        """The counter `key` in the store (ranks raise it with `world_store().add(key, 1)`)."""
        return self.store.add(key, 0)

    def run(
        self,
        fn: Callable,
        *args: object,
        deadline_s: float = DEFAULT_DEADLINE_S,
        progress_key: str | None = None,
    ) -> None:
        """Call `fn(rank, world_size, *args)` in every rank and wait for all of them.

        Without `progress_key` the world must end within `deadline_s`; with it, the deadline
        restarts whenever that store counter changes (the first change is due within
        `max(deadline_s, STARTUP_S)`). Past it: `WorldTimeout` with every
        rank's stack. An exception in a rank is raised here (the others are terminated).
        """
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        # Inherited by the ranks: with one GPU visible, the RNG tracker would drive the CUDA
        # generator while these CPU tensors draw from the CPU one, and DeepSpeed would put rank
        # r's pipeline stage on `cuda:r`, which one GPU does not have.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            with tempfile.TemporaryDirectory(prefix="world_stacks_") as stack_dir:
                mp.set_forkserver_preload(list(WORLD_PRELOAD))
                context = mp.start_processes(
                    _worker,
                    args=(fn, self.world_size, self.store.port, stack_dir, dict(os.environ), args),
                    nprocs=self.world_size,
                    join=False,
                    start_method="forkserver",
                )
                try:
                    self._supervise(context, fn, stack_dir, deadline_s, progress_key)
                except Exception:  # a rank raised or timed out: no rank outlives the call
                    _kill(context)
                    raise
                except BaseException:
                    # pytest-timeout's interruption (or Ctrl-C): its report shows only this
                    # process's stack, so print where every rank was (captured with the test).
                    print(self._stacks_then_kill(context, stack_dir), file=sys.stderr)
                    raise
        finally:
            if hidden is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden

    def _supervise(
        self,
        context: mp.ProcessContext,
        fn: Callable,
        stack_dir: str,
        deadline_s: float,
        progress_key: str | None,
    ) -> None:
        last_progress = self.progress(progress_key) if progress_key else None
        first = max(deadline_s, STARTUP_S) if progress_key else deadline_s
        deadline = time.monotonic() + first
        while not context.join(timeout=0.5):
            if progress_key is not None:
                now = self.progress(progress_key)
                if now != last_progress:
                    last_progress, deadline = now, time.monotonic() + deadline_s
            if time.monotonic() > deadline:
                stacks = self._stacks_then_kill(context, stack_dir)
                what = "no rank reported progress" if progress_key else "the world did not end"
                raise WorldTimeout(
                    f"{fn.__module__}.{fn.__qualname__} on {self.world_size} ranks: {what} "
                    f"within {deadline_s:g} s; killed.\n{stacks}"
                )

    def _doing(self, rank: int) -> str:
        key = DOING_KEY.format(rank=rank)
        if not self.store.check([key]):
            return "(said nothing)"
        return self.store.get(key).decode()

    def _stacks_then_kill(self, context: mp.ProcessContext, stack_dir: str) -> str:
        """Every live rank's Python stacks (faulthandler), then SIGKILL the world."""
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        reports = []
        for rank in range(len(context.processes)):
            path = os.path.join(stack_dir, f"rank{rank}.txt")
            if not os.path.exists(path):  # a loaded machine: the rank had not started yet
                stacks = "(no stack written: the rank had not started)"
            else:
                with open(path, encoding="utf-8") as stream:
                    stacks = stream.read().strip() or "(no stack written: the rank had exited)"
            reports.append(f"--- rank {rank}, doing: {self._doing(rank)}\n{stacks}")
        _kill(context)
        return "\n".join(reports)


def _kill(context: mp.ProcessContext) -> None:
    """SIGKILL every rank still running and reap them all."""
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join()


def run_distributed(
    fn: Callable, world_size: int, *args: object, deadline_s: float = DEFAULT_DEADLINE_S
) -> None:
    """Call `fn(rank, world_size, *args)` in `world_size` spawned gloo processes.

    `fn` must be a module-level function; an exception in any rank fails the call, and a world
    still running after `deadline_s` fails it with every rank's stack (`WorldTimeout`). The
    processes see no GPU, also on a GPU machine (see `World.run`).
    """
    World(world_size).run(fn, *args, deadline_s=deadline_s)
