"""GPT2BPETokenizer: ids equal the reference GPT-2 BPE, Megatron's API, padding, bad files."""

from __future__ import annotations

import glob
import json
import sysconfig
from argparse import Namespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.tokenizer import (
    GPT2BPETokenizer,
    TokenizerFileError,
    build_tokenizer,
    vocab_size_with_padding,
)
from megatron.tokenizer.byte_encoding import bytes_to_unicode
from tests.tokenizer.reference_bpe import ReferenceGPT2BPE

VARIED_TEXTS = [
    "",
    "Hello world",
    "It's, we're, they've, I'm, you'll, he'd — IT'S WE'RE",
    "  leading and trailing spaces   ",
    " " * 200 + "word" + "\t" * 30 + "\n" * 12,
    "def f(x):\n    return x ** 2  # square\n\n\n\tif x:\r\n\t\tpass\r\n",
    "😀👍🏽 👨‍👩‍👧‍👦 émigré naïve Ünïcödé 日本語のテキスト 한국어 עִבְרִית العربية",
    "numbers 3.14159 1,000,000 ١٢٣ ½ Ⅻ ²",
    "<|endoftext|> is plain text here",
    "\x00\x01\x1c\x1d\x1e\x1f\x7f\x85\xa0\u2028\u2029\u3000\ufeff",
    "'s's''s 'S 'll'll",
    "a" * 5000,
    "https://example.com/path?query=1&b=2#frag",
    "   \n   \n\n  x",
]


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_ids_equal_reference(tokenizer, reference_bpe, text):
    """Hand-picked hard cases: whitespace runs, contractions, emoji, controls, long words."""
    assert tokenizer.tokenize(text) == reference_bpe.encode(text)
    assert tokenizer.tokenize_to_array(text).tolist() == reference_bpe.encode(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=80))
def test_random_text_equals_reference(tokenizer, reference_bpe, text):
    """Random unicode strings (no lone surrogates) tokenize like the reference."""
    assert tokenizer.tokenize(text) == reference_bpe.encode(text)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                " ",
                "  ",
                "\t",
                "\n",
                "'",
                "'s",
                "a",
                "Z",
                "1",
                "é",
                "!",
                "😀",
                "\r\n",
                "\u3000",
                "ll",
                "ve",
            ]
        ),
        max_size=40,
    )
)
def test_whitespace_and_apostrophe_mixes_equal_reference(tokenizer, reference_bpe, pieces):
    """Dense mixes of the characters where the pre-tokenization regex backtracks."""
    text = "".join(pieces)
    assert tokenizer.tokenize(text) == reference_bpe.encode(text)


def test_python_source_files_equal_reference(tokenizer, reference_bpe):
    """Real code: a spread of files from this Python's standard library."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(f"{stdlib}/*.py"))[::15][:25]
    assert len(files) >= 10
    for path in files:
        text = open(path, encoding="utf-8", errors="replace").read()
        assert tokenizer.tokenize(text) == reference_bpe.encode(text), path


def test_detokenize_round_trip(tokenizer):
    """Detokenizing returns the text for valid UTF-8, and handles the end-of-text token."""
    for text in VARIED_TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.detokenize([tokenizer.eod]) == "<|endoftext|>"
    assert tokenizer.detokenize(np.array([15496, 995])) == "Hello world"


def test_detokenize_invalid_utf8_and_unknown_ids(tokenizer):
    """A lone continuation byte decodes to U+FFFD; ids beyond the vocab are an error."""
    lone_byte = tokenizer.vocab[bytes_to_unicode()[0x80]]
    assert tokenizer.detokenize([lone_byte]) == "\ufffd"
    with pytest.raises(ValueError, match="50300"):
        tokenizer.detokenize([50300])


def test_megatron_api(tokenizer):
    """The attributes Megatron code reads."""
    assert tokenizer.vocab_size == 50257
    assert tokenizer.eod == 50256
    assert tokenizer.vocab["<|endoftext|>"] == 50256
    assert tokenizer.inv_vocab[50256] == "<|endoftext|>"
    assert tokenizer.vocab["Ġthe"] == 262
    assert tokenizer.tokenize("Hello world") == [15496, 995]


def test_build_tokenizer_pads_vocab_like_megatron(gpt2_files, capsys):
    """build_tokenizer sets args.padded_vocab_size and logs Megatron's line."""
    vocab, merges = gpt2_files
    args = Namespace(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=vocab,
        merge_file=merges,
        rank=0,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
    )
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 50257 and args.padded_vocab_size == 50304
    out = capsys.readouterr().out
    assert "> building GPT2BPETokenizer tokenizer ..." in out
    assert "> padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)" in out
    args.tensor_model_parallel_size, args.rank = 4, 1
    build_tokenizer(args)
    assert args.padded_vocab_size == 50688  # multiple of 128 * 4
    assert capsys.readouterr().out == ""  # only rank 0 logs


def test_vocab_size_with_padding_values():
    """Smallest multiple of divisible_by * TP that holds the vocabulary."""
    assert vocab_size_with_padding(50257, 128, 1, verbose=False) == 50304
    assert vocab_size_with_padding(50257, 128, 2, verbose=False) == 50432
    assert vocab_size_with_padding(50304, 128, 1, verbose=False) == 50304
    assert vocab_size_with_padding(50257, 1, 1, verbose=False) == 50257
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        vocab_size_with_padding(50257, 0, 1)


