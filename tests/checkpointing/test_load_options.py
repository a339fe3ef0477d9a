"""Loading as Megatron documents it: --finetune, --no-load-optim, a missing --load, and clear
errors for checkpoints that do not fit this run's flags (each a real pretrain_gpt.py run)."""

from __future__ import annotations

import argparse

import pytest

from megatron.checkpointing import CheckpointError, check_checkpoint_args, find_checkpoint
from megatron.checkpointing import commit as checkpoint_commit
from tests.checkpointing.compare import rolled_back
from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags


def _flags(dataset: str, *extra: str) -> list[str]:
    return tiny_gpt_flags(dataset) + ["--global-batch-size", "4", "--train-iters", "4", *extra]


@pytest.fixture(scope="module")
def checkpoint(stdlib_dataset: str, tmp_path_factory) -> str:
    """A one-process Megatron-layout checkpoint at iteration 2."""
    save = str(tmp_path_factory.mktemp("load_options") / "ckpt")
    run = launch(
        1, _flags(stdlib_dataset, "--save", save, "--save-interval", "2", "--exit-interval", "2")
    )
    assert run.returncode == 0, run.stdout[-3000:]
    return save


def _iterations(output: str) -> list[int]:
    return [log["iteration"] for log in iteration_logs(output)]


