"""benchmarks/run_meters.py and benchmarks/measured_run.py: what a measured run records.

- the memory meter: a known sequence of allocations gives a known peak per window, and an
  address allocated again while live counts as freed (a free the profiler did not see);
- the communication meter, in a 2-process gloo world: an all-reduce of N floats counts 4N
  bytes in its group's kind, an all-gather counts its output, a group of one rank counts
  nothing, p2p sends count as pipeline and receives apart, a collective that calls another
  counts once, and DDP's gradient all-reduce (moved to Python) is seen;
- one real run: `torchrun` 2 ranks of pretrain_gpt.py under measured_run.py writes both rank
  reports with iterations 1..3 and the same data-parallel bytes on both ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from benchmarks.run_meters import (
    Call,
    CommMeter,
    GroupTable,
    MemoryMeter,
    match_frees,
    payload_bytes,
    summarize_calls,
    window_peaks,
)
from megatron.core import parallel_state
from tests.conftest import REPO_ROOT
from tests.distributed import free_port, run_distributed
from tests.pretrain_runs import cpu_env, tiny_gpt_flags

N = 1000  # floats per test collective


def test_window_peaks_of_a_known_sequence() -> None:
    """Each window's peak starts from the bytes live at its start; an event on a bound
    belongs to the window starting there."""
    times = [10, 20, 30, 40, 50, 60]
    deltas = [100, 50, -100, 200, -50, -200]
    peaks, levels = window_peaks(times, deltas, [0, 25, 40, 100])
    assert peaks == [150, 150, 250]  # +200 at t=40 opens the third window
    assert levels == [0, 150, 50, 0]


def test_match_frees_repairs_an_unseen_free_and_drops_an_unmatched_one() -> None:
    """Address A allocated again while live: its first block was freed unseen; a free of an
    address never seen allocated changes nothing."""
    events = [(1, 0xA, 100), (2, 0xB, 50), (3, 0xA, 70), (4, 0xC, -30), (5, 0xB, -50)]
    times, deltas, counts = match_frees(events)
    assert list(zip(times, deltas)) == [(1, 100), (2, 50), (3, -100), (3, 70), (5, -50)]
    assert counts == {"unseen_frees": 1, "unseen_free_bytes": 100, "unmatched_frees": 1}


def test_memory_meter_measures_the_peak_of_known_allocations() -> None:
    """1 MB and 3 MB live together, then 0.5 MB after the first is freed: the window's peak
    is 4 MB above its start, and everything is freed by its end."""
    meter = MemoryMeter()
    meter.start()
    try:
        meter.mark("a")
        first = torch.empty(1_000_000, dtype=torch.uint8)
        second = torch.empty(3_000_000, dtype=torch.uint8)
        del first
        third = torch.empty(500_000, dtype=torch.uint8)
        del second, third
        meter.mark("b")
    finally:
        trace = meter.stop()
    peaks, levels = window_peaks(trace.times, trace.deltas, [trace.marks["a"], trace.marks["b"]])
    assert peaks[0] - levels[0] == 4_000_000
    assert levels[1] == levels[0]


@pytest.mark.parametrize(
    "op, arguments, expected",
    [
        ("all_reduce", {"tensor": torch.empty(N)}, 4 * N),
        ("all_gather_into_tensor", {"output_tensor": torch.empty(2 * N)}, 8 * N),
        ("all_gather", {"tensor_list": [torch.empty(N), torch.empty(N)]}, 8 * N),
        ("reduce_scatter_single", {"input": torch.empty(2 * N), "output": torch.empty(N)}, 8 * N),
        ("broadcast", {"tensor": torch.empty(N, dtype=torch.bfloat16)}, 2 * N),
        ("all_to_all", {"input_tensor_list": [torch.empty(N)] * 2}, 8 * N),
        ("barrier", {}, 0),
    ],
)
def test_payload_is_the_input_or_the_gathered_output(op: str, arguments: dict, expected) -> None:
    """The spec's rule: input bytes, but an all-gather's output; numel x element size."""
    assert payload_bytes(op, arguments) == expected


def test_kinds_follow_the_group_and_the_op() -> None:
    """TP group -> tensor_parallel; embedding and pipeline -> pipeline; p2p -> pipeline,
    receives apart; all-to-all by its op; the rest -> data_parallel; one rank -> nothing."""
    table = GroupTable(
        [
            ("tensor", (0, 1)),
            ("embedding", (0, 6)),
            ("pipeline", (0, 2, 4, 6)),
            ("data", (0, 8)),
            ("world", tuple(range(16))),
        ]
    )
    assert table.kind("all_reduce", (0, 1)) == "tensor_parallel"
    assert table.kind("all_reduce", (0, 6)) == "pipeline"
    assert table.kind("broadcast", (0, 2, 4, 6)) == "pipeline"
    assert table.kind("reduce_scatter_single", (0, 8)) == "data_parallel"
    assert table.kind("all_reduce", tuple(range(16))) == "data_parallel"
    assert table.kind("isend", tuple(range(16))) == "pipeline"
    assert table.kind("recv", tuple(range(16))) == "pipeline_received"
    assert table.kind("all_to_all_single", (0, 1)) == "all_to_all"
    assert table.kind("all_reduce", (0,)) is None
    assert table.describe((3, 5)) == "ranks[3, 5]"
    calls = [
        Call(1, "all_reduce", (0, 1), 40),
        Call(1, "send", (0, 1), 8),
        Call(1, "recv", (0, 1), 8),
        Call(1, "all_reduce", (0,), 40),
    ]
    summary = summarize_calls(calls, table)
    assert summary["comm_bytes"] == {
        "tensor_parallel": 40,
        "data_parallel": 0,
        "pipeline": 8,
        "all_to_all": 0,
        "total": 48,
        "pipeline_received": 8,
    }
    assert summary["calls"]["all_reduce @ tensor"] == {
        "kind": "tensor_parallel",
        "calls": 1,
        "bytes": 40,
    }
    assert summary["calls"]["all_reduce @ ranks[0]"]["bytes"] == 0


def _counted(meter: CommMeter, run) -> dict:  # noqa: ANN001 - a callable
    """The summary of what `run()` issues, classified by this rank's parallel_state groups."""
    meter.calls.clear()
    run()
    return summarize_calls(meter.calls, GroupTable.from_parallel_state())


