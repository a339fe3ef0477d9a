"""Streaming reader of the inputs of `tools/preprocess_data.py`, in line batches, with a position.

Inputs are loose-JSON files (one object per line, plain or .gz), and tables read with pyarrow
(`pip install pyarrow`, or the project's `data` extra), locally, without the `datasets`
library and without any download:

- Parquet files (`.parquet`, `.pq`);
- Arrow files (`.arrow`, the IPC stream or file format);
- folders that `datasets.Dataset.save_to_disk` wrote (`dataset_info.json`, `state.json` and
  the `.arrow` shards that `state.json` lists, read in its order). A `DatasetDict`'s folder
  holds one such folder per split: give the split's folder.

Each table row becomes the JSON line it would be in a JSON-lines file (its columns as the
object's keys), so the same text gives byte for byte the same `.bin/.idx` whatever the input
format, and the tokenizer workers see one kind of input. Only the columns the run reads are
read (`--json-keys`, or the SFT record keys), in batches of rows, so memory stays bounded.
For tables, the numbers in error messages (`path:N`) are 1-based row numbers, counted across
the shards of a saved dataset.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator

PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIX = ".arrow"
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")
_ARROW_FILE_MAGIC = b"ARROW1"


class InputError(ValueError):
    """Unusable input; the message names the flag, file or line."""


class BadLineError(ValueError):
    """A line (or table row) that cannot become a document; the message says why."""


def is_saved_dataset(path: str) -> bool:
    """Whether `path` is a folder `datasets.Dataset.save_to_disk` wrote."""
    return os.path.isdir(path) and all(
        os.path.isfile(os.path.join(path, name)) for name in SAVED_DATASET_FILES
    )


def is_table_input(path: str) -> bool:
    """Whether `path` is read as a table (Parquet, Arrow, saved dataset), not as JSON lines."""
    return path.lower().endswith((*PARQUET_SUFFIXES, ARROW_SUFFIX)) or is_saved_dataset(path)


def require_pyarrow(path: str) -> None:
    """InputError naming `path` and the install command when pyarrow is missing."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        pass
    else:
        return
    if is_saved_dataset(path):
        kind = "a saved Hugging Face dataset"
    else:
        kind = "Parquet" if path.lower().endswith(PARQUET_SUFFIXES) else "Arrow"
    raise InputError(
        f"--input {path}: reading {kind} needs pyarrow: pip install pyarrow "
        "(or pip install -e '.[data]')"
    )


