"""The tokenizer and data-source flags, checked before anything starts.

Tokenizer: every type built here gets the flags and files it needs (`tokenizer_flag_problem`);
the others are refused in one line naming what to use instead. Data: one source, as Megatron-LM
asserts ("A single data source must be provided"): `--data-path` (or v1's `--train-data`) cut
by `--split`; `--train-data-path` / `--valid-data-path` / `--test-data-path`, each split its
own datasets (with which `--split` is refused, as megatron-core's "split and blend_per_split
are incompatible"); or `--mock-data`, whose synthetic documents are split evenly whatever
`--split` says.
"""

from __future__ import annotations

import argparse
import os

from megatron.arguments.errors import ArgumentError
from megatron.tokenizer.base import MODEL_FILE_TOKENIZERS
from megatron.tokenizer.tokenizer import TokenizerConfig, tokenizer_flag_problem

# GPT-2's vocabulary and merges, shipped with the repository (dataset/), used when
# GPT2BPETokenizer is asked for without --vocab-file/--merge-file (as Megatron-LM v1 was).
_DATASET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "dataset")
SHIPPED_GPT2_VOCAB = os.path.join(_DATASET_DIR, "gpt2-vocab.json")
SHIPPED_GPT2_MERGES = os.path.join(_DATASET_DIR, "gpt2-merges.txt")

# Tokenizer types Megatron-LM removed, and what it says to use instead.
_REMOVED_TOKENIZERS = {
    "Llama3Tokenizer": "Megatron-LM removed it (Aug 2024, with MistralTokenizer) for "
    "HuggingFaceTokenizer: give --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
    "<the Llama-3 tokenizer folder or tokenizer.json>",
    "MistralTokenizer": "Megatron-LM removed it (Aug 2024, with Llama3Tokenizer) for "
    "HuggingFaceTokenizer: give --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
    "<the Mistral tokenizer folder or tokenizer.json>",
}
_PER_SPLIT = ("train_data_path", "valid_data_path", "test_data_path")
_PER_SPLIT_FLAGS = "--train-data-path/--valid-data-path/--test-data-path"


def settle_tokenizer(args: argparse.Namespace) -> None:
    """The tokenizer types built here get their flags and files; others refused in one line."""
    tokenizer = getattr(args, "tokenizer_type", None) or "GPT2BPETokenizer"
    if tokenizer == "HuggingFaceTokenizer":  # Megatron-LM's current name for the same tokenizer
        tokenizer = args.tokenizer_type = "HFTokenizer"
    shipped = os.path.isfile(SHIPPED_GPT2_VOCAB) and os.path.isfile(SHIPPED_GPT2_MERGES)
    if tokenizer == "GPT2BPETokenizer" and not (args.vocab_file or args.merge_file) and shipped:
        # Megatron-LM v1 fetched GPT-2's files itself; the same files ship in dataset/.
        args.vocab_file, args.merge_file = SHIPPED_GPT2_VOCAB, SHIPPED_GPT2_MERGES
        args.compat_notes.append(
            f" > GPT2BPETokenizer without --vocab-file/--merge-file: using GPT-2's files "
            f"shipped in {os.path.dirname(SHIPPED_GPT2_VOCAB)}"
        )
    if tokenizer in _REMOVED_TOKENIZERS:
        raise ArgumentError(f"--tokenizer-type {tokenizer}: {_REMOVED_TOKENIZERS[tokenizer]}")
    if tokenizer not in ("GPT2BPETokenizer", "NullTokenizer", *MODEL_FILE_TOKENIZERS):
        raise ArgumentError(
            f"--tokenizer-type {tokenizer}: not built here; use GPT2BPETokenizer "
            f"(--vocab-file/--merge-file), NullTokenizer (--vocab-size) or, with "
            f"--tokenizer-model, {', '.join(MODEL_FILE_TOKENIZERS)}"
        )
    problem = tokenizer_flag_problem(TokenizerConfig.from_args(args))
    if problem:
        raise ArgumentError(problem)
    # --vocab-size beside a tokenizer with files sizes the embedding once the tokenizer is
    # built (`megatron.tokenizer.tokenizer.embedding_rows`): at least its ids, else refused.


