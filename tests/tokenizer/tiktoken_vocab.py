"""A small tiktoken JSON vocabulary (Megatron-LM's TikTokenizer format) for tests.

The 256 single bytes in order, then the tokens of GPT-2's first merges in merge order (so the
ranks are a real byte-level BPE), each as `{"rank", "token_bytes" (base64), "token_str"}`.
"""

from __future__ import annotations

import base64
import json

from megatron.tokenizer.byte_encoding import bytes_to_unicode
from tests.conftest import MERGE_FILE


def tiktoken_entries(num_tokens: int = 1000) -> list[dict]:
    """The first `num_tokens` entries: bytes 0..255, then GPT-2's merged tokens."""
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)
    with open(MERGE_FILE, encoding="utf-8") as merges:
        for line in merges:
            if line.startswith("#version") or not line.strip():
                continue
            left, right = line.split()
            token = bytes(decode[c] for c in left + right)
            if token not in seen:
                seen.add(token)
                tokens.append(token)
            if len(tokens) == num_tokens:
                break
    return [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode("ascii"),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for rank, token in enumerate(tokens)
    ]


def write_tiktoken_vocab(path: str, num_tokens: int = 1000) -> str:
    """Write `tiktoken_entries(num_tokens)` as JSON to `path`; returns `path`."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(tiktoken_entries(num_tokens), file)
    return path
