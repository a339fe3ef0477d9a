"""Stand-ins for `python`, `torchrun` and `deepspeed` that a test puts first on a launch
script's PATH (`shim_env`): the script's training launch then runs forked from the pytest
worker's preloaded process (tests/preloaded.py), as `launch_command` runs one, instead of a
launcher and ranks that each import torch, DeepSpeed and megatron again.

Everything else runs the real program: `python -c ...` and other non-script runs, launcher
options for several nodes or a hostfile (`preloaded.parse_command`), and an environment whose
import-time variables the script changed (the preloaded process imported with the test's).
Each stand-in (tests/launcher_shims/NAME) is `python tests/launcher_shim.py NAME ARGS`.
The real launchers keep their own tests: tests/test_preloaded.py compares the two, and the
launcher-behaviour tests (tests/training/test_collective_failures.py, the v1 and legacy
launchers in tests/compat) start them for real.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

if __name__ == "__main__":  # run as a file by the stand-ins: the repository's tests package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import preloaded  # noqa: E402 - standard library only

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher_shims")
_VARIABLES = ("SHIM_SOCKET", "SHIM_KEY", "SHIM_PYTHON", "SHIM_BIN")


def shim_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the stand-ins first on PATH and as $PYTHON, pointing at the preloaded process
    of `env`'s import-time variables (started here if need be)."""
    python = env.get("PYTHON", sys.executable)
    bin_dir = os.path.dirname(sys.executable)
    real = dict(env, PYTHON=python)
    server = preloaded.preloaded_for(real)
    return dict(
        real,
        PATH=os.pathsep.join([SHIM_DIR, env.get("PATH", "")]),
        PYTHON=os.path.join(SHIM_DIR, "python"),
        SHIM_SOCKET=server.socket_path,
        SHIM_KEY=json.dumps(preloaded.import_time_key(real)),
        SHIM_PYTHON=python,
        SHIM_BIN=bin_dir,
    )


def _real_env() -> dict[str, str]:
    """This process's environment without the stand-ins: what the real program, or the ranks,
    get."""
    env = {k: v for k, v in os.environ.items() if k not in _VARIABLES}
    env["PYTHON"] = os.environ["SHIM_PYTHON"]
    paths = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(path for path in paths if path != SHIM_DIR)
    return env


def main(name: str, args: list[str]) -> int:
    """Run `name args` forked from the preloaded process when it can, else exec the real one."""
    env = _real_env()
    real = os.environ["SHIM_PYTHON"] if name == "python" else os.path.join(
        os.environ["SHIM_BIN"], name
    )  # fmt: skip
    try:
        launcher, processes, port, script, script_args = preloaded.parse_command([name, *args])
        same = json.dumps(preloaded.import_time_key(env)) == os.environ["SHIM_KEY"]
    except ValueError:
        same = False
    if not same:
        os.execve(real, [real, *args], env)
    if launcher != "python":
        env["MASTER_PORT"] = str(port)
    with tempfile.NamedTemporaryFile("rb", prefix="launch_", suffix=".log") as log:
        request = dict(
            script=script, args=script_args, processes=processes, launcher=launcher, env=env,
            cwd=os.getcwd(), port=port, log=log.name, errors=None,
        )  # fmt: skip
        reply = preloaded.send_launch(os.environ["SHIM_SOCKET"], request, timeout=3600)
        sys.stdout.flush()
        os.write(1, log.read())
    return preloaded.exit_code(launcher, reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
