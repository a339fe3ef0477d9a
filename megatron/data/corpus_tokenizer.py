"""Tokenize loose-JSON files into Megatron's `.bin/.idx` datasets, streaming, in parallel.

The engine behind `tools/preprocess_data.py` and `--train-data` (Megatron-LM v1's loose-JSON
training files, tokenized on first use); Parquet files and saved Hugging Face datasets are read
as JSON lines (`corpus_reader`). Lines go to a pool of `DocumentEncoder` workers in
batches and come back in input order; at most a few batches per worker are in flight, so
memory stays bounded on any input size. Progress (documents/s, MB/s, ETA) goes to stderr.
Each output is written under a temporary name and renamed only once it is complete: a bad
line or an interrupt leaves earlier files under the final names untouched.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import warnings
from collections import deque
from dataclasses import dataclass

from megatron.atomic_files import discard, partial_path, publish
from megatron.data.corpus_reader import CorpusReader, InputError, input_size
from megatron.data.document_encoder import DocumentEncoder, EncodedBatch, EncoderConfig
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.data.progress import Progress

# Bad lines printed in full when they are skipped; the rest are only counted.
SHOWN_BAD_LINES = 20


@dataclass
class TokenizeOptions:
    """How to run the tokenization; the defaults are preprocess_data.py's."""

    workers: int = 1
    """Encoder processes."""
    chunk_size: int = 25
    """Lines sent to a worker at a time."""
    log_interval: int = 100
    """A progress line every this many documents."""
    skip_bad_lines: bool = False
    """Count and skip unusable lines instead of stopping at the first."""
    bad_line_hint: str = "fix the line, or pass --skip-bad-lines to skip such lines"
    """Appended to the error that names a bad line: what the user can do about it."""
    input_label: str = ""
    """How errors about the whole input name it (e.g. `--input a.jsonl`); default: the files."""


@dataclass
class TokenizeSummary:
    """What a finished run wrote, per output file prefix."""

    documents: int
    bad_lines: int
    outputs: dict[str, IndexedDatasetBuilder]


# The worker's encoder. With fork (Linux) it is built once in the parent and inherited, which
# saves each worker the tokenizer start-up; with spawn each worker builds its own.
_WORKER_ENCODER: DocumentEncoder | None = None


def _init_worker(config: EncoderConfig) -> None:
    global _WORKER_ENCODER
    warnings.simplefilter("ignore")  # the main process already showed any warning once
    if _WORKER_ENCODER is None:
        _WORKER_ENCODER = DocumentEncoder(config)


