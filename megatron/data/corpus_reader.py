"""Streaming reader for loose-JSON inputs (plain or .gz), in line batches, with a byte position."""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterator


class InputError(ValueError):
    """Unusable input; the message names the flag, file or line."""


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by --input, globs expanded (sorted), in the order given."""
    files: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
            if not matches:
                raise InputError(f"--input {pattern}: no file matches")
            files.extend(matches)
        elif os.path.isdir(pattern):
            raise InputError(
                f"--input {pattern}: is a directory; give files or a glob such as "
                f"'{os.path.join(pattern, '*.jsonl')}'"
            )
        elif not os.path.isfile(pattern):
            raise InputError(f"--input {pattern}: no such file")
        else:
            files.append(pattern)
    return files


class CorpusReader:
    """Yields (file index, first line number, raw lines) batches across all input files."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.total_bytes = sum(os.path.getsize(path) for path in paths)
        self._finished_bytes = 0
        self._current = None

    @property
    def position(self) -> int:
        """Bytes of input read so far (compressed bytes for .gz files), for progress and ETA."""
        current = self._current.tell() if self._current and not self._current.closed else 0
        return self._finished_bytes + current

    def batches(self, lines_per_batch: int) -> Iterator[tuple[int, int, list[bytes]]]:
        """Consecutive lines of each file, `lines_per_batch` at a time; line numbers are 1-based."""
        for file_index, path in enumerate(self.paths):
            with open(path, "rb") as raw:
                self._current = raw
                stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
                try:
                    yield from self._file_batches(file_index, stream, lines_per_batch)
                except (OSError, EOFError, zlib.error) as error:
                    raise InputError(f"{path}: cannot be read ({error})") from None
            self._finished_bytes += os.path.getsize(path)
            self._current = None

    @staticmethod
    def _file_batches(
        file_index: int,
        stream,
        lines_per_batch: int,  # type: ignore[no-untyped-def]
    ) -> Iterator[tuple[int, int, list[bytes]]]:
        batch: list[bytes] = []
        first_line = 1
        for line_number, line in enumerate(stream, start=1):
            batch.append(line)
            if len(batch) == lines_per_batch:
                yield file_index, first_line, batch
                batch, first_line = [], line_number + 1
        if batch:
            yield file_index, first_line, batch
