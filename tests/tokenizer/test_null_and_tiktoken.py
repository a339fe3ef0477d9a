"""NullTokenizer and TikTokenizer: Megatron-LM's meanings, megatron-core 0.16.1 as the oracle
for tiktoken's ids, and both through tools/preprocess_data.py.

The tiktoken vocabulary is `tests/tokenizer/tiktoken_vocab.py`'s: the 256 bytes, then the
tokens of GPT-2's first merges (1,000 tokens).
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import (
    NullTokenizer,
    TikTokenizer,
    TokenizerConfig,
    TokenizerFileError,
    build_tokenizer,
    create_tokenizer,
)
from megatron.tokenizer.tokenizer import tokenizer_flag_problem
from tests.conftest import run_oracle
from tests.tokenizer.tiktoken_vocab import tiktoken_entries, write_tiktoken_vocab

pytest.importorskip("tiktoken")

ORACLE_SCRIPT = os.path.join(os.path.dirname(__file__), "megatron_core_tiktoken.py")
TEXTS = [
    "Hello world, this is a test of the tiktoken tokenizer.",
    "def f(a, b):\n    return a + b  # 12345 67\n\n\n",
    "naïve café façade 東京 données Ωμέγα 🙂 CamelCaseWords and ALLCAPS",
    "special text <s> and </s> and <pad> and <SPECIAL_9> inside",
    "   leading spaces\ttabs\r\nand CRLF",
    "",
]


@pytest.fixture(scope="module")
def tiktoken_vocab(tmp_path_factory) -> str:
    """A 1,000-token tiktoken JSON vocabulary."""
    return write_tiktoken_vocab(str(tmp_path_factory.mktemp("tiktoken") / "vocab.json"))


# ------------------------------------------------------------------------------ NullTokenizer


def test_null_tokenizer_reads_ids_and_ends_documents_with_the_last_one() -> None:
    """Megatron-LM today: vocab_size N, end of document N - 1 (or --null-tokenizer-eod-id)."""
    tokenizer = NullTokenizer(1000)
    assert (tokenizer.vocab_size, tokenizer.eod) == (1000, 999)
    assert tokenizer.tokenize("5 17 3 999") == [5, 17, 3, 999]
    assert tokenizer.tokenize(" 1\n2 ") == [1, 2]
    array = tokenizer.tokenize_to_array("7 8")
    assert array.dtype == np.int32 and array.tolist() == [7, 8]
    assert tokenizer.detokenize(np.array([5, 17, 3])) == "5 17 3"
    assert tokenizer.vocab["42"] == 42 and tokenizer.inv_vocab[42] == "42"
    assert NullTokenizer(1000, eod_id=0).eod == 0


@pytest.mark.parametrize(
    ("text", "words"),
    [("1 two 3", ["'two' is not a token id"]), ("1 1000", ["1000", "--vocab-size 1000"])],
)
def test_null_tokenizer_errors_name_the_word(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        NullTokenizer(1000).tokenize(text)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_null_tokenizer_flags_are_checked() -> None:
    config = TokenizerConfig(tokenizer_type="NullTokenizer")
    assert "needs --vocab-size" in tokenizer_flag_problem(config)
    bad_eod = TokenizerConfig(
        tokenizer_type="NullTokenizer", vocab_size=10, null_tokenizer_eod_id=10
    )
    assert "--null-tokenizer-eod-id 10" in tokenizer_flag_problem(bad_eod)
    with pytest.raises(ValueError, match="needs --vocab-size"):
        create_tokenizer(config)


@pytest.mark.parametrize(
    ("vocab_size", "divisible_by", "tp", "padded"),
    [(1000, 128, 1, 1024), (1000, 128, 2, 1024), (1025, 128, 1, 1152), (128256, 128, 8, 129024)],
)
def test_null_tokenizer_vocabulary_is_padded_as_megatron_pads(
    vocab_size: int, divisible_by: int, tp: int, padded: int
) -> None:
    """Megatron's rule: the smallest multiple of divisible-by x TP that holds N ids."""
    args = Namespace(
        tokenizer_type="NullTokenizer",
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp,
        rank=1,
    )
    tokenizer = build_tokenizer(args)
    assert (args.tokenizer_vocab_size, args.padded_vocab_size) == (vocab_size, padded)
    assert tokenizer.eod == vocab_size - 1


