"""`--tokenizer-type TikTokenizer`: Megatron-LM's tiktoken tokenizer, read as Megatron-LM reads it.

--tokenizer-model is a JSON list of `{"rank": i, "token_bytes": base64, "token_str": ...}`
(the first 256 entries the single bytes 0..255, in order). Ids are Megatron-LM's: the special
tokens come first (`--tokenizer-special-tokens`, by default `<unk> <s> </s> <mask> <pad> <cls>
<sep>`, filled up to `--tiktoken-num-special-tokens` (1000) with `<SPECIAL_i>`), then entry i
of the file is id i + num_special_tokens. `--vocab-size` (default 2**17) is the whole size: the
file is cut to its first vocab_size - num_special_tokens entries, and must hold that many.
Text is split by `--tiktoken-pattern` v1 or v2 (the default), special-token text in the input
becomes that special token, and end of document is `</s>`. Encoding runs in the `tiktoken`
package (an optional dependency: pip install tiktoken).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

from megatron.extensions import install_hint
from megatron.tokenizer.base import TokenizerFileError, checked_ids

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
"""megatron-core's `_PATTERN_TIKTOKEN_V1` and `_PATTERN_TIKTOKEN_V2`."""
DEFAULT_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
"""The special tokens every TikTokenizer has (its first ids unless reordered)."""
PIP_HINT = install_hint("tiktoken", "tiktoken")


def _import_tiktoken() -> Any:
    try:
        import tiktoken
    except ImportError:
        raise ImportError(f"--tokenizer-type TikTokenizer needs tiktoken: {PIP_HINT}") from None
    return tiktoken


def special_token_list(special_tokens: Sequence[str] | None, num_special_tokens: int) -> list[str]:
    """The special tokens in id order, filled with `<SPECIAL_i>`; ValueError naming the flags."""
    tokens = list(special_tokens) if special_tokens else list(SPECIAL_TOKENS)
    flag = "--tokenizer-special-tokens"
    if len(set(tokens)) != len(tokens):
        repeated = next(t for t in tokens if tokens.count(t) > 1)
        raise ValueError(f"{flag}: {repeated} is given twice; special tokens must be unique")
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise ValueError(
            f"{flag}: TikTokenizer needs {' '.join(SPECIAL_TOKENS)}; missing {missing}"
        )
    if len(tokens) > num_special_tokens:
        raise ValueError(
            f"{flag}: {len(tokens)} tokens do not fit in --tiktoken-num-special-tokens "
            f"{num_special_tokens}"
        )
    filler = [f"<SPECIAL_{i}>" for i in range(len(tokens), num_special_tokens)]
    clash = next((t for t in filler if t in tokens), None)
    if clash is not None:
        raise ValueError(f"{flag}: {clash} is also the name of a filler special token")
    return tokens + filler


