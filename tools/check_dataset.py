"""Check a `.bin/.idx` dataset: it opens, each document detokenizes to its source text,
and GPT training samples can be read from it.

    python tools/check_dataset.py --prefix data/stdlib_content_document \\
        --input data/stdlib.jsonl --json-key content --seq-length 1024

Every index entry is checked on open, and every token id against the vocabulary. Exits 1 at
the first fault (naming the file and the entry, document or input line), so it verifies a
preprocessing run end to end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.config import DataConfig  # noqa: E402
from megatron.data.corpus_reader import InputError  # noqa: E402
from megatron.data.document_encoder import BadLineError, parse_json_line  # noqa: E402
from megatron.data.gpt_dataset import build_train_valid_test_datasets  # noqa: E402
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError  # noqa: E402
from megatron.data.progress import Progress  # noqa: E402
from megatron.data.token_check import check_token_ids  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from megatron.tokenizer.gpt2_bpe import TokenizerFileError  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_input_file, run_tool  # noqa: E402
from tools.preprocess_data import DEFAULT_MERGES, DEFAULT_VOCAB  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", required=True, help="dataset prefix (without .bin/.idx)")
    parser.add_argument("--input", help="the JSON-lines file the dataset was made from")
    parser.add_argument("--json-key", default="text", help="key of the text in --input")
    parser.add_argument("--vocab-file", default=DEFAULT_VOCAB)
    parser.add_argument("--merge-file", default=DEFAULT_MERGES)
    parser.add_argument(
        "--seq-length",
        type=int,
        default=1024,
        help="sequence length of the GPT samples to read back",
    )
    parser.add_argument("--log-interval", type=int, default=500)
    args = parser.parse_args(argv)
    for flag in ("seq_length", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
            )
    if args.input is not None:
        check_input_file(args.input, "--input")
    return args


def _text(line: bytes, key: str, path: str, line_number: int) -> object:
    """The `key` value of the JSON object on `line`; InputError naming the line if none."""
    try:
        record = parse_json_line(line, strip_bom=line_number == 1)
    except BadLineError as error:
        raise InputError(f"{path}:{line_number}: {error}") from None
    if key not in record:
        raise InputError(f"{path}:{line_number}: no key {key!r}; choose the key with --json-key")
    return record[key]


def check_round_trip(
    dataset: IndexedDataset,
    tokenizer: GPT2BPETokenizer,
    input_path: str,
    key: str,
    log_interval: int,
) -> int:
    """Compare each document with its JSON line; returns the number of documents checked."""
    progress = Progress(os.path.getsize(input_path), log_interval)
    document = 0
    with open(input_path, "rb") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if document >= len(dataset.doc_idx) - 1:
                raise IndexedDatasetError(
                    f"{input_path}:{line_number}: more documents in the input than "
                    f"the {len(dataset.doc_idx) - 1} in the dataset"
                )
            first, last = dataset.doc_idx[document], dataset.doc_idx[document + 1]
            tokens = np.concatenate([dataset[i] for i in range(first, last)] or [[]])
            if len(tokens) and tokens[-1] == tokenizer.eod:
                tokens = tokens[:-1]  # written by --append-eod
            text = _text(line, key, input_path, line_number)
            if tokenizer.detokenize(tokens) != text:
                raise IndexedDatasetError(
                    f"{input_path}:{line_number}: document {document} does not "
                    "detokenize to the JSON text"
                )
            document += 1
            progress.update(1, len(line), lines.tell())
    if document != len(dataset.doc_idx) - 1:
        raise IndexedDatasetError(
            f"{input_path} has {document} documents, the dataset {len(dataset.doc_idx) - 1}"
        )
    return document


def show_gpt_sample(prefix: str, tokenizer: GPT2BPETokenizer, seq_length: int) -> None:
    """Build train/valid/test GPT datasets (index cache in a temp dir) and print a sample."""
    with tempfile.TemporaryDirectory() as cache:
        config = DataConfig(
            data_path=[prefix], seq_length=seq_length, split="949,50,1", data_cache_path=cache
        )
        train, valid, test = build_train_valid_test_datasets(config, [100, 10, 10])
        sample = train[0]["text"]
        print(
            f"GPT samples: train {len(train)}, valid {len(valid) if valid else 0}, test "
            f"{len(test) if test else 0}; sample 0 has {len(sample)} tokens, starting:"
        )
        print("    " + repr(tokenizer.detokenize(sample[:48]))[:300])


def check(argv: list[str] | None) -> int:
    """Parse the flags and check the dataset; raises at the first fault."""
    args = get_args(argv)
    start = time.time()
    dataset = IndexedDataset(args.prefix)
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    print(
        f"{args.prefix}: {len(dataset.doc_idx) - 1} documents, {len(dataset)} sequences, "
        f"{dataset.num_tokens} tokens ({dataset.dtype.name})"
    )
    check_token_ids(dataset, args.prefix, tokenizer.vocab_size, vocabulary=args.vocab_file)
    if args.input:
        checked = check_round_trip(dataset, tokenizer, args.input, args.json_key, args.log_interval)
        print(f"OK: all {checked} documents detokenize to their text in {args.input}")
    show_gpt_sample(args.prefix, tokenizer, args.seq_length)
    print(f"checked in {time.time() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error at the first fault."""
    return run_tool(lambda: check(argv), (IndexedDatasetError, TokenizerFileError, InputError))


if __name__ == "__main__":
    sys.exit(main())