def _data_parallel_world(rank: int, meter: CommMeter) -> None:
    """TP=1 on 2 ranks: the world is the data-parallel group, the tensor group one rank."""
    peer = 1 - rank
    parallel_state.initialize_model_parallel(1, 1)
    summary = _counted(meter, lambda: dist.all_reduce(torch.ones(N)))
    assert summary["comm_bytes"]["data_parallel"] == 4 * N
    assert summary["comm_bytes"]["total"] == 4 * N
    tensor_group = parallel_state.get_tensor_model_parallel_group()
    summary = _counted(meter, lambda: dist.all_reduce(torch.ones(N), group=tensor_group))
    assert summary["comm_bytes"]["total"] == 0
    assert [entry["kind"] for entry in summary["calls"].values()] == ["group of 1 (not counted)"]
    gathered = torch.empty(2 * N)
    summary = _counted(meter, lambda: dist.all_gather_into_tensor(gathered, torch.ones(N)))
    assert summary["comm_bytes"]["data_parallel"] == 8 * N
    # The deprecated form calls all_gather_into_tensor itself: counted once.
    summary = _counted(
        meter, lambda: dist.distributed_c10d._all_gather_base(gathered, torch.ones(N))
    )
    assert summary["comm_bytes"]["data_parallel"] == 8 * N
    assert sum(entry["calls"] for entry in summary["calls"].values()) == 1

    def exchange() -> None:
        ops = (
            [
                dist.P2POp(dist.isend, torch.ones(N), peer),
                dist.P2POp(dist.irecv, torch.empty(2 * N), peer),
            ]
            if rank == 0
            else [
                dist.P2POp(dist.irecv, torch.empty(N), peer),
                dist.P2POp(dist.isend, torch.ones(2 * N), peer),
            ]
        )
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    summary = _counted(meter, exchange)
    sent, received = (N, 2 * N) if rank == 0 else (2 * N, N)
    assert summary["comm_bytes"]["pipeline"] == 4 * sent
    assert summary["comm_bytes"]["pipeline_received"] == 4 * received
    assert summary["comm_bytes"]["total"] == 4 * sent
    summary = _counted(meter, lambda: dist.all_to_all_single(torch.empty(2 * N), torch.ones(2 * N)))
    assert summary["comm_bytes"]["all_to_all"] == 8 * N
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(4, 2), process_group=parallel_state.get_data_parallel_group()
    )
    summary = _counted(meter, lambda: model(torch.ones(3, 4)).sum().backward())
    # DDP's one bucket: the weight's and bias's gradients, (4 x 2 + 2) floats.
    assert summary["comm_bytes"]["data_parallel"] == 4 * 10
    parallel_state.destroy_model_parallel()


