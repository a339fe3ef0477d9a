"""Unit tests of the commit protocol and of code-free loading (one process, no launcher)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from megatron import checkpoint_commit
from megatron.checkpoint_format import load_file
from megatron.checkpoint_layouts import LocatedCheckpoint
from megatron.checkpointing import find_checkpoint


def _save(root: str, iteration: int, crash_before_commit: bool = False) -> None:
    final = os.path.join(root, f"iter_{iteration:07d}")
    staging = checkpoint_commit.begin(final)
    os.makedirs(os.path.join(staging, "mp_rank_00"))
    torch.save({"iteration": iteration}, os.path.join(staging, "mp_rank_00", "model_optim_rng.pt"))
    if crash_before_commit:
        return
    checkpoint_commit.commit(final, {checkpoint_commit.TRACKER_FILENAME: str(iteration)})


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
    with pytest.raises(ValueError, match="expected an iteration number or 'release'"):
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
