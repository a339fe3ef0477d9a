"""Crash safety: SIGKILL a real run at each step of the commit protocol.

The deterministic test kills rank 0 at each named point of `megatron.checkpointing.commit.commit`
(`MEGATRON_CHECKPOINT_FAULT`), one launch after another on the same directory: after each kill
every directory under a final name loads completely, our readers and the repaired files agree
on the newest one, and the next launch resumes from exactly that one; the run then finishes
with the same bytes as one never interrupted. The whole chain runs on torch_dist written in
the background (`--async-save`, committed on the main thread when a later iteration finds the
writes done), whose final checkpoint holds the uninterrupted run's tensors; DeepSpeed's ZeRO-2
files (the same commit protocol) take the point their second tracker file (DeepSpeed's
`latest`) adds: a kill between the two trackers. A background save whose write completed
but whose commit never began (rank 0 killed at `background-written`) is committed by the next
start, which resumes from it. (Kills at random moments were tested too until
issue 16: they cost one to three minutes of the CI budget and covered no point the named
faults miss, and their timing was chance.) A Mixture-of-Experts run killed before its second
checkpoint is renamed into place leaves the first, DeepSpeed's expert files of both
expert-parallel ranks included, as the newest; the killed one's files are all in its staging
directory. SIGTERM with `--exit-signal-handler` saves and exits 0.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest
import torch

from megatron.checkpointing import commit as checkpoint_commit
from megatron.checkpointing.commit import STAGING_SUFFIX, read_deepspeed_tag, read_tracker
from megatron.checkpointing.dist_checkpoint import _checked_metadata
from megatron.checkpointing.shards import load_dense_checkpoint
from tests.checkpointing.compare import differences, load_any, raw_trackers
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


ASYNC_TORCH_DIST = ["--ckpt-format", "torch_dist", "--async-save"]
"""The plain engine writing torch_dist in the background: commits happen on the main thread
when a later iteration (or the next save, or the end) finds every rank's write done."""


def _flags(dataset: str, save: str, train_iters: int = TRAIN_ITERS, engine: list = DS_ZERO2):
    return tiny_gpt_flags(dataset) + engine + [
        "--global-batch-size", "4", "--train-iters", str(train_iters),
        "--save", save, "--load", save, "--save-interval", "1",
    ]  # fmt: skip


def _name(iteration: int, deepspeed: bool) -> str:
    return f"global_step{iteration}" if deepspeed else f"iter_{iteration:07d}"


def _complete_checkpoints(save: str, deepspeed: bool = True) -> list[int]:
    """Iterations of every directory under a final name; each must load in full."""
    found = []
    prefix = "global_step" if deepspeed else "iter_"
    for name in sorted(os.listdir(save)):
        match = re.fullmatch(rf"{prefix}(\d+)", name)
        if match is None:
            assert name.endswith(STAGING_SUFFIX) or not name.startswith(prefix), name
            continue
        directory = os.path.join(save, name)
        if deepspeed:
            assert set(os.listdir(directory)) >= EXPECTED_FILES, f"{name} is incomplete"
            for file in EXPECTED_FILES:
                load_any(os.path.join(directory, file))  # raises on a truncated file
        else:
            load_any(os.path.join(directory, "common.pt"))
            _checked_metadata(directory)  # every shard file there and long enough
        found.append(int(match.group(1)))
    return sorted(found)


def _tracked(save: str, deepspeed: bool = True) -> int | None:
    """The iteration both trackers name (Megatron's alone for torch_dist), as every reader of
    ours sees them."""
    tag = read_deepspeed_tag(save)
    tracker = read_tracker(save)
    if not deepspeed:
        assert tag is None
        return None if tracker is None else tracker[0]
    if tag is None:
        assert tracker is None
        return None
    assert tracker == (int(tag.removeprefix("global_step")), False)
    return tracker[0]


