"""One-line errors for the command-line tools: a user's mistake is not a traceback.

A tool's `main(argv)` returns `run_tool(body, user_errors)`. A failure the user causes (a
missing, unreadable or corrupt file, a bad flag, an output path that cannot be written) ends
with one `error: ...` line on stderr that names the file or flag, and exit code 1 (2 for a bad
flag, argparse's code, as pretrain_gpt.py and Megatron's tools give). Only the
exception types a tool lists count as the user's: anything else is a bug and keeps its
traceback. MEGATRON_DEBUG_TRACEBACKS=1 shows the traceback of a user error too, as it does
for pretrain_gpt.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from megatron.atomic_files import nearest_existing

DEBUG_TRACEBACKS = "MEGATRON_DEBUG_TRACEBACKS"


class UsageError(ValueError):
    """A flag value or combination the tool cannot run with; the message names the flag."""


class ToolArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise `UsageError` instead of printing the usage.

    Through `run_tool` a bad flag is then one `error:` line and exit 2 rather than
    argparse's usage block; `--help` still prints it.
    """

    def error(self, message: str) -> None:  # noqa: D102 - argparse's hook
        raise UsageError(f"{message} (see --help)")


def debug_tracebacks() -> bool:
    """Whether MEGATRON_DEBUG_TRACEBACKS asks for the traceback of user errors."""
    return os.environ.get(DEBUG_TRACEBACKS, "0") not in ("", "0")


def describe(error: BaseException) -> str:
    """The error as one line: an OSError as `path: reason`, otherwise its message's first line."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        where = str(error.filename)
        if error.filename2 is not None:
            where += f" -> {error.filename2}"
        return f"{where}: {error.strerror}"
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def check_input_file(path: str, flag: str) -> None:
    """An OSError naming `flag` unless `path` is an existing file (a folder is refused too)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{flag} {path}: is a folder; give a file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")


def check_output_path(path: str, flag: str, is_folder: bool = False) -> None:
    """Before any work: an OSError naming `flag` if `path` cannot be created (or replaced).

    Its folders need not exist yet (the tools create them), but the nearest one that does
    must be a writable folder, not a file such as `/etc/passwd` in `/etc/passwd/out`. With
    `is_folder`, `path` itself is a folder to write into, so an existing file there is refused.
    """
    if is_folder and os.path.exists(path) and not os.path.isdir(path):
        raise OSError(f"{flag} {path} is a file, not a folder")
    folder = nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(folder):
        raise OSError(f"{flag} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"{flag} {path}: the folder {folder} is not writable")


def run_tool(
    body: Callable[[], int | None],
    user_errors: tuple[type[BaseException], ...] = (),
    note: str = "",
) -> int:
    """Run `body` (parse, then work); its exit code, or 1 (2: a bad flag) after one `error:` line.

    `user_errors` are the exception types that mean bad input for this tool; OSError and
    `UsageError` always do. `note` (e.g. "nothing was written") is appended to the line of
    every error but a bad flag, which stops the tool before it starts.
    """
    try:
        return body() or 0
    except (OSError, UsageError, *user_errors) as error:
        if debug_tracebacks():
            raise
        message = describe(error)
        if note and not isinstance(error, UsageError):
            message += f"; {note}"
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, UsageError) else 1