def read_mergeable_ranks(path: str, count: int, offset: int) -> dict[bytes, int]:
    """The first `count` tokens of a tiktoken JSON vocabulary, token i at id i + `offset`.

    TokenizerFileError names the file and the entry for anything megatron-core asserts on.
    """
    flag = f"--tokenizer-model {path}"
    if not os.path.isfile(path):
        raise TokenizerFileError(f"{flag}: no such file")
    if not path.endswith(".json"):
        raise TokenizerFileError(
            f"{flag}: TikTokenizer reads a tiktoken JSON vocabulary (a .json file)"
        )
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file)
    except (ValueError, UnicodeDecodeError) as error:
        raise TokenizerFileError(f"{flag}: not JSON ({error})") from None
    if not isinstance(entries, list):
        raise TokenizerFileError(
            f"{flag}: expected a JSON list of {{rank, token_bytes, token_str}} entries"
        )
    if len(entries) < count:
        raise TokenizerFileError(
            f"{flag}: {len(entries)} tokens, fewer than --vocab-size minus "
            f"--tiktoken-num-special-tokens = {count}; pass --vocab-size "
            f"{len(entries) + offset} (its tokens plus the {offset} special tokens)"
        )
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:count]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
            raise TokenizerFileError(
                f"{flag}: entry {i} is not {{rank, token_bytes, token_str}}: {str(entry)[:80]}"
            )
        if entry["rank"] != i:
            raise TokenizerFileError(f"{flag}: entry {i} has rank {entry['rank']}, expected {i}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise TokenizerFileError(f"{flag}: entry {i}: token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise TokenizerFileError(f"{flag}: entry {i} must be the single byte {i}")
        if token in ranks:
            raise TokenizerFileError(
                f"{flag}: entry {i} repeats the token of entry {ranks[token] - offset}"
            )
        ranks[token] = i + offset
    return ranks


class TikTokenizer:
    """Megatron-LM's TikTokenizer: special tokens first, the file's BPE tokens after them."""

    def __init__(
        self,
        tokenizer_model: str,
        pattern: str | None = None,
        vocab_size: int | None = None,
        num_special_tokens: int | None = None,
        special_tokens: Sequence[str] | None = None,
    ) -> None:
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern}: choose v1 or v2")
        vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        if num_special_tokens is None:
            num_special_tokens = DEFAULT_NUM_SPECIAL_TOKENS
        if not 0 <= num_special_tokens < vocab_size:
            raise ValueError(
                f"--tiktoken-num-special-tokens {num_special_tokens} must be at least 0 and below "
                f"--vocab-size {vocab_size}"
            )
        self.special_tokens = special_token_list(special_tokens, num_special_tokens)
        tiktoken = _import_tiktoken()
        self.num_special_tokens = num_special_tokens
        self._vocab_size = vocab_size
        ranks = read_mergeable_ranks(
            tokenizer_model, vocab_size - num_special_tokens, num_special_tokens
        )
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(tokenizer_model))),
            pat_str=PATTERNS[pattern],
            mergeable_ranks=ranks,
            special_tokens={token: i for i, token in enumerate(self.special_tokens)},
        )
        named = {token: self.special_tokens.index(token) for token in SPECIAL_TOKENS}
        self.unk_id, self.bos_id, self.eos_id = named["<unk>"], named["<s>"], named["</s>"]
        self.mask_id, self.pad_id = named["<mask>"], named["<pad>"]
        self.cls_id, self.sep_id = named["<cls>"], named["<sep>"]

    @property
    def vocab_size(self) -> int:
        """--vocab-size: the special tokens and the file's tokens (before padding)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The id of `</s>`, the end-of-document token."""
        return self.eos_id

    @property
    def eos(self) -> int:
        """The id of `</s>`."""
        return self.eos_id

    @property
    def bos(self) -> int:
        """The id of `<s>`."""
        return self.bos_id

    @property
    def pad(self) -> int:
        """The id of `<pad>`."""
        return self.pad_id

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token text (a token's bytes decoded as UTF-8, invalid bytes replaced)."""
        tokens = dict(enumerate(self.special_tokens))
        for token_id in range(self.num_special_tokens, self._vocab_size):
            token = self.encoding.decode_single_token_bytes(token_id)
            tokens[token_id] = token.decode("utf-8", errors="replace")
        return tokens

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Token text to id (of tokens whose bytes share a text, the highest id)."""
        return {token: token_id for token_id, token in self.inv_vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        """Megatron-LM's `text_to_ids`: special-token text in `text` becomes that token."""
        return self.encoding.encode(text, allowed_special="all")

    def tokenize_to_array(self, text: str) -> np.ndarray:
        """`tokenize` as an int32 numpy array (the preprocessing path)."""
        return np.asarray(self.tokenize(text), dtype=np.int32)

    def detokenize(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """The text of the ids, special tokens included (invalid UTF-8 replaced)."""
        return self.encoding.decode(checked_ids(token_ids, self._vocab_size))
