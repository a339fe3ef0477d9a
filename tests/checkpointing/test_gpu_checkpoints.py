"""Checkpoints on one GPU over NCCL (world size 1): FSDP2's torch_dist saves and loads of its
CUDA slices, synchronous and `--async-save` (whose poll and commit collectives must stay off
NCCL, which takes no CPU tensor), and a resume that logs the run's own losses.

The same paths run on CPU over gloo in tests/core/test_sharded_optimizer_state.py and
tests/core/test_async_save_world.py; these are their GPU branches (`pytest -m gpu`,
scripts/gpu_check.sh).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags

GPU_ENV = {"CUDA_VISIBLE_DEVICES": "0", "DS_ACCELERATOR": "cuda"}
STRATEGIES = {
    "fsdp2-async": ["--use-torch-fsdp2", "--async-save"],
    "distributed-optimizer": ["--use-distributed-optimizer"],
}


def _flags(dataset: str, save: str, extra: list[str]) -> list[str]:
    flags = tiny_gpt_flags(dataset)
    backend = flags.index("--distributed-backend")
    flags[backend + 1] = "nccl"  # the GPU's own backend, as a user's run takes it
    return flags + ["--bf16", "--train-iters", "6", "--save", save, "--save-interval", "3", *extra]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sharded_torch_dist_checkpoints_resume_on_one_gpu(
    stdlib_dataset: str, tmp_path, strategy: str
) -> None:
    save = str(tmp_path / "save")
    straight = launch(1, _flags(stdlib_dataset, save, STRATEGIES[strategy]), 600, GPU_ENV)
    assert straight.returncode == 0, straight.stdout[-3000:]
    assert "successfully saved checkpoint at iteration       6" in straight.stdout
    assert os.path.isfile(os.path.join(save, "iter_0000003", ".metadata"))  # torch_dist
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("3")
    again = str(tmp_path / "again")
    resumed = launch(1, _flags(stdlib_dataset, again, STRATEGIES[strategy]) + ["--load", save],
                     600, GPU_ENV)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    logs, expected = iteration_logs(resumed.stdout), iteration_logs(straight.stdout)[3:]
    assert [log["iteration"] for log in logs] == [4, 5, 6]
    for log, reference in zip(logs, expected, strict=True):
        # The same kernels from the same state; bf16 GPU kernels need not be bitwise
        # reproducible (atomic adds in attention's backward), so to bf16's precision.
        assert log["lm loss"] == pytest.approx(reference["lm loss"], rel=2e-3), (log, reference)
