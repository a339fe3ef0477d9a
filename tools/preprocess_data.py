"""Tokenize a loose-JSON corpus into Megatron's mmap `.bin/.idx` format.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --vocab-file dataset/gpt2-vocab.json --merge-file dataset/gpt2-merges.txt \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 8
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/llama \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model \\
        --append-eod --workers 8

--tokenizer-type SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer read a
SentencePiece `.model` file, HFTokenizer a Hugging Face tokenizer folder or `tokenizer.json`,
all given with --tokenizer-model. Token ids are stored as uint16 when the vocabulary has fewer
than 65,500 tokens, else int32, as Megatron does.

Writes `{output_prefix}_{key}_document.bin/.idx` (`_sentence` with --split-sentences) for
every --json-keys key, byte for byte what Megatron-LM's preprocess_data.py writes for the
same input and vocabulary. Input is streamed (memory stays bounded), progress goes to stderr,
and output appears under its final name only once it is complete: a bad line stops the run
(or is skipped and counted with --skip-bad-lines) and leaves earlier output untouched.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import warnings
from collections import deque

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.atomic_files import discard, partial_path, publish  # noqa: E402
from megatron.data.document_encoder import (  # noqa: E402
    DocumentEncoder,
    EncodedBatch,
    EncoderConfig,
)
from megatron.data.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from megatron.tokenizer.base import TokenizerFileError, missing_tokenizer_model  # noqa: E402
from megatron.tokenizer.tokenizer import SUPPORTED_TOKENIZERS, TokenizerConfig  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402
from tools.corpus_reader import CorpusReader, InputError, expand_inputs  # noqa: E402
from tools.progress import Progress  # noqa: E402

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
DEFAULT_VOCAB = os.path.join(REPO_ROOT, "dataset", "gpt2-vocab.json")
DEFAULT_MERGES = os.path.join(REPO_ROOT, "dataset", "gpt2-merges.txt")
# Bad lines printed in full with --skip-bad-lines; the rest are only counted.
SHOWN_BAD_LINES = 20


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse Megatron's preprocess_data flags (plus --skip-bad-lines)."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="loose-JSON files (one object per line), globs allowed, .gz read too",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to extract from each JSON object (default: text)",
    )
    group.add_argument(
        "--split-sentences", action="store_true", help="split documents into sentences (NLTK punkt)"
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="keep newlines between sentences when splitting",
    )
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=SUPPORTED_TOKENIZERS,
        help="tokenizer to use (default: %(default)s)",
    )
    group.add_argument("--vocab-file", default=DEFAULT_VOCAB, help="GPT-2 vocab JSON")
    group.add_argument("--merge-file", default=DEFAULT_MERGES, help="GPT-2 BPE merges")
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model file (SentencePieceTokenizer, GPTSentencePieceTokenizer, "
        "Llama2Tokenizer) or Hugging Face tokenizer folder or tokenizer.json (HFTokenizer)",
    )
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token (<|endoftext|> for GPT-2) to each document",
    )
    group.add_argument("--lang", default="english", help="language of the NLTK punkt model")
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", required=True, help="prefix of the output files, without _{key}_document"
    )
    group.add_argument(
        "--dataset-impl",
        default="mmap",
        choices=["lazy", "cached", "mmap"],
        help="only mmap, Megatron's default, is supported",
    )
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    group.add_argument(
        "--chunk-size", type=int, default=25, help="lines sent to a worker at a time"
    )
    group.add_argument(
        "--log-interval", type=int, default=100, help="report progress every this many documents"
    )
    group.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip unusable lines (bad JSON or UTF-8, missing key, empty "
        "document) and count them, instead of stopping at the first",
    )
    args = parser.parse_args(argv)
    for flag in ("workers", "chunk_size", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
            )
    problem = missing_tokenizer_model(args.tokenizer_type, args.tokenizer_model)
    if problem:
        parser.error(problem)
    if args.dataset_impl != "mmap":
        parser.error(f"--dataset-impl {args.dataset_impl} is not supported; use mmap")
    if args.keep_newlines and not args.split_sentences:
        print(
            "note: --keep-newlines only matters with --split-sentences; newlines inside "
            "documents are always kept",
            file=sys.stderr,
        )
    check_output_path(args.output_prefix, "--output-prefix")
    args.input_files = expand_inputs(args.input)  # InputError names a missing file
    return args


# The worker's encoder. With fork (Linux) it is built once in the parent and inherited, which
# saves each worker the tokenizer start-up; with spawn each worker builds its own.
_WORKER_ENCODER: DocumentEncoder | None = None


def _init_worker(config: EncoderConfig) -> None:
    global _WORKER_ENCODER
    warnings.simplefilter("ignore")  # the main process already showed any warning once
    if _WORKER_ENCODER is None:
        _WORKER_ENCODER = DocumentEncoder(config)


def _start_method() -> str:
    # fork only on Linux: elsewhere (macOS) it is unsafe, and Python defaults to spawn.
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

    def __init__(self, outputs: dict[str, OutputDataset], args: argparse.Namespace) -> None:
        self.outputs = outputs
        self.input_files = args.input_files
        self.skip_bad_lines = args.skip_bad_lines
        total_bytes = sum(os.path.getsize(path) for path in args.input_files)
        self.progress = Progress(total_bytes, args.log_interval)
        self.bad_lines = 0
        self.blank_lines = 0

    def write(self, batch: EncodedBatch, position: int) -> None:
        """Add one batch; `position` is how far the reader was when it was sent."""
        path = self.input_files[batch.file_index]
        for line_number, reason in batch.errors:
            location = f"{path}:{line_number}: {reason}"
            if not self.skip_bad_lines:
                raise InputError(
                    f"{location} (fix the line, or pass --skip-bad-lines to skip such lines)"
                )
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
    args: argparse.Namespace, config: EncoderConfig, start_method: str, writer: BatchWriter
) -> None:
    """Send line batches to the worker pool and write the results back in input order."""
    reader = CorpusReader(args.input_files)
    window = 4 * args.workers  # batches in flight: bounds memory on any input size
    context = multiprocessing.get_context(start_method)
    with context.Pool(args.workers, initializer=_init_worker, initargs=(config,)) as pool:
        pending: deque = deque()
        try:
            for file_index, first_line, lines in reader.batches(args.chunk_size):
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


def preprocess(args: argparse.Namespace) -> int:
    """Run the conversion; returns the process exit code."""
    global _WORKER_ENCODER
    config = EncoderConfig(
        json_keys=args.json_keys,
        tokenizer=TokenizerConfig.from_args(args),
        append_eod=args.append_eod,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
    )
    # Built here first: bad tokenizer files fail fast, warnings show once.
    encoder = DocumentEncoder(config)
    start_method = _start_method()
    if start_method == "fork":
        _WORKER_ENCODER = encoder
    level = "sentence" if args.split_sentences else "document"
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    outputs = {
        key: OutputDataset(f"{args.output_prefix}_{key}_{level}", encoder.dtype.type)
        for key in args.json_keys
    }
    writer = BatchWriter(outputs, args)
    try:
        encode_in_order(args, config, start_method, writer)
        if writer.progress.documents == 0:
            skipped = f" after skipping {writer.bad_lines} bad lines" if writer.bad_lines else ""
            raise InputError(f"--input {' '.join(args.input)}: no documents found{skipped}")
        for output in outputs.values():
            output.commit()
    except BaseException as error:
        for output in outputs.values():
            output.discard()
        if isinstance(error, KeyboardInterrupt):
            print("\ninterrupted: no output was written", file=sys.stderr)
            return 130
        raise
    writer.progress.finish(writer.bad_lines, writer.blank_lines)
    for output in outputs.values():
        builder = output.builder
        print(
            f"wrote {output.prefix}.bin/.idx: {builder.num_documents} documents, "
            f"{builder.num_sequences} sequences, {builder.num_tokens} tokens "
            f"({encoder.dtype.name})",
            file=sys.stderr,
        )
    return 0


def run(argv: list[str] | None) -> int:
    """Parse the flags, then preprocess; raises on bad input."""
    args = get_args(argv)
    print(f"Opening {', '.join(args.input_files)}", file=sys.stderr)
    return preprocess(args)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input, nothing written."""
    return run_tool(
        lambda: run(argv),
        (InputError, TokenizerFileError, ImportError),
        note="no output was written (earlier files under that --output-prefix are untouched)",
    )


if __name__ == "__main__":
    sys.exit(main())
