"""What every tokenizer offers the rest of the code, and the error for unusable tokenizer files.

Training reads `vocab_size` and `eod`; `tools/preprocess_data.py` calls `tokenize_to_array`;
`tools/generate_samples_gpt.py` calls `tokenize` and `detokenize`. The Megatron names `vocab`
and `inv_vocab` are there too. Each family adds its own special-token ids (`bos`, `eos`,
`pad`, ...) under Megatron's names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

# The --tokenizer-type values that read --tokenizer-model, and what that file is.
MODEL_FILE_TOKENIZERS = {
    "SentencePieceTokenizer": "a SentencePiece .model file",
    "GPTSentencePieceTokenizer": "a SentencePiece .model file",
    "Llama2Tokenizer": "a SentencePiece .model file",
    "HFTokenizer": "a Hugging Face tokenizer folder or tokenizer.json file",
    "TikTokenizer": "a tiktoken JSON vocabulary, as Megatron-LM's TikTokenizer reads it",
}


def missing_tokenizer_model(tokenizer_type: str, tokenizer_model: str | None) -> str | None:
    """The one-line problem when a type that reads --tokenizer-model is given none, else None."""
    if tokenizer_type in MODEL_FILE_TOKENIZERS and not tokenizer_model:
        return (
            f"--tokenizer-type {tokenizer_type} needs --tokenizer-model "
            f"({MODEL_FILE_TOKENIZERS[tokenizer_type]})"
        )
    return None


class TokenizerFileError(ValueError):
    """A tokenizer file cannot be used; the message names its flag and the file (and line)."""


@runtime_checkable
class Tokenizer(Protocol):
    """The tokenizer interface of `build_tokenizer`'s result (Megatron's names)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (before padding); every id the tokenizer emits is below it."""

    @property
    def eod(self) -> int:
        """The end-of-document id, appended after each document with --append-eod."""

    @property
    def vocab(self) -> dict[str, int]:
        """Token string to id."""

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token string."""

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`."""

    def tokenize_to_array(self, text: str) -> np.ndarray:
        """`tokenize` as an int32 numpy array (the preprocessing path)."""

    def detokenize(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """Text of the ids."""


def checked_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> list[int]:
    """`token_ids` as a list of ints, or ValueError naming the first id outside the vocabulary."""
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        unknown = next(i for i in ids if not 0 <= i < vocab_size)
        raise ValueError(
            f"token id {unknown} is not in the vocabulary ({vocab_size} tokens); "
            "ids past it are padding rows of the embedding"
        )
    return ids
