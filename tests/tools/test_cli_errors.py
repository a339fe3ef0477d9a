"""tools/cli_errors.py: which exceptions become one `error:` line, and the debug escape hatch."""

from __future__ import annotations

import pytest

from tests.one_line_errors import assert_one_line_error, file_under_a_file
from tools.cli_errors import (
    DEBUG_TRACEBACKS,
    ToolArgumentParser,
    check_output_path,
    describe,
    run_tool,
)


class DomainError(ValueError):
    """Stands for a tool's own error class (IndexedDatasetError, TokenizerFileError...)."""


def _raise(error: BaseException):
    def body():
        raise error

    return body


def test_listed_errors_and_oserror_are_one_line_with_the_note(capsys):
    error = DomainError("data/x.idx: truncated\nsecond line dropped")
    assert run_tool(_raise(error), (DomainError,), note="nothing was written") == 1
    assert capsys.readouterr().err == "error: data/x.idx: truncated; nothing was written\n"
    missing = FileNotFoundError(2, "No such file or directory", "data/in.jsonl")
    assert run_tool(_raise(missing)) == 1
    assert capsys.readouterr().err == "error: data/in.jsonl: No such file or directory\n"


def test_a_bad_flag_is_one_line_without_the_note(capsys):
    parser = ToolArgumentParser(prog="tool")
    parser.add_argument("--workers", type=int, required=True)
    code = run_tool(lambda: parser.parse_args(["--workers", "many"]), note="nothing was written")
    line = assert_one_line_error(code, capsys.readouterr().err, "--workers", "'many'")
    assert line.endswith("(see --help)")


def test_other_exceptions_are_bugs_and_keep_their_traceback():
    with pytest.raises(KeyError):
        run_tool(_raise(KeyError("bug")), (DomainError,))
    with pytest.raises(ValueError):
        run_tool(_raise(ValueError("a plain ValueError is not listed")), (DomainError,))


def test_debug_variable_shows_the_traceback(monkeypatch):
    monkeypatch.setenv(DEBUG_TRACEBACKS, "1")
    with pytest.raises(DomainError):
        run_tool(_raise(DomainError("x")), (DomainError,))
    monkeypatch.setenv(DEBUG_TRACEBACKS, "0")
    assert run_tool(_raise(DomainError("x")), (DomainError,)) == 1


def test_check_output_path(tmp_path):
    check_output_path(str(tmp_path / "new" / "deeper" / "out.bin"), "--output")  # creatable
    blocked = file_under_a_file(tmp_path)
    with pytest.raises(OSError, match=f"^--output {blocked}: .*a_file is a file, not a folder$"):
        check_output_path(blocked, "--output")
    with pytest.raises(OSError, match="--save .*a_file is a file, not a folder"):
        check_output_path(str(tmp_path / "a_file"), "--save", is_folder=True)
    assert describe(OSError("--save x: message")) == "--save x: message"


def test_help_still_prints_usage(capsys):
    parser = ToolArgumentParser(prog="tool")
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--help"])
    assert exited.value.code == 0 and "usage: tool" in capsys.readouterr().out
