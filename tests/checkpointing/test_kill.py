"""Crash safety: SIGKILL a real run at random moments, during training and during saves.

After every kill, each checkpoint directory under its final name must load completely and
the trackers must name the newest of them; the next launch must resume from exactly that
one. Killed and resumed again and again, the run must finish with the same weights as a run
that was never interrupted. SIGTERM with `--exit-signal-handler` saves and exits 0.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

from megatron.checkpoint_commit import STAGING_SUFFIX, read_deepspeed_tag, read_tracker
from tests.checkpointing.compare import differences, load_any
from tests.conftest import REPO_ROOT
from tests.pretrain_runs import iteration_logs, launch, signal_tree, start, tiny_gpt_flags

TRAIN_ITERS = 16
DS_ZERO2 = ["--deepspeed", "--deepspeed_config", f"{REPO_ROOT}/examples/ds_configs/ds_zero2.json"]
# ZeRO-2 over 2 ranks writes: the model file and one optimizer shard per rank.
EXPECTED_FILES = {
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
}


def _flags(dataset: str, save: str) -> list[str]:
    return tiny_gpt_flags(dataset) + DS_ZERO2 + [
        "--global-batch-size", "4", "--train-iters", str(TRAIN_ITERS),
        "--save", save, "--load", save, "--save-interval", "1",
    ]  # fmt: skip


def _complete_checkpoints(save: str) -> list[int]:
    """Iterations of every directory under a final name; each must load in full."""
    found = []
    for name in sorted(os.listdir(save)):
        match = re.fullmatch(r"global_step(\d+)", name)
        if match is None:
            assert name.endswith(STAGING_SUFFIX) or not name.startswith("global_step"), name
            continue
        directory = os.path.join(save, name)
        assert set(os.listdir(directory)) >= EXPECTED_FILES, f"{name} is incomplete"
        for file in EXPECTED_FILES:
            load_any(os.path.join(directory, file))  # raises on a truncated file
        found.append(int(match.group(1)))
    return sorted(found)


def _tracked(save: str) -> int | None:
    tag = read_deepspeed_tag(save)
    tracker = read_tracker(save)
    if tag is None:
        assert tracker is None
        return None
    assert tracker == (int(tag.removeprefix("global_step")), False)
    return tracker[0]


def _wait_for(log_path: str, pattern: str, count: int, process, timeout: float = 120) -> bool:
    """Wait until `pattern` occurs `count` times in the log; False if the run ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(log_path) as log:
            if log.read().count(pattern) >= count:
                return True
        if process.poll() is not None:
            return False
        time.sleep(0.01)
    raise TimeoutError(f"{pattern!r} did not appear {count} times in {log_path}")


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_from_newest_complete(
    stdlib_dataset: str, tmp_path
) -> None:
    straight_dir = str(tmp_path / "straight")
    straight = launch(2, _flags(stdlib_dataset, straight_dir))
    assert straight.returncode == 0, straight.stdout[-3000:]

    save = str(tmp_path / "killed")
    chooser = random.Random(20261122)
    kills = kills_during_save = 0
    for attempt in range(5):
        tracked_before = _tracked(save) if os.path.isdir(save) else None
        log_path = str(tmp_path / f"attempt{attempt}.log")
        process = start(2, _flags(stdlib_dataset, save), log_path)
        if tracked_before is not None:
            _wait_for(log_path, "loaded deepspeed checkpoint", 1, process)
            with open(log_path) as log:
                assert f"at iteration {tracked_before}" in log.read()
        # Even attempts: kill right after a save starts; odd ones: in the middle of a step.
        pattern = "saving checkpoint at iteration" if attempt % 2 == 0 else "| consumed samples:"
        if _wait_for(log_path, pattern, chooser.randint(1, 2), process):
            time.sleep(chooser.uniform(0.0, 0.01 if attempt % 2 == 0 else 0.5))
            signal_tree(process, signal.SIGKILL)
            kills += 1
        process.wait(timeout=60)
        with open(log_path) as log:
            output = log.read()
        if output.count("saving checkpoint at") > output.count("successfully saved"):
            kills_during_save += 1
        complete = _complete_checkpoints(save) if os.path.isdir(save) else []
        tracked = _tracked(save) if os.path.isdir(save) else None
        assert tracked == (max(complete) if complete else None), (tracked, complete)
    assert kills >= 4 and kills_during_save >= 1, (kills, kills_during_save)

    final = launch(2, _flags(stdlib_dataset, save))
    assert final.returncode == 0, final.stdout[-3000:]
    assert iteration_logs(final.stdout)[-1]["iteration"] == TRAIN_ITERS
    last = f"global_step{TRAIN_ITERS}"
    assert differences(os.path.join(straight_dir, last), os.path.join(save, last)) == []


@pytest.mark.slow
def test_sigterm_with_exit_signal_handler_saves_and_exits_cleanly(
    stdlib_dataset: str, tmp_path
) -> None:
    save = str(tmp_path / "ckpt")
    flags = tiny_gpt_flags(stdlib_dataset) + [
        "--global-batch-size", "4", "--train-iters", "1000", "--save", save,
        "--save-interval", "1000", "--exit-signal-handler",
    ]  # fmt: skip
    log_path = str(tmp_path / "run.log")
    process = start(2, flags, log_path)
    assert _wait_for(log_path, "| consumed samples:", 3, process)
    # As SLURM does: every rank gets SIGTERM (torchrun then sees its ranks exit cleanly).
    signal_tree(process, signal.SIGTERM, include_launcher=False)
    assert process.wait(timeout=120) == 0
    with open(log_path) as log:
        output = log.read()
    stopped = iteration_logs(output)[-1]["iteration"]
    assert f"exiting program at iteration {stopped} after receiving SIGTERM" in output
    assert read_tracker(save) == (stopped, False)
    assert os.path.isfile(
        os.path.join(save, f"iter_{stopped:07d}", "mp_rank_00", "model_optim_rng.pt")
    )