# ------------------------------------------------------------------------------- TikTokenizer

ORACLE_CASES = [
    {},
    {"pattern": "v1"},
    {"pattern": "v2", "vocab_size": 1500},
    {"num_special_tokens": 10, "vocab_size": 1010},
    {
        "num_special_tokens": 16,
        "vocab_size": 1016,
        "special_tokens": ["<pad>", "<s>", "</s>", "<unk>", "<mask>", "<cls>", "<sep>", "<x>"],
    },
]


def _ours(vocab: str, kwargs: dict) -> TikTokenizer:
    return TikTokenizer(
        vocab,
        kwargs.get("pattern"),
        kwargs.get("vocab_size", 2000),
        kwargs.get("num_special_tokens"),
        kwargs.get("special_tokens"),
    )


def test_ids_equal_megatron_cores_tiktoken_tokenizer(tiktoken_vocab, stdlib_texts, tmp_path):
    """Ids, their text, vocab_size and eod equal megatron-core 0.16.1's TikTokenTokenizer for
    both patterns, other special-token counts, a cut vocabulary and reordered special tokens."""
    texts = TEXTS + stdlib_texts[:10]
    cases = [
        {"vocab": tiktoken_vocab, "kwargs": {"vocab_size": 2000, **kwargs}, "texts": texts}
        for kwargs in ORACLE_CASES
    ]
    cases_file, out_file = tmp_path / "cases.json", tmp_path / "out.json"
    cases_file.write_text(json.dumps(cases))
    run_oracle(ORACLE_SCRIPT, str(cases_file), str(out_file))
    expected = json.loads(out_file.read_text())
    assert len(expected) == len(cases)
    for case, theirs in zip(cases, expected):
        tokenizer = _ours(tiktoken_vocab, case["kwargs"])
        assert (tokenizer.vocab_size, tokenizer.eod) == (theirs["vocab_size"], theirs["eod"])
        for text, ids, decoded in zip(texts, theirs["ids"], theirs["texts"]):
            assert tokenizer.tokenize(text) == ids, (case["kwargs"], text[:60])
            assert tokenizer.detokenize(ids) == decoded == text


def test_special_tokens_come_first(tiktoken_vocab) -> None:
    tokenizer = TikTokenizer(tiktoken_vocab, vocab_size=2000)
    assert (tokenizer.unk_id, tokenizer.bos, tokenizer.eod, tokenizer.pad) == (0, 1, 2, 4)
    assert tokenizer.inv_vocab[7] == "<SPECIAL_7>" and tokenizer.inv_vocab[999] == "<SPECIAL_999>"
    assert tokenizer.inv_vocab[1000] == "\x00" and tokenizer.inv_vocab[1000 + ord("a")] == "a"
    assert tokenizer.vocab["</s>"] == 2
    assert tokenizer.tokenize("a</s>") == [1000 + ord("a"), 2]
    assert max(tokenizer.tokenize(" ".join(TEXTS))) < 2000


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"vocab_size": None}, ["1000 tokens, fewer than", "pass --vocab-size 2000"]),
        ({"num_special_tokens": 2000}, ["--tiktoken-num-special-tokens 2000"]),
        ({"special_tokens": ["<s>", "</s>"]}, ["--tokenizer-special-tokens", "missing"]),
        (
            {
                "special_tokens": [
                    *"abcdefgh",
                    "<unk>",
                    "<s>",
                    "</s>",
                    "<mask>",
                    "<pad>",
                    "<cls>",
                    "<sep>",
                    "a",
                ]
            },
            ["a is given twice"],
        ),  # fmt: skip
        ({"pattern": "v3"}, ["--tiktoken-pattern v3"]),
    ],
)
def test_bad_flags_are_one_line_errors_naming_them(tiktoken_vocab, kwargs, words) -> None:
    arguments = {"vocab_size": 2000, **kwargs}
    with pytest.raises(ValueError) as error:
        TikTokenizer(
            tiktoken_vocab,
            arguments.get("pattern"),
            arguments["vocab_size"],
            arguments.get("num_special_tokens"),
            arguments.get("special_tokens"),
        )
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


