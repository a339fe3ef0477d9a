"""Megatron-LM's data-source and tokenizer flags: --mock-data, --train/valid/test-data-path,
NullTokenizer (--vocab-size, --null-tokenizer-eod-id) and TikTokenizer's flags, validated
with Megatron-LM's rules; mistakes are one-line errors naming the flags."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.config import DataConfig

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3"
).split()
NULL = "--tokenizer-type NullTokenizer --vocab-size 1000"


def validated(extra: str = ""):
    argv = BASE + extra.split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), 1, typed_flags(parser, argv))


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    """Two tiny indexed datasets."""
    import numpy as np

    from megatron.data.indexed_dataset import IndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("prefixes")
    made = []
    for name in ("a", "b"):
        prefix = str(folder / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        builder.add_item([1, 2, 3])
        builder.end_document()
        builder.finalize(prefix + ".idx")
        made.append(prefix)
    return made


def test_mock_data_with_null_tokenizer_validates_as_the_recipes_write_it() -> None:
    """Megatron-LM's Llama-3 recipe: --mock-data --tokenizer-type NullTokenizer --vocab-size
    128256 --tiktoken-pattern v2 --split '99,1,0' (the pattern and the split not read)."""
    args = validated(f"--mock-data {NULL} --tiktoken-pattern v2 --split '99,1,0'")
    assert args.mock_data and args.vocab_size == 1000 and args.tiktoken_pattern == "v2"
    assert any("--mock-data: --split '99,1,0' is not read" in n for n in args.compat_notes)
    config = DataConfig.from_args(args)
    assert config.mock_data and config.data_path is None


@pytest.mark.parametrize(
    "extra, words",
    [
        ("--mock-data --data-path x", ["--mock-data and --data-path", "A single data source"]),
        ("--mock-data --train-data-path x", ["--mock-data and --train-data-path"]),
        ("--data-path x --valid-data-path y", ["--data-path and --train-data-path/--valid"]),
        ("--valid-data-path x", ["--valid-data-path/--test-data-path need --train-data-path"]),
        ("--train-data-path x --split 1,1,0", ["--split 1,1,0 with --train-data-path"]),
        ("--train-data-path 1 x 2", ["--train-data-path takes one prefix or weight/prefix"]),
        ("--train-data-path x", ["--train-data-path x: no dataset there"]),
        ("--tokenizer-type NullTokenizer", ["NullTokenizer needs --vocab-size"]),
        (f"{NULL} --null-tokenizer-eod-id 1000", ["--null-tokenizer-eod-id 1000: must be"]),
        (f"{NULL} --null-tokenizer-pad-id 0", ["--null-tokenizer-pad-id 0: NullTokenizer's pad"]),
        ("--tokenizer-type TikTokenizer", ["TikTokenizer needs --tokenizer-model"]),
        (
            "--tokenizer-type TikTokenizer --tokenizer-model v.json --tiktoken-special-tokens <s>",
            ["--tokenizer-special-tokens: TikTokenizer needs <unk>"],
        ),
        (
            "--tokenizer-type TikTokenizer --tokenizer-model v.json --vocab-size 1000",
            ["--tiktoken-num-special-tokens 1000 must be at least 0 and below --vocab-size 1000"],
        ),
        ("--tokenizer-type Llama3Tokenizer", ["Megatron-LM removed it", "HuggingFaceTokenizer"]),
        ("--tokenizer-type MistralTokenizer", ["Megatron-LM removed it"]),
    ],
)
def test_mistakes_are_one_line_errors_naming_the_flags(extra: str, words: list[str]) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(extra)
    message = str(refused.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_per_split_paths_validate_and_reach_the_data_config(prefixes: list[str]) -> None:
    a, b = prefixes
    args = validated(f"--train-data-path 0.3 {a} 0.7 {b} --valid-data-path {b} {NULL}")
    config = DataConfig.from_args(args)
    assert config.data_path is None and config.test_data_path is None
    assert config.train_data_path == ["0.3", a, "0.7", b] and config.valid_data_path == [b]
    with pytest.raises(ArgumentError, match=f"^--test-data-path {b}x: no dataset there"):
        validated(f"--train-data-path {a} --test-data-path {b}x")


def test_a_dry_run_checks_the_flags_but_not_the_files() -> None:
    args = validated("--train-data-path /absent/a --valid-data-path /absent/b --dry-run")
    assert args.train_data_path == ["/absent/a"]
    with pytest.raises(ArgumentError, match="--valid-data-path: weight -1 of"):
        validated("--train-data-path /absent/a --valid-data-path -1 x --dry-run")


def test_tiktoken_flags_and_their_older_spelling() -> None:
    extra = (
        "--tokenizer-type TikTokenizer --tokenizer-model v.json --vocab-size 1010 "
        "--tiktoken-num-special-tokens 10 --tiktoken-pattern v1 --tiktoken-special-tokens "
        "<unk> <s> </s> <mask> <pad> <cls> <sep> <x>"
    )
    args = validated(extra)
    assert args.tokenizer_special_tokens[-1] == "<x>"
    assert validated(extra.replace("tiktoken-special", "tokenizer-special")) is not None


def test_vocab_size_of_other_tokenizers_sizes_the_embedding() -> None:
    """Megatron-LM's Llama-3 recipe passes --vocab-size 128256 beside a Hugging Face tokenizer
    (its own count): accepted; a tokenizer with files takes it as the embedding's rows when it
    is at least the tokenizer's ids (a published model's shape), and refuses it below them."""
    from megatron.tokenizer.tokenizer import TokenizerConfig, embedding_rows

    args = validated("--tokenizer-type HuggingFaceTokenizer --tokenizer-model t --vocab-size 9")
    assert args.tokenizer_type == "HFTokenizer"
    config = TokenizerConfig.from_args(args)
    assert embedding_rows(config, 9) == 9
    assert embedding_rows(dataclasses.replace(config, vocab_size=None), 7) == 7
    assert embedding_rows(dataclasses.replace(config, vocab_size=250_000), 50_257) == 250_000
    with pytest.raises(ValueError, match=r"--vocab-size 9 is below the 50,257 ids of "):
        embedding_rows(config, 50_257)
    assert validated(f"{NULL} --null-tokenizer-pad-id -1").vocab_size == 1000
