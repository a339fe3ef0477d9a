"""Smoke runs of the benchmarks: they start, measure every layout and print a table that parses.

Timings are never asserted (a shared CI machine makes them noise); only the structure of the
output and the values that do not depend on the clock (the schedule's predicted bubble, the
first-step losses agreeing across layouts, the all-to-all calls and active parameters of an
MoE step, FP8 losses close to bf16's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron.core.pipeline_parallel.layout import bubble_fraction
from tests.conftest import REPO_ROOT

PIPELINE_LAYOUTS = {  # title in the table -> (PP, V)
    "PP=1 (1 process, baseline)": (1, 1),
    "DP=2 (2 processes, no pipeline)": (1, 1),
    "PP=2, 1F1B": (2, 1),
    "PP=2 x V=2, interleaved 1F1B": (2, 2),
}
PERCENT = re.compile(r"^(-?\d+\.\d)%$")


def _percent(cell: str) -> float:
    match = PERCENT.match(cell.split(" ")[0])
    assert match, f"not a percentage: {cell!r}"
    return float(match.group(1)) / 100


def _run_benchmark(script: str, *flags: str) -> str:
    """`benchmarks/<script> <flags>` on the CPU (CUDA hidden), within 5 minutes: its stdout,
    after asserting it exited 0 (else the tail of its output is the message)."""
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", script), *flags],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_pipeline_schedules_quick_prints_every_layout() -> None:
    """`benchmarks/pipeline_schedules.py --quick`: one table row per layout, all of it parses."""
    stdout = _run_benchmark("pipeline_schedules.py", "--quick")
    lines = stdout.splitlines()
    assert any(line.startswith("first-step loss, m=4:") and "-> OK" in line for line in lines)
    header = next(line for line in lines if line.startswith("| layout |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in PIPELINE_LAYOUTS:
            rows[cells[0]] = dict(zip(columns, cells))
    assert set(rows) == set(PIPELINE_LAYOUTS), stdout
    for title, row in rows.items():
        pp, virtual = PIPELINE_LAYOUTS[title]
        assert len(row) == len(columns), row
        assert int(row["micro-batches"]) == 4
        assert re.fullmatch(r"\d+ ms", row["step (median)"]), row
        assert float(row["ratio to PP=1"].strip("*")) > 0
        expected = bubble_fraction(pp, virtual, 4) if pp > 1 else 0.0
        assert _percent(row["predicted bubble"]) == pytest.approx(expected, abs=1e-3)
        assert 0.0 <= _percent(row["measured bubble (mean; per rank)"]) <= 1.0
        _percent(row["span vs ideal"])
    assert float(rows["PP=1 (1 process, baseline)"]["ratio to PP=1"].strip("*")) == 1.0


MOE_SETUPS = ("dense-top1", "moe-top1", "dense-top2", "moe-top2")


@pytest.mark.slow
def test_moe_step_quick_prints_every_setup() -> None:
    """`benchmarks/moe_step.py --quick`: a row per setup that parses; the MoE rows count the
    all-to-alls DeepSpeed-MoE makes and the dense rows none; active parameters match."""
    stdout = _run_benchmark("moe_step.py", "--quick")
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("| setup |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in MOE_SETUPS:
            rows[cells[0]] = dict(zip(columns, cells))
    assert set(rows) == set(MOE_SETUPS), stdout
    for name, row in rows.items():
        assert len(row) == len(columns), row
        assert re.fullmatch(r"\d+ ms", row["step (median)"]), row
        assert float(row["tokens/s"].replace(",", "")) > 0
        for share in ("all-to-all share", "all-reduce share", "optimizer step share"):
            assert 0.0 <= _percent(row[share]) <= 1.0, row
        calls = int(row["all-to-all calls, MB per step and rank"].split(",")[0])
        # --quick: 2 MoE layers x (2 all-to-alls forward + 2 backward) x 1 micro-batch.
        assert calls == (8 if name.startswith("moe") else 0), row
    for k in ("1", "2"):
        dense, moe = rows[f"dense-top{k}"], rows[f"moe-top{k}"]
        assert dense["vs dense (per round; medians)"].startswith("**1.00x**")
        assert float(moe["vs dense (per round; medians)"].split("x")[0].strip("*")) > 0
        # Same active parameters but for the gate (h x experts) and the k - 1 more output
        # biases (h) of the k experts, in each of the 2 layers (h 64, 4 experts).
        active = [int(row["active per token"].replace(",", "")) for row in (dense, moe)]
        assert active[1] - active[0] == 2 * (64 * 4 + (int(k) - 1) * 64), active
    first = [line for line in lines if line.startswith("first step, moe-")]
    assert len(first) == 2 and all("moe loss" in line for line in first), first


ULYSSES_SIZES = ("S=1", "S=2", "S=4")


@pytest.mark.slow
def test_ulysses_step_quick_prints_every_size() -> None:
    """`benchmarks/ulysses_step.py --quick`: a row per S that parses; the first-step losses agree
    with one process; the activations saved for backward shrink with S; the all-to-all is
    counted under Ulysses only, with the volume the shapes give."""
    stdout = _run_benchmark("ulysses_step.py", "--quick")
    lines = stdout.splitlines()
    losses = [line for line in lines if line.startswith("first-step loss:")]
    assert len(losses) == 1 and losses[0].endswith("-> OK"), losses
    header = next(line for line in lines if line.startswith("| S |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ULYSSES_SIZES:
            rows[cells[0]] = dict(zip(columns, cells))
    assert set(rows) == set(ULYSSES_SIZES), stdout
    for name, row in rows.items():
        size = int(name.removeprefix("S="))
        assert len(row) == len(columns), row
        assert re.fullmatch(r"\d+ ms", row["step (median)"]), row
        assert float(row["tokens/s"].replace(",", "")) > 0
        assert float(row["vs S=1 (per round; medians)"].split("x")[0].strip("*")) > 0
        for share in ("all-to-all share", "all-reduce share", "optimizer step share"):
            assert 0.0 <= _percent(row[share]) <= 1.0, row
        calls, megabytes = row["all-to-all calls, MB per step and rank"].split(",")
        # --quick: 2 layers x (q, k, v, context) x (forward, backward), each [256/S, 1, 64] fp32.
        assert int(calls) == (0 if size == 1 else 16), row
        expected = 0.0 if size == 1 else 16 * (256 // size) * 64 * 4 / 1e6
        assert float(megabytes) == pytest.approx(expected, abs=0.05), row
    activation = [float(rows[name]["activation MB per rank"]) for name in ULYSSES_SIZES]
    assert activation[0] > activation[1] > activation[2] > 0, activation


ROUTED_MOE_SETUPS = ("dense-top2", "moe-top2-grouped", "moe-top2-loop", "moe-top2-allgather")


@pytest.mark.slow
def test_routed_moe_step_quick_prints_every_setup() -> None:
    """`benchmarks/routed_moe_step.py --quick`: a row per setup that parses; each dispatcher
    makes its own collectives (and the dense model none), the grouped setups call grouped_mm
    and the loop does not; the MoE setups agree on the first-step loss; active parameters
    match."""
    stdout = _run_benchmark("routed_moe_step.py", "--quick")
    lines = stdout.splitlines()
    losses = [line for line in lines if line.startswith("first-step lm loss, top-2:")]
    assert len(losses) == 1 and losses[0].endswith("-> OK"), losses
    header = next(line for line in lines if line.startswith("| setup |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ROUTED_MOE_SETUPS:
            rows[cells[0]] = dict(zip(columns, cells))
    assert set(rows) == set(ROUTED_MOE_SETUPS), stdout
    # --quick: 2 MoE layers, 1 micro-batch. All-to-all: the count exchange and 2 token
    # all-to-alls forward, 2 backward. All-gather: tokens, weights, routing map and the
    # reduce-scatter forward, 3 transposes backward. grouped_mm: 2 per layer forward.
    expected = {  # setup -> (all-to-all calls, all-gather + reduce-scatter calls, grouped_mm)
        "dense-top2": (0, 0, 0),
        "moe-top2-grouped": (10, 0, 4),
        "moe-top2-loop": (10, 0, 0),
        "moe-top2-allgather": (0, 14, 4),
    }
    for name, row in rows.items():
        assert len(row) == len(columns), row
        assert re.fullmatch(r"\d+ ms", row["step (median)"]), row
        assert float(row["tokens/s"].replace(",", "")) > 0
        assert float(row["vs dense (per round; medians)"].split("x")[0].strip("*")) > 0
        for share in ("all-to-all share", "all-gather + reduce-scatter share"):
            assert 0.0 <= _percent(row[share]) <= 1.0, row
        assert 0.0 < _percent(row["optimizer step share"]) < 1.0, row
        a2a_calls = int(row["all-to-all calls, MB (rank 0/1)"].split(",")[0])
        gather_calls = int(row["all-gather + reduce-scatter calls, MB (rank 0/1)"].split(",")[0])
        assert (a2a_calls, gather_calls, int(row["grouped_mm calls"])) == expected[name], row
        if a2a_calls:  # a step that moves tokens spends some of its time doing it
            assert 0.0 < _percent(row["all-to-all share"]) < 1.0, row
    assert rows["dense-top2"]["vs dense (per round; medians)"].startswith("**1.00x**")
    assert rows["moe-top2-loop"]["vs loop (per round; medians)"].startswith("**1.00x**")
    assert (
        float(rows["moe-top2-grouped"]["vs loop (per round; medians)"].split("x")[0].strip("*")) > 0
    )
    # Same active parameters but for the router (experts x h, and its bias: megatron-core's
    # with the linear biases) and the second expert's output bias (h), in each of the 2
    # layers (h 64, 4 experts).
    active = [int(rows[name]["active per token"].replace(",", "")) for name in ROUTED_MOE_SETUPS]
    assert [value - active[0] for value in active] == [0] + [2 * (64 * 4 + 4 + 64)] * 3, active


@pytest.mark.slow
def test_fp8_throughput_smoke_compares_bf16_and_fp8_runs(tmp_path) -> None:
    """`benchmarks/fp8_throughput.py --smoke`: both pretrain_gpt.py runs finish, the second with
    FP8 matmuls in every transformer linear layer; a loss row per iteration, tokens/s per run
    and their ratio parse; the FP8 losses stay within 1% of bf16's (6 steps of a tiny LLaMA)."""
    stdout = _run_benchmark("fp8_throughput.py", "--smoke", "--work-dir", str(tmp_path))
    with open(tmp_path / "fp8.log") as fp8_log, open(tmp_path / "bf16.log") as bf16_log:
        assert " > FP8 matmuls: 8 of this rank's 9 tensor-parallel linear layers" in fp8_log.read()
        assert "FP8 matmuls" not in bf16_log.read()
    lines = stdout.splitlines()
    losses = [line.split("|")[1:-1] for line in lines if re.match(r"\| \d+ \| ", line)]
    assert [int(row[0]) for row in losses] == list(range(1, 7)), stdout
    for _, bf16, fp8, difference, *_ in losses:
        assert abs(float(fp8) - float(bf16)) / float(bf16) < 0.01, losses
        assert float(difference.strip().rstrip("%")) < 1.0, losses
    tokens_per_s = {  # the runs' table: | run | ms/iter | tokens/s | ...
        line.split("|")[1].strip(): float(line.split("|")[3].replace(",", ""))
        for line in lines
        if line.startswith(("| bf16 |", "| fp8 |"))
    }
    assert set(tokens_per_s) == {"bf16", "fp8"} and min(tokens_per_s.values()) > 0, tokens_per_s
    assert any(re.match(r"fp8 / bf16 tokens/s: \d+\.\d{3}x \(steady", line) for line in lines)
    agreement = [line for line in lines if line.startswith("loss agreement:")]
    assert len(agreement) == 1 and "-> OK" in agreement[0], agreement


