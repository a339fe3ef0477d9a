"""Benchmark: host overhead per training iteration on each engine path, on CPU (issue 56).

    python benchmarks/host_overhead.py                       # every path, the table
    python benchmarks/host_overhead.py --paths plain ds-z1 ds-pipe --rounds 5
    python benchmarks/host_overhead.py --kinds 10 --json /tmp/host_overhead.json
    python benchmarks/host_overhead.py --torch-compile     # compiled layers, profiler's count

For one training iteration of a launch-bound GPT (2 layers, hidden 64, 4 heads, seq 64,
micro-batch 2, 4 micro-batches per iteration, vocabulary 512, bf16; on CPU this model is
bound by the host as GPT-2 124M is on an H200), per path:

- ops/iter: the aten/c10d ops dispatched (`benchmarks/op_meter.py`'s `OpCounter`, a
  TorchDispatchMode; forward, backward, gradient accumulation, optimizer, LR schedule,
  logging reads). Nothing is compiled here, so all of them are dispatched outside a compiled
  graph; the model's own ops are the same on every path, the excess over plain is the engine's;
  With `--torch-compile` the count is `op_meter.ProfiledOps`' instead: the top-level ops of
  torch.profiler's events, a compiled graph's fused kernels not among them, composites once
  (not comparable with the eager count; ratios only within one mode);
- non-view: of those, the ops that do not just alias an input (each a kernel on a device);
- syncs/iter: `aten._local_scalar_dense` (`.item()`, `float(t)`, `bool(t)`): a device sync each;
  "of them on a GPU": without foreach AdamW's reads of its CPU step counters (on a GPU the
  fused AdamW runs, which reads none: `op_meter.StepCounterReads`);
- host ms/iter: median wall time of an uncounted iteration (one thread by default).

Paths (each built through the project's own code: `parse_args` on the flags, seeded,
`megatron.training.build_engine`, stepped by the engine's `train_step`; each path in a fresh
process of its own, world size 1 over gloo, as a real run builds one engine per process):
plain (no --deepspeed), ds-z0..ds-z3 (`--deepspeed --no-pipeline-parallel --zero-stage N`),
ds-pipe (`--deepspeed --zero-stage 1`: DeepSpeed's PipelineEngine at PP = 1), mcore-pp1
(Megatron's schedules engine at PP = 1, set on the layout: no flag selects it below PP = 2).

Each path runs `--warmup` iterations first (optimizer state, DeepSpeed's first-step set-up),
then `--count` counted iterations (their counts must agree: steady state), then `--rounds`
timed ones. The whole sequence of paths runs `--passes` times (each path's processes
alternating with the others', so machine noise hits all alike); every pass must count the same
ops (the counts are deterministic), the host times of all passes make the median. The table's
ratios are against plain in the same run; the issue's target is <= 1.2x the plain engine's ops
for ds-z1 and ds-pipe (a miss is printed, not an error). `--kinds N` prints, per path, the N
op kinds it dispatches most beyond plain's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.op_meter import (  # noqa: E402
    PATH_FLAGS,
    MeterShape,
    PathMeasurement,
    excess_kinds,
    measure_in_subprocess,
)

TARGET_RATIO = 1.2
TARGET_PATHS = ("ds-z1", "ds-pipe")
LOSS_TOLERANCE = 5e-3
"""First-iteration losses of the paths agree to this (bf16 matmuls, the same data and seeds;
DeepSpeed's bf16 parameters against the plain engine's fp32 ones under autocast; eager spread
6e-6, compiled 2.3e-3: inductor's fused kernels round bf16 differently)."""


def print_header(shape: MeterShape) -> None:
    """Command, versions, threads, CPU and load, for pasting into RESULTS.md."""
    import deepspeed

    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, deepspeed "
        f"{deepspeed.__version__}, threads {torch.get_num_threads()}"
    )
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"cpu: {cpu_model()}, {os.cpu_count()} logical cores; load average at start {load}")
    print(
        f"model: {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads, seq {shape.seq_length}, micro-batch "
        f"{shape.micro_batch_size} x {shape.micro_batches} per iteration, vocab "
        f"{shape.vocab_size}, {shape.precision}"
        + (", --torch-compile (ops: profiler's top-level count)" if shape.torch_compile else "")
    )


def check_losses(paths: list[PathMeasurement]) -> None:
    """The first warm-up losses agree across paths (else they do not train the same model)."""
    first = {path.name: path.losses[0] for path in paths}
    spread = max(first.values()) - min(first.values())
    print(
        "first-iteration lm loss: "
        + ", ".join(f"{name} {loss:.5f}" for name, loss in first.items())
        + f"; spread {spread:.1e}"
    )
    if spread > LOSS_TOLERANCE:
        raise SystemExit(f"the first losses differ by {spread:.1e}: the paths are not comparable")