def settle_data_sources(args: argparse.Namespace, typed: set[str] | None) -> None:
    """One data source, its per-split blends well formed; --split where it is read."""
    from megatron.data.blendable_dataset import parse_data_path

    per_split = any(getattr(args, dest, None) for dest in _PER_SPLIT)
    given = {
        "--mock-data": bool(getattr(args, "mock_data", False)),
        # v1's --train-data becomes --data-path (v1_flags refuses the two together).
        "--data-path": bool(getattr(args, "data_path", None) or getattr(args, "train_data", None)),
        _PER_SPLIT_FLAGS: per_split,
    }
    sources = [flag for flag, present in given.items() if present]
    if len(sources) > 1:
        raise ArgumentError(
            f"{' and '.join(sources)}: give one data source (Megatron-LM: 'A single data "
            "source must be provided')"
        )
    if given["--mock-data"] and getattr(args, "sft", False):
        raise ArgumentError("--sft with --mock-data: the synthetic documents have no loss masks")
    split_typed = typed is not None and "split" in typed
    if given["--mock-data"] and split_typed:
        args.compat_notes.append(
            f" > --mock-data: --split {args.split} is not read; the synthetic documents are "
            "split 1,1,1, as Megatron-LM splits them"
        )
    if not per_split:
        return
    if not getattr(args, "train_data_path", None):
        raise ArgumentError(
            "--valid-data-path/--test-data-path need --train-data-path (the split to train on)"
        )
    if split_typed:
        raise ArgumentError(
            f"--split {args.split} with --train-data-path: each split is its own datasets, "
            "whole, so there is nothing to cut (megatron-core: 'split and blend_per_split are "
            "incompatible'); drop --split"
        )
    for dest, flag in _given_per_split(args):
        try:
            parse_data_path(getattr(args, dest), flag)
        except ValueError as error:
            raise ArgumentError(str(error)) from None


PROMPT_JSON_DATA = "prompt_json_data"
"""The `args_defaults` key by which an entry script (finetune_llama.py) says that its
`--data-path` is one Alpaca JSON file (Megatron-DeepSpeed's SupervisedDataset), not the
prefixes of indexed datasets."""


def check_prompt_json_file(args: argparse.Namespace) -> None:
    """--data-path is one existing JSON file (finetune_llama.py's prompt/response records)."""
    paths = list(args.data_path)
    if len(paths) != 1:
        raise ArgumentError(
            f"--data-path {' '.join(paths)}: finetune_llama.py reads one Alpaca JSON file (a "
            "list of {instruction, input, output} records)"
        )
    if not os.path.isfile(paths[0]):
        raise ArgumentError(
            f"--data-path {paths[0]}: no such file (finetune_llama.py reads one Alpaca JSON file)"
        )


def check_per_split_files(args: argparse.Namespace) -> None:
    """Every prefix of --train-data-path, --valid-data-path and --test-data-path exists."""
    from megatron.data.blendable_dataset import parse_data_path
    from megatron.data.indexed_dataset import data_file_path, dataset_exists, index_file_path

    for dest, flag in _given_per_split(args):
        for prefix in parse_data_path(getattr(args, dest), flag)[0]:
            if not dataset_exists(prefix):
                raise ArgumentError(
                    f"{flag} {prefix}: no dataset there (need {data_file_path(prefix)} and "
                    f"{index_file_path(prefix)}; make them with tools/preprocess_data.py)"
                )


def _given_per_split(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(dest, flag) of each per-split path given."""
    return [
        (dest, "--" + dest.replace("_", "-")) for dest in _PER_SPLIT if getattr(args, dest, None)
    ]
