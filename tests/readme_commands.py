"""The checker behind tests/test_readme_commands.py: README commands, scripts, flags.

The commands come from README.md's ```bash (also sh, shell, console) blocks: lines ending in a
backslash are joined, `shlex` splits them (dropping `# comments`), and `&&`, `||`, `;`, `|`
separate commands. Leading `NAME=value` tokens are the command's environment. Each command is
then checked by the rule for its program (`PROGRAMS`): the script it names exists, the flags
given to `pretrain_gpt.py` (directly, through a launcher, or through a launch script) parse with
its parser, and the flags given to any other script, module or launcher appear in its `--help`.
Nothing is run for real.

The check is strict: a program, script or option it has no rule for fails the test, with a
message saying where to teach it, so a new README command is always checked. The README's
```python block runs as written, its relative links must point at files of the repository,
and its first two commands must stay the newcomer's `bash examples/quickstart.sh` and
`bash scripts/run_tests.sh`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass

from tests.conftest import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")
BIN_DIR = os.path.dirname(sys.executable)
TEACH = "teach tests/readme_commands.py about it"

SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Option strings in `--help` output: `-h`, `--num-layers`, `--top_k` (not `non-UTF`, `-1`).
HELP_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
NEGATIVE_NUMBER = re.compile(r"^-\.?\d")
MARKDOWN_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")

# Launch scripts whose extra arguments go to pretrain_gpt.py.
LAUNCH_SCRIPTS = {
    "scripts/ds_pretrain_gpt2.sh",
    "scripts/ds_zero2_pretrain_gpt2_model_parallel.sh",
    "scripts/pretrain_gpt2.sh",
    "scripts/pretrain_gpt2_model_parallel.sh",
    "examples/pretrain_gpt.sh",
    "examples/pretrain_gpt_distributed.sh",
    "examples/pretrain_llama2_distributed.sh",
}
SLURM_SCRIPT = "examples/pretrain_gpt_slurm.sh"
# apply_model_size and apply_llama_model_size in scripts/common.sh
MODEL_SIZES = {"124M", "345M", "1.5B", "tiny"} | {
    "llama-tiny",
    "llama-1.3B",
    "llama2-7B",
    "llama2-13B",
    "llama2-70B",
}
# Environment variables naming files of the repository.
REPO_FILE_VARIABLES = {"LAUNCH_SCRIPT", "DS_CONFIG"}
# Arguments under these folders are files shipped with the repository (data/, checkpoints/,
# runs/ are the user's); they must exist.
REPO_FOLDERS = ("benchmarks/", "dataset/", "docs/", "examples/", "megatron/", "scripts/", "tools/")
# sbatch's options that take a value (as `--nodes 4`; `--nodes=4` is one token), and its flags.
SBATCH_VALUE_OPTIONS = {
    "-A", "--account", "-a", "--array", "-C", "--constraint", "-c", "--cpus-per-task",
    "-d", "--dependency", "-e", "--error", "--gpus", "-G", "--gpus-per-node", "--gres",
    "-J", "--job-name", "--mail-type", "--mail-user", "--mem", "-N", "--nodes", "-n",
    "--ntasks", "--ntasks-per-node", "-o", "--output", "-p", "--partition", "-q", "--qos",
    "--reservation", "--signal", "-t", "--time",
}  # fmt: skip
SBATCH_FLAGS = {"--exclusive", "-H", "--hold", "--requeue", "--no-requeue", "-W", "--wait"}
EXPECTED_FIRST_COMMANDS = ["bash examples/quickstart.sh", "bash scripts/run_tests.sh"]
MIN_COMMANDS = 25
HELP_MARKER = "README-HELP-RESULTS:"


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language and lines, the first at README line `first_line`."""

    language: str
    first_line: int
    lines: tuple[str, ...]