def run_passes(cli: argparse.Namespace, shape: MeterShape) -> list[PathMeasurement]:
    """Every path measured `cli.passes` times, each in a fresh process; one merged
    measurement per path (host times of all passes). Raises if two passes counted apart."""
    merged: dict[str, PathMeasurement] = {}
    for index in range(cli.passes):
        for name in cli.paths:
            result = measure_in_subprocess(
                name, shape, cli.warmup, cli.count, cli.rounds, cli.seed, cli.threads
            )
            print(
                f"pass {index + 1}: {name}: ops/iter {result.ops_per_iteration}, syncs/iter "
                f"{result.syncs_per_iteration}, host {result.host_ms:.1f} ms/iter",
                flush=True,
            )
            first = merged.setdefault(name, result)
            if first is result:
                continue
            if result.ops_per_iteration != first.ops_per_iteration or result.kinds != first.kinds:
                raise SystemExit(
                    f"{name}: pass {index + 1} counted {result.ops_per_iteration} ops per "
                    f"iteration, pass 1 {first.ops_per_iteration}: the counts are not deterministic"
                )
            first.host_seconds += result.host_seconds
    return [merged[name] for name in cli.paths]


def print_table(paths: list[PathMeasurement]) -> list[dict]:
    """The markdown table; the rows as dicts (for --json)."""
    base = paths[0]
    print(
        "| path | engine | model/optimizer | ops/iter | non-view ops/iter | host syncs/iter "
        "| of them on a GPU | host ms/iter (median) | ops vs plain | non-view vs plain "
        "| host ms vs plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for m in paths:
        kernels, base_kernels = m.ops - m.views, base.ops - base.views
        row = {
            "path": m.name,
            "engine": m.engine,
            "optimizer": m.optimizer,
            "ops": m.ops,
            "non_view_ops": kernels,
            "syncs": m.syncs,
            "device_syncs": m.device_syncs,
            "host_ms": round(m.host_ms, 2),
            "ops_ratio": round(m.ops / base.ops, 3),
            "non_view_ratio": round(kernels / base_kernels, 3),
            "host_ms_ratio": round(m.host_ms / base.host_ms, 3),
            "steady": m.steady,
        }
        rows.append(row)
        steady = "" if m.steady else f" (varies: {m.ops_per_iteration})"
        print(
            f"| {m.name} | {m.engine} | {m.optimizer} | {m.ops}{steady} | {kernels} | {m.syncs} "
            f"| {m.device_syncs} | {m.host_ms:.1f} | {row['ops_ratio']:.2f}x "
            f"| {row['non_view_ratio']:.2f}x | {row['host_ms_ratio']:.2f}x |"
        )
    return rows


def print_kinds(paths: list[PathMeasurement], rows: int) -> None:
    """Per path, the op kinds it dispatches most beyond the plain engine's."""
    base = paths[0]
    for path in paths[1:]:
        top = excess_kinds(path, base, rows)
        print(
            f"{path.name} beyond plain: "
            + ", ".join(f"{kind} {n} (plain {b}, +{n - b})" for kind, n, b in top)
        )


def parse_cli() -> argparse.Namespace:
    """The benchmark's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", nargs="+", choices=list(PATH_FLAGS), default=list(PATH_FLAGS))
    parser.add_argument("--warmup", type=int, default=2, help="iterations before counting")
    parser.add_argument("--count", type=int, default=2, help="counted iterations per path")
    parser.add_argument("--rounds", type=int, default=10, help="timed iterations per pass")
    parser.add_argument("--passes", type=int, default=2, help="fresh processes per path")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument(
        "--torch-compile", action="store_true", help="--torch-compile on every path"
    )
    parser.add_argument("--kinds", type=int, default=8, help="op kinds per path beyond plain's")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    cli = parser.parse_args()
    if min(cli.warmup, cli.count, cli.rounds, cli.passes) < 1:
        parser.error("--warmup, --count, --rounds and --passes must be at least 1")
    if cli.paths[0] != "plain":
        cli.paths = ["plain", *[name for name in cli.paths if name != "plain"]]
    return cli


def main() -> None:
    """Measure every path, print the table, the targets' verdicts and the excess op kinds."""
    cli = parse_cli()
    torch.set_num_threads(cli.threads)  # what the header reports; each path's process sets it
    shape = MeterShape(precision=cli.precision, torch_compile=cli.torch_compile)
    print_header(shape)
    paths = run_passes(cli, shape)
    check_losses(paths)
    rows = print_table(paths)
    for row in rows:
        if row["path"] in TARGET_PATHS:
            verdict = "PASS" if row["ops_ratio"] <= TARGET_RATIO else "over target"
            print(f"{row['path']}: {row['ops_ratio']:.2f}x plain's ops (target <= 1.2x) {verdict}")
    print_kinds(paths, cli.kinds)
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"load average at the end {load}")
    if cli.json:
        with open(cli.json, "w", encoding="utf-8") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
