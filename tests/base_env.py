"""The base install's environment for tests/test_base_install.py: a virtualenv in
`.cache/base-install/venv` holding only what `scripts/setup_env.sh` with no extras installs,
into a copy of the working tree as a user's clone would be (`.cache/base-install/src`).

Kept for the next run while the project's build inputs stay the same (setup_env.sh's own
stamp). Standard library only: scripts/run_tests.sh builds it in the background while the test
environment installs (pip leaves a core idle), as `python -m tests.base_env`; the test's fixture
then finds it built, or builds it itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.cached import CACHE_DIR, REPO_ROOT, cache_lock

BASE_DIR = os.path.join(CACHE_DIR, "base-install")
SOURCE_DIR = os.path.join(BASE_DIR, "src")
PYTHON = os.path.join(BASE_DIR, "venv", "bin", "python")


class BuildError(RuntimeError):
    """scripts/setup_env.sh failed in the base environment (its stderr's end)."""


def copy_of_the_working_tree(destination: str) -> None:
    """The files a clone of this working tree would have (tracked, and new ones not ignored),
    over an earlier copy: files gone from the tree go, its built extensions stay."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    names = {name for name in listed.split("\0") if os.path.isfile(os.path.join(REPO_ROOT, name))}
    for root, _dirs, files in os.walk(destination):
        for file in files:
            name = os.path.relpath(os.path.join(root, file), destination)
            if name not in names and not name.endswith((".so", ".pyc")) and ".egg-info" not in name:
                os.unlink(os.path.join(root, file))
    for name in names:
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(REPO_ROOT, name), target)


def build(interpreter: str = sys.executable) -> tuple[str, str]:
    """(python of the base environment, the copy of the working tree it installed), made or
    brought up to date with `interpreter`'s venv module; raises BuildError."""
    with cache_lock("base-install"):
        copy_of_the_working_tree(SOURCE_DIR)
        if not os.path.exists(PYTHON):
            subprocess.run([interpreter, "-m", "venv", os.path.dirname(os.path.dirname(PYTHON))])
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        setup = subprocess.run(
            ["bash", os.path.join(SOURCE_DIR, "scripts", "setup_env.sh")],
            cwd=SOURCE_DIR,  # its import check must find the copy's megatron, not this tree's
            env=dict(env, PYTHON=PYTHON),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if setup.returncode != 0 or setup.stdout.strip().splitlines()[-1:] != [PYTHON]:
            raise BuildError(setup.stdout[-2000:] + setup.stderr[-4000:])
    return PYTHON, SOURCE_DIR


if __name__ == "__main__":
    try:
        print(build()[0])
    except BuildError as error:
        sys.exit(f"error: the base environment did not build:\n{error}")