@dataclass(frozen=True)
class ReadmeCommand:
    """One shell command of the README: its environment assignments and its words."""

    line: int  # 1-based README line where the command starts
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    syntax_error: str = ""

    @property
    def text(self) -> str:
        """The command as a shell would read it back."""
        return shlex.join([f"{name}={value}" for name, value in self.env] + list(self.argv))

    @property
    def where(self) -> str:
        """README line and command, to start an error message."""
        return f"README.md:{self.line}: `{self.text}`"


def read_blocks(path: str = README) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    blocks, fence, language, first_line, lines = [], "", "", 0, []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f.read().splitlines(), start=1):
            match = FENCE.match(line)
            if not fence and match:  # an opening fence
                fence, language = match.group(1), match.group(2)
                first_line, lines = number + 1, []
            elif not fence:
                continue
            elif match and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                blocks.append(Block(language.lower(), first_line, tuple(lines)))
                fence = ""
            else:
                lines.append(line)
    return blocks


def _logical_lines(block: Block) -> list[tuple[int, str]]:
    """(README line, text) of each shell line, backslash continuations joined."""
    logical, pending, start = [], "", 0
    for number, line in enumerate(block.lines, start=block.first_line):
        if not pending and block.language == "console":
            if not line.lstrip().startswith("$ "):
                continue  # console output
            line = line.lstrip()[2:]
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append((start, pending + line))
        pending = ""
    if pending:
        logical.append((start, pending))
    return logical


def block_commands(block: Block) -> list[ReadmeCommand]:
    """The commands of a shell block, split at `&&`, `||`, `;`, `|`, `&`."""
    commands = []
    for line, text in _logical_lines(block):
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError as error:
            commands.append(ReadmeCommand(line, (), (text.strip(),), f"shlex: {error}"))
            continue
        segments: list[list[str]] = [[]]
        for token in tokens:
            if token in SEPARATORS:
                segments.append([])
            else:
                segments[-1].append(token)
        for words in segments:
            if not words:
                continue
            count = 0
            while count < len(words) and ASSIGNMENT.match(words[count]):
                count += 1
            env = tuple(tuple(word.split("=", 1)) for word in words[:count])
            commands.append(ReadmeCommand(line, env, tuple(words[count:])))
    return commands


def readme_commands() -> list[ReadmeCommand]:
    """Every command of README.md's shell blocks, in order."""
    blocks = [block for block in read_blocks() if block.language in SHELL_LANGUAGES]
    return [command for block in blocks for command in block_commands(block)]


# ---------------------------------------------------------------------------------------------
# What a command's arguments may be: pretrain_gpt.py's parser, a program's --help.


class HelpCache:
    """`--help` outputs of the programs the README's commands run, and their option strings.

    A target is `(SCRIPT,)` (a Python script: a repository file, or a launcher beside this
    Python) or `("-m", MODULE)`. One subprocess per target would import torch each time (about
    45 s for the README's targets on 2 cores), so `prefetch` lists the targets the commands need
    with a dry run of their checks, and one subprocess (`_print_helps`) runs them all in turn.
    """

    def __init__(self) -> None:
        self._results: dict[tuple[str, ...], tuple[int, str, frozenset[str]]] = {}
        self._wanted: list[tuple[str, ...]] | None = None

    def prefetch(self, commands: list[ReadmeCommand]) -> None:
        """Run the `--help` of every target that `commands` name, in one subprocess."""
        self._wanted = []
        for command in commands:
            check_command(command, self)  # dry run: only records the targets
        wanted, self._wanted = self._wanted, None
        self._results.update(_run_helps(sorted(set(wanted) - set(self._results))))

    def get(self, target: tuple[str, ...]) -> tuple[int, str, frozenset[str]]:
        """(exit status, output, option strings) of `python TARGET --help`."""
        if self._wanted is not None:
            self._wanted.append(target)
            return 0, "", frozenset()
        if target not in self._results:
            self._results.update(_run_helps([target]))
        return self._results[target]

    def problems(self, target: tuple[str, ...], args: tuple[str, ...], name: str) -> list[str]:
        """Problems with `args` as arguments of `target`: an option its --help does not list."""
        returncode, output, options = self.get(target)
        if returncode != 0:
            return [f"`{name} --help` exits {returncode}:\n{output[-2000:]}"]
        return [
            f"{name} has no option {flag!r} (not in `{name} --help`)"
            for flag in _flags(args)
            if flag not in options
        ]


