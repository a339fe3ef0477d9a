"""pretrain_gpt.py trains a Mixture-of-Experts GPT without DeepSpeed, on CPUs over gloo.

A tiny GPT-2 (2 layers, hidden 64) with 4 DeepSpeed-MoE experts in every layer, top-2, runs 6
iterations on 2 ranks under torchrun: at PP=2 on Megatron's pipeline schedules (each stage's
MoE loss reaching the backward through autograd, the logged 'moe loss' summed over both
stages' layers), and at PP=1 on plain torch with DDP over 2 data-parallel ranks. Every
iteration logs a positive, finite 'moe loss' beside 'lm loss', the LM loss falls (by tenths,
far beyond rounding), and the validation block reports both. (That such a run equals one
process's arithmetic is tests/core/test_moe_pipeline.py's; resuming it bit-exactly is
tests/checkpointing/test_resume.py's.)
"""

from __future__ import annotations

import math

import pytest

from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags

MOE = "--num-experts 4 --expert-interval 1 --topk 2 --global-batch-size 4 --train-iters 6"
LAYOUTS = {
    "megatron-pp2": "--pipeline-model-parallel-size 2",
    "plain-dp2": "--pipeline-model-parallel-size 1",
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_trains_without_deepspeed(layout: str, stdlib_dataset: str) -> None:
    flags = tiny_gpt_flags(stdlib_dataset) + f"{MOE} {LAYOUTS[layout]}".split()
    run = launch(2, flags)
    assert run.returncode == 0, run.stdout[-3000:]
    logs = iteration_logs(run.stdout)
    assert [log["iteration"] for log in logs] == list(range(1, 7)), run.stdout[-3000:]
    for log in logs:
        assert math.isfinite(log["lm loss"]), log
        assert 0 < log["moe loss"] < math.inf, log
    assert logs[-1]["lm loss"] < logs[0]["lm loss"] - 0.1, [log["lm loss"] for log in logs]
    validation = [line for line in run.stdout.splitlines() if "validation loss at" in line]
    assert validation and all("moe loss value" in line for line in validation), validation
