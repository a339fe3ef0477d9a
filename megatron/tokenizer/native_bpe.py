"""Glue for the native GPT-2 BPE encoder (the `megatron.tokenizer.bpe_engine` C++ extension).

`build_native_engine` turns a GPT-2 vocabulary (token strings in GPT-2's byte-to-unicode
spelling -> ids) and merges list into the plain data the C++ `BPEEngine` takes: the raw
bytes of every token, merges as (left_id, right_id, merged_id) in rank order, the id of
each single byte, and the code point ranges of the regex classes \\p{L}, \\p{N} and \\s.

The ranges are computed at runtime from the Python `regex` module, the engine the
reference tokenizer uses, so the native pre-tokenizer classifies every code point exactly
as the reference does under whatever Unicode version that `regex` build implements. They
are computed once per process and cached here.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import operator
from collections.abc import Iterator

import numpy as np
import regex

from megatron.extensions import load_extension
from megatron.tokenizer.byte_encoding import bytes_to_unicode

BPEEngine = load_extension("megatron.tokenizer.bpe_engine").BPEEngine

__all__ = [
    "BPEEngine",
    "build_native_engine",
    "engine_from_data",
    "native_engine_data",
    "unicode_class_ranges",
]

_NUM_CODE_POINTS = 0x110000
_CLASS_PATTERNS = {"letter": r"\p{L}+", "number": r"\p{N}+", "space": r"\s+"}
_class_ranges: dict[str, np.ndarray] | None = None


def unicode_class_ranges() -> dict[str, np.ndarray]:
    """Half-open code point ranges of \\p{L}, \\p{N} and \\s, as `regex` matches them.

    Returns a dict with keys "letter", "number" and "space", each an int64 array of shape
    [k, 2] of maximal runs [lo, hi). Computed once per process (about 50 ms), then cached.
    """
    global _class_ranges
    if _class_ranges is None:
        # Every code point, lone surrogates included (they belong to none of the classes).
        everything = (
            np.arange(_NUM_CODE_POINTS, dtype="<u4").tobytes().decode("utf-32-le", "surrogatepass")
        )
        ranges = {}
        for name, pattern in _CLASS_PATTERNS.items():
            spans = [match.span() for match in regex.finditer(pattern, everything)]
            ranges[name] = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        _class_ranges = ranges
    return _class_ranges


def build_native_engine(
    encoder: dict[str, int],
    merges: list[tuple[str, str]],
    *,
    force_reference_order: bool = False,
) -> BPEEngine:
    """Build a `BPEEngine` that encodes exactly like the reference GPT-2 BPE.

    Args:
        encoder: token string (GPT-2's byte-to-unicode spelling) -> id, as in gpt2-vocab.json.
        merges: the (left, right) symbol pairs of the merges file, in priority order.
        force_reference_order: always merge in the reference's own order (min-rank pair, all
            occurrences left to right) instead of the equivalent O(n log n) merge. For tests.

    Tokens that are neither a single byte nor the result of a merge (e.g. <|endoftext|>) get
    empty bytes, so encode never emits them. Merges that can never apply (an input is not
    producible from bytes by merges) are dropped; the others keep their order. Raises
    ValueError if two tokens share an id, a byte symbol is missing from the vocabulary, a merge
    symbol is empty, or an applicable merge has a symbol the vocabulary lacks.
    """
    return engine_from_data(
        native_engine_data(encoder, merges), force_reference_order=force_reference_order
    )


def native_engine_data(
    encoder: dict[str, int], merges: list[tuple[str, str]]
) -> tuple[list[bytes], list[tuple[int, int, int]], list[int]]:
    """The plain data `BPEEngine` is built from (token bytes, merge id triples, byte ids): the
    costly part of `build_native_engine` (0.1-0.2 s for GPT-2's 50k merges), worth keeping when
    the same files make several engines. Raises ValueError as `build_native_engine` does."""
    with _gc_paused():  # ~200k short-lived objects: spare the collector's full passes
        return _engine_data(encoder, merges)


def engine_from_data(
    data: tuple[list[bytes], list[tuple[int, int, int]], list[int]],
    *,
    force_reference_order: bool = False,
) -> BPEEngine:
    """A new `BPEEngine` (with its own, empty word cache) from `native_engine_data`'s output."""
    token_bytes, merge_ids, byte_ids = data
    ranges = unicode_class_ranges()
    return BPEEngine(
        token_bytes,
        merge_ids,
        byte_ids,
        ranges["letter"],
        ranges["number"],
        ranges["space"],
        force_reference_order=force_reference_order,
    )


def _applicable_merges(lefts: list[str], rights: list[str], producible: set[str]) -> list[int]:
    """Indices of the merges whose inputs can be produced from `producible` (the bytes)."""
    applicable = [False] * len(lefts)
    changed = True
    while changed:
        changed = False
        for index, (left, right) in enumerate(zip(lefts, rights)):
            if not applicable[index] and left in producible and right in producible:
                applicable[index] = changed = True
                producible.add(left + right)
    return [index for index, ok in enumerate(applicable) if ok]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block (restoring its prior state)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _engine_data(
    encoder: dict[str, int], merges: list[tuple[str, str]]
) -> tuple[list[bytes], list[tuple[int, int, int]], list[int]]:
    """token_bytes, merge id triples and byte ids for `BPEEngine` (see build_native_engine)."""
    byte_encoder = bytes_to_unicode()
    byte_symbols = [byte_encoder[b] for b in range(256)]
    ids = list(encoder.values())
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError("vocabulary ids must be unique non-negative ints")
    missing = [b for b, symbol in enumerate(byte_symbols) if symbol not in encoder]
    if missing:
        raise ValueError(f"vocabulary lacks the symbols of bytes {missing[:8]}")
    byte_ids = [encoder[symbol] for symbol in byte_symbols]

    # Everything below runs at C speed (map/zip/set) for the 50k GPT-2 merges.
    lefts, rights = (list(side) for side in zip(*merges)) if merges else ([], [])
    if not (all(lefts) and all(rights)):
        raise ValueError("merge symbols must be non-empty")
    merged = list(map(operator.add, lefts, rights))
    # If every input is a byte symbol or some merge's result, every merge can apply (by
    # induction on length: a merge's inputs are shorter than its result). Otherwise keep only
    # the merges whose inputs can be produced, found by iterating to a fixpoint.
    produced = set(merged).union(byte_symbols)
    if not (produced.issuperset(lefts) and produced.issuperset(rights)):
        keep = _applicable_merges(lefts, rights, set(byte_symbols))
        lefts, rights, merged = ([side[i] for i in keep] for side in (lefts, rights, merged))
    try:
        merged_ids = list(map(encoder.__getitem__, merged))
        merge_ids = list(
            zip(map(encoder.__getitem__, lefts), map(encoder.__getitem__, rights), merged_ids)
        )
    except KeyError as error:
        raise ValueError(f"merge symbol {error.args[0]!r} is not in the vocabulary") from None

    # Raw bytes of the byte symbols and merge results: map every character back to its byte
    # value in one vectorized pass, then cut the result at the symbol boundaries.
    symbols = byte_symbols + merged
    byte_of_char = np.zeros(max(map(ord, byte_symbols)) + 1, dtype=np.uint8)
    byte_of_char[[ord(symbol) for symbol in byte_symbols]] = np.arange(256)
    chars = np.frombuffer("".join(symbols).encode("utf-32-le"), dtype=np.uint32)
    blob = byte_of_char[chars].tobytes()
    ends = list(itertools.accumulate(map(len, symbols)))
    pieces = map(blob.__getitem__, map(slice, [0, *ends[:-1]], ends))
    token_bytes = [b""] * (max(ids) + 1)
    collections.deque(map(token_bytes.__setitem__, byte_ids + merged_ids, pieces), maxlen=0)
    return token_bytes, merge_ids, byte_ids
