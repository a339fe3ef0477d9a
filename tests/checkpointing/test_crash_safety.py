"""Unit tests of the commit protocol and of code-free loading (one process, no launcher)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing import CheckpointError, find_checkpoint
from megatron.checkpointing import commit as checkpoint_commit
from megatron.checkpointing.file_format import load_file
from megatron.checkpointing.layouts import LocatedCheckpoint, locate_checkpoint
from tests.checkpointing.compare import raw_trackers
from tests.conftest import REPO_ROOT


def _save(root: str, iteration: int, crash_before_commit: bool = False) -> None:
    final = os.path.join(root, f"iter_{iteration:07d}")
    staging = checkpoint_commit.begin(final)
    os.makedirs(os.path.join(staging, "mp_rank_00"))
    torch.save({"iteration": iteration}, os.path.join(staging, "mp_rank_00", "model_optim_rng.pt"))
    if crash_before_commit:
        return
    checkpoint_commit.commit(final, checkpoint_commit.megatron_trackers(str(iteration)))


def test_an_interrupted_save_leaves_the_previous_checkpoint_current(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 10)
    _save(root, 20, crash_before_commit=True)
    assert find_checkpoint(root) == LocatedCheckpoint("megatron", f"{root}/iter_0000010", 10)
    assert not os.path.exists(f"{root}/iter_0000020")  # only the staging directory exists
    assert os.path.isdir(f"{root}/iter_0000020{checkpoint_commit.STAGING_SUFFIX}")
    _save(root, 20)  # the rerun clears the leftover and publishes
    assert find_checkpoint(root).iteration == 20
    assert sorted(os.listdir(root)) == [
        "iter_0000010",
        "iter_0000020",
        checkpoint_commit.TRACKER_FILENAME,
    ]


def _background_save(root: str, iteration: int, written: bool) -> str:
    """A save handed to the background and recorded, as `--async-save` starts one; `written`:
    its write completed (the file that says so is there). The run then ends uncommitted."""
    final = os.path.join(root, f"iter_{iteration:07d}")
    staging = checkpoint_commit.begin(final)
    torch.save({"iteration": iteration}, os.path.join(staging, "tensors.distcp"))
    trackers = checkpoint_commit.megatron_trackers(str(iteration))
    checkpoint_commit.record_background_save(final, trackers, ".metadata")
    if written:
        open(os.path.join(staging, ".metadata"), "w").close()
    return final


def test_a_written_background_save_is_committed_at_the_next_start(tmp_path, capsys) -> None:
    root = str(tmp_path)
    _save(root, 10)
    final = _background_save(root, 20, written=True)
    assert checkpoint_commit.read_tracker(root) == (10, False)  # not published yet
    checkpoint_commit.recover(root)
    assert f"> committed the background save of {final}" in capsys.readouterr().out
    assert checkpoint_commit.read_tracker(root) == (20, False)
    assert load_file(os.path.join(final, "tensors.distcp")) == {"iteration": 20}
    assert sorted(os.listdir(root)) == [
        "iter_0000010",
        "iter_0000020",
        checkpoint_commit.TRACKER_FILENAME,
    ]


def test_an_unwritten_background_save_is_discarded_at_the_next_start(tmp_path, capsys) -> None:
    root = str(tmp_path)
    _save(root, 10)
    final = _background_save(root, 20, written=False)
    checkpoint_commit.recover(root)
    assert f"> discarded the background save of {final}" in capsys.readouterr().out
    assert checkpoint_commit.read_tracker(root) == (10, False)
    assert sorted(os.listdir(root)) == ["iter_0000010", checkpoint_commit.TRACKER_FILENAME]


def test_a_committed_background_save_leaves_no_record(tmp_path, capsys) -> None:
    root = str(tmp_path)
    final = _background_save(root, 20, written=True)
    checkpoint_commit.commit(final, checkpoint_commit.megatron_trackers("20"))
    assert checkpoint_commit.BACKGROUND_FILENAME not in os.listdir(root)
    checkpoint_commit.recover(root)
    assert capsys.readouterr().out == ""
    assert checkpoint_commit.read_tracker(root) == (20, False)


def test_saving_an_iteration_again_replaces_it(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 5)
    _save(root, 5)
    assert load_file(f"{root}/iter_0000005/mp_rank_00/model_optim_rng.pt") == {"iteration": 5}
    assert sorted(os.listdir(root)) == ["iter_0000005", checkpoint_commit.TRACKER_FILENAME]


def test_no_tracker_means_no_checkpoint_and_a_dangling_tracker_is_an_error(tmp_path) -> None:
    assert find_checkpoint(str(tmp_path)) is None
    (tmp_path / checkpoint_commit.TRACKER_FILENAME).write_text("30")
    with pytest.raises(ValueError, match="names iteration 30, but .*iter_0000030 does not exist"):
        find_checkpoint(str(tmp_path))
    (tmp_path / checkpoint_commit.TRACKER_FILENAME).write_text("thirty")
    # A CheckpointError: pretrain_gpt.py prints it as one `error:` line.
    with pytest.raises(CheckpointError, match="expected an iteration number or 'release'"):
        find_checkpoint(str(tmp_path))


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_never_executes_code_from_a_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    with open(path, "wb") as handle:
        pickle.dump({"model": _RunsCode()}, handle)
    with pytest.raises(RuntimeError, match=f"cannot read checkpoint file {path}"):
        load_file(str(path))
    assert not (tmp_path / "pwned").exists()


# --- a kill at each step of the commit protocol ----------------------------------------------

_SAVE_TWICE = """
import os, sys
from megatron.checkpointing import commit as cc
root = sys.argv[1]
for iteration in (1, 2):
    final = os.path.join(root, f"global_step{iteration}")
    staging = cc.begin(final)
    with open(os.path.join(staging, "model_states.pt"), "w") as handle:
        handle.write(str(iteration))
    cc.commit(final, {cc.DEEPSPEED_TRACKER_FILENAME: f"global_step{iteration}",
                      cc.TRACKER_FILENAME: str(iteration)})
