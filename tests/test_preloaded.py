"""The preloaded launcher (tests/preloaded.py) against the real launchers it stands in for.

Most of the suite's `pretrain_gpt.py` runs fork their ranks from a process that imported torch,
DeepSpeed and megatron once. Here the same runs go through `torchrun` and DeepSpeed's launcher
themselves, every rank a new Python process, and through the preloaded launcher: the same
iteration lines (losses, norms, token counts) and the same checkpoint, file by file and tensor
by tensor; a failing rank gives the launcher's exit code and stops the others; a run past its
timeout is killed with every rank.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests import preloaded
from tests.checkpointing.compare import differences
from tests.distributed import free_port
from tests.launcher_shim import shim_env
from tests.pretrain_runs import iteration_logs, launch, launch_for_real, tiny_gpt_flags

pytestmark = pytest.mark.slow

LAUNCHERS = {
    "torchrun": [],
    "deepspeed": ["--deepspeed", "--zero-stage", "1", "--no-pipeline-parallel"],
}


def _comparable(output: str) -> list[dict]:
    """The iteration lines without their timings."""
    timed = ("elapsed time", "samples per second", "tokens per gpu per second", "TFLOPs", "ETA")
    return [
        {key: value for key, value in log.items() if not key.startswith(timed)}
        for log in iteration_logs(output)
    ]


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_preloaded_launch_runs_as_the_launcher_would(launcher, stdlib_dataset, tmp_path):
    flags = tiny_gpt_flags(stdlib_dataset) + LAUNCHERS[launcher]
    flags += ["--global-batch-size", "8", "--train-iters", "3", "--save-interval", "3"]
    runs = {}
    for name, start in (("real", launch_for_real), ("preloaded", launch)):
        save = str(tmp_path / name)
        runs[name] = start(2, [*flags, "--save", save], launcher=launcher)
        assert runs[name].returncode == 0, (name, runs[name].stdout[-3000:])
    real, forked = (_comparable(runs[name].stdout) for name in ("real", "preloaded"))
    assert len(real) == 3 and forked == real
    assert differences(str(tmp_path / "real"), str(tmp_path / "preloaded")) == []


_SCRIPT = """import os, sys, time
rank = int(os.environ.get("RANK", "0"))
# One write per line: both ranks share the unbuffered pipe, and print's separate writes interleave.
line = f"rank {rank} of {os.environ.get('WORLD_SIZE')} argv {sys.argv[1:]} cwd {os.getcwd()}"
sys.stdout.write(line + "\\n")
if sys.argv[-1] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[-1] in ("fail", "hang"):
    time.sleep(600)