def _run_helps(targets: list[tuple[str, ...]]) -> dict[tuple[str, ...], tuple]:
    """`HelpCache.get`'s results for `targets`, from one `_print_helps` subprocess."""
    if not targets:
        return {}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PATH"] = BIN_DIR + os.pathsep + env.get("PATH", "")
    code = "from tests.readme_commands import _print_helps; _print_helps()"
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(targets),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    reports = [line for line in result.stdout.splitlines() if line.startswith(HELP_MARKER)]
    assert result.returncode == 0 and reports, f"_print_helps failed:\n{result.stdout[-3000:]}"
    return {
        tuple(target): (returncode, output, frozenset(HELP_OPTION.findall(output)))
        for target, returncode, output in json.loads(reports[-1][len(HELP_MARKER) :])
    }


def _print_helps() -> None:
    """Run `python TARGET --help` for each target (a JSON list on stdin), in this process.

    Each runs as `python SCRIPT` or `python -m MODULE` would run it: as `__main__`, with its
    `sys.argv`, and the script's folder (for a module, the current one) first on `sys.path`.
    Prints `HELP_MARKER` and a JSON list of [target, exit status, output] (captured output:
    loggers holding the real stdout may print around it).
    """
    base_path = [entry for entry in sys.path if entry not in ("", os.getcwd(), REPO_ROOT)]
    reports = []
    for target in json.loads(sys.stdin.read()):
        output, status = io.StringIO(), 0
        module = target[1] if target[0] == "-m" else None
        sys.argv = [module or target[0], "--help"]
        sys.path[:] = [os.getcwd() if module else os.path.dirname(target[0])] + base_path
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target[0], run_name="__main__")
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except Exception as error:  # any failure is the target's
            status, output = 1, io.StringIO(f"{output.getvalue()}\n{error!r}")
        reports.append([target, status, output.getvalue()])
    print(HELP_MARKER + json.dumps(reports))


def _flags(args: tuple[str, ...]) -> list[str]:
    """The option strings among `args`: `-x`, `--name` (`--name=value` gives `--name`)."""
    flags = []
    for token in args:
        if token == "--":
            break
        if token.startswith("-") and token != "-" and not NEGATIVE_NUMBER.match(token):
            flags.append(token.split("=", 1)[0])
    return flags


_PRETRAIN_PARSER = []  # built once: it imports DeepSpeed


