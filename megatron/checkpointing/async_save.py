"""`--async-save`: torch_dist checkpoints written in the background, committed when durable.

A save stages a CPU copy of every tensor this rank writes (torch.distributed.checkpoint's
`async_save` with a stager that keeps its buffers for the next save; the copy is made before
training goes on) and hands the write to a thread that talks to the other ranks over a
process group of its own (gloo). The checkpoint is published by the same commit as a
synchronous save (`checkpoint_commit`: staging directory, journal, rename, trackers), run on
the main thread once every rank's write has finished: the loop asks every iteration (`poll`,
one small all-reduce over a gloo group of its own: NCCL takes no CPU tensor, and the writing
thread's group must not interleave with it), and a save or the end of training waits for it
(`finish`), also when training stops early (`TrainingStopped`). At most one save is in
flight; a writer failure on any rank fails the save on every rank in one line. A run that
ends another way (an exception on one rank, a kill) leaves the save recorded
(`commit.record_background_save`): the next start commits it if its write completed
(torch.distributed.checkpoint's `.metadata` is written last, once every rank's files are),
else discards it, so a kill at any moment leaves the newest complete checkpoint.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.checkpointing import commit as checkpoint_commit
from megatron.utils import print_rank_0


@dataclass
class _InFlight:
    future: Future
    final: str
    iteration: int
    started: float


class SlicesStager:
    """DCP's stager for a state dict that also holds FSDP2 ranks' slices (ShardedTensors, which
    torch's `DefaultStager` cannot copy): those copied into host buffers kept per key
    (`fsdp_slices.staged_copy`), the rest staged by `inner` (synchronously, as configured)."""

    _synchronize_after_execute = False

    def __init__(self, inner: object, pin: bool) -> None:
        self.inner, self.pin = inner, pin
        self._buffers: dict[str, list[torch.Tensor]] = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Staging is done when `stage` returns: nothing to wait for after the write starts."""
        return False

    def stage(self, state_dict: dict) -> dict:
        """A host copy of `state_dict`, made before training goes on."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        from megatron.checkpointing.fsdp_slices import staged_copy

        slices = {k: v for k, v in state_dict.items() if isinstance(v, ShardedTensor)}
        rest = {k: v for k, v in state_dict.items() if k not in slices}
        staged = dict(self.inner.stage(rest)) if rest else {}
        for key, sharded in slices.items():
            staged[key] = staged_copy(sharded, self._buffers.setdefault(key, []), self.pin)
        return {key: staged[key] for key in state_dict}

    def synchronize_staging(self) -> None:
        """Nothing: `stage` copies synchronously."""

    def close(self) -> None:
        """Drop the buffers and the inner stager's."""
        self._buffers.clear()
        self.inner.close()


class AsyncSaves:
    """The one torch_dist save a run has in flight, if any: each engine holds one
    (`TrainingEngine.background_saves`, handed to the saves in its `CheckpointTarget`)."""

    def __init__(self) -> None:
        self._in_flight: _InFlight | None = None
        self._group = None
        self._poll_group = None
        self._stager = None

    def background(self) -> tuple:
        """(process group, stager) for a background save.

        The group: gloo, made on the first save (a collective), never the one training's
        collectives use. The stager: one for the run, keeping its CPU staging buffers between
        saves (allocating them anew each time costs more than the copy), pinned on a GPU;
        the copy is made before training goes on."""
        if self._group is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._group = dist.new_group(backend="gloo")
            self._poll_group = dist.new_group(backend="gloo")
            pinned = torch.cuda.is_available()
            default = DefaultStager(StagingOptions(pinned, False, False, False))
            self._stager = SlicesStager(default, pinned)
        return self._group, self._stager

    def started(self, future: Future, final: str, iteration: int, complete: str) -> None:
        """Record the save just handed to the background (every rank, the same iteration);
        `complete`: the file whose presence in its staging directory says it is written."""
        self._in_flight = _InFlight(future, final, iteration, time.time())
        trackers = checkpoint_commit.megatron_trackers(str(iteration))
        checkpoint_commit.record_background_save(final, trackers, complete)

    def poll(self) -> None:
        """Commit the save in flight if every rank's write has finished (a collective when one
        is in flight; every rank has one or none, as saves start on all ranks together)."""
        if self._in_flight is None:
            return
        done = torch.tensor([int(self._in_flight.future.done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if done.item():
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight and commit it (a collective); nothing if none."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        from torch.distributed.checkpoint.api import CheckpointException

        from megatron.checkpointing.dist_checkpoint import first_failure

        failure = None
        try:
            in_flight.future.result()
        # Any writer failure fails it on every rank; DCP's report of one on some rank is a
        # BaseException, which `except Exception` would let through on the ranks it reached.
        except (Exception, CheckpointException) as error:  # noqa: BLE001
            failure = f"error: saving {in_flight.final} failed: {first_failure(error)}"
        else:
            if dist.get_rank() == 0:  # crash tests: the write done, its commit not begun
                checkpoint_commit.fault_point("background-written")
        trackers = checkpoint_commit.megatron_trackers(str(in_flight.iteration))
        checkpoint_commit.commit(in_flight.final, trackers, failure)
        print_rank_0(
            f"  successfully saved checkpoint at iteration {in_flight.iteration:7d} "
            f"(written in the background in {time.time() - in_flight.started:.1f}s)"
        )
