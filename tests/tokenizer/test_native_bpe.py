"""The native C++ GPT-2 BPE engine gives exactly the reference's token ids.

The oracle is the pure-Python reference (tests/tokenizer/reference_bpe.py) on the real GPT-2
vocabulary and merges in dataset/. Covered: every Unicode code point in two contexts, random
text (hypothesis), hand-picked edge cases of the pre-tokenization regex, real stdlib source,
the reference-order merge fallback on merge tables where the fast merge would differ, and
errors (lone surrogates, bad construction data).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import sysconfig
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.tokenizer.byte_encoding import bytes_to_unicode
from megatron.tokenizer.gpt2_bpe import _load_merges
from megatron.tokenizer.native_bpe import BPEEngine, build_native_engine, unicode_class_ranges
from tests.tokenizer.reference_bpe import ReferenceGPT2BPE

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(REPO_ROOT, "dataset", "gpt2-vocab.json")
MERGES = os.path.join(REPO_ROOT, "dataset", "gpt2-merges.txt")


def _load_engine(force_reference_order: bool = False) -> BPEEngine:
    with open(VOCAB, encoding="utf-8") as f:
        encoder = json.load(f)
    return build_native_engine(
        encoder, _load_merges(MERGES), force_reference_order=force_reference_order
    )


@pytest.fixture(scope="module")
def reference() -> ReferenceGPT2BPE:
    return ReferenceGPT2BPE(VOCAB, MERGES)


@pytest.fixture(scope="module")
def engine() -> BPEEngine:
    return _load_engine()


@pytest.fixture(scope="module")
def slow_engine() -> BPEEngine:
    """The same vocabulary, merging in the reference's own order (no heap fast path)."""
    return _load_engine(force_reference_order=True)


def _ids(engine: BPEEngine, text: str) -> list[int]:
    result = engine.encode(text)
    assert result.dtype == np.int32 and result.ndim == 1
    return result.tolist()


# --- every code point --------------------------------------------------------------------


def _contexts(cp: int) -> tuple[str, str]:
    c = chr(cp)
    return "a" + c + "b " + c + c + " 1" + c, " " + c + "  " + c


_worker_state: dict[str, object] = {}


def _check_code_points(bounds: tuple[int, int]) -> list[tuple[int, str, list[int], list[int]]]:
    """Pool worker: (code point, context, reference ids, native ids) of every mismatch."""
    if "engine" not in _worker_state:
        _worker_state["engine"] = _load_engine()
        _worker_state["reference"] = ReferenceGPT2BPE(VOCAB, MERGES)
    engine, reference = _worker_state["engine"], _worker_state["reference"]
    reference.cache.clear()  # its words are unique to each code point: bound the memory
    mismatches = []
    for cp in range(*bounds):
        if 0xD800 <= cp < 0xE000:  # lone surrogates cannot be encoded (tested below)
            continue
        for text in _contexts(cp):
            expected = reference.encode(text)
            got = engine.encode(text).tolist()
            if got != expected:
                mismatches.append((cp, text, expected, got))
    return mismatches


@pytest.mark.slow
def test_every_code_point_in_context() -> None:
    # ~2.2M reference encodes: split over both cores (each worker checks its own chunks and
    # reports only mismatches).
    chunk = 0x4000
    chunks = [(lo, min(lo + chunk, 0x110000)) for lo in range(0, 0x110000, chunk)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    processes = max(1, min(os.cpu_count() or 1, 4))
    with multiprocessing.get_context(method).Pool(processes) as pool:
        mismatches = [m for part in pool.imap_unordered(_check_code_points, chunks) for m in part]
    mismatches.sort()
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:5]}"


# --- random text ---------------------------------------------------------------------------

_FUZZ_ALPHABET = st.one_of(
    st.sampled_from(list(" \t\n\r\x0b\x0c\x85\xa0\u2003\u3000'sStTmdrevl1209")),
    st.sampled_from(["'s", "'S", "'re", "'ll", "'ve", "'d", "'m", "''", "  ", "\r\n", "\t "]),
    st.sampled_from(list('😀👍🏽🇫🇷é中Ωπ١٣ⅫÅ̈\u200d\ufeff.,;:!?()[]{}<>_-+=*/\\"#@$%^&|~`')),
    st.characters(blacklist_categories=("Cs",)),
)
_FUZZ_TEXT = st.lists(_FUZZ_ALPHABET, max_size=60).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_FUZZ_TEXT)
def test_random_text_matches_reference(reference, engine, slow_engine, text: str) -> None:
    expected = reference.encode(text)
    assert _ids(engine, text) == expected
    assert _ids(slow_engine, text) == expected


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_random_unicode_matches_reference(reference, engine, text: str) -> None:
    assert _ids(engine, text) == reference.encode(text)