def pretrain_problems(args: tuple[str, ...]) -> list[str]:
    """Problems with `args` as pretrain_gpt.py's arguments: argparse's error, if any."""
    if not _PRETRAIN_PARSER:
        from megatron.arguments import build_parser

        parser = build_parser()
        parser.prog = "pretrain_gpt.py"
        _PRETRAIN_PARSER.append(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            _PRETRAIN_PARSER[0].parse_args(list(args))
    except SystemExit as exit_:
        if exit_.code:
            error = stderr.getvalue().strip().splitlines()[-1:]  # argparse's `prog: error: ...`
            return [f"pretrain_gpt.py's parser rejects {shlex.join(args)!r}: {''.join(error)}"]
    return []


def _repo_path_problems(command: ReadmeCommand) -> list[str]:
    """Arguments (or `--flag=` values) under the repository's own folders must exist."""
    problems = []
    for token in command.argv[1:]:
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        if value.startswith(REPO_FOLDERS) and not os.path.exists(os.path.join(REPO_ROOT, value)):
            problems.append(f"{value}: no such file in the repository")
    return problems


def _env_problems(command: ReadmeCommand) -> list[str]:
    """Checks on `NAME=value`: MODEL_SIZE is known, repository files exist."""
    problems = []
    for name, value in command.env:
        if name == "MODEL_SIZE" and value not in MODEL_SIZES:
            problems.append(f"MODEL_SIZE={value} is not one of {sorted(MODEL_SIZES)}")
        if name in REPO_FILE_VARIABLES and not os.path.isfile(os.path.join(REPO_ROOT, value)):
            problems.append(f"{name}={value}: no such file in the repository")
    return problems


def _unread_variables(command: ReadmeCommand, scripts: list[str]) -> list[str]:
    """Environment variables of the command that none of `scripts` (or common.sh) reads."""
    texts = []
    for script in scripts:
        path = os.path.join(REPO_ROOT, script)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
    if any("common.sh" in text for text in texts):
        with open(os.path.join(REPO_ROOT, "scripts", "common.sh"), encoding="utf-8") as f:
            texts.append(f.read())
    return [
        f"{name}= is read by none of {', '.join(scripts)} (a typo?)"
        for name, _ in command.env
        if not any(re.search(rf"\${{?{name}\b", text) for text in texts)
    ]


def _missing(path: str) -> list[str]:
    """A problem if `path` is not a file of the repository."""
    if os.path.isfile(os.path.join(REPO_ROOT, path)):
        return []
    return [f"{path}: no such file in the repository"]


# ---------------------------------------------------------------------------------------------
# The rule of each program. Each returns the problems of `command` (empty: it works).


def _script_args_problems(script: str, args: tuple[str, ...], helps: HelpCache) -> list[str]:
    """The arguments of a shell script of the repository, by what the script does with them."""
    if script in LAUNCH_SCRIPTS or script == SLURM_SCRIPT:
        return pretrain_problems(args)  # extra arguments go to pretrain_gpt.py
    if script == "examples/quickstart.sh":
        return [f"quickstart.sh takes only --redo or --help, not {a!r}" for a in args
                if a not in {"--redo", "--help", "-h"}]  # fmt: skip
    if script == "scripts/run_tests.sh":  # arguments go to pytest
        return helps.problems(("-m", "pytest"), args, "pytest") if args else []
    return [f"no rule for the arguments of {script} ({TEACH}: _script_args_problems)"]


def check_bash(command: ReadmeCommand, helps: HelpCache) -> list[str]:
    """`bash SCRIPT [args]`: SCRIPT exists, its arguments are what it takes."""
    args = command.argv[1:]
    if not args or args[0].startswith("-"):
        return [f"`bash` without a script, or with options ({TEACH}: check_bash)"]
    script, rest = args[0], args[1:]
    if _missing(script):
        return _missing(script)
    scripts = [script] + ([value for name, value in command.env if name == "LAUNCH_SCRIPT"])
    return _script_args_problems(script, rest, helps) + _unread_variables(command, scripts)


def check_sbatch(command: ReadmeCommand, helps: HelpCache) -> list[str]:
    """`sbatch [options] SCRIPT [args]`: known sbatch options, SCRIPT exists, its arguments."""
    args, index = command.argv[1:], 0
    while index < len(args) and args[index].startswith("-"):
        option = args[index].split("=", 1)[0]
        if option in SBATCH_VALUE_OPTIONS:
            index += 1 if "=" in args[index] else 2
        elif option in SBATCH_FLAGS:
            index += 1
        else:
            return [f"unknown sbatch option {args[index]!r} ({TEACH}: SBATCH_VALUE_OPTIONS)"]
    if index >= len(args):
        return ["sbatch without a script"]
    script, rest = args[index], args[index + 1 :]
    if _missing(script):
        return _missing(script)
    if script != SLURM_SCRIPT:
        return [f"no rule for the arguments of sbatch {script} ({TEACH}: check_sbatch)"]
    launch_script = dict(command.env).get("LAUNCH_SCRIPT", "scripts/ds_pretrain_gpt2.sh")
    return _script_args_problems(script, rest, helps) + _unread_variables(
        command, [script, launch_script]
    )


def check_python_script(script: str, args: tuple[str, ...], helps: HelpCache) -> list[str]:
    """`python SCRIPT.py [args]`: SCRIPT exists and takes the flags."""
    if script.startswith("checkpoints/"):  # DeepSpeed writes zero_to_fp32.py into checkpoints
        if os.path.basename(script) == "zero_to_fp32.py":
            return []
        return [f"{script}: only zero_to_fp32.py is expected in a checkpoint ({TEACH})"]
    if _missing(script):
        return _missing(script)
    if os.path.normpath(script) in ("pretrain_gpt.py", "pretrain_gpt2.py"):  # one parser
        return pretrain_problems(args)
    return helps.problems((script,), args, script)


def check_python(command: ReadmeCommand, helps: HelpCache) -> list[str]:
    """`python SCRIPT.py`, `python -m MODULE`, `python -c CODE`."""
    args = command.argv[1:]
    if len(args) >= 2 and args[0] == "-c":
        try:
            compile(args[1], "<README python -c>", "exec")
        except SyntaxError as error:
            return [f"python -c code does not compile: {error}"]
        return []
    if len(args) >= 2 and args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pip":
            return check_pip(ReadmeCommand(command.line, command.env, ("pip", *rest)), helps)
        if importlib.util.find_spec(module) is None:
            return [f"no module named {module}"]
        return helps.problems(("-m", module), rest, f"python -m {module}")
    if args and args[0].endswith(".py"):
        return check_python_script(args[0], args[1:], helps)
    return [f"no rule for `{command.argv[0]}` with these arguments ({TEACH}: check_python)"]


def _launcher_checker(launcher: str):
    """The rule of `LAUNCHER [launcher options] SCRIPT.py [args]` (deepspeed, torchrun)."""

    def check(command: ReadmeCommand, helps: HelpCache) -> list[str]:
        args = command.argv[1:]
        scripts = [index for index, token in enumerate(args) if token.endswith(".py")]
        if not scripts:
            return [f"{launcher} without a .py script ({TEACH}: _launcher_checker)"]
        executable = os.path.join(BIN_DIR, launcher)
        if not os.path.isfile(executable):
            return [f"{executable}: no such launcher in this environment"]
        options, script, rest = args[: scripts[0]], args[scripts[0]], args[scripts[0] + 1 :]
        return helps.problems((executable,), options, launcher) + check_python_script(
            script, rest, helps
        )

    check.__doc__ = f"`{launcher} [options] SCRIPT.py [args]`: its options, then the script."
    return check


def check_tensorboard(command: ReadmeCommand, helps: HelpCache) -> list[str]:
    """`tensorboard ...`: installed beside this Python (a dependency); flags unchecked."""
    if os.path.isfile(os.path.join(BIN_DIR, "tensorboard")):
        return []
    return [f"no tensorboard executable in {BIN_DIR}"]


def check_pip(command: ReadmeCommand, helps: HelpCache) -> list[str]:
    """`pip install ...`: allowed, not run."""
    if command.argv[1:2] == ("install",):
        return []
    return [f"only `pip install` is known ({TEACH}: check_pip)"]


PROGRAMS = {
    "bash": check_bash,
    "sbatch": check_sbatch,
    "python": check_python,
    "python3": check_python,
    "deepspeed": _launcher_checker("deepspeed"),
    "torchrun": _launcher_checker("torchrun"),
    "tensorboard": check_tensorboard,
    "pip": check_pip,
}


def check_command(command: ReadmeCommand, helps: HelpCache) -> list[str]:
    """Every problem of one README command (empty: it works as written)."""
    if command.syntax_error:
        return [command.syntax_error]
    program = command.argv[0] if command.argv else ""
    if program not in PROGRAMS:
        return [f"unknown command in README: {command.text} ({TEACH}: PROGRAMS)"]
    problems = _env_problems(command) + _repo_path_problems(command)
    problems += PROGRAMS[program](command, helps)
    return list(dict.fromkeys(problems))  # a missing script is reported once


# ---------------------------------------------------------------------------------------------
# The tests.
