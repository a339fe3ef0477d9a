"""Oracle job: megatron-core's `OptimizerParamScheduler` lr per step, run with megatron-core
importable as `megatron`.

Usage: python megatron_core_lr_schedules.py CASES.json OUT.json. Each case is
{"name", "kwargs" (the scheduler's arguments but the optimizer), "groups" ([{"max_lr",
"min_lr"} or {}]), "steps" ([sample counts])}; OUT.json maps each name to, for each step,
the lr of every group after stepping to it.
"""

import json
import sys

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def lrs(case: dict) -> list[list[float]]:
    """The case's lr of every group at each of its steps."""
    weights = [torch.nn.Parameter(torch.zeros(1)) for _ in case["groups"]]
    groups = [{"params": [w], **extra} for w, extra in zip(weights, case["groups"])]
    optimizer = torch.optim.SGD(groups, lr=0.0)
    scheduler = OptimizerParamScheduler(optimizer, **case["kwargs"])
    out, done = [], 0
    for step in case["steps"]:
        scheduler.step(step - done)
        done = step
        out.append([group["lr"] for group in optimizer.param_groups])
    return out


def main() -> None:
    """Read the cases, write megatron-core's learning rates."""
    with open(sys.argv[1]) as stream:
        cases = json.load(stream)
    with open(sys.argv[2], "w") as out:
        json.dump({case["name"]: lrs(case) for case in cases}, out)


if __name__ == "__main__":
    main()
