"""How close `pretrain_gpt.py --dry-run` comes to real runs: memory and communication per rank.

For every configuration of `planner_configs.CONFIGS` (plain fp32 and bf16 DDP, TP=2 with
sequence parallelism and selective recompute, TP=2 with full recompute, DeepSpeed ZeRO 1, 2
and 3 in bf16 at DP=2, DeepSpeed's pipeline engine at PP=2, Megatron's 1F1B and interleaved
schedules at PP=2,
DeepSpeed-Ulysses and -MoE, a LLaMA-style shape plain and under ZeRO-2 with TP=2, fp16
at ZeRO-0 and ZeRO-1 on both DeepSpeed engines where DeepSpeed's CPU accelerator has fp16,
and torch FSDP2's two strategies in fp32 and bf16 on the plain engine):

- the plan: `pretrain_gpt.py FLAGS --dry-run --dry-run-world-size N --dry-run-json plan.json`,
  as a user runs it (its wall time is reported too);
- the run: 3 iterations under `benchmarks/measured_run.py` (peak tensor bytes from the
  allocator's events after the first iteration, when the optimizer state exists; the bytes
  handed to every collective in iteration 3; the framework's resident memory apart);
- per rank: predicted / measured peak memory and communication. Targets: memory within 10%,
  communication within 5%.

    python benchmarks/planner_accuracy.py [--only NAME ...] [--out DIR] [--data-path PREFIX]
    python benchmarks/planner_accuracy.py --bloom [--out DIR]   # BLOOM-176B's plans only

`--bloom` plans BigScience's BLOOM-176B layout (384 A100 80GB: bf16 ZeRO-0 as it ran, and fp16
ZeRO-1) the same way, and prints each stage kind's predicted peak and the predicted step
beside nothing measured here (benchmarks/RESULTS.md sets them beside BigScience's figures).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.machine import describe_machine  # noqa: E402
from benchmarks.planner_configs import (  # noqa: E402
    CONFIGS,
    PRETRAIN_GPT,
    PlannerConfig,
    bloom_ds_config,
    bloom_flags,
    cpu_runs_fp16,
    pretrain_flags,
    run,
    write_bloom_tokenizer,
)
from tests.pretrain_runs import build_stdlib_dataset, cpu_env  # noqa: E402

MEMORY_TARGET = 0.10
COMMUNICATION_TARGET = 0.05
_KINDS = ("tensor_parallel", "data_parallel", "pipeline", "all_to_all")


def plan(
    config: PlannerConfig, data_prefix: str, work_dir: str, in_process: bool = False
) -> tuple[dict, float]:
    """The dry run's JSON for `config` and its wall seconds: in a fresh process, as a user
    runs it, or (`in_process`, for the tests) through the same `run_dry_run` in this one."""
    ds_config_path = None
    if config.ds_config is not None:
        ds_config_path = os.path.join(work_dir, f"{config.name}.ds_config.json")
        with open(ds_config_path, "w") as file:
            json.dump(config.ds_config, file)
    path = os.path.join(work_dir, f"{config.name}.plan.json")
    flags = pretrain_flags(config, data_prefix, ds_config_path)
    flags += ["--dry-run", "--dry-run-world-size", str(config.processes), "--dry-run-json", path]
    started = time.time()
    if in_process:
        from megatron.dry_run import run_dry_run

        with contextlib.redirect_stdout(io.StringIO()):
            run_dry_run(flags)
    else:
        done = subprocess.run(
            [sys.executable, PRETRAIN_GPT, *flags],
            cwd=REPO_ROOT,
            env=cpu_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{config.name}: the dry run failed:\n{done.stdout}{done.stderr}")
    seconds = time.time() - started
    with open(path) as file:
        return json.load(file), seconds


def compare(
    config: PlannerConfig,
    data_prefix: str,
    work_dir: str,
    in_process: bool = False,
    launch: Callable[..., subprocess.CompletedProcess] | None = None,
) -> list[dict]:
    """One row per rank: predicted (`plan`) and measured peak memory and communication
    (`launch` starts the measured run: `planner_configs.run`'s)."""
    predicted, plan_seconds = plan(config, data_prefix, work_dir, in_process)
    result = run(config, data_prefix, work_dir, launch=launch)
    if result["returncode"] != 0:
        raise RuntimeError(f"{config.name}: the run failed:\n{result['output'][-3000:]}")
    rows = []
    for report in result["reports"]:
        entry = predicted["ranks"][report["rank"]]
        measured_comm = next(i for i in report["iterations"] if i["iteration"] == 3)["comm_bytes"]
        predicted_comm = entry["comm_bytes_per_iteration"]
        rows.append(
            {
                "config": config.name,
                "rank": report["rank"],
                "predicted_peak": entry["memory"]["peak_bytes"],
                "peak_at": entry["memory"]["peak_at"],
                "measured_peak": report["peak_tensor_bytes_after_first"],
                "framework_resident": report["framework_resident_bytes"],
                "predicted_comm": {kind: predicted_comm[kind] for kind in (*_KINDS, "total")},
                "measured_comm": {kind: measured_comm[kind] for kind in (*_KINDS, "total")},
                "plan_seconds": plan_seconds,
            }
        )
    return rows


def ratio(predicted: float, measured: float) -> float:
    """predicted / measured; 1.0 when both are zero (nothing to predict, nothing sent)."""
    if measured == 0:
        return 1.0 if predicted == 0 else float("inf")
    return predicted / measured


def within_targets(row: dict) -> bool:
    """Memory within 10% and communication within 5% (total and every kind)."""
    memory = abs(ratio(row["predicted_peak"], row["measured_peak"]) - 1) <= MEMORY_TARGET
    kinds = (*_KINDS, "total")
    comm = all(
        abs(ratio(row["predicted_comm"][kind], row["measured_comm"][kind]) - 1)
        <= COMMUNICATION_TARGET
        for kind in kinds
    )
    return memory and comm


def format_row(row: dict) -> str:
    """A markdown table row."""
    mib = 2**20
    comm_p, comm_m = row["predicted_comm"]["total"], row["measured_comm"]["total"]
    kinds = ", ".join(
        f"{kind.split('_')[0]} {row['predicted_comm'][kind] / 1e6:.2f}/"
        f"{row['measured_comm'][kind] / 1e6:.2f}"
        for kind in _KINDS
        if row["predicted_comm"][kind] or row["measured_comm"][kind]
    )
    return (
        f"| {row['config']} | {row['rank']} | {row['predicted_peak'] / mib:.1f} "
        f"({row['peak_at']}) | {row['measured_peak'] / mib:.1f} | "
        f"{ratio(row['predicted_peak'], row['measured_peak']):.3f} | "
        f"{row['framework_resident'] / mib:.0f} | {comm_p / 1e6:.2f} | {comm_m / 1e6:.2f} | "
        f"{ratio(comm_p, comm_m):.4f} | {kinds or '-'} | {row['plan_seconds']:.1f} |"
    )


HEADER = (
    "| config | rank | predicted peak MiB (moment) | measured peak MiB | memory ratio | "
    "framework MiB (not predicted) | predicted comm MB | measured comm MB | comm ratio | "
    "by kind, predicted/measured MB | dry run s |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def dry_run_json(flags: list[str], path: str) -> tuple[dict, float]:
    """`pretrain_gpt.py FLAGS --dry-run-json path` in a fresh process; its JSON and wall s."""
    started = time.time()
    done = subprocess.run(
        [sys.executable, PRETRAIN_GPT, *flags, "--dry-run-json", path],
        cwd=REPO_ROOT,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the dry run failed:\n{done.stdout}{done.stderr}")
    with open(path) as file:
        return json.load(file), time.time() - started


def bigscience_tflops(layers: int, hidden: int, vocab: int, seconds: float) -> float:
    """TFLOP/s per GPU as BigScience's log line counts them for BLOOM's batch (2048 x 2048
    tokens, 384 GPUs) with recomputation: Narayanan et al. 2021's Eq. 3 with 4 passes,
    24 x 4 B s L h^2 (1 + s / 6h + V / 16Lh) (bigscience-workshop/Megatron-DeepSpeed PR 251)."""
    batch, seq, world = 2048, 2048, 384
    flops = 24 * 4 * batch * seq * layers * hidden**2
    flops *= 1 + seq / (6 * hidden) + vocab / (16 * layers * hidden)
    return flops / (seconds * world * 1e12)


# (row, precision, ZeRO stage, heads, layers of the plan the end stages come from, layers of
# the plan the middle stages and the step come from, layers the TFLOPs formula counts)
BLOOM_ROWS = (
    ("BLOOM-176B, bf16 ZeRO-0 (its flags)", "bf16", 0, 112, 60, 72, 70),
    # BigScience's BF16_Optimizer accumulated in fp32 (tr11 README); DeepSpeed 0.19 runs
    # that at ZeRO-1 only (at ZeRO-0 it accumulates bf16 gradients in bf16).
    ("BLOOM-176B, bf16 ZeRO-1, fp32 accumulation", "bf16", 1, 112, 60, 72, 70),
    ("BLOOM-176B, fp16 ZeRO-1", "fp16", 1, 112, 60, 72, 70),
    ("BigScience's fp16 ZeRO-1 test shape (72 layers, 64 heads)", "fp16", 1, 64, 72, 72, 72),
)


def bloom_table(work_dir: str) -> list[str]:
    """The BLOOM-176B plans as markdown rows (see `BLOOM_ROWS` and planner_configs)."""
    tokenizer = write_bloom_tokenizer(os.path.join(work_dir, "bloom_tokenizer.json"))
    device = ["--dry-run", "--dry-run-world-size", "384", "--dry-run-device", "A100-80GB"]
    rows = [
        "| layout | first stage GiB | busiest middle stage GiB | last stage GiB | "
        "fits (78 GiB usable) | predicted step s | TFLOPs per GPU | dry run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gib = 2**30
    for name, precision, stage, heads, ends, middle, counted in BLOOM_ROWS:
        config_path = os.path.join(work_dir, f"bloom_{precision}_zero{stage}.json")
        with open(config_path, "w") as file:
            json.dump(bloom_ds_config(precision, stage), file)
        plans, seconds = {}, 0.0
        for layers in sorted({ends, middle}):
            flags = bloom_flags(layers, heads, precision, stage, tokenizer, config_path)
            plan_name = f"bloom_{precision}_zero{stage}_{layers}x{heads}.plan.json"
            path = os.path.join(work_dir, plan_name)
            plans[layers], wall = dry_run_json(flags + device, path)
            seconds += wall
        peaks = {}
        for layers, plan in plans.items():
            for entry in plan["ranks"]:
                memory = entry["memory"]
                key = (layers, entry["pp_rank"])
                peaks[key] = (memory["peak_bytes"], memory["peak_at"])
        first, last = peaks[(ends, 0)], peaks[(ends, 11)]
        busiest = max(peaks[(middle, stage_)] for stage_ in range(1, 11))
        step = plans[middle]["device"]["step_seconds"]
        fits = max(first[0], busiest[0], last[0]) <= plans[middle]["device"]["usable_bytes"]
        tflops = bigscience_tflops(counted, 14336, 250_880, step)
        rows.append(
            f"| {name} | {first[0] / gib:.2f} ({first[1]}) | {busiest[0] / gib:.2f} "
            f"({busiest[1]}) | {last[0] / gib:.2f} ({last[1]}) | {'yes' if fits else 'NO'} | "
            f"{step:.1f} | {tflops:.1f} | {seconds:.1f} |"
        )
    return rows


def main() -> int:
    """Plan and run each configuration; print every ratio; exit 1 if a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    parser.add_argument("--out", help="where plans and reports go (default: a temporary folder)")
    parser.add_argument("--data-path", help="a dataset prefix (default: build a stdlib one)")
    parser.add_argument("--bloom", action="store_true", help="plan BLOOM-176B's layouts only")
    cli = parser.parse_args()
    work_dir = cli.out or tempfile.mkdtemp(prefix="planner_accuracy_")
    os.makedirs(work_dir, exist_ok=True)
    if cli.bloom:
        print("\n".join(bloom_table(work_dir)))
        return 0
    data_prefix = cli.data_path or build_stdlib_dataset(work_dir)
    processes = "2 processes per run (1 for plain-1, 4 for ds-zero1-fp16-dp4)"
    print(f"machine: {describe_machine(processes)}")
    print(HEADER)
    rows = []
    for config in CONFIGS:
        if cli.only and config.name not in cli.only:
            continue
        if config.fp16 and not cpu_runs_fp16():
            print(f"| {config.name} | skipped: DeepSpeed has no fp16 on this CPU |", flush=True)
            continue
        for row in compare(config, data_prefix, work_dir):
            rows.append(row)
            print(format_row(row), flush=True)
    memory = [ratio(row["predicted_peak"], row["measured_peak"]) for row in rows]
    comm = [ratio(row["predicted_comm"]["total"], row["measured_comm"]["total"]) for row in rows]
    print(
        f"memory ratios {min(memory):.3f}-{max(memory):.3f} (target within "
        f"{MEMORY_TARGET:.0%}); communication ratios {min(comm):.4f}-{max(comm):.4f} "
        f"(target within {COMMUNICATION_TARGET:.0%}); {len(rows)} ranks of "
        f"{len({row['config'] for row in rows})} configurations"
    )
    return 0 if all(within_targets(row) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