@pytest.mark.slow
def test_gpu_throughput_cpu_smoke_runs_the_three_engines() -> None:
    """`benchmarks/gpu_throughput.py --device cpu`: the plain engine, DeepSpeed's engine and
    its pipeline engine each train through pretrain_gpt.py's code (the settled arguments
    included) and print a row, and both DeepSpeed engines' ratios to the plain one parse."""
    stdout = _run_benchmark(
        "gpu_throughput.py",
        *("--device", "cpu", "--model", "tiny", "--iters", "1", "--warmup", "1"),
        *("--modes", "eager", "--engines", "plain", "nopipe", "pipe", "--no-baseline"),
        *("--seq-length", "64", "--global-batch-size", "4", "--micro-batch-size", "2"),
    )
    lines = stdout.splitlines()
    rows = [line.split()[2] for line in lines if re.match(r"  ours eager \(\w+\) +\d", line)]
    assert rows == ["(plain)", "(nopipe)", "(pipe)"], stdout
    ratios = [
        re.match(r"  ours eager \((\w+)\): (\d+\.\d{3})x the plain engine \(target >= ", line)
        for line in lines
    ]
    assert [m.group(1) for m in ratios if m] == ["nopipe", "pipe"], stdout
    assert all(float(m.group(2)) > 0 for m in ratios if m)