@pytest.mark.slow
def test_missing_load_directory_starts_fresh_and_says_so(stdlib_dataset: str, tmp_path) -> None:
    run = launch(
        1, _flags(stdlib_dataset, "--load", str(tmp_path / "nothing"), "--exit-interval", "1")
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"no checkpoint found in {tmp_path / 'nothing'}; starting from iteration 0" in run.stdout
    assert _iterations(run.stdout) == [1]


@pytest.mark.slow
def test_a_plain_save_replaces_a_deepspeed_latest_left_in_the_directory(
    stdlib_dataset: str, tmp_path
) -> None:
    save = tmp_path / "ckpt"
    (save / "global_step7").mkdir(parents=True)  # an earlier --deepspeed run's checkpoint
    (save / checkpoint_commit.DEEPSPEED_TRACKER_FILENAME).write_text("global_step7")
    flags = ["--save", str(save), "--save-interval", "1", "--exit-interval", "1"]
    run = launch(1, _flags(stdlib_dataset, *flags))
    assert run.returncode == 0, run.stdout[-3000:]
    # `latest` would be read first and resume the older DeepSpeed checkpoint.
    assert not (save / checkpoint_commit.DEEPSPEED_TRACKER_FILENAME).exists()
    assert find_checkpoint(str(save)).directory == str(save / "iter_0000001")


@pytest.mark.slow
def test_a_malformed_commit_journal_is_a_one_line_error(stdlib_dataset: str, tmp_path) -> None:
    load = tmp_path / "ckpt"
    load.mkdir()
    (load / checkpoint_commit.JOURNAL_FILENAME).write_text("{cut short")
    run = launch(1, _flags(stdlib_dataset, "--load", str(load)))
    assert run.returncode == 1, run.stdout[-3000:]
    assert f"error: {load}/commit_journal.json is not a commit journal" in run.stdout
    assert "Traceback" not in run.stdout
    assert (load / checkpoint_commit.JOURNAL_FILENAME).read_text() == "{cut short"  # untouched


@pytest.mark.slow
def test_finetune_loads_weights_only_and_starts_at_iteration_0(checkpoint, stdlib_dataset) -> None:
    run = launch(
        1, _flags(stdlib_dataset, "--load", checkpoint, "--finetune", "--exit-interval", "1")
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert "at iteration 2 (weights only)" in run.stdout
    assert _iterations(run.stdout) == [1]


@pytest.mark.slow
def test_no_load_optim_keeps_progress_and_the_schedule(checkpoint, stdlib_dataset) -> None:
    run = launch(
        1, _flags(stdlib_dataset, "--load", checkpoint, "--no-load-optim", "--no-load-rng")
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert _iterations(run.stdout) == [3, 4]
    assert "learning-rate schedule continues at sample 8" in run.stdout
    resumed = launch(1, _flags(stdlib_dataset, "--load", checkpoint))
    lr = [log["learning rate"] for log in iteration_logs(resumed.stdout)]
    assert [log["learning rate"] for log in iteration_logs(run.stdout)] == lr


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, message",
    [
        (("--num-layers", "3"), "was saved with --num-layers 2, this run has --num-layers 3"),
        (("--make-vocab-size-divisible-by", "256"), "has a vocabulary of 50304 rows (padded)"),
    ],
)
def test_a_checkpoint_of_another_shape_is_a_clear_error(checkpoint, stdlib_dataset, extra, message):
    run = launch(1, _flags(stdlib_dataset, "--load", checkpoint, *extra))
    assert run.returncode == 1
    errors = [line for line in run.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], run.stdout[-2000:]


@pytest.mark.slow
def test_another_tensor_parallel_size_names_the_reshard_tool(checkpoint, stdlib_dataset) -> None:
    run = launch(
        2, _flags(stdlib_dataset, "--load", checkpoint, "--tensor-model-parallel-size", "2")
    )
    assert run.returncode != 0
    errors = {line for line in run.stdout.splitlines() if line.startswith("error:")}
    assert len(errors) == 1, run.stdout[-2000:]
    (error,) = errors
    assert "saved with --tensor-model-parallel-size 1, this run has" in error
    assert "tools/checkpoint/reshard.py" in error and "--target-tensor-parallel-size 2" in error


def test_a_checkpoint_of_other_moe_layers_is_a_clear_error() -> None:
    saved = dict(num_layers=2, num_experts=[4], expert_interval=1, mlp_type="standard")

    def run_args(**moe: object) -> argparse.Namespace:
        sizes = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        return argparse.Namespace(**{**saved, **sizes, **moe})

    check_checkpoint_args(saved, run_args(num_experts=[4, 4]), "f.pt")  # one value per layer
    for moe, named in (
        (dict(num_experts=[2]), "this run has --num-experts 2 --expert-interval 1: pass"),
        (dict(num_experts=[1]), "this run has no MoE layers"),
        (dict(mlp_type="residual"), "this run has --num-experts 4 --expert-interval 1 --mlp-type"),
    ):
        with pytest.raises(CheckpointError, match=f"f.pt was saved with --num-experts 4 .*{named}"):
            check_checkpoint_args(saved, run_args(**moe), "f.pt")


@pytest.mark.slow
def test_a_bf16_zero0_deepspeed_run_resumes_at_another_data_parallel_size(
    stdlib_dataset: str, tmp_path
) -> None:
    """bf16 at ZeRO-0 on DeepSpeed's plain engine (--no-pipeline-parallel) keeps its fp32
    optimizer state whole on every rank (DeepSpeed 0.19 partitions it only under its pipeline
    engine), so a checkpoint saved at DP=2 resumes at DP=1 with its optimizer state (issue 36,
    defect 6: it was refused as partitioned). Iteration 3's loss, from the same weights, is the
    straight run's up to bf16 rounding."""
    config = tmp_path / "ds_zero0_bf16.json"
    config.write_text('{"zero_optimization": {"stage": 0}, "bf16": {"enabled": true}}')
    save = str(tmp_path / "ckpt")
    deepspeed = ["--bf16", "--deepspeed", "--deepspeed_config", str(config)]
    flags = [*deepspeed, "--no-pipeline-parallel"]
    straight = launch(2, _flags(stdlib_dataset, *flags, "--save", save, "--save-interval", "2"))
    assert straight.returncode == 0, straight.stdout[-3000:]
    at_two = rolled_back(save, 2, str(tmp_path / "at_two"))
    resumed = launch(1, _flags(stdlib_dataset, *flags, "--load", at_two))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    logs = {log["iteration"]: log["lm loss"] for log in iteration_logs(straight.stdout)}
    again = {log["iteration"]: log["lm loss"] for log in iteration_logs(resumed.stdout)}
    assert sorted(again) == [3, 4]
    assert abs(again[3] - logs[3]) < 2e-2 * abs(logs[3]), (again, logs)
