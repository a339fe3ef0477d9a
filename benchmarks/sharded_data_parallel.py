"""Sharded data parallelism on CPU: DDP, torch FSDP2 and DeepSpeed ZeRO at DP = 2 and 4.

For one small fp32 GPT (4 layers, h 256, 4 heads, seq 256, GPT-2's 50k vocabulary, micro-batch
2, two micro-batches per iteration) and each of

- DDP on the plain engine (the baseline),
- `--use-distributed-optimizer` (FSDP2 optim_grads, the ZeRO-2 pattern),
- `--use-torch-fsdp2` (FSDP2 optim_grads_params, the ZeRO-3 pattern),
- DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 (`--deepspeed --zero-stage N --no-pipeline-parallel`),

it trains a few iterations under `benchmarks/measured_run.py` (as `planner_configs.run` does)
and plans the same flags with `--dry-run` (as `planner_accuracy.plan` does), then prints per
layout: the largest rank's peak tensor bytes after the first iteration and its ratio to DDP's
at the same DP, the planner's prediction for that rank (and the worst predicted / measured
ratio over all ranks), and the median `elapsed time per iteration (ms)` of the iterations
after the first two, with its ratio to DDP's in the same run. The step times are taken under
the memory meter (the allocator's events only), the same for every layout.

    python benchmarks/sharded_data_parallel.py [--dp 2 4] [--iters 6] [--only NAME ...]

measured_run does not count optimizer state apart from other tensors, so no such column.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.machine import describe_machine  # noqa: E402
from benchmarks.planner_accuracy import plan, ratio  # noqa: E402
from benchmarks.planner_configs import PlannerConfig, run  # noqa: E402
from tests.pretrain_runs import build_stdlib_dataset, iteration_logs  # noqa: E402

MICRO_BATCH = 2
ACCUMULATION = 2
SKIPPED_ITERATIONS = 2
"""Iterations left out of the step time: the first builds the optimizer state, the second
still pays first-touch costs."""

# (name, launcher, flags, ZeRO stage or None for the plain engine)
LAYOUTS = (
    ("ddp", "torchrun", (), None),
    ("distributed-optimizer", "torchrun", ("--use-distributed-optimizer",), None),
    ("torch-fsdp2", "torchrun", ("--use-torch-fsdp2",), None),
    ("ds-zero1", "deepspeed", (), 1),
    ("ds-zero2", "deepspeed", (), 2),
    ("ds-zero3", "deepspeed", (), 3),
)


def config_for(name: str, launcher: str, flags: tuple, stage: int | None, dp: int, iters: int):
    """The PlannerConfig of one layout at `dp` ranks (its flags override the shared model's)."""
    global_batch = MICRO_BATCH * ACCUMULATION * dp
    shape = f"--num-layers 4 --micro-batch-size {MICRO_BATCH} --train-iters {iters}"
    shape += f" --global-batch-size {global_batch}"
    flags = (*shape.split(), *flags)
    ds_config = None
    if stage is not None:
        flags = (*flags, "--no-pipeline-parallel", "--zero-stage", str(stage))
        ds_config = {
            "train_batch_size": global_batch,
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
        }
    return PlannerConfig(f"{name}-dp{dp}", launcher, dp, flags, ds_config)


def step_ms(output: str) -> float:
    """Median `elapsed time per iteration (ms)` of the iterations after the skipped ones."""
    logs = [log for log in iteration_logs(output) if log["iteration"] > SKIPPED_ITERATIONS]
    if not logs:
        raise RuntimeError("no timed iteration in the log: raise --iters")
    return statistics.median(log["elapsed time per iteration (ms)"] for log in logs)


def measure(config: PlannerConfig, data_prefix: str, work_dir: str) -> dict:
    """Plan and run `config`; the largest rank's peak, its prediction, worst ratio, step ms."""
    predicted, _ = plan(config, data_prefix, work_dir)
    result = run(config, data_prefix, work_dir)
    if result["returncode"] != 0:
        raise RuntimeError(f"{config.name}: the run failed:\n{result['output'][-3000:]}")
    pairs = [
        (predicted["ranks"][r["rank"]]["memory"]["peak_bytes"], r["peak_tensor_bytes_after_first"])
        for r in result["reports"]
    ]
    largest = max(pairs, key=lambda pair: pair[1])
    worst = max((ratio(*pair) for pair in pairs), key=lambda value: abs(value - 1))
    return {
        "predicted": largest[0],
        "measured": largest[1],
        "worst_ratio": worst,
        "step_ms": step_ms(result["output"]),
        "wall": result["wall_seconds"],
    }


HEADER = (
    "| layout | DP | peak MiB (largest rank) | vs DDP (1/DP) | planned MiB | planned / measured "
    "(worst rank) | step ms (median) | vs DDP | wall s |\n|---|---|---|---|---|---|---|---|---|"
)


def format_row(name: str, dp: int, row: dict, baseline: dict) -> str:
    """One markdown row; ratios against DDP's row at the same DP."""
    mib = 2**20
    oversubscribed = " (oversubscribed)" if dp > (os.cpu_count() or 1) else ""
    return (
        f"| {name} | {dp}{oversubscribed} | {row['measured'] / mib:.1f} | "
        f"{row['measured'] / baseline['measured']:.2f}x ({1 / dp:.2f}) | "
        f"{row['predicted'] / mib:.1f} | {ratio(row['predicted'], row['measured']):.3f} "
        f"({row['worst_ratio']:.3f}) | {row['step_ms']:.0f} | "
        f"**{row['step_ms'] / baseline['step_ms']:.2f}x** | {row['wall']:.0f} |"
    )


def main() -> int:
    """Measure every layout at every DP; print the table; exit 1 if a plan misses by > 10%."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--iters", type=int, default=6, help="train iterations per run")
    parser.add_argument("--only", nargs="*", help="layout names (default: all; ddp always)")
    parser.add_argument("--out", help="where plans and reports go (default: a temporary folder)")
    parser.add_argument("--data-path", help="a dataset prefix (default: build a stdlib one)")
    cli = parser.parse_args()
    work_dir = cli.out or tempfile.mkdtemp(prefix="sharded_data_parallel_")
    os.makedirs(work_dir, exist_ok=True)
    data_prefix = cli.data_path or build_stdlib_dataset(work_dir)
    dps = ", ".join(map(str, cli.dp))
    print(f"machine: {describe_machine(f'DP = {dps} processes per run, OMP_NUM_THREADS=1')}")
    print(HEADER, flush=True)
    misses = 0
    for dp in cli.dp:
        baseline = None
        for name, launcher, flags, stage in LAYOUTS:
            if cli.only and name != "ddp" and name not in cli.only:
                continue
            row = measure(
                config_for(name, launcher, flags, stage, dp, cli.iters), data_prefix, work_dir
            )
            baseline = baseline or row
            misses += abs(row["worst_ratio"] - 1) > 0.10
            print(format_row(name, dp, row, baseline), flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
