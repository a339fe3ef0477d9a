"""A stalled or dead rank ends the run with one line per surviving rank, not a hang or a traceback.

When a collective times out (`--distributed-timeout-minutes`) or a peer's connection closes,
torch raises an error that names neither the collective nor the group (gloo: `Timed out
waiting 600000ms for recv operation to complete`). `collective_failures_reported` turns it into

    rank 0: all_reduce on the data-parallel group (ranks 0, 1) timed out after 60 s
    (--distributed-timeout-minutes 1): another rank stalled or died; at
    megatron/training/step.py:201 in train_step_plain; Python stacks in SAVE/stacks/rank0.txt

written with the traceback and every thread's stack (faulthandler) to a file named by rank.
The launcher (torchrun, deepspeed) then ends the job; with `torchrun --max-restarts` and
`--load` = `--save` it restarts from the last complete checkpoint.

`report_error` prints such a line and hands it to torchrun's error file, so torchrun's closing
banner shows it as the root cause instead of "To enable traceback see ...".
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist

from megatron.core import parallel_state

# What torch's collectives raise when a peer stalls past the timeout or goes away.
_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms|Timeout\(ms\)=(\d+)|collective operation timeout")
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused|"
    r"NCCL communicator was aborted|remote process exited|ncclRemoteError",
    re.I,
)
_COLLECTIVES = {
    "all_reduce", "broadcast", "barrier", "monitored_barrier", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather",
    "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "batch_isend_irecv", "wait",
}  # fmt: skip
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_DDP_FILE = os.path.join("torch", "nn", "parallel", "distributed.py")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message names the rank, collective and group."""


def _group_name(group: object) -> str:
    """`the data-parallel group (ranks 0, 1)`, or the ranks alone for groups not ours."""
    names = {
        "tensor-model-parallel": parallel_state.get_tensor_model_parallel_group,
        "pipeline-model-parallel": parallel_state.get_pipeline_model_parallel_group,
        "data-parallel": parallel_state.get_data_parallel_group,
        "data-and-context-parallel": parallel_state.get_sequence_data_parallel_group,
        "context-parallel": parallel_state.get_context_parallel_group,
        "model-parallel": parallel_state.get_model_parallel_group,
        "embedding": parallel_state.get_embedding_group,
    }
    if group is None or group is dist.group.WORLD:
        return f"the world group ({dist.get_world_size()} ranks)"
    try:
        ranks = ", ".join(str(rank) for rank in dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        ranks = "?"
    for name, getter in names.items():
        if parallel_state.model_parallel_is_initialized() and getter() is group:
            return f"the {name} group (ranks {ranks})"
    return f"a group of ranks {ranks}"


def _where(error: BaseException) -> tuple[str, str]:
    """(collective and group, place in this repository) from the frames `error` passed."""
    collective, ddp_step, place = None, None, None
    frames = list(traceback.walk_tb(error.__traceback__))
    for frame, line in frames:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.endswith(_C10D_FILE) and frame.f_code.co_name in _COLLECTIVES:
            collective = (frame.f_code.co_name, frame.f_locals.get("group"))
        elif path.endswith(_DDP_FILE):
            ddp_step = frame.f_code.co_name
        elif path.startswith(_REPO_ROOT + os.sep) and "site-packages" not in path:
            place = f"{os.path.relpath(path, _REPO_ROOT)}:{line} in {frame.f_code.co_name}"
    if collective is not None:
        what = f"{collective[0]} on {_group_name(collective[1])}"
    elif ddp_step is not None:
        # DistributedDataParallel's own collectives (bucket rebuild, buffer sync) run in C++.
        what = f"a collective of DistributedDataParallel.{ddp_step} on {_group_name(_data_group())}"
    elif any("autograd" in frame.f_code.co_filename for frame, _ in frames):
        # Only DistributedDataParallel's reducer runs a collective inside backward from C++.
        what = f"the backward pass's gradient all-reduce on {_group_name(_data_group())}"
    else:
        what = "a collective"
    return what, place or "?"


def _data_group() -> object:
    """DDP's group: the data-parallel ranks (with the context-parallel ones under CP)."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_sequence_data_parallel_group()
    return None


def describe_collective_failure(error: BaseException, timeout_minutes: float) -> str | None:
    """The one line for a collective that timed out or lost a peer; None for other errors."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not dist.is_initialized():
        return None
    rank = dist.get_rank()
    what, place = _where(error)
    if _PEER_GONE.search(text):
        why = "failed: another rank closed its connection (it exited or was killed)"
    else:
        match = _TIMEOUT.search(text)
        if match is None:
            return None
        waited_ms = next((group for group in match.groups() if group), None)
        waited = f"{int(waited_ms) / 1000:g} s" if waited_ms else f"{timeout_minutes:g} min"
        why = (
            f"timed out after {waited} (--distributed-timeout-minutes {timeout_minutes:g}): "
            "another rank stalled or died"
        )
    return f"rank {rank}: {what} {why}; at {place}"


def write_stacks(path: str, message: str, error: BaseException) -> str | None:
    """Write `message`, `error`'s traceback and every thread's stack to `path`; None on failure."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as handle:
            handle.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n\n")
            handle.write("".join(traceback.format_exception(error)))
            handle.write("\nEvery thread of this process (faulthandler):\n")
            handle.flush()
            faulthandler.dump_traceback(handle, all_threads=True)
    except OSError:
        return None
    return path


@contextlib.contextmanager
def collective_failures_reported(stack_dir: str, timeout_minutes: float) -> Iterator[None]:
    """Turn a collective's timeout or lost peer inside the block into a `CollectiveFailure`.

    The rank's stacks go to `{stack_dir}/stacks/rank{R}.txt`; other errors pass unchanged.
    """
    try:
        yield
    except RuntimeError as error:
        message = describe_collective_failure(error, timeout_minutes)
        if message is None:
            raise
        path = os.path.join(stack_dir, "stacks", f"rank{dist.get_rank()}.txt")
        written = write_stacks(path, message, error)
        suffix = f"; Python stacks in {written}" if written else ""
        raise CollectiveFailure(message + suffix) from error


def report_error(message: str) -> None:
    """Print `error: message` to stderr, and give it to torchrun's error file when there is one."""
    line = f"error: {message}"
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    # torchrun's banner prints `py_callstack` as the failed rank's "traceback".
    extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
    report = {"message": line, "extraInfo": extra}
    with contextlib.suppress(OSError):
        with open(error_file, "w") as handle:
            json.dump({"message": report}, handle)