def _tensor_parallel_world(rank: int, meter: CommMeter) -> None:
    """TP=2 on 2 ranks: the tensor group's all-reduce is tensor_parallel."""
    parallel_state.initialize_model_parallel(2, 1)
    group = parallel_state.get_tensor_model_parallel_group()
    summary = _counted(meter, lambda: dist.all_reduce(torch.ones(N), group=group))
    assert summary["comm_bytes"]["tensor_parallel"] == 4 * N
    assert summary["comm_bytes"]["data_parallel"] == 0
    parallel_state.destroy_model_parallel()


def _counting_body(rank: int, world_size: int) -> None:
    meter = CommMeter()
    meter.install()
    try:
        _data_parallel_world(rank, meter)
        _tensor_parallel_world(rank, meter)
    finally:
        meter.uninstall()


def test_collectives_are_counted_by_the_payload_rule_and_kind() -> None:
    """Every counting rule, on both ranks of a 2-process gloo world."""
    run_distributed(_counting_body, 2)


@pytest.mark.slow
def test_measured_torchrun_writes_both_rank_reports(stdlib_dataset: str, tmp_path) -> None:
    """torchrun 2 ranks (DP=2, DDP) of the tiny GPT for 3 iterations under measured_run.py:
    each rank reports iterations 1..3, their peaks, its checkpoint saves' windows, and the same
    data-parallel bytes."""
    out = tmp_path / "measured"
    flags = tiny_gpt_flags(stdlib_dataset)
    flags += ["--train-iters", "3", "--eval-iters", "0", "--global-batch-size", "4"]
    flags += ["--save", str(tmp_path / "save"), "--save-interval", "2"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    argv = [
        torchrun,
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(REPO_ROOT, "benchmarks", "measured_run.py"),
        "--measure-out",
        str(out),
        os.path.join(REPO_ROOT, "pretrain_gpt.py"),
        *flags,
    ]
    done = subprocess.run(
        argv,
        cwd=REPO_ROOT,
        env=cpu_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    data_parallel = []
    for rank, report in enumerate(reports):
        assert (report["rank"], report["world_size"], report["dp_rank"]) == (rank, 2, rank)
        assert report["exit_status"] == 0
        assert [row["iteration"] for row in report["iterations"]] == [1, 2, 3]
        assert 0 < report["tensor_bytes_at_start"] < report["peak_tensor_bytes_after_first"]
        assert report["framework_resident_bytes"] > 0
        # Each save's window (iteration 2's, and the final one): it writes from what is live.
        assert [save["iteration"] for save in report["saves"]] == [2, 3]
        for save in report["saves"]:
            assert 0 < save["tensor_bytes_at_start"] <= save["peak_tensor_bytes"]
        bytes_by_iteration = [row["comm_bytes"]["data_parallel"] for row in report["iterations"]]
        # fp32 gradients of ~3.3M parameters (and the 4-byte loss), every iteration alike.
        assert bytes_by_iteration[0] > 4 * 3_000_000
        assert len(set(bytes_by_iteration)) == 1
        assert all(row["comm_bytes"]["tensor_parallel"] == 0 for row in report["iterations"])
        data_parallel.append(bytes_by_iteration)
    assert data_parallel[0] == data_parallel[1]
