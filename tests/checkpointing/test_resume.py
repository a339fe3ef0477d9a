"""Bit-exact resume: N iterations, stop, resume, N more equals 2N straight, in every layout.

Each case runs `pretrain_gpt.py` twice as a user would (torchrun for 2 processes, with
dropout on and gradient accumulation): 2N iterations straight, saving at N and 2N; and a
resume from a copy of the checkpoint at N to 2N. The losses of every resumed iteration must
match (the LM loss, and the MoE load-balancing loss where there is one), and the final
checkpoints must be identical file by file, tensor by tensor (weights, optimizer state,
scheduler, RNG states), `args` aside. (Stopping by --exit-interval, then resuming, is covered
by test_load_options.py and test_reshard_resume.py.)

The Mixture-of-Experts cases on DeepSpeed's engine (4 experts per layer spread over 2
expert-parallel ranks, started by the deepspeed launcher as Megatron-DeepSpeed's MoE scripts
are) write DeepSpeed's expert files and per-expert-rank optimizer state; the one on Megatron's
pipeline schedules (EP=1) writes Megatron's per-stage files, every expert in them. Their gating
draws random numbers (top-2's sampled second expert, top-1's random token selection) from
torch's generator, which the checkpoint's RNG state restores.
"""

from __future__ import annotations

import os

import pytest

from tests.checkpointing.compare import differences, rolled_back
from tests.conftest import REPO_ROOT
from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags

N = 2
GLOBAL_BATCH = 8
"""2 data-parallel ranks x micro-batch 2 -> 2 accumulated micro-batches (4 with one rank)."""


def _ds(stage: int) -> list[str]:
    config = os.path.join(REPO_ROOT, "examples", "ds_configs", f"ds_zero{stage}.json")
    return ["--deepspeed", "--deepspeed_config", config]


TP2 = ["--tensor-model-parallel-size", "2"]
MOE_EP2 = "--no-pipeline-parallel --num-experts 4 --expert-interval 1 --moe-expert-parallel-size 2"
MOE_ZERO0_FP32 = ["--deepspeed", "--zero-stage", "0", *MOE_EP2.split(), "--topk", "2"]
MOE_ZERO1_BF16 = _ds(1) + MOE_EP2.split() + [
    "--topk", "1", "--bf16", "--create-moe-param-group", "--mlp-type", "residual",
]  # fmt: skip
PP2 = ["--pipeline-model-parallel-size", "2"]
PP2_4_LAYERS = PP2 + "--num-layers 4 --seq-length 32 --max-position-embeddings 32".split()
MOE_MEGATRON_PP2 = PP2 + "--num-experts 4 --expert-interval 1 --topk 2".split()
CASES = {
    # Megatron's layout: 2 tensor-parallel files, each with its RNG states; 2 x 2 virtual
    # stages under Megatron's interleaved 1F1B (files with model0, model1; 4 micro-batches per
    # step; its plain 1F1B resumes in the MoE case at PP=2 below). DeepSpeed's: the pipeline
    # engine (ZeRO-1, also at PP=1), the plain engine (ZeRO-2), TP and PP splits; DeepSpeed-MoE
    # at EP=2 (ZeRO-0 fp32 top-2; ZeRO-1 bf16 top-1 PR-MoE with DeepSpeed's expert parameter
    # groups); and DeepSpeed-MoE without DeepSpeed's engine, on Megatron's 1F1B at PP=2 (EP=1,
    # top-2).
    "megatron-tp2": (2, TP2),
    "megatron-pp2-vpp2": (2, PP2_4_LAYERS + ["--virtual-pipeline-model-parallel-size", "2"]),
    "zero1-dp2": (2, _ds(1)),
    "zero2-dp2": (2, _ds(2)),
    "deepspeed-tp2": (2, _ds(1) + TP2),
    "deepspeed-pp2": (2, _ds(1) + PP2),
    "moe-ep2-zero0-fp32": (2, MOE_ZERO0_FP32),
    "moe-ep2-zero1-bf16": (2, MOE_ZERO1_BF16),
    "moe-megatron-pp2": (2, MOE_MEGATRON_PP2),
}


def _losses(output: str) -> list[tuple[int, float, float | None]]:
    return [
        (log["iteration"], log["lm loss"], log.get("moe loss")) for log in iteration_logs(output)
    ]


def _final_directory(save: str) -> str:
    if os.path.isfile(os.path.join(save, "latest")):
        return os.path.join(save, f"global_step{2 * N}")
    return os.path.join(save, f"iter_{2 * N:07d}")


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_and_resume_equals_straight_run(case: str, stdlib_dataset: str, tmp_path) -> None:
    processes, extra = CASES[case]
    launcher = "deepspeed" if "--deepspeed" in extra and case.startswith("moe") else "torchrun"
    flags = tiny_gpt_flags(stdlib_dataset) + extra
    flags += ["--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(2 * N)]
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")

    # The straight run also saves at N; the resume starts from a copy holding only that one.
    saving = ["--save", straight_dir, "--save-interval", str(N)]
    straight = launch(processes, flags + saving, launcher=launcher)
    assert straight.returncode == 0, straight.stdout[-3000:]
    rolled_back(straight_dir, N, resumed_dir)
    resuming = ["--load", resumed_dir, "--save", resumed_dir, "--save-interval", "100"]
    second = launch(processes, flags + resuming, launcher=launcher)
    assert second.returncode == 0, second.stdout[-3000:]

    assert f"at iteration {N}" in second.stdout and "loaded" in second.stdout
    straight_losses = _losses(straight.stdout)
    assert [it for it, *_ in straight_losses] == list(range(1, 2 * N + 1))
    assert all((moe is None) != case.startswith("moe") for *_, moe in straight_losses)
    assert _losses(second.stdout) == straight_losses[N:]
    assert differences(_final_directory(straight_dir), _final_directory(resumed_dir)) == []