def _directory_error(path: str) -> InputError:
    """Why a folder is not an input, and what to give instead."""
    try:
        with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as file:
            splits = [str(split) for split in json.load(file)["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        return InputError(
            f"--input {path}: is a directory (not a dataset saved with save_to_disk); give "
            f"files or a glob such as '{os.path.join(path, '*.jsonl')}'"
        )
    folders = ", ".join(os.path.join(path, split) for split in splits)
    return InputError(
        f"--input {path}: a DatasetDict saved with save_to_disk; give one split's folder: {folders}"
    )


def expand_inputs(patterns: list[str]) -> list[str]:
    """Inputs named by --input, globs expanded (sorted), in the order given; pyarrow checked."""
    files: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(
                path
                for path in glob.glob(pattern)
                if os.path.isfile(path) or is_saved_dataset(path)
            )
            if not matches:
                raise InputError(f"--input {pattern}: no file matches")
            files.extend(matches)
        elif os.path.isdir(pattern) and not is_saved_dataset(pattern):
            raise _directory_error(pattern)
        elif not os.path.exists(pattern):
            raise InputError(f"--input {pattern}: no such file")
        else:
            files.append(pattern)
    for path in files:
        if is_table_input(path):
            require_pyarrow(path)
            input_size(path)  # a saved dataset's state.json is read, its shards checked
    return files


def saved_dataset_files(folder: str) -> list[str]:
    """The `.arrow` shards of a saved dataset, in the order its `state.json` lists them."""
    state_path = os.path.join(folder, "state.json")
    try:
        with open(state_path, encoding="utf-8") as file:
            entries = json.load(file)["_data_files"]
        files = [os.path.join(folder, entry["filename"]) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InputError(
            f"--input {folder}: {state_path} does not list the dataset's files "
            f"({type(error).__name__}: {error}); was it written by save_to_disk?"
        ) from None
    for path in files:
        if not os.path.isfile(path):
            raise InputError(f"--input {folder}: {path}, listed in {state_path}, is missing")
    return files


def input_size(path: str) -> int:
    """Bytes of an input: the file's size, or the sum of a saved dataset's shards."""
    if os.path.isdir(path):
        return sum(os.path.getsize(shard) for shard in saved_dataset_files(path))
    return os.path.getsize(path)


class CorpusReader:
    """Yields (file index, first line number, raw lines) batches across all inputs.

    `columns`: the keys the run reads; a table input reads only these columns (None: all).
    """

    def __init__(self, paths: list[str], columns: list[str] | None = None) -> None:
        self.paths = paths
        self.columns = columns
        self.total_bytes = sum(input_size(path) for path in paths)
        self._finished_bytes = 0
        self._current: Callable[[], int] = lambda: 0

    @property
    def position(self) -> int:
        """Bytes of input read so far (compressed bytes for .gz files), for progress and ETA."""
        return self._finished_bytes + self._current()

    def batches(self, lines_per_batch: int) -> Iterator[tuple[int, int, list[bytes]]]:
        """Consecutive lines of each input, `lines_per_batch` at a time; numbers are 1-based."""
        for file_index, path in enumerate(self.paths):
            if is_table_input(path):
                table = TableReader(path, self.columns)
                self._current = table.position
                for first_row, lines in table.batches(lines_per_batch):
                    yield file_index, first_row, lines
            else:
                yield from self._json_batches(file_index, path, lines_per_batch)
            self._finished_bytes += input_size(path)
            self._current = lambda: 0

    def _json_batches(
        self, file_index: int, path: str, lines_per_batch: int
    ) -> Iterator[tuple[int, int, list[bytes]]]:
        with open(path, "rb") as raw:
            self._current = lambda: 0 if raw.closed else raw.tell()
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
            try:
                yield from _line_batches(file_index, stream, lines_per_batch)
            except (OSError, EOFError, zlib.error) as error:
                raise InputError(f"{path}: cannot be read ({error})") from None


def _line_batches(
    file_index: int,
    stream,  # type: ignore[no-untyped-def]
    lines_per_batch: int,
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


class TableReader:
    """The rows of one Parquet file, Arrow file or saved dataset as JSON lines, in batches."""

    def __init__(self, path: str, columns: list[str] | None) -> None:
        require_pyarrow(path)
        self.path = path
        self.columns = columns
        self._position: Callable[[], int] = lambda: 0

    def position(self) -> int:
        """Bytes of this input read so far (for Parquet: its size times the share of rows read)."""
        return self._position()

    def batches(self, rows_per_batch: int) -> Iterator[tuple[int, list[bytes]]]:
        """(first row number, JSON lines) of consecutive rows; row numbers are 1-based."""
        first_row = 1
        for record_batch in self._record_batches(rows_per_batch):
            for start in range(0, record_batch.num_rows, rows_per_batch):
                rows = record_batch.slice(start, rows_per_batch).to_pylist()
                yield first_row, [self._json_line(first_row + i, row) for i, row in enumerate(rows)]
                first_row += len(rows)

    def _record_batches(self, rows_per_batch: int) -> Iterator:  # type: ignore[type-arg]
        import pyarrow as pa

        try:
            if self.path.lower().endswith(PARQUET_SUFFIXES):
                yield from self._parquet_batches(rows_per_batch)
                return
            shards = saved_dataset_files(self.path) if os.path.isdir(self.path) else [self.path]
            finished = 0
            for shard in shards:
                with pa.memory_map(shard) as source:
                    self._position = lambda source=source, done=finished: (
                        done + (0 if source.closed else source.tell())
                    )
                    yield from self._arrow_batches(shard, source)
                finished += os.path.getsize(shard)
                self._position = lambda done=finished: done
        except (pa.ArrowException, OSError) as error:
            raise InputError(f"{self.path}: cannot be read ({error})") from None

    def _parquet_batches(self, rows_per_batch: int) -> Iterator:  # type: ignore[type-arg]
        import pyarrow.parquet as pq

        table = pq.ParquetFile(self.path)
        columns = self._readable_columns(table.schema_arrow.names, self.path)
        size, total_rows = os.path.getsize(self.path), max(table.metadata.num_rows, 1)
        rows_read = 0
        self._position = lambda: size * rows_read // total_rows
        for batch in table.iter_batches(batch_size=rows_per_batch, columns=columns):
            rows_read += batch.num_rows
            yield batch

    def _arrow_batches(self, shard: str, source) -> Iterator:  # type: ignore[no-untyped-def, type-arg]
        import pyarrow as pa

        is_file_format = source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC
        source.seek(0)
        if is_file_format:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        columns = self._readable_columns(reader.schema.names, shard)
        for batch in batches:
            yield batch.select(columns)

    def _readable_columns(self, names: list[str], where: str) -> list[str]:
        """The wanted columns the table has; InputError naming its columns when it has none."""
        if self.columns is None:
            return list(names)
        present = [name for name in self.columns if name in names]
        if not present:
            shard = f" ({where})" if where != self.path else ""
            raise InputError(
                f"--input {self.path}{shard}: no column {' or '.join(map(repr, self.columns))} "
                f"(its columns: {', '.join(names) or 'none'})"
            )
        return present

    def _json_line(self, row_number: int, row: dict) -> bytes:
        try:
            return json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n"
        except (TypeError, ValueError) as error:
            raise InputError(
                f"{self.path}:{row_number}: a value cannot be read as text or JSON ({error})"
            ) from None
