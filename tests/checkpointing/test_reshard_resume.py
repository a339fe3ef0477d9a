"""A resharded checkpoint resumes with the same loss: DeepSpeed PP=2 -> Megatron TP=2 -> TP=1.

A DeepSpeed pipeline run (PP=2, ZeRO-1) stops at iteration 2. Resumed as it is, its next
iteration has some loss; converted by `tools/checkpoint/reshard.py` to Megatron's layout at
TP=2 (plain torch, 2 ranks) and then to TP=1 (one process), each resumes at iteration 3 with
the same loss (dropout off; only reduction order differs), keeping the run's progress. The
vocabulary is padded to the same 50304 rows at every size (`--make-vocab-size-divisible-by
64`): the padding logits are part of the softmax, as in Megatron.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.pretrain_runs import cpu_env, iteration_logs, launch, tiny_gpt_flags

DS_ZERO1 = ["--deepspeed", "--deepspeed_config", f"{REPO_ROOT}/examples/ds_configs/ds_zero1.json"]


def _flags(dataset: str, *extra: str) -> list[str]:
    return tiny_gpt_flags(dataset) + [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4",
        "--train-iters", "4", "--exit-interval", "3", *extra,
        # 50304 rows at TP 1 and 2: new zero padding rows would join the softmax.
        "--make-vocab-size-divisible-by", "64",
    ]  # fmt: skip


def _reshard(source: str, target: str, tp: int, pp: int) -> None:
    result = subprocess.run(
        [
            sys.executable, f"{REPO_ROOT}/tools/checkpoint/reshard.py", "--load", source,
            "--save", target, "--target-tensor-parallel-size", str(tp),
            "--target-pipeline-parallel-size", str(pp),
        ],
        capture_output=True, text=True, env=cpu_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def _next_loss(run: subprocess.CompletedProcess) -> float:
    assert run.returncode == 0, run.stdout[-3000:]
    logs = iteration_logs(run.stdout)
    assert [log["iteration"] for log in logs] == [3]
    return logs[0]["lm loss"]


@pytest.mark.slow
def test_resharded_checkpoint_resumes_with_the_same_loss(stdlib_dataset: str, tmp_path) -> None:
    original = str(tmp_path / "pp2")
    first = launch(
        2, _flags(stdlib_dataset, *DS_ZERO1, "--pipeline-model-parallel-size", "2",
                  "--save", original, "--save-interval", "2", "--exit-interval", "2"),
    )  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:]
    reference = _next_loss(
        launch(2, _flags(stdlib_dataset, *DS_ZERO1, "--pipeline-model-parallel-size", "2",
                         "--load", original))
    )  # fmt: skip

    tp2, tp1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    _reshard(original, tp2, tp=2, pp=1)
    on_tp2 = _next_loss(
        launch(2, _flags(stdlib_dataset, "--tensor-model-parallel-size", "2", "--load", tp2))
    )
    _reshard(tp2, tp1, tp=1, pp=1)
    on_tp1 = _next_loss(launch(1, _flags(stdlib_dataset, "--load", tp1)))
    assert on_tp1 == pytest.approx(on_tp2, rel=1e-5)
    assert on_tp2 == pytest.approx(reference, rel=1e-5)
    assert on_tp1 == pytest.approx(reference, rel=1e-5)
