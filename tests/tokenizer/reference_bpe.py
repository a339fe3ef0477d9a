"""A small pure-Python GPT-2 byte-level BPE: the oracle our fast tokenizer is tested against.

It follows the published GPT-2 algorithm step by step, the way Megatron-LM's
``gpt2_tokenization.py`` does: map UTF-8 bytes to printable unicode characters, split the
text with GPT-2's pre-tokenization regex, then merge each word's symbols pair by pair,
always taking the pair with the lowest rank in the merges file, with a per-word cache.
It is deliberately simple and slow; the benchmark also uses it as the Megatron-style
baseline.
"""

from __future__ import annotations

import json

import regex

# GPT-2's pre-tokenization pattern, as published with the model.
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def bytes_to_unicode() -> dict[int, str]:
    """Map every byte to a printable unicode character (GPT-2's reversible byte encoding)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_values = printable[:]
    code_points = printable[:]
    shift = 0
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            code_points.append(256 + shift)
            shift += 1
    return {b: chr(c) for b, c in zip(byte_values, code_points)}


class ReferenceGPT2BPE:
    """The reference GPT-2 tokenizer: correct by construction, not fast."""

    def __init__(self, vocab_file: str, merges_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        with open(merges_file, encoding="utf-8") as f:
            # First line is '#version: 0.2'; the file ends with a newline.
            lines = f.read().split("\n")[1:-1]
        self.bpe_ranks = {tuple(line.split()): rank for rank, line in enumerate(lines)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self.cache: dict[str, str] = {}

    def bpe(self, word: str) -> str:
        """Merge one pre-tokenized word; returns its BPE symbols joined by spaces."""
        if word in self.cache:
            return self.cache[word]
        symbols = list(word)
        while len(symbols) > 1:
            pairs = {(symbols[i], symbols[i + 1]) for i in range(len(symbols) - 1)}
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if best not in self.bpe_ranks:
                break
            first, second = best
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i < len(symbols) - 1 and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        result = " ".join(symbols)
        self.cache[word] = result
        return result

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens in the text are treated as plain text."""
        ids: list[int] = []
        for word in self.pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder[symbol] for symbol in self.bpe(mapped).split(" "))
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; invalid UTF-8 sequences become U+FFFD, as in GPT-2."""
        text = "".join(self.decoder[i] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