@pytest.mark.slow
def test_moe_overlap_quick_prints_both_sizes_bit_identical() -> None:
    """`benchmarks/moe_overlap.py --quick`: a row per EP (2, 4) that parses, the overlapped
    forward's output the plain one's bit for bit on every rank, the hidden share a percentage."""
    stdout = _run_benchmark("moe_overlap.py", "--quick")
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("2", "4"):
            rows[cells[0]] = cells
    assert set(rows) == {"2", "4"}, stdout
    for cells in rows.values():
        assert cells[-1] == "yes", cells
        assert 0.0 <= _percent(cells[6]) <= 1.0 and 0.0 <= _percent(cells[7]) <= 1.0, cells


@pytest.mark.slow
def test_moe_combined_1f1b_quick_prints_every_setup_bit_identical() -> None:
    """`benchmarks/moe_combined_1f1b.py --quick --sizes 2`: a row per setup that parses, the
    three setups' losses and final weights bit-identical, the planned share a percentage."""
    stdout = _run_benchmark("moe_combined_1f1b.py", "--quick", "--sizes", "2", "--rounds", "1")
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| 2 |"):
            rows[cells[1]] = cells
    assert set(rows) == {"plain", "overlap", "overlap+delay"}, stdout
    assert all(cells[-1] == "yes" for cells in rows.values()), rows
    for name in ("overlap", "overlap+delay"):
        planned = re.fullmatch(r"(\d+)%", rows[name][6])
        assert planned and 0 < int(planned.group(1)) <= 100, rows[name]