"""
# (fault point, the iteration both trackers name afterwards): the checkpoint is published by
# the rename, so a kill after it keeps iteration 2.
_KILL_POINTS = [
    ("before-rename", 1),
    ("after-rename", 2),
    ("between-trackers", 2),
    ("after-trackers", 2),
]


@pytest.mark.parametrize("point,expected", _KILL_POINTS)
def test_a_kill_at_each_commit_step_leaves_one_newest_checkpoint(tmp_path, point, expected):
    root = str(tmp_path)
    env = dict(os.environ, **{checkpoint_commit.FAULT_ENV: f"{point}:2"})
    killed = subprocess.run([sys.executable, "-c", _SAVE_TWICE, root], env=env, cwd=REPO_ROOT)
    assert killed.returncode == -signal.SIGKILL
    # Every reader of ours sees the newest published checkpoint before anything is repaired.
    assert checkpoint_commit.read_deepspeed_tag(root) == f"global_step{expected}"
    assert checkpoint_commit.read_tracker(root) == (expected, False)
    assert find_checkpoint(root).directory == f"{root}/global_step{expected}"
    assert locate_checkpoint(root).iteration == expected
    # The next start repairs the files themselves: both agree, nothing is left to finish.
    checkpoint_commit.recover(root)
    assert raw_trackers(root) == (f"global_step{expected}", str(expected))
    assert sorted(os.listdir(root)) == [f"global_step{n}" for n in range(1, expected + 1)] + [
        checkpoint_commit.DEEPSPEED_TRACKER_FILENAME,
        checkpoint_commit.TRACKER_FILENAME,
    ]
    with open(f"{root}/global_step{expected}/model_states.pt") as handle:
        assert handle.read() == str(expected)


def test_a_resave_killed_between_the_two_renames_puts_the_old_directory_back(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 5)
    # The state such a kill leaves: journal written, the old copy moved aside, staging in place.
    os.replace(f"{root}/iter_0000005", f"{root}/iter_0000005.replaced")
    os.makedirs(f"{root}/iter_0000005{checkpoint_commit.STAGING_SUFFIX}")
    (tmp_path / checkpoint_commit.JOURNAL_FILENAME).write_text(
        json.dumps(
            {"directory": "iter_0000005", "trackers": {"latest_checkpointed_iteration.txt": "5"}}
        )
    )
    checkpoint_commit.recover(root)
    assert sorted(os.listdir(root)) == ["iter_0000005", checkpoint_commit.TRACKER_FILENAME]
    assert load_file(f"{root}/iter_0000005/mp_rank_00/model_optim_rng.pt") == {"iteration": 5}


def test_trackers_that_disagree_without_a_journal_follow_deepspeeds_latest(tmp_path) -> None:
    root = str(tmp_path)
    for iteration in (1, 2):
        os.makedirs(f"{root}/global_step{iteration}")
    (tmp_path / checkpoint_commit.DEEPSPEED_TRACKER_FILENAME).write_text("global_step2")
    (tmp_path / checkpoint_commit.TRACKER_FILENAME).write_text("1")  # an older version's kill
    checkpoint_commit.recover(root)
    assert raw_trackers(root) == ("global_step2", "2")


def test_a_malformed_journal_or_fault_point_is_a_clear_error(tmp_path, monkeypatch) -> None:
    (tmp_path / checkpoint_commit.JOURNAL_FILENAME).write_text("{not json")
    with pytest.raises(ValueError, match=r"commit_journal.json is not a commit journal"):
        checkpoint_commit.read_tracker(str(tmp_path))
    monkeypatch.setenv(checkpoint_commit.FAULT_ENV, "mid-save:1")
    with pytest.raises(ValueError, match="MEGATRON_CHECKPOINT_FAULT='mid-save:1'"):
        _save(str(tmp_path / "other"), 1)