"""


def test_exit_codes_environment_and_timeout(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    common = dict(env=env, cwd=str(tmp_path), port=29999)

    ok = preloaded.launch(["x"], str(script), ["a"], 2, "deepspeed", **common)
    assert ok.returncode == 0
    assert sorted(ok.stdout.splitlines()) == [
        f"rank {rank} of 2 argv ['--local_rank={rank}', 'a'] cwd {tmp_path}" for rank in (0, 1)
    ]
    # A failing rank stops the other (asleep for 10 minutes): torchrun exits 1, DeepSpeed's
    # launcher with the rank's code, one process with its own.
    for launcher, processes, code in (("torchrun", 2, 1), ("deepspeed", 2, 3), ("python", 1, 0)):
        done = preloaded.launch(["x"], str(script), ["fail"][: processes - 1] or ["b"],
                                processes, launcher, timeout=120, **common)  # fmt: skip
        assert done.returncode == code, (launcher, done.stdout)
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.launch(["x"], str(script), ["hang"], 2, "torchrun", timeout=5, **common)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(script) not in ps  # every rank of the timed-out launch was killed


def test_command_lines_are_read_as_the_launchers_read_them() -> None:
    parse = preloaded.parse_command
    assert parse(["/venv/bin/python", "s.py", "--x"]) == ("python", 1, 0, "s.py", ["--x"])
    assert parse(["torchrun", "--nproc-per-node=2", "--nnodes", "1", "--node_rank", "0",
                  "--master_addr", "localhost", "--master_port", "6000", "s.py", "--x"]) == (
        "torchrun", 2, 6000, "s.py", ["--x"])  # fmt: skip
    assert parse(["deepspeed.pt", "--num_nodes", "1", "--num_gpus", "2", "s.py"]) == (
        "deepspeed", 2, 29500, "s.py", [])  # fmt: skip
    legacy = ["python3", "-m", "torch.distributed.launch", "--nproc_per_node", "4"]
    assert parse([*legacy, "s.py"]) == ("torch.distributed.launch", 4, 29500, "s.py", [])
    assert parse([*legacy, "--use-env", "s.py"])[0] == "torchrun"  # LOCAL_RANK only
    for refused in (
        ["python", "-c", "print(1)"],
        ["torchrun", "--nnodes", "2", "--nproc_per_node", "2", "s.py"],
        ["torchrun", "--max-restarts", "1", "--nproc_per_node", "2", "s.py"],
        ["deepspeed", "--hostfile", "hosts", "--num_gpus", "2", "s.py"],
        ["deepspeed", "--num_gpus", "2"],
        ["accelerate", "launch", "s.py"],
    ):
        with pytest.raises(ValueError):
            parse(refused)


def test_the_legacy_launcher_passes_local_rank(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = preloaded.launch_command(
        [
            "python",
            "-m",
            "torch.distributed.launch",
            "--nproc_per_node",
            "2",
            f"--master_port={free_port()}",
            str(script),
            "a",
        ],  # fmt: skip
        env,
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout
    assert sorted(done.stdout.splitlines()) == [
        f"rank {rank} of 2 argv ['--local-rank={rank}', 'a'] cwd {tmp_path}" for rank in (0, 1)
    ]


_WHICH = """import os, sys, time
# One write per line: both ranks share the unbuffered pipe, and print's separate writes interleave.
how = "forked" if "deepspeed" in sys.modules else "started"
rank, port = os.environ.get("RANK", "0"), os.environ.get("MASTER_PORT", "")
sys.stdout.write(f"{how} {rank}\\n")
open(f"written.{port}.{rank}", "w").close()
failing = sys.argv[-1].isdigit() and rank == "1"
# A launcher stops the other ranks once one fails: rank 1 fails only after rank 0 has written
# its line (bounded by the launch's timeout).
while failing and not os.path.exists(f"written.{port}.0"):
    time.sleep(0.01)
sys.exit(int(sys.argv[-1]) if failing else 0)
"""


def test_a_launch_scripts_launchers_are_stood_in_for(tmp_path) -> None:
    """tests/launcher_shim.py: a script's `torchrun`, `deepspeed` and `$PYTHON script.py` are
    forked from the preloaded process; anything else runs the real program."""
    script = tmp_path / "which.py"
    script.write_text(_WHICH)
    env = shim_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))

    def sh(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    ports = [free_port() for _ in range(3)]  # one per launch, as the suite's other launches
    for line, code, expected in (
        (f"torchrun --nproc_per_node 2 --nnodes 1 --master_port {ports[0]} which.py", 0,
         ["forked 0", "forked 1"]),
        (f"deepspeed --num_gpus 2 --master_port {ports[1]} which.py 3", 3,
         ["forked 0", "forked 1"]),
        (f"torchrun --nproc_per_node 2 --master_port {ports[2]} which.py 5", 1,
         ["forked 0", "forked 1"]),
        ('"$PYTHON" which.py', 0, ["forked 0"]),
        ("python -c 'import sys; print(\"deepspeed\" in sys.modules)'", 0, ["False"]),
        # An import-time variable the preloaded process did not import with: the real python.
        ('OMP_NUM_THREADS=2 "$PYTHON" which.py', 0, ["started 0"]),
    ):  # fmt: skip
        done = sh(line)
        assert done.returncode == code, (line, done.stdout, done.stderr)
        assert sorted(done.stdout.split("\n")[:-1]) == expected, (line, done.stdout, done.stderr)