def _vocab_with(tmp_path, change) -> str:
    entries = tiktoken_entries(300)
    change(entries)
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(entries))
    return str(path)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda e: e.__setitem__(3, {**e[3], "rank": 4}), ["entry 3 has rank 4"]),
        (lambda e: e.__setitem__(5, {**e[5], "token_bytes": "QQ=="}), ["entry 5 must be"]),
        (lambda e: e.__setitem__(280, {**e[280], "token_bytes": "QQ=="}), ["entry 280 repeats"]),
        (lambda e: e[7].pop("token_str"), ["entry 7 is not"]),
        (lambda e: e.__setitem__(290, {**e[290], "token_bytes": "%%"}), ["not base64"]),
    ],
)
def test_bad_vocabulary_files_name_the_file_and_entry(tmp_path, change, words) -> None:
    path = _vocab_with(tmp_path, change)
    with pytest.raises(TokenizerFileError) as error:
        TikTokenizer(path, vocab_size=1300)
    message = str(error.value)
    assert message.startswith(f"--tokenizer-model {path}: ") and "\n" not in message
    assert all(word in message for word in words), message


def test_missing_vocabulary_and_missing_package_name_the_fix(tmp_path, monkeypatch) -> None:
    with pytest.raises(TokenizerFileError, match="no such file"):
        TikTokenizer(str(tmp_path / "absent.json"), vocab_size=2000)
    config = TokenizerConfig(tokenizer_type="TikTokenizer")
    assert "needs --tokenizer-model" in tokenizer_flag_problem(config)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise
    with pytest.raises(ImportError, match=r"needs tiktoken: pip install tiktoken"):
        TikTokenizer(str(tmp_path / "absent.json"), vocab_size=2000)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    config = TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model="x.json")
    assert tokenizer_flag_problem(config) == (
        "--tokenizer-type TikTokenizer needs tiktoken: pip install tiktoken (or pip install -e "
        "'.[tiktoken]')"
    )


# --------------------------------------------------------------------- tools/preprocess_data.py


def _preprocess(tmp_path, texts: list[str], *flags: str) -> IndexedDataset:
    from tools import preprocess_data

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "out")
    argv = ["--input", str(corpus), "--output-prefix", prefix, "--append-eod", *flags]
    assert preprocess_data.main(argv) == 0
    return IndexedDataset(prefix + "_text_document")


def test_preprocess_data_with_tiktoken(tiktoken_vocab, tmp_path) -> None:
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tiktoken_vocab]
    flags += ["--vocab-size", "1010", "--tiktoken-num-special-tokens", "10"]
    flags += ["--tiktoken-pattern", "v1"]
    dataset = _preprocess(tmp_path, TEXTS[:5], *flags)
    tokenizer = TikTokenizer(tiktoken_vocab, "v1", 1010, 10)
    assert dataset.dtype == np.uint16
    for i, text in enumerate(TEXTS[:5]):
        assert dataset.get(i).tolist() == tokenizer.tokenize(text) + [2]


def test_preprocess_data_with_null_tokenizer(tmp_path, capsys) -> None:
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000"]
    dataset = _preprocess(tmp_path, ["1 2 3", "69998 0"], *flags)
    assert dataset.dtype == np.int32  # more than 65,500 ids, as Megatron chooses
    assert [dataset.get(i).tolist() for i in range(2)] == [[1, 2, 3, 69999], [69998, 0, 69999]]
    from tools import preprocess_data

    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(json.dumps({"text": "1 x"}) + "\n")
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "bad"), *flags]
    assert preprocess_data.main(argv) == 1
    assert (
        "bad.jsonl:1: key 'text': NullTokenizer: 'x' is not a token id" in capsys.readouterr().err
    )