def _dcp_tensors(directory: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = directory + ".whole.pt"
    dcp_to_torch_save(directory, whole)
    return torch.load(whole, weights_only=True)


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


def _repaired(save: str, scratch: str) -> tuple[str | None, str | None]:
    """The two tracker files as the next start leaves them (repaired on a copy)."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(save, scratch)
    checkpoint_commit.recover(scratch)
    assert not os.path.exists(os.path.join(scratch, checkpoint_commit.JOURNAL_FILENAME))
    return raw_trackers(scratch)


# One launch per fault: (commit step, which of the launch's saves it strikes, the iteration that
# is newest and complete afterwards, what the next start says it did). Each launch resumes from
# the one before, so the saves struck are those of iterations 2, 2, 3 and 4.
FAULT_CHAIN = [
    ("before-rename", 2, 1, "discarded the interrupted save"),
    ("after-rename", 1, 2, "finished the interrupted commit"),
    ("between-trackers", 1, 3, "finished the interrupted commit"),
    ("after-trackers", 1, 4, "finished the interrupted commit"),
]
CHAIN_ITERS = 5
# DeepSpeed's run: the kill between its two tracker files, in its first launch's second save.
DEEPSPEED_CHAIN = [("between-trackers", 2, 2, "finished the interrupted commit")]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["deepspeed-zero2", "torch_dist-async"])
def test_sigkill_at_each_commit_step_resumes_from_newest_complete(
    stdlib_dataset: str, tmp_path, engine: str
) -> None:
    deepspeed = engine.startswith("deepspeed")
    flags = DS_ZERO2 if deepspeed else ASYNC_TORCH_DIST
    straight_dir = str(tmp_path / "straight")
    straight = launch(2, _flags(stdlib_dataset, straight_dir, CHAIN_ITERS, flags))
    assert straight.returncode == 0, straight.stdout[-3000:]

    save = str(tmp_path / "killed")
    previous, said = None, None
    for point, strike, newest, next_start_says in DEEPSPEED_CHAIN if deepspeed else FAULT_CHAIN:
        run = launch(
            2,
            _flags(stdlib_dataset, save, CHAIN_ITERS, flags),
            env={checkpoint_commit.FAULT_ENV: f"{point}:{strike}"},
        )
        assert run.returncode != 0, run.stdout[-3000:]  # rank 0 was killed inside the commit
        if previous is not None:
            assert f"> {said}" in run.stdout, run.stdout[-3000:]
            loaded = "deepspeed" if deepspeed else "torch_dist"
            assert (
                f"loaded {loaded} checkpoint {save}/{_name(previous, deepspeed)} at iteration "
                f"{previous}" in run.stdout
            )
        assert _complete_checkpoints(save, deepspeed)[-1] == newest, point
        assert _tracked(save, deepspeed) == newest, point
        repaired = _repaired(save, str(tmp_path / "repaired"))
        assert repaired == ((f"global_step{newest}" if deepspeed else None), str(newest))
        previous, said = newest, next_start_says

    final = launch(2, _flags(stdlib_dataset, save, CHAIN_ITERS, flags))
    assert final.returncode == 0, final.stdout[-3000:]
    assert f"> {said}" in final.stdout
    assert f"at iteration {previous}" in final.stdout
    assert read_tracker(save) == (CHAIN_ITERS, False)
    last = _name(CHAIN_ITERS, deepspeed)
    if deepspeed:
        assert read_deepspeed_tag(save) == last
        assert differences(os.path.join(straight_dir, last), os.path.join(save, last)) == []
        return
    ours = _dcp_tensors(os.path.join(save, last))
    theirs = _dcp_tensors(os.path.join(straight_dir, last))
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key


@pytest.mark.slow
def test_a_run_ended_after_its_background_save_was_written_resumes_from_it(
    stdlib_dataset: str, tmp_path
) -> None:
    """`--async-save`: rank 0 killed once iteration 2's background save is written, before its
    commit began (`background-written`, the second save's wait, at iteration 3): the next start
    commits it, resumes at iteration 2, and ends with the uninterrupted run's tensors."""
    iterations = 3
    straight_dir = str(tmp_path / "straight")
    straight = launch(2, _flags(stdlib_dataset, straight_dir, iterations, ASYNC_TORCH_DIST))
    assert straight.returncode == 0, straight.stdout[-3000:]
    save = str(tmp_path / "killed")
    flags = _flags(stdlib_dataset, save, iterations, ASYNC_TORCH_DIST)
    killed = launch(2, flags, env={checkpoint_commit.FAULT_ENV: "background-written:2"})
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert _tracked(save, deepspeed=False) == 1
    assert os.path.isdir(os.path.join(save, _name(2, False) + STAGING_SUFFIX))
    resumed = launch(2, flags)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"> committed the background save of {save}/{_name(2, False)}" in resumed.stdout
    assert f"loaded torch_dist checkpoint {save}/{_name(2, False)} at iteration 2" in resumed.stdout
    assert _complete_checkpoints(save, deepspeed=False) == [1, 2, 3]
    ours = _dcp_tensors(os.path.join(save, _name(iterations, False)))
    theirs = _dcp_tensors(os.path.join(straight_dir, _name(iterations, False)))
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key


MOE_EP2 = [
    "--deepspeed", "--zero-stage", "0", "--no-pipeline-parallel", "--num-experts", "4",
    "--expert-interval", "1", "--moe-expert-parallel-size", "2", "--topk", "2",
]  # fmt: skip
# DeepSpeed-MoE's files at ZeRO-0: the model without experts (data-parallel rank 0), one file
# per expert of each MoE layer (each expert-parallel rank writes its own), the optimizer state
# of each expert-parallel rank.
MOE_FILES = {
    "mp_rank_00_model_states.pt",
    *(f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)),
    *(f"expp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)),
}


@pytest.mark.slow
def test_a_killed_moe_save_leaves_the_complete_one_newest(stdlib_dataset: str, tmp_path) -> None:
    save = str(tmp_path / "moe")
    flags = tiny_gpt_flags(stdlib_dataset) + MOE_EP2 + [
        "--global-batch-size", "4", "--train-iters", "2", "--save", save, "--save-interval", "1",
    ]  # fmt: skip
    fault = {checkpoint_commit.FAULT_ENV: "before-rename:2"}
    run = launch(2, flags, env=fault, launcher="deepspeed")
    assert run.returncode != 0, run.stdout[-3000:]
    assert "saving checkpoint at iteration       2" in run.stdout
    assert not os.path.exists(os.path.join(save, "global_step2"))
    published = os.path.join(save, "global_step1")
    assert set(os.listdir(published)) == MOE_FILES
    assert set(os.listdir(os.path.join(save, f"global_step2{STAGING_SUFFIX}"))) == MOE_FILES
    assert _tracked(save) == 1
    experts = {}
    for name in sorted(MOE_FILES):
        if name.startswith("layer_"):
            experts.update(load_any(os.path.join(published, name)))
    assert len(experts) == 2 * 4 * 4  # layers x experts x (2 weights, 2 biases)
    dense = load_dense_checkpoint(save)  # what the tools read: every expert, globally numbered
    assert dense.iteration == 1
    for key, tensor in experts.items():
        assert torch.equal(dense.state_dict[key], tensor), key


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