# --- hand-picked cases ---------------------------------------------------------------------

HAND_PICKED = [
    "",
    "a",
    " ",
    "Hello world",
    "I'm here, you're there, we've been, she'll go, he'd say, it's, don't",
    "I'M HERE, YOU'RE THERE, WE'VE BEEN, SHE'LL GO, HE'D SAY, IT'S, DON'T",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'x '' ''s x's x''s ' s '",
    "'",
    "'r",
    "'l",
    "   a",
    "  \ta",
    "\n a",
    " \n a",
    "a  ",
    "a \n",
    "trailing spaces   ",
    "tabs\t\tand\tmore\t",
    "line1\r\nline2\r\n\r\n",
    "a\n\nb",
    "a\u00a0 b\u3000\u3000c \u2003d",
    " " * 10000,
    "x" + " " * 10000 + "y",
    "\n" * 5000 + "z",
    " 123 4567890 1.5e10 ١٢٣ ⅫⅩ",
    " !!! ?? ... ---> <== ###",
    "😀😀 😀 a😀b 👍🏽 🇫🇷",
    "naïve café résumé 中文字符 日本語 한국어 Ελληνικά русский العربية עברית",
    "e\u0301 a\u0308 combining",
    "<|endoftext|> stays plain text <|endoftext|>",
    "def f(x: int) -> int:\n    '''Docstring.'''\n    return x ** 2  # comment\n",
    "class A:\n\tpass\n\n\nif __name__ == '__main__':\n    A()\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\r\n",
    '{"key": [1, 2, 3], "other": null}',
]


@pytest.mark.parametrize("text", HAND_PICKED, ids=range(len(HAND_PICKED)))
def test_hand_picked(reference, engine, slow_engine, text: str) -> None:
    expected = reference.encode(text)
    assert _ids(engine, text) == expected
    assert _ids(slow_engine, text) == expected


def test_long_single_word(reference, engine, slow_engine) -> None:
    # (How fast: benchmarks/bpe_engine_speed.py; a wall-clock bound here would fail on a
    # loaded machine.)
    word = "a" * 20000
    assert _ids(engine, word) == reference.encode(word)

    rng = random.Random(0)
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(20000))
    ids = _ids(engine, word)
    assert ids == _ids(slow_engine, word)  # the fallback is checked against the reference
    shorter = word[:1500]  # the reference is quadratic; keep its share small
    assert _ids(engine, shorter) == reference.encode(shorter)


STDLIB_FILES = [
    "os.py",
    "textwrap.py",
    "shlex.py",
    "re/_casefix.py",
    "test/test_email/test_contentmanager.py",
    "tkinter/test/test_tkinter/test_misc.py",
]


def test_stdlib_sources(reference, engine) -> None:
    root = sysconfig.get_paths()["stdlib"]
    paths = [os.path.join(root, p) for p in STDLIB_FILES if os.path.isfile(os.path.join(root, p))]
    if not paths:
        pytest.skip("no stdlib sources found")
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert _ids(engine, text) == reference.encode(text), path


def test_repeated_calls_use_cache_consistently(reference, engine) -> None:
    text = "The cache must not change results: the the the, The THE. " * 50
    first = _ids(engine, text)
    assert engine.cache_size > 0
    assert _ids(engine, text) == first == reference.encode(text)
    engine.clear_cache()
    assert engine.cache_size == 0
    assert _ids(engine, text) == first


def test_threads_share_an_engine(reference, engine) -> None:
    texts = [f"thread {i}: some words, more words {i * 7919} 'll 😀\n" * 200 for i in range(4)]
    expected = [reference.encode(t) for t in texts]
    results: dict[int, list[list[int]]] = {}

    def work(i: int) -> None:
        results[i] = [_ids(engine, texts[(i + k) % 4]) for k in range(8)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(4):
        assert results[i] == [expected[(i + k) % 4] for k in range(8)]


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["\ud800", "abc \udfff def", "😀\udc80"])
def test_lone_surrogate_raises(engine, text: str) -> None:
    with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
        engine.encode(text)
    assert _ids(engine, "still works") == [24219, 2499]


def test_rejects_non_str(engine) -> None:
    with pytest.raises(TypeError):
        engine.encode(b"bytes")


def test_construction_reuses_the_class_ranges(monkeypatch) -> None:
    """The Unicode class table (the costly part of building an engine) is computed once per
    process: a second engine does not scan the code points again."""
    from megatron.tokenizer import native_bpe

    first = unicode_class_ranges()

    def scan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the Unicode class ranges were computed again")

    monkeypatch.setattr(native_bpe.regex, "finditer", scan)
    _load_engine()
    assert unicode_class_ranges() is first