def test_build_tokenizer_errors(gpt2_files):
    """Unsupported types and missing files name the flag."""
    vocab, merges = gpt2_files
    with pytest.raises(ValueError, match="--tokenizer-type BertWordPieceLowerCase"):
        build_tokenizer(
            Namespace(tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab, merge_file=merges)
        )
    with pytest.raises(ValueError, match="--vocab-file and --merge-file"):
        build_tokenizer(
            Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=merges)
        )


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_bad_vocab_and_merges_files(tmp_path, gpt2_files):
    """Each unusable file is reported with its flag, path and (for merges) line number."""
    vocab, merges = gpt2_files
    with pytest.raises(TokenizerFileError, match="--vocab-file .*missing.json: no such file"):
        GPT2BPETokenizer(str(tmp_path / "missing.json"), merges)
    bad_json = _write(tmp_path / "bad.json", '{"a": 1,\n "b": }')
    with pytest.raises(TokenizerFileError, match=r"bad.json:2: not a JSON vocabulary"):
        GPT2BPETokenizer(bad_json, merges)
    no_eod = json.load(open(vocab, encoding="utf-8"))
    del no_eod["<|endoftext|>"]
    with pytest.raises(TokenizerFileError, match="has no <|endoftext|> token"):
        GPT2BPETokenizer(_write(tmp_path / "noeod.json", json.dumps(no_eod)), merges)
    lines = open(merges, encoding="utf-8").read().split("\n")
    broken = lines[:5] + ["Ġt he extra"] + lines[5:]
    with pytest.raises(TokenizerFileError, match=r"bad.txt:6: expected two symbols"):
        GPT2BPETokenizer(vocab, _write(tmp_path / "bad.txt", "\n".join(broken)))
    unknown = lines[:3] + ["Ġt zzzqqq"] + lines[3:]
    with pytest.raises(TokenizerFileError, match=r"unknown.txt:4: symbol 'zzzqqq' is not in"):
        GPT2BPETokenizer(vocab, _write(tmp_path / "unknown.txt", "\n".join(unknown)))


def _toy_vocabulary(tmp_path, shuffle_ids: bool) -> tuple[str, str]:
    """A small byte-level BPE (all 256 bytes plus a few merges); ids optionally permuted."""
    byte_symbols = list(bytes_to_unicode().values())
    merges = [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("e", "r"),
        ("Ġthe", "r"),
        ("a", "a"),
        ("aa", "aa"),
        ("i", "n"),
        ("Ġ", "in"),
    ]
    tokens = byte_symbols + [a + b for a, b in merges] + ["<|endoftext|>"]
    ids = list(range(len(tokens)))
    if shuffle_ids:
        np.random.RandomState(0).shuffle(ids)
    vocab = dict(zip(tokens, ids))
    vocab_path = _write(tmp_path / f"toy{shuffle_ids}.json", json.dumps(vocab))
    merges_path = _write(
        tmp_path / f"toy{shuffle_ids}.txt",
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
    )
    return vocab_path, merges_path


@pytest.mark.parametrize("shuffle_ids", [False, True])
def test_other_byte_level_vocabularies(tmp_path, shuffle_ids):
    """A vocabulary whose ids are not its merge ranks still tokenizes like the reference."""
    vocab, merges = _toy_vocabulary(tmp_path, shuffle_ids)
    ours, reference = GPT2BPETokenizer(vocab, merges), ReferenceGPT2BPE(vocab, merges)
    for text in ["the therapist in the inn", "aaaaaaa aaa", "ther there", "é 😀 in", ""]:
        ids = ours.tokenize(text)
        assert ids == reference.encode(text)
        assert ours.tokenize_to_array(text).tolist() == ids
        assert ours.detokenize(ids) == text
    assert ours.eod == reference.encoder["<|endoftext|>"]


def test_missing_byte_symbol_is_reported(tmp_path):
    """A vocabulary without all 256 byte symbols is rejected with the missing byte named."""
    vocab, merges = _toy_vocabulary(tmp_path, False)
    data = json.load(open(vocab, encoding="utf-8"))
    del data["!"]
    with pytest.raises(TokenizerFileError, match="byte 33"):
        GPT2BPETokenizer(_write(tmp_path / "nobang.json", json.dumps(data)), merges)


def test_unchanged_files_are_read_once_and_changed_files_again(tmp_path, monkeypatch):
    """A second tokenizer from the same files reuses their checked contents (not its engine or
    vocabulary dict); rewritten files are read again, a broken rewrite is reported."""
    from megatron.tokenizer import gpt2_bpe

    vocab, merges = _toy_vocabulary(tmp_path, False)
    first = GPT2BPETokenizer(vocab, merges)
    reads = []
    monkeypatch.setattr(gpt2_bpe, "_load_vocab", lambda path: reads.append(path) or {})
    second = GPT2BPETokenizer(vocab, merges)
    assert reads == []
    assert second.tokenize("the therapist") == first.tokenize("the therapist")
    assert second._engine is not first._engine and second.encoder is not first.encoder
    second.encoder["extra"] = 10**6  # a caller's change stays in its own tokenizer
    assert "extra" not in GPT2BPETokenizer(vocab, merges).encoder
    monkeypatch.undo()

    fewer = open(merges, encoding="utf-8").read().replace("Ġt he\n", "")
    _write(tmp_path / "toyFalse.txt", fewer)  # rewritten in place: another size
    rebuilt = GPT2BPETokenizer(vocab, merges)
    reference = ReferenceGPT2BPE(vocab, merges)
    assert rebuilt.tokenize(" the there") == reference.encode(" the there")
    assert rebuilt.tokenize(" the there") != first.tokenize(" the there")
    _write(tmp_path / "toyFalse.txt", fewer + "Ġt zzz\n")
    with pytest.raises(TokenizerFileError, match=r"toyFalse.txt:\d+: symbol 'zzz' is not in"):
        GPT2BPETokenizer(vocab, merges)
