"""Memory of a torch_dist save and load under FSDP2 sharding at DP = 4, CPU, against a checkout
whose saves gather (issue 55).

For `--use-distributed-optimizer` (FSDP2 optim_grads) and `--use-torch-fsdp2` (optim_grads_params)
on one fp32 GPT (4 layers, h 256, 4 heads, GPT-2's 50k vocabulary: 16.1M parameters, so 246
MiB of weights, gradients and Adam state whole; sequences of 64 tokens, one a micro-batch, so
the step's activations stay small beside what a save could gather), each checkout runs under
`benchmarks/measured_run.py` (every rank's live tensor bytes per iteration, from the
profiler's allocator events):

- straight: 4 iterations at DP = 4, `--ckpt-format torch_dist`, a save after iterations 2
  and 4. Save transient = the live tensor bytes the save of iteration 2 adds at its peak
  (measured_run marks each save's start and end), largest rank;
- resumed: from that checkout's checkpoint of iteration 2, at DP = 4: the start-up peak
  (before the first iteration: model, optimizer and the load) minus the straight run's (the
  same without a load) is the load transient; its losses of iterations 3 and 4 against the
  straight run's;
- this checkout only: resumed at DP = 2 (the same global batch), the losses against the
  straight run's.

    python benchmarks/checkpoint_memory.py --baseline-checkout /tmp/before [--out DIR]

`--baseline-checkout`: a checkout of the code to compare with (its `.so` extensions built),
run from its own directory (`PYTHONPATH` pointing there); without it only this checkout runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.machine import describe_machine  # noqa: E402
from benchmarks.planner_configs import PlannerConfig, _launch, run  # noqa: E402
from tests.pretrain_runs import build_stdlib_dataset, iteration_logs  # noqa: E402

STRATEGIES = {
    "distributed-optimizer": "--use-distributed-optimizer",
    "torch-fsdp2": "--use-torch-fsdp2",
}
MIB = 2**20


def _config(name: str, strategy: str, dp: int, save: str, load: str | None) -> PlannerConfig:
    flags = f"--num-layers 4 --seq-length 64 --micro-batch-size 1 --global-batch-size 8 {strategy}"
    flags += " --train-iters 4"
    flags += f" --ckpt-format torch_dist --save {save} --save-interval 2"
    if load:
        flags += f" --load {load}"
    return PlannerConfig(name, "torchrun", dp, tuple(flags.split()), None)


def _run(config: PlannerConfig, data: str, work: str, checkout: str) -> dict:
    """`config` run from `checkout`'s code, measured; fails loudly when the run fails."""

    def launch(argv, env, cwd, timeout):  # noqa: ANN001, ANN202
        # That checkout's pretrain_gpt.py (and so its megatron); this one's meters and launcher.
        script = os.path.join(REPO_ROOT, "pretrain_gpt.py")
        argv = [os.path.join(checkout, "pretrain_gpt.py") if arg == script else arg for arg in argv]
        return _launch(argv, dict(env, PYTHONPATH=checkout), checkout, timeout)

    result = run(config, data, work, launch=launch)
    if result["returncode"] != 0:
        raise RuntimeError(f"{config.name} ({checkout}) failed:\n{result['output'][-3000:]}")
    return result


def _largest(result: dict, pick) -> int:  # noqa: ANN001
    return max(pick(report) for report in result["reports"])


def _peak(iteration: int):  # noqa: ANN202
    return lambda report: report["iterations"][iteration - 1]["peak_tensor_bytes"]


def _save_added(iteration: int):  # noqa: ANN202
    """A report's live tensor bytes added by the save of `iteration` (its peak over its start)."""

    def added(report: dict) -> int:
        (save,) = [s for s in report["saves"] if s["iteration"] == iteration]
        return save["peak_tensor_bytes"] - save["tensor_bytes_at_start"]

    return added


def _losses(result: dict) -> dict[int, float]:
    return {log["iteration"]: log["lm loss"] for log in iteration_logs(result["output"])}


def measure(checkout: str, data: str, work: str, name: str, strategy: str, other_dp: bool) -> dict:
    """The save and load transients of `strategy` at DP = 4 with `checkout`'s code."""
    base = os.path.join(work, f"{name}-{os.path.basename(checkout.rstrip('/'))}")
    os.makedirs(base, exist_ok=True)
    save = os.path.join(base, "save")
    straight = _run(_config(f"{name}-straight", strategy, 4, save, None), data, base, checkout)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("2")  # resume from iteration 2's checkpoint
    again = os.path.join(base, "again")
    resumed = _run(_config(f"{name}-resumed", strategy, 4, again, save), data, base, checkout)
    row = {
        "state": _largest(straight, _peak(3)),
        "save": _largest(straight, _save_added(2)),
        "load": _largest(resumed, lambda r: r["peak_tensor_bytes_before_first"])
        - _largest(straight, lambda r: r["peak_tensor_bytes_before_first"]),
        "same losses": all(_losses(resumed)[i] == _losses(straight)[i] for i in (3, 4)),
    }
    if other_dp:
        config = dataclasses.replace(
            _config(f"{name}-dp2", strategy, 2, os.path.join(base, "dp2"), save), processes=2
        )
        at_two = _losses(_run(config, data, base, checkout))
        row["dp2 worst relative"] = max(
            abs(at_two[i] - _losses(straight)[i]) / _losses(straight)[i] for i in (3, 4)
        )
    return row


def main() -> int:
    """Measure both strategies with this checkout (and the baseline's), print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-checkout", default=None)
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    options = parser.parse_args()
    work = options.out or tempfile.mkdtemp(prefix="checkpoint_memory_")
    os.makedirs(os.path.join(work, "data"), exist_ok=True)
    data = build_stdlib_dataset(os.path.join(work, "data"))
    print(describe_machine("4 ranks (torchrun)"))
    print(
        "| strategy | code | live tensors, iteration 3 (MiB) | save adds (MiB) | load adds "
        "(MiB) | resumed losses at DP=4 | resumed at DP=2, worst relative loss difference |"
    )
    print("|---|---|---|---|---|---|---|")
    checkouts = [("this checkout", REPO_ROOT)]
    if options.baseline_checkout:
        checkouts.append(("baseline", os.path.abspath(options.baseline_checkout)))
    for name, strategy in STRATEGIES.items():
        for label, checkout in checkouts:
            row = measure(checkout, data, work, name, strategy, checkout == REPO_ROOT)
            dp2 = row.get("dp2 worst relative")
            print(
                f"| {name} | {label} | {row['state'] / MIB:.1f} | {row['save'] / MIB:.1f} | "
                f"{row['load'] / MIB:.1f} | {'bit for bit' if row['same losses'] else 'DIFFER'} | "
                f"{'-' if dp2 is None else f'{dp2:.1e}'} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