def test_class_ranges_are_disjoint_and_sorted() -> None:
    ranges = unicode_class_ranges()
    marks = np.zeros(0x110000, dtype=np.int8)
    for name in ("letter", "number", "space"):
        table = ranges[name]
        assert table.dtype == np.int64 and table.shape[1] == 2 and len(table) > 0
        assert (table[:, 0] < table[:, 1]).all() and (table[1:, 0] > table[:-1, 1]).all()
        for lo, hi in table:
            marks[lo:hi] += 1
    assert marks.max() == 1
    assert {chr(c) for c in range(128) if marks[c]} >= set("aZ09 \t\n")


def test_bad_construction_data_raises() -> None:
    byte_encoder = bytes_to_unicode()
    encoder = {symbol: byte for byte, symbol in byte_encoder.items()}
    encoder["ab"] = 256
    with pytest.raises(ValueError, match="not in the vocabulary"):
        build_native_engine(encoder, [("a", "b"), ("ab", "c")])
    ranges = unicode_class_ranges()
    token_bytes = [bytes([b]) for b in range(256)] + [b"ab"]
    args = (ranges["letter"], ranges["number"], ranges["space"])
    with pytest.raises(ValueError, match="token_bytes"):
        BPEEngine(token_bytes, [(97, 98, 97)], list(range(256)), *args)
    with pytest.raises(ValueError, match="not a token id"):
        BPEEngine(token_bytes, [(97, 98, 999)], list(range(256)), *args)
    with pytest.raises(ValueError, match="single byte"):
        BPEEngine(token_bytes, [], [0] * 256, *args)
    with pytest.raises(ValueError, match="shape"):
        BPEEngine(token_bytes, [], list(range(256)), np.zeros(3), *args[1:])


# --- merge tables where the fast merge order would not match the reference ------------------


def _toy_tokenizers(tmp_path, merges: list[tuple[str, str]]):
    """Reference and native tokenizers for the 256 byte symbols plus the given merges."""
    byte_encoder = bytes_to_unicode()
    encoder = {byte_encoder[b]: b for b in range(256)}
    for left, right in merges:
        encoder.setdefault(left + right, len(encoder))
    encoder["<|endoftext|>"] = len(encoder)
    vocab_file, merges_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(encoder), encoding="utf-8")
    lines = "".join(f"{left} {right}\n" for left, right in merges)
    merges_file.write_text("#version: 0.2\n" + lines, encoding="utf-8")
    reference = ReferenceGPT2BPE(str(vocab_file), str(merges_file))
    return reference, build_native_engine(encoder, merges)


def test_fallback_when_merges_use_later_results(tmp_path) -> None:
    # "ab" is used (rank 0) before it is produced (rank 1). In "abab" the reference merges
    # both (a, b) first, giving [ab, ab]; a one-pair-at-a-time heap would give [aba, b].
    reference, engine = _toy_tokenizers(tmp_path, [("ab", "a"), ("a", "b"), ("b", "c")])
    assert not engine.fast_merge
    assert _ids(engine, "abab") == reference.encode("abab")
    assert [reference.decoder[i] for i in reference.encode("abab")] == ["ab", "ab"]
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice("abc a") for _ in range(rng.randrange(30)))
        assert _ids(engine, text) == reference.encode(text), text


def test_duplicate_merge_uses_last_rank(tmp_path) -> None:
    # The reference's {pair: rank} dict keeps the last rank of a repeated pair.
    # With (a, b) at rank 2, "abc" is [a, bc]; with rank 0 it would be [abc].
    merges = [("a", "b"), ("b", "c"), ("a", "b"), ("ab", "c")]
    reference, engine = _toy_tokenizers(tmp_path, merges)
    assert [reference.decoder[i] for i in reference.encode("abc")] == ["a", "bc"]
    for text in ["abc", "abcabc", "aabbcc", "ab", "bcab", "abab c"]:
        assert _ids(engine, text) == reference.encode(text), text


def test_merges_that_never_apply_are_dropped(tmp_path) -> None:
    # "中" is not a byte symbol, so ("中", "a") and ("中a", "b") can never apply.
    merges = [("a", "b"), ("中", "a"), ("中a", "b"), ("ab", "c")]
    reference, engine = _toy_tokenizers(tmp_path, merges)
    assert engine.fast_merge
    for text in ["中ab", "abc中a", "中a中ab c"]:
        assert _ids(engine, text) == reference.encode(text), text


def test_special_tokens_never_produced(engine) -> None:
    assert 50256 not in _ids(engine, "<|endoftext|>" * 3)
