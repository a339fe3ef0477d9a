"""Every command quoted in README.md must work as written: scripts exist and flags parse.

The checker (`tests/readme_commands.py`) reads README.md's ```bash blocks and checks each
command by the rule for its program; a command it has no rule for fails, so a new README
command is always checked. The README's ```python block runs as written, its relative links
must point at files of the repository, and its first two commands must stay the newcomer's
`bash examples/quickstart.sh` and `bash scripts/run_tests.sh`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.readme_commands import (
    EXPECTED_FIRST_COMMANDS,
    MARKDOWN_LINK,
    MIN_COMMANDS,
    README,
    Block,
    HelpCache,
    ReadmeCommand,
    check_command,
    read_blocks,
    readme_commands,
)

COMMANDS = readme_commands()


def _command_id(command: ReadmeCommand) -> str:
    """A short test id: the README line and the command's start."""
    text = command.text
    return f"L{command.line} {text[:60]}{'...' if len(text) > 60 else ''}"


@pytest.fixture(scope="session")
def helps(request) -> HelpCache:
    """The `--help` of every program the README runs.

    The ```python blocks are started first when their test is selected, to run meanwhile.
    """
    selected = [getattr(item, "originalname", "") for item in request.session.items]
    if "test_readme_python_block" in selected:
        request.getfixturevalue("python_block_runs")
    cache = HelpCache()
    cache.prefetch(COMMANDS)
    return cache


@pytest.mark.parametrize("command", COMMANDS, ids=_command_id)
def test_readme_command(command: ReadmeCommand, helps: HelpCache) -> None:
    """The command's script exists and its flags parse (see the module docstring)."""
    problems = check_command(command, helps)
    assert not problems, f"{command.where}:\n  " + "\n  ".join(problems)


def test_readme_has_commands() -> None:
    """The extractor finds the README's commands (guards against it silently finding none)."""
    assert len(COMMANDS) >= MIN_COMMANDS, (
        f"only {len(COMMANDS)} commands found in README.md's ```bash blocks "
        f"(expected at least {MIN_COMMANDS}): is the extractor broken?"
    )


def test_readme_starts_with_quickstart_and_tests() -> None:
    """The README's first two commands are the newcomer's: the quickstart, then the tests."""
    first = [command.text for command in COMMANDS[:2]]
    lines = [command.line for command in COMMANDS[:2]]
    assert first == EXPECTED_FIRST_COMMANDS, (
        f"README.md:{lines}: the first two commands must be {EXPECTED_FIRST_COMMANDS}, "
        f"found {first}"
    )


def _readme_links() -> list[tuple[int, str]]:
    """(README line, target) of each relative Markdown link or image outside code blocks."""
    code_lines = {
        block.first_line + offset
        for block in read_blocks()
        for offset in range(-1, len(block.lines) + 1)
    }
    links = []
    with open(README, encoding="utf-8") as f:
        for number, line in enumerate(f.read().splitlines(), start=1):
            if number in code_lines:
                continue
            for target in MARKDOWN_LINK.findall(line):
                if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", target):  # http:, mailto:, #anchor
                    links.append((number, target.split("#", 1)[0]))
    return links


@pytest.mark.parametrize("line,target", _readme_links(), ids=lambda value: str(value))
def test_readme_link(line: int, target: str) -> None:
    """A relative link or image of the README points at a file of the repository."""
    path = os.path.join(os.path.dirname(README), target)
    assert os.path.exists(path), f"README.md:{line}: link target {target} does not exist"


PYTHON_BLOCKS = [block for block in read_blocks() if block.language == "python"]


@pytest.fixture(scope="session")
def python_block_runs(tmp_path_factory):
    """Each ```python block started on CPU (`python -c BLOCK`), with the file of its output.

    They take tens of seconds on 2 cores (the model example runs a 124M model forward), so
    they start before the commands are checked (`helps` asks for this fixture) and run
    meanwhile; `test_readme_python_block` waits for them. Killed if still running at the end.
    """
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    runs = {}
    for block in PYTHON_BLOCKS:
        output = tmp_path_factory.mktemp("readme_python") / f"line{block.first_line}.txt"
        with open(output, "w") as f:
            code = "\n".join(block.lines) + "\n"
            process = subprocess.Popen(
                [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=f, stderr=f
            )
        runs[block] = (process, output)
    yield runs
    for process, _ in runs.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda block: f"L{block.first_line}")
def test_readme_python_block(block: Block, python_block_runs) -> None:
    """A ```python block runs as written (on CPU), and prints what its comments promise.

    A `print(...)  # A, B` line promises that the output contains each of A and B (the model
    example: `124,475,904 parameters` and `0.855 GFLOPs per token`).
    """
    process, output_file = python_block_runs[block]
    returncode = process.wait(timeout=600)
    output = output_file.read_text()
    where = f"README.md:{block.first_line}: the ```python block"
    assert returncode == 0, f"{where} exits {returncode}:\n{output[-3000:]}"
    for line in block.lines:
        match = re.match(r"^\s*print\(.*\)\s*#\s*(.+)$", line)
        for promised in match.group(1).split(", ") if match else []:
            assert promised in output, (
                f"{where} does not print {promised!r} ({line.strip()!r}); it printed:\n"
                f"{output[-3000:]}"
            )
