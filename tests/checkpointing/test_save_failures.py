"""Saves that fail for lack of space or permission end the run in one line and leave no trace.

Unit tests drive `megatron.checkpointing.disk` and the commit protocol in one process. The runs
launch `pretrain_gpt.py` as a user would: onto a small tmpfs that fills up mid-file (where the
tests run as root; else the same disk-full error is injected), and with a permission error
injected on one rank of a DeepSpeed ZeRO-2 run at its second save. Each asserts the exit code,
that the output's last line is the one-line error naming --save and the file, that the staging
directory is gone, and that what was on disk before (a checkpoint, a user's file) is unchanged.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess

import pytest
import torch

from megatron.checkpointing import CheckpointSaveError, disk
from megatron.checkpointing import commit as checkpoint_commit
from tests.checkpointing.compare import load_any, raw_trackers
from tests.conftest import REPO_ROOT
from tests.one_line_errors import snapshot
from tests.pretrain_runs import last_rank_line, launch, rank_output, tiny_gpt_flags


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Set MEGATRON_SAVE_FAULT for this process, its file count starting afresh."""
    monkeypatch.setattr(disk, "_files_written", 0)
    return lambda value: monkeypatch.setenv(disk.FAULT_ENV, value)


def test_failed_write_raises_its_oserror_with_the_path_and_leaves_no_file(fault, tmp_path) -> None:
    fault("ENOSPC@2")
    path = str(tmp_path / "x.pt")
    disk.save_torch_file({"w": torch.ones(1000)}, path)  # the first file is written
    assert torch.load(path)["w"].sum() == 1000
    with pytest.raises(OSError) as raised:
        disk.save_torch_file({"w": torch.ones(1000)}, str(tmp_path / "y.pt"))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "y.pt")
    assert sorted(os.listdir(tmp_path)) == ["x.pt"]


def test_failure_line_names_save_dir_final_file_and_sizes(tmp_path) -> None:
    staged = f"{tmp_path}/iter_0000004.partial/mp_rank_00/model_optim_rng.pt.partial-123"
    error = OSError(errno.ENOSPC, "No space left on device", staged)
    line = disk.describe_failure(error, str(tmp_path), 3 * disk.MEGABYTE)
    free = disk.megabytes(disk.free_bytes(str(tmp_path)))
    assert line == (
        f"--save {tmp_path}: no space left on device while writing "
        f"{tmp_path}/iter_0000004/mp_rank_00/model_optim_rng.pt (3.0 MB needed, {free} MB free)"
    )
    denied = OSError(errno.EACCES, "Permission denied", f"{tmp_path}/latest")
    assert disk.describe_failure(denied, str(tmp_path)) == (
        f"--save {tmp_path}: permission denied while writing {tmp_path}/latest"
    )


def test_save_refused_before_writing_when_previous_checkpoint_does_not_fit(tmp_path) -> None:
    root = tmp_path / "save"
    previous = root / "iter_0000002"
    previous.mkdir(parents=True)
    (root / checkpoint_commit.TRACKER_FILENAME).write_text("2")
    too_big = disk.free_bytes(str(root)) + disk.MEGABYTE
    with pytest.raises(CheckpointSaveError) as raised:
        checkpoint_commit.begin(str(root / "iter_0000004"), (str(previous), too_big))
    assert re.fullmatch(
        rf"--save {root}: no space left on device for the checkpoint of iteration 4 "
        r"\(\d+ MB needed, as iter_0000002; \d+ MB free\); nothing was written",
        str(raised.value),
    ), raised.value
    assert sorted(os.listdir(root)) == ["iter_0000002", checkpoint_commit.TRACKER_FILENAME]


def test_failed_commit_removes_staging_and_keeps_trackers(tmp_path) -> None:
    root = str(tmp_path)
    checkpoint_commit.write_tracker(os.path.join(root, checkpoint_commit.TRACKER_FILENAME), "2")
    final = os.path.join(root, "iter_0000004")
    staging = checkpoint_commit.begin(final)
    open(os.path.join(staging, "half.pt"), "wb").close()
    with pytest.raises(CheckpointSaveError, match="^--save .*: no space left"):
        checkpoint_commit.commit(final, {}, failure=f"--save {root}: no space left on device")
    assert sorted(os.listdir(root)) == [checkpoint_commit.TRACKER_FILENAME]
    assert checkpoint_commit.read_tracker(root) == (2, False)


def _mount_tmpfs(path: str, megabytes: int) -> bool:
    """Mount a `megabytes` tmpfs at `path`; False where this process may not mount."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", path], capture_output=True
    )
    return result.returncode == 0


@pytest.mark.slow
def test_disk_full_mid_file_ends_run_in_one_line(stdlib_dataset: str, tmp_path) -> None:
    """The tiny GPT's checkpoint (38 MB with Adam state) does not fit a 20 MB disk."""
    mount = str(tmp_path / "disk")
    mounted = _mount_tmpfs(mount, 20)
    try:
        save = os.path.join(mount, "checkpoints")
        os.makedirs(save)
        with open(os.path.join(save, "notes.txt"), "w") as handle:
            handle.write("the user's own file\n")
        before = snapshot(save)
        flags = tiny_gpt_flags(stdlib_dataset) + [
            "--global-batch-size", "2", "--train-iters", "2", "--eval-iters", "0",
            "--save", save, "--save-interval", "2",
        ]  # fmt: skip
        result = launch(1, flags, env={} if mounted else {disk.FAULT_ENV: "ENOSPC"})
        assert result.returncode == 1, result.stdout[-3000:]
        written = f"{save}/iter_0000002/mp_rank_00/model_optim_rng.pt"
        assert re.fullmatch(
            rf"error: --save {save}: no space left on device while writing {written} "
            r"\(\d+ MB needed, [\d.]+ MB free\)",
            last_rank_line(result.stdout),
        ), result.stdout[-2000:]
        assert "Traceback" not in result.stdout
        assert snapshot(save) == before  # no staging directory, no tracker, notes untouched
    finally:
        if mounted:
            subprocess.run(["umount", mount], check=False)


@pytest.mark.slow
def test_permission_error_on_one_rank_of_a_deepspeed_save(stdlib_dataset: str, tmp_path) -> None:
    """Rank 1 fails its second save: both ranks stop in one line, global_step2 stays newest."""
    save = str(tmp_path / "save")
    config = os.path.join(REPO_ROOT, "examples", "ds_configs", "ds_zero2.json")
    flags = tiny_gpt_flags(stdlib_dataset) + [
        "--deepspeed", "--deepspeed_config", config, "--global-batch-size", "4",
        "--train-iters", "4", "--eval-iters", "0", "--save", save, "--save-interval", "2",
    ]  # fmt: skip
    result = launch(2, flags, env={disk.FAULT_ENV: "EACCES:1@2"})
    assert result.returncode != 0, result.stdout[-3000:]
    line = (
        f"error: --save {save}: permission denied while writing "
        f"{save}/global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    assert result.stdout.splitlines().count(line) == 2, result.stdout[-3000:]  # every rank says it
    assert last_rank_line(result.stdout) == line
    assert not any(line.startswith("Traceback") for line in rank_output(result.stdout))
    assert sorted(name for name in os.listdir(save) if name.startswith("global_step")) == [
        "global_step2"
    ]
    assert raw_trackers(save) == ("global_step2", "2")
    for name in os.listdir(os.path.join(save, "global_step2")):
        load_any(os.path.join(save, "global_step2", name))  # complete
