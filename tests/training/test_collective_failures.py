"""A stalled or killed rank ends the job with one line per surviving rank, and restarts resume.

The unit tests time out a real gloo collective in two processes and read the line and the
stack file. The runs inject the fault at a named point (`MEGATRON_TRAINING_FAULT`: a rank
SIGSTOPs or SIGKILLs itself as it begins an iteration), so nothing depends on timing:

- a stalled rank under torchrun, `--distributed-timeout-minutes 0.25`: rank 0 names the
  collective, the group and the wait, writes its stacks, and exits 1; the checkpoint it
  resumed from is unchanged;
- a killed rank under the deepspeed launcher (ZeRO-2): the survivor says its peer is gone;
- `torchrun --max-restarts 2` with a rank killed after the checkpoint at iteration 4: the job
  restarts from it and ends with the same weights, optimizer and RNG state as a run never
  interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron.core import parallel_state
from megatron.training import failures
from megatron.training.fault_injection import FAULT_ENV
from tests.checkpointing.compare import differences, rolled_back
from tests.conftest import REPO_ROOT
from tests.distributed import run_distributed
from tests.one_line_errors import snapshot
from tests.pretrain_runs import (
    command,
    cpu_env,
    last_rank_line,
    launch,
    rank_output,
    signal_tree,
    tiny_gpt_flags,
)


def _time_out_on_data_parallel_group(rank: int, world_size: int, stack_dir: str) -> None:
    # As initialize_distributed does: groups made from here on time out after 6 s (long
    # enough for a loaded machine to create them).
    dist.barrier()
    distributed_c10d.default_pg_timeout = timedelta(seconds=6)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        if rank == 0:
            with pytest.raises(failures.CollectiveFailure) as raised:
                with failures.collective_failures_reported(stack_dir, 0.1):
                    tensor = torch.ones(1)
                    dist.all_reduce(tensor, group=parallel_state.get_data_parallel_group())
            path = os.path.join(stack_dir, "stacks", "rank0.txt")
            assert re.fullmatch(
                r"rank 0: all_reduce on the data-parallel group \(ranks 0, 1\) timed out after "
                r"6 s \(--distributed-timeout-minutes 0\.1\): another rank stalled or died; "
                r"at tests/training/test_collective_failures\.py:\d+ in "
                rf"_time_out_on_data_parallel_group; Python stacks in {re.escape(path)}",
                str(raised.value),
            ), raised.value
            with open(path) as handle:
                stacks = handle.read()
            assert "Timed out waiting 6000ms" in stacks and "Current thread" in stacks
        # Rank 1 never joins the all-reduce; both meet here (world group, default timeout).
        dist.barrier(group=dist.group.WORLD)
    finally:
        parallel_state.destroy_model_parallel()


def test_timed_out_collective_named_with_group_wait_and_stacks(tmp_path) -> None:
    run_distributed(_time_out_on_data_parallel_group, 2, str(tmp_path))


def _lose_a_peer(rank: int, world_size: int, stack_dir: str) -> None:
    # A bound on the wait: a lost peer must be reported at once, not after this timeout.
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    dist.barrier(group=group)
    if rank == 1:
        os._exit(0)  # gone without a word, as a SIGKILLed rank is: its sockets close
    started = time.time()
    with pytest.raises(failures.CollectiveFailure) as raised:
        with failures.collective_failures_reported(stack_dir, 1):
            dist.all_reduce(torch.ones(1), group=group)
    assert time.time() - started < 30
    assert re.fullmatch(
        r"rank 0: all_reduce on a group of ranks 0, 1 failed: another rank closed its "
        r"connection \(it exited or was killed\); at tests/training/test_collective_failures"
        r"\.py:\d+ in _lose_a_peer; Python stacks in \S+/stacks/rank0\.txt",
        str(raised.value),
    ), raised.value
    os._exit(0)  # the world group cannot be torn down without rank 1


def test_lost_peer_named_at_once(tmp_path) -> None:
    run_distributed(_lose_a_peer, 2, str(tmp_path))


def test_other_errors_pass_through_unchanged(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="^DataLoader timed out"):
        with failures.collective_failures_reported(str(tmp_path), 1):
            raise RuntimeError("DataLoader timed out after 5 seconds")
    assert not os.path.exists(tmp_path / "stacks")


def test_report_error_feeds_torchrun_banner(tmp_path, capsys, monkeypatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    failures.report_error("--save /x: no space left on device")
    assert capsys.readouterr().err == "error: --save /x: no space left on device\n"
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["extraInfo"]["py_callstack"] == (
        "error: --save /x: no space left on device"
    )
    json.loads(error_file.read_text())


TRAIN_ITERS = 6


@pytest.fixture(scope="module")
def straight_run(stdlib_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """2 ranks (DDP), 6 iterations, a checkpoint every 2: (flags, save directory)."""
    save = str(tmp_path_factory.mktemp("straight") / "save")
    flags = tiny_gpt_flags(stdlib_dataset) + [
        "--global-batch-size", "4", "--train-iters", str(TRAIN_ITERS), "--eval-iters", "0",
        "--save-interval", "2",
    ]  # fmt: skip
    result = launch(2, flags + ["--save", save])
    assert result.returncode == 0, result.stdout[-3000:]
    return flags, save


@pytest.mark.slow
def test_stalled_rank_times_out_in_one_line(straight_run: tuple, tmp_path) -> None:
    flags, straight = straight_run
    save = rolled_back(straight, 2, str(tmp_path / "save"))
    before = snapshot(save)
    # 15 s: no healthy collective of start-up waits that long, even on a loaded machine.
    flags = flags + ["--load", save, "--save", save, "--distributed-timeout-minutes", "0.25"]
    log_path = str(tmp_path / "log.txt")
    env = cpu_env(OMP_NUM_THREADS="1", **{FAULT_ENV: "stop@4:1"})
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command(2, flags), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        # Rank 0 reports within the 15 s timeout of the stall; then let the stopped rank take
        # torchrun's SIGTERM at once instead of after torchrun's 30 s grace.
        deadline = time.time() + 240
        while "error: rank 0:" not in open(log_path).read() and process.poll() is None:
            assert time.time() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.5)
        signal_tree(process, signal.SIGCONT, include_launcher=False)
        process.wait(timeout=120)
    finally:
        signal_tree(process, signal.SIGKILL)
    output = open(log_path).read()
    assert process.returncode == 1, output[-3000:]
    stacks = os.path.join(save, "stacks", "rank0.txt")
    assert re.search(
        r"^error: rank 0: .+ on the data-parallel group \(ranks 0, 1\) timed out after 15 s "
        r"\(--distributed-timeout-minutes 0\.25\): another rank stalled or died; at \S+:\d+ in "
        r"\w+; Python stacks in "
        rf"{re.escape(stacks)}$",
        output,
        re.M,
    ), output[-3000:]
    # Rank 1, let go, may add its own line about rank 0's exit; either is a rank's error line.
    assert last_rank_line(output).startswith("error: rank "), output[-3000:]
    assert not any(line.startswith("Traceback") for line in rank_output(output))
    after = snapshot(save)
    assert {name: digest for name, digest in after.items() if name in before} == before
    assert set(after) - set(before) <= {"stacks/rank0.txt", "stacks/rank1.txt"}


@pytest.mark.slow
def test_killed_rank_under_deepspeed_launcher(stdlib_dataset: str, tmp_path) -> None:
    """The job ends at once, no rank prints a traceback, the checkpoint before is intact.

    Whether rank 0 prints its line (`test_lost_peer_named_at_once`) before the launcher, which
    polls once a second, kills it is a race; when it does, the line is the one-line form.
    """
    save = str(tmp_path / "save")
    config = os.path.join(REPO_ROOT, "examples", "ds_configs", "ds_zero2.json")
    flags = tiny_gpt_flags(stdlib_dataset) + [
        "--deepspeed", "--deepspeed_config", config, "--global-batch-size", "4",
        "--train-iters", "6", "--eval-iters", "0", "--save", save, "--save-interval", "2",
    ]  # fmt: skip
    deepspeed = os.path.join(os.path.dirname(command(1, [])[0]), "deepspeed")
    result = subprocess.run(
        [deepspeed, "--num_gpus", "2", "--master_port", cpu_env()["MASTER_PORT"],
         os.path.join(REPO_ROOT, "pretrain_gpt.py"), *flags],
        cwd=REPO_ROOT, env=cpu_env(OMP_NUM_THREADS="1", **{FAULT_ENV: "kill@3:1"}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout
    assert result.returncode != 0, output[-3000:]
    assert "[MEGATRON_TRAINING_FAULT] rank 1: SIGKILL at iteration 3" in output
    assert re.search(r"launch\.py:\d+:sigkill_handler\] .* exits with return code = -9", output)
    assert "Traceback" not in output, output[-3000:]
    for line in output.splitlines():
        if line.startswith("error: "):
            assert re.fullmatch(
                r"error: rank 0: \w+ on the data-parallel group \(ranks 0, 1\) failed: another "
                r"rank closed its connection \(it exited or was killed\); at \S+:\d+ in \w+; "
                rf"Python stacks in {re.escape(os.path.join(save, 'stacks', 'rank0.txt'))}",
                line,
            ), line
    assert sorted(os.listdir(os.path.join(save, "global_step2")))  # the checkpoint before stays
    assert open(os.path.join(save, "latest")).read() == "global_step2"


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_to_the_same_weights(straight_run: tuple, tmp_path) -> None:
    flags, straight = straight_run
    save = str(tmp_path / "save")
    # torchrun's static rendezvous keeps its store across restarts: without the per-restart
    # namespace of `initialize_distributed`, 1 restart in 4 failed or hung here.
    command_line = command(2, flags + ["--save", save, "--load", save])
    command_line.insert(1, "--max-restarts=2")
    result = subprocess.run(
        command_line, cwd=REPO_ROOT, env=cpu_env(OMP_NUM_THREADS="1", **{FAULT_ENV: "kill@5:1"}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert "SIGKILL at iteration 5" in result.stdout
    assert "loaded megatron checkpoint" in result.stdout and "at iteration 4" in result.stdout
    final = f"iter_{TRAIN_ITERS:07d}"
    assert differences(os.path.join(straight, final), os.path.join(save, final)) == []
