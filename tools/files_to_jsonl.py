"""Turn folders of text or code files into loose JSON lines, one document per file.

    python tools/files_to_jsonl.py --output data/stdlib.jsonl            # this Python's stdlib
    python tools/files_to_jsonl.py --input-dir ~/src/myrepo --extensions .py .md \\
        --output data/myrepo.jsonl

Each line is `{"repo_name": ..., "path": ..., "size": ..., "content": ...}` like the
CodeParrot dataset, so `tools/preprocess_data.py --json-keys content` tokenizes it. Files
are visited in sorted order (the output is reproducible); files that are empty, too large or
not UTF-8 are skipped and counted. The output appears under its name only when complete.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import sysconfig

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.atomic_files import atomic_outputs  # noqa: E402
from megatron.data.progress import Progress  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402

DEFAULT_EXCLUDES = ["site-packages/*", "*/site-packages/*", "*/__pycache__/*", "__pycache__/*"]


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--input-dir",
        nargs="+",
        default=None,
        help="folders to read (default: this Python's standard library source)",
    )
    parser.add_argument("--output", required=True, help="JSON-lines file to write")
    parser.add_argument(
        "--extensions",
        nargs="+",
        default=[".py"],
        help="file name endings to include (default: .py)",
    )
    parser.add_argument("--key", default="content", help="JSON key of the file text")
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=DEFAULT_EXCLUDES,
        help="glob patterns on the path relative to the input folder",
    )
    parser.add_argument(
        "--max-file-bytes",
        type=int,
        default=1_000_000,
        help="skip files larger than this (default 1 MB)",
    )
    parser.add_argument("--log-interval", type=int, default=500, help="files between reports")
    args = parser.parse_args(argv)
    if args.input_dir is None:
        args.input_dir = [sysconfig.get_paths()["stdlib"]]
        print(
            f"no --input-dir given: using this Python's standard library, {args.input_dir[0]}",
            file=sys.stderr,
        )
    for folder in args.input_dir:
        if not os.path.isdir(folder):
            parser.error(f"--input-dir {folder}: no such folder")
    if os.path.isdir(args.output):
        parser.error(f"--output {args.output} is a folder; give the JSON-lines file to write")
    check_output_path(args.output, "--output")
    if args.max_file_bytes < 1:
        parser.error(f"--max-file-bytes must be at least 1, got {args.max_file_bytes}")
    return args


def find_files(root: str, extensions: list[str], excludes: list[str]) -> list[str]:
    """Paths under `root` (relative to it) with a wanted ending, sorted, excludes applied."""
    found = []
    for folder, _subfolders, names in os.walk(root):
        for name in names:
            relative = os.path.relpath(os.path.join(folder, name), root)
            if name.endswith(tuple(extensions)) and not any(
                fnmatch.fnmatch(relative, pattern) for pattern in excludes
            ):
                found.append(relative)
    return sorted(found)


class NothingToWriteError(ValueError):
    """No file qualified, so no output is published."""


def convert(args: argparse.Namespace) -> dict[str, int]:
    """Write the JSON lines; returns counts of written and skipped files."""
    jobs = [
        (root, path)
        for root in args.input_dir
        for path in find_files(root, args.extensions, args.exclude)
    ]
    total_bytes = sum(os.path.getsize(os.path.join(root, path)) for root, path in jobs)
    counts = {"written": 0, "bytes": 0, "empty": 0, "too_large": 0, "not_utf8": 0}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    progress = Progress(total_bytes, args.log_interval)
    seen_bytes = 0
    with atomic_outputs(args.output) as (partial,):
        with open(partial, "w", encoding="utf-8") as out:
            for root, path in jobs:
                data = open(os.path.join(root, path), "rb").read()
                seen_bytes += len(data)
                text, reason = _decode_file(data, args.max_file_bytes)
                if reason:
                    counts[reason] += 1
                else:
                    record = {
                        "repo_name": os.path.basename(os.path.normpath(root)),
                        "path": path,
                        "size": len(data),
                        args.key: text,
                    }
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    counts["written"] += 1
                    counts["bytes"] += len(data)
                progress.update(1, len(data), seen_bytes)
        if not counts["written"]:
            raise NothingToWriteError(
                f"no {' '.join(args.extensions)} files with text under "
                f"{' '.join(args.input_dir)}; nothing written"
            )
    return counts


def _decode_file(data: bytes, max_bytes: int) -> tuple[str, str | None]:
    """The file's text, or the reason (a `counts` key) to skip it."""
    if not data.strip():
        return "", "empty"
    if len(data) > max_bytes:
        return "", "too_large"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return "", "not_utf8"


def run(argv: list[str] | None) -> int:
    """Parse the flags, write the JSON lines, report; raises on bad input."""
    args = get_args(argv)
    counts = convert(args)
    print(
        f"wrote {args.output}: {counts['written']} documents, {counts['bytes'] / 1e6:.1f} MB "
        f"(skipped {counts['empty']} empty, {counts['too_large']} over "
        f"{args.max_file_bytes} bytes, {counts['not_utf8']} not UTF-8)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input."""
    return run_tool(lambda: run(argv), (NothingToWriteError,))


if __name__ == "__main__":
    sys.exit(main())
