"""`--tokenizer-type NullTokenizer --vocab-size N`: Megatron-LM's tokenizer for synthetic data.

Text is token ids written as integers separated by spaces ("5 17 3"), so a corpus that is
already tokenized (or a benchmark with --mock-data) needs no vocabulary files. As Megatron-LM
today (megatron-core's `NullTokenizer` since 2026-04, commit c9dfe347): `vocab_size` is N and
end of document is N - 1, or `--null-tokenizer-eod-id`. (megatron-core 0.16 and older
Megatron-LM counted one more: N + 1 ids, end of document N.)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from megatron.tokenizer.base import checked_ids


class NullTokenizer:
    """Space-separated integer ids in, the same ids out; `eod` is `vocab_size - 1` by default."""

    def __init__(self, vocab_size: int | None, eod_id: int | None = None) -> None:
        if vocab_size is None or vocab_size < 1:
            raise ValueError(
                "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 1): the number of "
                f"token ids, end of document N - 1; got {vocab_size}"
            )
        self._vocab_size = int(vocab_size)
        self._eod = self._vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self._eod < self._vocab_size:
            raise ValueError(
                f"--null-tokenizer-eod-id {eod_id}: must be an id below --vocab-size {vocab_size}"
            )

    @property
    def vocab_size(self) -> int:
        """N, the --vocab-size (before padding)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The end-of-document id: --null-tokenizer-eod-id, else vocab_size - 1."""
        return self._eod

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Each id's decimal text to the id (a NullTokenizer's tokens are its ids)."""
        return {str(i): i for i in range(self._vocab_size)}

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Each id to its decimal text."""
        return {i: str(i) for i in range(self._vocab_size)}

    def tokenize(self, text: str) -> list[int]:
        """The integers of `text`; ValueError naming the first word that is not an id."""
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise ValueError(
                    f"NullTokenizer: {word[:40]!r} is not a token id (its text is integer ids "
                    "separated by spaces)"
                ) from None
        outside = next((i for i in ids if not 0 <= i < self._vocab_size), None)
        if outside is not None:
            raise ValueError(
                f"NullTokenizer: token id {outside} is outside --vocab-size {self._vocab_size} "
                f"(ids 0..{self._vocab_size - 1})"
            )
        return ids

    def tokenize_to_array(self, text: str) -> np.ndarray:
        """`tokenize` as an int32 numpy array (the preprocessing path)."""
        return np.asarray(self.tokenize(text), dtype=np.int32)

    def detokenize(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """The ids as decimal integers separated by single spaces."""
        return " ".join(map(str, checked_ids(token_ids, self._vocab_size)))
