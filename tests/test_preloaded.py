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
print(f"rank {rank} of {os.environ.get('WORLD_SIZE')} argv {sys.argv[1:]} cwd {os.getcwd()}")
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
