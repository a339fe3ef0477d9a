"""Meters for one rank of a real training run: live CPU tensor bytes and collective payloads.

`benchmarks/measured_run.py` installs them around `pretrain_gpt.main()`; the planner's
`--dry-run` predictions are checked against what they record.

- `MemoryMeter`: every allocation and free of the CPU allocator, from the PyTorch profiler's
  memory events (only those: the profiler is told to record no operator, which keeps its cost
  off every op), plus zero-length markers at the iteration boundaries on the same clock.
  The running sum of the events is the live tensor bytes; `window_peaks` takes its maximum
  within each iteration.
- `CommMeter`: wraps the Python collectives of `torch.distributed` (and DDP's gradient
  all-reduce, moved to Python with torch's own `allreduce_hook`); each call records its
  payload bytes (`payload_bytes`) under the iteration it was issued in.
- `GroupTable`: names a call's process group by comparing its ranks with the groups of
  `megatron.core.parallel_state`, and gives its kind (tensor_parallel, data_parallel,
  pipeline, all_to_all).

Limits: the profiler's memory events are per thread. gloo's worker thread often drops the
last reference to a collective's tensors (and to its own temporaries), and that free goes
unseen; `CommMeter` therefore pauses briefly after each blocking collective while still
holding the work object (`SETTLE_SECONDS`), and `match_frees` repairs what still slips
through (an address allocated again while live). `MemoryTrace.counts` says how much was
repaired; live bytes at the start of iterations 2 and 3 agree when nothing is missed.
Collectives made from C++ (DDP's bucket rebuild after iteration 1) are not seen.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch._C._profiler import ProfilerActivity, RecordScope, _ExperimentalConfig
from torch.autograd.profiler import ProfilerConfig, ProfilerState, record_function

MARK_PREFIX = "measured_run:"
"""Name prefix of the boundary markers in the profiler's event list."""

KINDS = ("tensor_parallel", "data_parallel", "pipeline", "all_to_all")
"""The kinds whose bytes add up to `total`."""

