"""GPT-2 byte-level BPE tokenizer with the token ids of the reference algorithm, in C++.

The vocabulary and merges files are the ones Megatron uses (`gpt2-vocab.json`,
`gpt2-merges.txt`). Encoding runs in the native engine (`megatron/tokenizer/bpe_engine.cpp`,
glue in `native_bpe.py`): GPT-2's pre-tokenization regex as a hand-written scanner, then
lowest-rank-first merges with a word cache, about 9x tiktoken's speed. The test suite checks
it against a pure-Python reference of GPT-2's encoder.py on varied text, real code and every
Unicode code point.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from megatron.tokenizer.base import TokenizerFileError
from megatron.tokenizer.byte_encoding import bytes_to_unicode
from megatron.tokenizer.native_bpe import engine_from_data, native_engine_data

END_OF_TEXT = "<|endoftext|>"
# Merges file lines after '#version': two non-empty symbols separated by one space.
_MERGES_BODY = re.compile(r"(?:[^ \n]+ [^ \n]+(?:\n|$))*")


def _load_vocab(vocab_file: str) -> dict[str, int]:
    if not os.path.isfile(vocab_file):
        raise TokenizerFileError(f"--vocab-file {vocab_file}: no such file")
    try:
        with open(vocab_file, encoding="utf-8") as stream:
            vocab = json.load(stream)
    except json.JSONDecodeError as error:
        raise TokenizerFileError(
            f"--vocab-file {vocab_file}:{error.lineno}: not a JSON vocabulary ({error.msg})"
        ) from None
    except UnicodeDecodeError:
        raise TokenizerFileError(f"--vocab-file {vocab_file}: not UTF-8 text") from None
    if not isinstance(vocab, dict) or not all(
        isinstance(v, int) and v >= 0 for v in vocab.values()
    ):
        raise TokenizerFileError(f"--vocab-file {vocab_file}: expected a {{token: id}} object")
    if len(set(vocab.values())) != len(vocab):
        raise TokenizerFileError(f"--vocab-file {vocab_file}: two tokens share an id")
    return vocab


def _load_merges(merges_file: str) -> list[tuple[str, str]]:
    """The (left, right) symbol pairs of the merges file, in priority order."""
    if not os.path.isfile(merges_file):
        raise TokenizerFileError(f"--merge-file {merges_file}: no such file")
    try:
        with open(merges_file, encoding="utf-8") as stream:
            lines = stream.read().split("\n")
    except UnicodeDecodeError:
        raise TokenizerFileError(f"--merge-file {merges_file}: not UTF-8 text") from None
    first = 1 if lines and lines[0].startswith("#version") else 0
    body = "\n".join(line for line in lines[first:] if line)
    if _MERGES_BODY.fullmatch(body):  # one C-speed check of every line
        return [tuple(line.split(" ")) for line in body.split("\n")] if body else []
    for line_number, line in enumerate(lines[first:], start=first + 1):
        parts = line.split(" ")
        if line and (len(parts) != 2 or not all(parts)):
            raise TokenizerFileError(
                f"--merge-file {merges_file}:{line_number}: expected two symbols separated "
                f"by one space, got {line[:80]!r}"  # a binary file's "line" can be huge
            )
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _CheckedFiles:
    """What a vocabulary and merges file pair gives every tokenizer built from it (read-only)."""

    encoder: dict[str, int]
    engine_data: tuple[list[bytes], list[tuple[int, int, int]], list[int]]
    token_bytes: list[bytes]


# Checked files by the (path, modification time, size, inode) of both: a process that builds the
# tokenizer again (evaluation, generation, a test's runs) reads and checks them once.
_CHECKED_FILES: dict[tuple, _CheckedFiles] = {}
_CHECKED_FILES_KEPT = 4


def _file_stamp(path: str) -> tuple | None:
    try:
        status = os.stat(path)
    except OSError:
        return None  # reported by the loaders, which name the flag
    return os.path.realpath(path), status.st_mtime_ns, status.st_size, status.st_ino


def _read_files(vocab_file: str, merge_file: str) -> _CheckedFiles:
    """The checked contents of both files, read once per process while they are unchanged."""
    key = (_file_stamp(vocab_file), _file_stamp(merge_file))
    if None not in key and key in _CHECKED_FILES:
        return _CHECKED_FILES[key]
    encoder = _load_vocab(vocab_file)
    if END_OF_TEXT not in encoder:
        raise TokenizerFileError(f"--vocab-file {vocab_file}: has no {END_OF_TEXT} token")
    merges = _load_merges(merge_file)
    _check_files(encoder, merges, vocab_file, merge_file)
    files = _CheckedFiles(encoder, native_engine_data(encoder, merges), _decoding_table(encoder))
    if None not in key:
        while len(_CHECKED_FILES) >= _CHECKED_FILES_KEPT:
            del _CHECKED_FILES[next(iter(_CHECKED_FILES))]
        _CHECKED_FILES[key] = files
    return files


def _check_files(
    vocab: dict[str, int], merges: list[tuple[str, str]], vocab_file: str, merge_file: str
) -> None:
    """All 256 byte symbols exist and every merge uses known symbols (errors name lines)."""
    for byte, symbol in bytes_to_unicode().items():
        if symbol not in vocab:
            raise TokenizerFileError(
                f"--vocab-file {vocab_file}: byte {byte} (symbol {symbol!r}) is missing; "
                "a byte-level BPE vocabulary needs all 256 byte symbols"
            )
    if all(left + right in vocab and left in vocab and right in vocab for left, right in merges):
        return
    for index, (left, right) in enumerate(merges):
        for symbol in (left, right, left + right):
            if symbol not in vocab:
                raise TokenizerFileError(
                    f"--merge-file {merge_file}:{index + 2}: symbol {symbol!r} is not "
                    f"in --vocab-file {vocab_file}"
                )


def _decoding_table(encoder: dict[str, int]) -> list[bytes]:
    """The bytes of every id (tokens outside the byte map, if any, as their UTF-8)."""
    to_byte_values = {ord(char): byte for byte, char in bytes_to_unicode().items()}
    table = [b""] * (max(encoder.values()) + 1)
    for token, token_id in encoder.items():
        spelled = token.translate(to_byte_values)
        try:
            table[token_id] = spelled.encode("latin-1")
        except UnicodeEncodeError:
            table[token_id] = token.encode("utf-8")
    return table


class GPT2BPETokenizer:
    """Megatron's GPT-2 tokenizer API (`tokenize`, `detokenize`, `vocab`, `eod`, ...)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.vocab_file, self.merge_file = vocab_file, merge_file
        files = _read_files(vocab_file, merge_file)
        self.encoder = dict(files.encoder)
        self.decoder = {token_id: token for token, token_id in self.encoder.items()}
        self.eod_id = self.encoder[END_OF_TEXT]
        self._engine = engine_from_data(files.engine_data)
        self._token_bytes = files.token_bytes
        # GPT-2's ids are 0..N-1: then a min/max check replaces a lookup per id when decoding.
        self._contiguous_ids = len(self._token_bytes) == len(self.encoder)

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary file (before padding)."""
        return len(self.encoder)

    @property
    def vocab(self) -> dict[str, int]:
        """Token string (in GPT-2's byte-to-unicode spelling) to id."""
        return self.encoder

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token string."""
        return self.decoder

    @property
    def eod(self) -> int:
        """Id of <|endoftext|>, appended after each document with --append-eod."""
        return self.eod_id

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`; '<|endoftext|>' inside the text is ordinary text, as in Megatron."""
        return self._engine.encode(text).tolist()

    def tokenize_to_array(self, text: str) -> np.ndarray:
        """`tokenize` as an int32 numpy array, without building a Python list (the fast path)."""
        return self._engine.encode(text)

    def detokenize(self, token_ids: list[int] | np.ndarray) -> str:
        """Text of the ids; byte sequences that are not valid UTF-8 become U+FFFD."""
        ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
        if ids and (
            min(ids) < 0
            or max(ids) >= len(self._token_bytes)
            or not self._contiguous_ids
            and any(i not in self.decoder for i in ids)
        ):
            unknown = next(i for i in ids if i not in self.decoder)
            raise ValueError(
                f"token id {unknown} is not in the vocabulary ({self.vocab_size} tokens); "
                "ids past it are padding rows of the embedding"
            )
        return b"".join(map(self._token_bytes.__getitem__, ids)).decode("utf-8", "replace")