def default_start_method() -> str:
    """fork on Linux; elsewhere (macOS) fork is unsafe, and Python defaults to spawn."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


def _encode_batch(file_index: int, first_line: int, lines: list[bytes]) -> EncodedBatch:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER.encode_lines(file_index, first_line, lines)


class OutputDataset:
    """One `.bin/.idx` pair written under temporary names and renamed when complete."""

    def __init__(self, prefix: str, dtype: type) -> None:
        self.prefix = prefix
        self.final_paths = [prefix + ".bin", prefix + ".idx"]
        self.partial_paths = [partial_path(path) for path in self.final_paths]
        self.builder = IndexedDatasetBuilder(self.partial_paths[0], dtype=dtype)

    def commit(self) -> None:
        """Write the index, flush both files to disk, then give them their final names."""
        self.builder.finalize(self.partial_paths[1])
        publish(self.partial_paths, self.final_paths)

    def discard(self) -> None:
        """Remove the temporary files; the final names were never touched."""
        self.builder.close()
        discard(self.partial_paths)


class BatchWriter:
    """Adds encoded batches to the outputs in input order; reports or counts bad lines."""

    def __init__(
        self, outputs: dict[str, OutputDataset], input_files: list[str], options: TokenizeOptions
    ) -> None:
        self.outputs = outputs
        self.input_files = input_files
        self.options = options
        total_bytes = sum(input_size(path) for path in input_files)
        self.progress = Progress(total_bytes, options.log_interval)
        self.bad_lines = 0
        self.blank_lines = 0

    def write(self, batch: EncodedBatch, position: int) -> None:
        """Add one batch; `position` is how far the reader was when it was sent."""
        path = self.input_files[batch.file_index]
        for line_number, reason in batch.errors:
            location = f"{path}:{line_number}: {reason}"
            if not self.options.skip_bad_lines:
                raise InputError(f"{location} ({self.options.bad_line_hint})")
            self.bad_lines += 1
            if self.bad_lines <= SHOWN_BAD_LINES:
                print(f"warning: {location} (skipped)", file=sys.stderr)
        for key, encoded in batch.keys.items():
            self.outputs[key].builder.add_documents(
                encoded.tokens, encoded.sequence_lengths, encoded.sequences_per_document
            )
        self.blank_lines += batch.num_blank_lines
        self.progress.update(batch.num_documents, batch.num_bytes, position)


def encode_in_order(
    input_files: list[str],
    config: EncoderConfig,
    options: TokenizeOptions,
    start_method: str,
    writer: BatchWriter,
) -> None:
    """Send line batches to the worker pool and write the results back in input order."""
    reader = CorpusReader(input_files, config.record_keys())
    window = 4 * options.workers  # batches in flight: bounds memory on any input size
    context = multiprocessing.get_context(start_method)
    with context.Pool(options.workers, initializer=_init_worker, initargs=(config,)) as pool:
        pending: deque = deque()
        try:
            for file_index, first_line, lines in reader.batches(options.chunk_size):
                task = pool.apply_async(_encode_batch, (file_index, first_line, lines))
                pending.append((reader.position, task))
                if len(pending) >= window:
                    position, task = pending.popleft()
                    writer.write(task.get(), position)
            while pending:
                position, task = pending.popleft()
                writer.write(task.get(), position)
        except BaseException:
            # Let the batches in flight finish (at most `window`) before the pool terminates:
            # a worker killed while sending its result can deadlock Pool.terminate, which
            # hung a bad-line run. Idle workers terminate cleanly, as on success.
            for _, task in pending:
                task.wait()
            raise


def tokenize_corpus(
    input_files: list[str],
    output_prefix: str,
    config: EncoderConfig,
    options: TokenizeOptions,
    start_method: str | None = None,
) -> TokenizeSummary:
    """Write `{output_prefix}_{key}_{document|sentence}.bin/.idx` for every JSON key (with
    `config.sft`: `{output_prefix}_sft_document` and its `_loss_mask` beside it).

    Raises `InputError` for a bad line (unless skipped) or input without documents; nothing
    is then left under the final names that was not there before.
    """
    global _WORKER_ENCODER
    # Built here first: bad tokenizer files fail fast, warnings show once.
    encoder = DocumentEncoder(config)
    start_method = start_method or default_start_method()
    _WORKER_ENCODER = encoder if start_method == "fork" else None
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    outputs = {
        name: OutputDataset(output_prefix + suffix, dtype.type)
        for name, (suffix, dtype) in encoder.outputs.items()
    }
    writer = BatchWriter(outputs, input_files, options)
    try:
        encode_in_order(input_files, config, options, start_method, writer)
        if writer.progress.documents == 0:
            skipped = f" after skipping {writer.bad_lines} bad lines" if writer.bad_lines else ""
            label = options.input_label or " ".join(input_files)
            raise InputError(f"{label}: no documents found{skipped}")
        for output in outputs.values():
            output.commit()
    except BaseException:
        for output in outputs.values():
            output.discard()
        raise
    finally:
        _WORKER_ENCODER = None
    writer.progress.finish(writer.bad_lines, writer.blank_lines)
    return TokenizeSummary(
        writer.progress.documents,
        writer.bad_lines,
        {output.prefix: output.builder for output in outputs.values()},
    )
