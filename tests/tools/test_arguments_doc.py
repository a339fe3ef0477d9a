"""docs/arguments.md matches the parser, and every flag of pretrain_gpt.py has help."""

from __future__ import annotations

import argparse
import os

import pytest

from tests.conftest import REPO_ROOT, run_cli
from tools import write_arguments_doc
from tools.write_arguments_doc import (
    DOC_PATH,
    build_doc_parser,
    expand_help,
    main,
    render_arguments_markdown,
)

RERUN = "run python tools/write_arguments_doc.py"


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser as the doc tool builds it (built once: DeepSpeed is slow)."""
    return build_doc_parser()


@pytest.fixture(scope="module")
def rendered(parser: argparse.ArgumentParser) -> str:
    """A fresh render of docs/arguments.md."""
    return render_arguments_markdown(parser)


def test_committed_doc_is_current(rendered: str):
    """The committed page is byte-for-byte what the tool writes now."""
    path = os.path.join(REPO_ROOT, DOC_PATH)
    assert os.path.isfile(path), f"{DOC_PATH} is missing; {RERUN}"
    with open(path, encoding="utf-8", newline="") as file:
        committed = file.read()
    assert committed == rendered, f"{DOC_PATH} is stale; {RERUN}"


def test_every_flag_has_help(parser: argparse.ArgumentParser):
    """A new flag without help= fails here (DeepSpeed's flags included)."""
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if action.help is not argparse.SUPPRESS and not (action.help or "").strip()
    ]
    assert not missing, f"flags without help=: {', '.join(missing)}"


def test_every_flag_is_documented(parser: argparse.ArgumentParser, rendered: str):
    """Each option string appears in a table row, once."""
    for action in parser._actions:
        for option in action.option_strings:
            assert rendered.count(f"`{option}`") == 1, option
    assert "| `--zero-stage` | {0,1,2,3} |  | ZeRO stage" in rendered
    assert "| `--no-bias-gelu-fusion` | flag | off |" in rendered
    assert "| `--rampup-batch-size` | START INCREMENT SAMPLES (int) |  |" in rendered


def test_render_ignores_the_launcher_environment(monkeypatch, rendered: str):
    """--local-rank's default comes from LOCAL_RANK; the page must not depend on it."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert render_arguments_markdown(build_doc_parser()) == rendered
    assert os.environ["LOCAL_RANK"] == "3"


def test_help_defaults_expand_and_pipes_are_escaped():
    """%(default)s becomes the default; a | in help cannot break the table row."""
    parser = argparse.ArgumentParser(prog="x")
    group = parser.add_argument_group("demo")
    group.add_argument("--width", type=int, default=7, help="Width (default: %(default)s).")
    group.add_argument("--mode", choices=["a", "b"], default="a", help="a | b: %(choices)s.")
    group.add_argument("--off", action="store_false", dest="on", help="Turn it off.")
    width, mode, off = parser._action_groups[-1]._group_actions
    assert expand_help(width) == "Width (default: 7)."
    assert expand_help(mode) == "a | b: a, b."
    page = render_arguments_markdown(parser)
    assert "| `--width` | int | `7` | Width (default: 7). |" in page
    assert "| `--mode` | {a,b} | `a` | a \\| b: a, b. |" in page
    assert "| `--off` | flag | off | Turn it off. |" in page
    assert "%(" not in page


def test_real_help_defaults_expand(rendered: str):
    """The %(default)s fields of our own flags are filled in, none left raw."""
    assert "Fraction of each head's channels that RoPE rotates (default: 1.0)." in rendered
    assert "Tokenizer (default: GPT2BPETokenizer, from --vocab-file/--merge-file)" in rendered
    assert "%(" not in rendered


def test_check_passes_on_current_file_and_fails_on_stale_copy(tmp_path, capsys, rendered: str):
    """--check: 0 on a current page, 1 with a one-line message on a stale one; writes nothing.

    The stale case runs the script as a user would; the current case calls main() in-process
    (a second interpreter would import torch and DeepSpeed again for the same code path).
    """
    current = tmp_path / "current.md"
    current.write_text(rendered, encoding="utf-8")
    assert main(["--check", "--output", str(current)]) == 0
    assert "error" not in capsys.readouterr().err
    stale = tmp_path / "stale.md"
    stale.write_text(rendered.replace("Transformer hidden size", "Hidden size"), encoding="utf-8")
    before = stale.read_text(encoding="utf-8")
    result = run_cli("tools/write_arguments_doc.py", "--check", "--output", str(stale))
    assert result.returncode == 1, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error_lines == [f"error: {stale} is stale; {RERUN} --output {stale}"]
    assert stale.read_text(encoding="utf-8") == before
    assert main(["--check", "--output", str(tmp_path / "missing.md")]) == 1


def test_check_message_for_the_default_path(monkeypatch, capsys, tmp_path):
    """The default page's message is the one CI shows: run the script, no --output."""
    monkeypatch.setattr(write_arguments_doc, "DEFAULT_OUTPUT", str(tmp_path / "arguments.md"))
    assert main(["--check", "--output", str(tmp_path / "arguments.md")]) == 1
    assert capsys.readouterr().err == f"error: {DOC_PATH} is stale; {RERUN}\n"
