"""The flags of NullTokenizer and TikTokenizer, shared by pretrain_gpt.py's parser and the tools.

Megatron-LM spells and means them so: `--vocab-size` is read by those two types only (other
types take their vocabulary from their files, and accept the flag without effect, as
Megatron-LM does); the tiktoken flags are read by TikTokenizer only.
"""

from __future__ import annotations

import argparse

from megatron.tokenizer.tiktoken_tokenizer import DEFAULT_NUM_SPECIAL_TOKENS, PATTERNS


def add_vocabulary_flags(group: argparse._ArgumentGroup) -> None:
    """--vocab-size, --null-tokenizer-eod-id and TikTokenizer's flags, with Megatron-LM's
    names and defaults."""
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer: its number of token ids N (end of document N - 1); TikTokenizer: "
        "its whole vocabulary, special tokens included (default 131072). Other tokenizer types "
        "take the vocabulary from their files; given with them, it is the embedding's rows "
        "before padding (a published model's, at least the tokenizer's ids: fewer is refused).",
    )
    group.add_argument(
        "--null-tokenizer-eod-id",
        type=int,
        default=None,
        help="NullTokenizer's end-of-document id (default: --vocab-size minus 1).",
    )
    group.add_argument(
        "--tiktoken-pattern",
        choices=sorted(PATTERNS),
        default=None,
        help="TikTokenizer's pre-tokenizer regex, Megatron-LM's v1 or v2 (default v2).",
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=DEFAULT_NUM_SPECIAL_TOKENS,
        help="TikTokenizer's special-token ids, before the vocabulary file's tokens "
        "(default: %(default)s).",
    )
    group.add_argument(
        "--tokenizer-special-tokens",
        "--tiktoken-special-tokens",
        dest="tokenizer_special_tokens",
        nargs="+",
        default=None,
        help="TikTokenizer's named special tokens, in id order; they must include <unk> <s> "
        "</s> <mask> <pad> <cls> <sep> (the default list). --tiktoken-special-tokens is "
        "Megatron-LM's older spelling.",
    )
