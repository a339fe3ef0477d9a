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
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.config import DataConfig  # noqa: E402
from megatron.data.gpt_dataset import build_train_valid_test_datasets  # noqa: E402
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError  # noqa: E402
from megatron.data.token_check import check_token_ids  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tools.preprocess_data import DEFAULT_MERGES, DEFAULT_VOCAB  # noqa: E402
from tools.progress import Progress  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    return parser.parse_args(argv)


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
                raise ValueError(
                    f"{input_path}:{line_number}: more documents in the input than "
                    f"the {len(dataset.doc_idx) - 1} in the dataset"
                )
            first, last = dataset.doc_idx[document], dataset.doc_idx[document + 1]
            tokens = np.concatenate([dataset[i] for i in range(first, last)] or [[]])
            if len(tokens) and tokens[-1] == tokenizer.eod:
                tokens = tokens[:-1]  # written by --append-eod
            text = json.loads(line)[key]
            if tokenizer.detokenize(tokens) != text:
                raise ValueError(
                    f"{input_path}:{line_number}: document {document} does not "
                    "detokenize to the JSON text"
                )
            document += 1
            progress.update(1, len(line), lines.tell())
    if document != len(dataset.doc_idx) - 1:
        raise ValueError(
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


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = get_args(argv)
    start = time.time()
    try:
        dataset = IndexedDataset(args.prefix)
        tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
        print(
            f"{args.prefix}: {len(dataset.doc_idx) - 1} documents, {len(dataset)} sequences, "
            f"{dataset.num_tokens} tokens ({dataset.dtype.name})"
        )
        check_token_ids(dataset, args.prefix, tokenizer.vocab_size, vocabulary=args.vocab_file)
        if args.input:
            checked = check_round_trip(
                dataset, tokenizer, args.input, args.json_key, args.log_interval
            )
            print(f"OK: all {checked} documents detokenize to their text in {args.input}")
        show_gpt_sample(args.prefix, tokenizer, args.seq_length)
    except (IndexedDatasetError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"checked in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