P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
RECEIVES = frozenset({"recv", "irecv"})
ALL_TO_ALL_OPS = frozenset({"all_to_all", "all_to_all_single"})
SETTLE_SECONDS = 0.0002
"""Pause after a blocking collective, before this thread lets go of its tensors and work
object: gloo's worker thread drops its own references just after the work completes, and
the last reference's thread frees the memory; paused, that is this (profiled) thread.
Without it a third to a half of the freed inputs and gloo's own temporaries went unseen."""


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def window_peaks(
    times: Sequence[int], deltas: Sequence[int], bounds: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Peak live bytes in each window [bounds[i], bounds[i+1]) and the live bytes at each bound.

    `times` (sorted) and `deltas` are the allocator's events: +bytes for an allocation, -bytes
    for a free; the live bytes after an event are the sum of all deltas up to it. An event at
    exactly a bound belongs to the window that starts there. Returns (peaks, levels): one peak
    per window (len(bounds) - 1), one level per bound (the bytes live just before it).
    """
    t = np.asarray(times, dtype=np.int64)
    live = np.cumsum(np.asarray(deltas, dtype=np.int64))
    cut = np.searchsorted(t, np.asarray(bounds, dtype=np.int64), side="left")
    levels = [int(live[i - 1]) if i > 0 else 0 for i in cut]
    peaks = []
    for window in range(len(bounds) - 1):
        start, stop = cut[window], cut[window + 1]
        inside = int(live[start:stop].max()) if stop > start else levels[window]
        peaks.append(max(levels[window], inside))
    return peaks, levels


def match_frees(events: Iterable[tuple[int, int, int]]) -> tuple[list[int], list[int], dict]:
    """(times, deltas, counts) of the live-bytes changes in time-ordered allocator `events`.

    Each event is (time, address, +bytes) for an allocation or (time, address, -bytes) for a
    free. The profiler sees only the threads it follows, so two repairs keep the sum true:
    an allocation at an address that is still live means the block there was freed unseen
    (on another thread): it is taken off at that moment (`unseen_frees`); a free of an address
    never seen allocated (before the start, or on another thread) is ignored
    (`unmatched_frees`).
    """
    live: dict[int, int] = {}
    times: list[int] = []
    deltas: list[int] = []
    counts = {"unseen_frees": 0, "unseen_free_bytes": 0, "unmatched_frees": 0}
    for time_ns, address, nbytes in events:
        if nbytes >= 0:
            stale = live.pop(address, None)
            if stale is not None:
                times.append(time_ns)
                deltas.append(-stale)
                counts["unseen_frees"] += 1
                counts["unseen_free_bytes"] += stale
            live[address] = nbytes
            times.append(time_ns)
            deltas.append(nbytes)
        elif address in live:
            times.append(time_ns)
            deltas.append(-live.pop(address))
        else:
            counts["unmatched_frees"] += 1
    return times, deltas, counts


@dataclass
class MemoryTrace:
    """Live-bytes changes of one profiled run, in time order, and the named markers."""

    times: np.ndarray
    deltas: np.ndarray
    marks: dict[str, int]
    counts: dict[str, int] = field(default_factory=dict)
    """What `match_frees` repaired, and how many allocator events there were."""

    def live_bytes(self) -> np.ndarray:
        """The live tensor bytes after each change."""
        return np.cumsum(self.deltas)


def live_at_peak(
    events: Sequence[tuple[int, int, int]], origins: dict, start: int, stop: int, top: int = 12
) -> list[dict]:
    """What was live at the highest point in [start, stop), by allocating operator (largest
    first): the diagnosis of a peak (needs `MemoryMeter(record_ops=True)`'s `origins`)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    snapshot: dict[int, tuple[int, str]] = {}
    for time_ns, address, nbytes in events:
        if nbytes >= 0:
            total -= live.pop(address, (0, ""))[0]
            live[address] = (nbytes, origins.get((time_ns, address), "?"))
            total += nbytes
        elif address in live:
            total -= live.pop(address)[0]
        if start <= time_ns < stop and total > peak:
            peak, snapshot = total, dict(live)
    by_op: dict[str, list[int]] = {}
    for nbytes, op in snapshot.values():
        entry = by_op.setdefault(op, [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    ranked = sorted(by_op.items(), key=lambda item: -item[1][0])[:top]
    return [{"op": op, "bytes": nbytes, "tensors": count} for op, (nbytes, count) in ranked]


def _origin(node: object, depth: int = 4) -> str:
    """The operators around an allocation, innermost first ("aten::mm < MmBackward0 < ...")."""
    names = []
    parent = node.parent
    while parent is not None and len(names) < depth:
        names.append(parent.name)
        parent = parent.parent
    return " < ".join(names) or "?"


def _walk(nodes: list) -> Iterable:
    """Every node of the profiler's event tree, in its order (memory events nest under open
    scopes; events of one time stamp must keep their recorded order)."""
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


class MemoryMeter:
    """The PyTorch profiler recording only the CPU allocator's events and our markers.

    The scope filter (`RecordScope.USER_SCOPE`) keeps the per-operator callbacks from
    recording anything but `record_function` blocks; the allocator reports to the profiler
    whatever the filter. `record_ops=True` records every operator too (the usual profiler).
    """

    def __init__(self, record_ops: bool = False) -> None:
        self.record_ops = record_ops
        self.running = False

    def start(self) -> None:
        """Start recording on this thread."""
        config = ProfilerConfig(
            ProfilerState.KINETO,
            False,  # report_input_shapes
            True,  # profile_memory
            False,  # with_stack
            False,  # with_flops
            False,  # with_modules
            _ExperimentalConfig(),
        )
        activities = {ProfilerActivity.CPU}
        scopes = set() if self.record_ops else {RecordScope.USER_SCOPE}
        _prepare_profiler(config, activities)
        _enable_profiler(config, activities, scopes)
        self.running = True

    def mark(self, name: str) -> None:
        """A zero-length marker event `name` at this moment, on the memory events' clock."""
        if self.running:
            with record_function(MARK_PREFIX + name):
                pass

    def stop(self) -> MemoryTrace:
        """Stop recording; the live-bytes changes in time order and the markers."""
        result = _disable_profiler()
        self.running = False
        memory, marks = [], {}
        self.origins = {}  # with record_ops: (time, address) -> the operator that allocated
        # The event tree carries each allocation's address (the flat event list does not).
        for node in _walk(result.experimental_event_tree()):
            if node.name == "[memory]":
                fields = node.extra_fields
                if fields.device.type == "cpu":
                    memory.append((node.start_time_ns, fields.ptr, fields.alloc_size))
                    if self.record_ops and fields.alloc_size > 0:
                        self.origins[(node.start_time_ns, fields.ptr)] = _origin(node)
            elif node.name.startswith(MARK_PREFIX):
                marks[node.name[len(MARK_PREFIX) :]] = node.start_time_ns
        memory.sort(key=lambda event: event[0])  # stable: one thread's order is kept
        self.events = memory
        times, deltas, counts = match_frees(memory)
        counts["allocator_events"] = len(memory)
        return MemoryTrace(
            np.array(times, dtype=np.int64), np.array(deltas, dtype=np.int64), marks, counts
        )


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------


def _nbytes(tensors: object) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(item) for item in tensors)
    return 0


# The spec's payload rule: what an op puts on the wire from this rank. The input of a
# reduction, broadcast, all-to-all or send; the output of an all-gather; the received tensor
# of a receive (counted apart). Each entry names the argument that holds it.
PAYLOAD_ARGUMENT = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "reduce": "tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter": "input_list",
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",
    "_all_gather_base": "output_tensor",
    "all_gather": "tensor_list",
    "all_gather_coalesced": "output_tensor_lists",
    "broadcast": "tensor",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "send": "tensor",
    "isend": "tensor",
    "recv": "tensor",
    "irecv": "tensor",
    "gather": "tensor",
    "scatter": "scatter_list",
    "barrier": None,
}
"""Op name -> the argument whose bytes are the payload (None: no payload)."""


def payload_bytes(op: str, arguments: dict) -> int:
    """The payload bytes of a call of `op` with these (bound) arguments."""
    name = PAYLOAD_ARGUMENT[op]
    return 0 if name is None else _nbytes(arguments.get(name))


@dataclass
class Call:
    """One collective as this rank issued it."""

    iteration: int | None
    """The iteration it was issued in (0 before the first; None after the last ended)."""
    op: str
    ranks: tuple[int, ...]
    """The global ranks of its group, sorted (the world for group=None)."""
    nbytes: int


def _group_ranks(group: object) -> tuple[int, ...] | None:
    """Sorted global ranks of `group` (None: the world); None when this rank is not in it."""
    if group is None or group is c10d.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    if group is c10d.GroupMember.NON_GROUP_MEMBER:
        return None
    return tuple(sorted(dist.get_process_group_ranks(group)))


class CommMeter:
    """Counts the Python-level collectives of torch.distributed while installed.

    Only the outermost wrapped call of a thread counts (`all_gather_single` calling
    `all_gather_into_tensor`, `batch_isend_irecv` calling `isend`, count once).
    """

    def __init__(self, settle: bool = True) -> None:
        self.settle = settle
        """Pause SETTLE_SECONDS after each blocking collective (for the memory meter)."""
        self.iteration: int | None = 0
        self.calls: list[Call] = []
        self._depth = threading.local()
        self._restore: list[Callable[[], None]] = []

    # Installation -----------------------------------------------------------------------

    def install(self, ddp_python_allreduce: bool = True) -> None:
        """Wrap the collectives on `torch.distributed` and `distributed_c10d` (and DDP's)."""
        for op in PAYLOAD_ARGUMENT:
            original = getattr(c10d, op, None)
            if original is not None:
                self._patch(op, original, self._wrap(op, original))
        self._patch(
            "batch_isend_irecv", c10d.batch_isend_irecv, self._wrap_batch(c10d.batch_isend_irecv)
        )
        self._patch(
            "_broadcast_coalesced", dist._broadcast_coalesced, self._wrap_broadcast_coalesced()
        )
        if ddp_python_allreduce:
            self._restore.append(python_allreduce_for_ddp())

    def uninstall(self) -> None:
        """Put every original back."""
        while self._restore:
            self._restore.pop()()

    def _patch(self, name: str, original: Callable, wrapper: Callable) -> None:
        modules = [m for m in (dist, c10d) if getattr(m, name, None) is original]
        for module in modules:
            setattr(module, name, wrapper)

        def restore() -> None:
            for module in modules:
                setattr(module, name, original)

        self._restore.append(restore)

    # Recording --------------------------------------------------------------------------

    def record(self, op: str, group: object, nbytes: int) -> None:
        """Add one call of `op` on `group` (None: the world) with `nbytes` of payload."""
        ranks = _group_ranks(group)
        if ranks is not None:
            self.calls.append(Call(self.iteration, op, ranks, nbytes))

    def _outermost(self, count: Callable[[], None], run: Callable[[], object]) -> object:
        depth = getattr(self._depth, "value", 0)
        if depth == 0:
            count()
        self._depth.value = depth + 1
        try:
            return run()
        finally:
            self._depth.value = depth

    def _wrap(self, op: str, original: Callable) -> Callable:
        signature = inspect.signature(original)
        can_wait = "async_op" in signature.parameters

        @functools.wraps(original)
        def wrapper(*args: object, **kwargs: object) -> object:
            bound = signature.bind(*args, **kwargs)
            outermost = getattr(self._depth, "value", 0) == 0
            call = functools.partial(original, *args, **kwargs)
            if outermost and self.settle and can_wait and not bound.arguments.get("async_op"):
                bound.arguments["async_op"] = True
                call = functools.partial(self._blocking, original, bound)
            result = self._outermost(
                lambda: self.record(
                    op, bound.arguments.get("group"), payload_bytes(op, bound.arguments)
                ),
                call,
            )
            if outermost and self.settle and not can_wait and op not in ("isend", "irecv"):
                time.sleep(SETTLE_SECONDS)
            return result

        return wrapper

    @staticmethod
    def _blocking(original: Callable, bound: inspect.BoundArguments) -> None:
        """A blocking collective run as c10d runs one (start, wait), but holding the work
        object past SETTLE_SECONDS, so that this thread frees what it owns."""
        work = original(*bound.args, **bound.kwargs)
        # None: this rank is not in the group; _IllegalWork: queued in a coalescing block,
        # which runs (and is waited for) when the block ends.
        if work is not None and not isinstance(work, getattr(c10d, "_IllegalWork", ())):
            work.wait()
            time.sleep(SETTLE_SECONDS)
        del work

    def _wrap_batch(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(p2p_op_list: list, *args: object, **kwargs: object) -> object:
            def count() -> None:
                for p2p in p2p_op_list:
                    # P2POp.op is dist.isend or dist.irecv (ours or the original: same name).
                    self.record(p2p.op.__name__, p2p.group, _nbytes(p2p.tensor))

            return self._outermost(count, lambda: original(p2p_op_list, *args, **kwargs))

        return wrapper

    def _wrap_broadcast_coalesced(self) -> Callable:
        original = dist._broadcast_coalesced

        # DDP's parameter and buffer broadcast: (process_group, tensors, bucket_size, src).
        def wrapper(process_group: object, tensors: list, *args: object, **kwargs: object):  # noqa: ANN202
            return self._outermost(
                lambda: self.record("broadcast_coalesced", process_group, _nbytes(tensors)),
                lambda: original(process_group, tensors, *args, **kwargs),
            )

        return wrapper


def python_allreduce_for_ddp() -> Callable[[], None]:
    """Make every new DDP reduce its gradient buckets with torch's `allreduce_hook`.

    DDP's own reducer all-reduces in C++, out of the Python meter's sight; the hook divides
    each bucket by the group size and calls `dist.all_reduce` on it, which the meter counts
    (numerically DDP's default). Returns the function that restores DDP's `__init__`.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    @functools.wraps(original)
    def __init__(self: DistributedDataParallel, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, allreduce_hook)

    DistributedDataParallel.__init__ = __init__
    return lambda: setattr(DistributedDataParallel, "__init__", original)


# ---------------------------------------------------------------------------------------------
# Naming groups and kinds
# ---------------------------------------------------------------------------------------------


@dataclass
class GroupTable:
    """Named rank sets of this rank's groups, in the order a name is preferred."""

    groups: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    @classmethod
    def from_parallel_state(cls) -> GroupTable:
        """This rank's groups in `megatron.core.parallel_state` (and DeepSpeed's expert ones)."""
        import sys

        from megatron.core import parallel_state

        state = parallel_state.get_parallel_state()
        named = [
            ("tensor", state.tensor_ranks),
            ("embedding", state.embedding_ranks),
            ("pipeline", state.pipeline_ranks),
            ("data", state.data_ranks),
            ("sequence", state.sequence_ranks if state.sequence_group is not None else []),
            ("sequence_data", state.sequence_data_ranks),
            ("model", state.model_ranks),
        ]
        groups_module = sys.modules.get("deepspeed.utils.groups")
        if groups_module is not None:  # DeepSpeed-MoE's groups, made by deepspeed.initialize
            for label, attribute in (
                ("expert_parallel", "_EXPERT_PARALLEL_GROUP"),
                ("expert_data", "_EXPERT_DATA_PARALLEL_GROUP"),
            ):
                for name, group in (getattr(groups_module, attribute, None) or {}).items():
                    ranks = _group_ranks(group)
                    named.append((f"{label}:{name}", list(ranks or [])))
        named.append(("world", list(range(dist.get_world_size()))))
        return cls([(name, tuple(sorted(ranks))) for name, ranks in named if ranks])

    def names(self, ranks: tuple[int, ...]) -> list[str]:
        """Every name whose ranks are exactly `ranks`."""
        return [name for name, group in self.groups if group == ranks]

    def describe(self, ranks: tuple[int, ...]) -> str:
        """`tensor`, `pipeline=embedding=world`, or `ranks[0, 3]` when no group matches."""
        names = self.names(ranks)
        return "=".join(names) if names else f"ranks{list(ranks)}"

    def kind(self, op: str, ranks: tuple[int, ...]) -> str | None:
        """The kind a call's bytes count in; `pipeline_received` for receives; None for a
        group of one rank, which moves nothing.

        p2p -> pipeline; all-to-all -> all_to_all; the tensor-parallel group ->
        tensor_parallel; the embedding or pipeline group -> pipeline; everything else
        (data, sequence-data, model, expert-data, world) -> data_parallel. Where one rank set
        has several names (PP=2 on 2 ranks: pipeline = embedding = world) the first wins.
        """
        if len(ranks) <= 1:
            return None
        if op in P2P_OPS:
            return "pipeline_received" if op in RECEIVES else "pipeline"
        if op in ALL_TO_ALL_OPS:
            return "all_to_all"
        names = self.names(ranks)
        if "tensor" in names:
            return "tensor_parallel"
        if "embedding" in names or "pipeline" in names:
            return "pipeline"
        return "data_parallel"


def summarize_calls(calls: Iterable[Call], table: GroupTable) -> dict:
    """Bytes by kind (with `total` and `pipeline_received`) and the op x group breakdown."""
    by_kind = dict.fromkeys((*KINDS, "total", "pipeline_received"), 0)
    breakdown: dict[str, dict] = {}
    for call in calls:
        kind = table.kind(call.op, call.ranks)
        counted = 0 if kind is None else call.nbytes
        if kind is not None:
            by_kind[kind] += counted
            if kind in KINDS:
                by_kind["total"] += counted
        key = f"{call.op} @ {table.describe(call.ranks)}"
        entry = breakdown.setdefault(
            key, {"kind": kind or "group of 1 (not counted)", "calls": 0, "bytes": 0}
        )
        entry["calls"] += 1
        entry["bytes"] += counted
    return {"comm_bytes": by_kind, "calls": dict(sorted(breakdown.items()))}
