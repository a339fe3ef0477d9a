"""`--mock-data`: Megatron-LM's synthetic documents, so a run needs no dataset on disk.

The documents are megatron-core's `MockGPTLowLevelDataset`: 100,000 of them, document i of
length L_i drawn once from `numpy.random.default_rng(0).integers(1, 4096)` (the same for
every run and seed), holding the ids 1, 2, ..., L_i - 1 (modulo the vocabulary size) and then
the end-of-document id. As in megatron-core, the documents are split evenly into train,
validation and test ("1,1,1": --split is not read), and each split becomes GPT samples through
the same document, sample and shuffle indices as real data (`gpt_dataset.GPTDataset`), shuffled
by --seed: the tokens equal megatron-core's `MockGPTDataset`.
"""

from __future__ import annotations

import numpy as np

MOCK_DOCUMENTS = 100_000
"""megatron-core's `MockGPTLowLevelDataset.size`."""
MOCK_SEED = 0
"""megatron-core's `MockGPTLowLevelDataset.seed`: fixed, whatever --seed says."""
MOCK_MAX_LENGTH = 4096
"""megatron-core's `MockGPTLowLevelDataset.max_sequence_length` (lengths are below it)."""
MOCK_SPLIT = (1.0, 1.0, 1.0)
"""The split megatron-core's config sets for mock data."""


class MockDocuments:
    """The synthetic documents, read as an indexed dataset is (`sizes`, `get`)."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        if vocab_size < 1 or not 0 <= eod < vocab_size:
            raise ValueError(
                f"--mock-data needs an end-of-document id ({eod}) below the vocabulary size "
                f"({vocab_size})"
            )
        self.vocab_size = vocab_size
        self.eod = eod
        rng = np.random.default_rng(seed=MOCK_SEED)
        self.sizes = rng.integers(low=1, high=MOCK_MAX_LENGTH, size=MOCK_DOCUMENTS, dtype=np.int32)

    def __len__(self) -> int:
        return MOCK_DOCUMENTS

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document `idx` (to its end when length is None)."""
        size = int(self.sizes[idx])
        stop = size if length is None else offset + length
        positions = np.arange(offset, stop, dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == size - 1] = self.eod
        return tokens


def mock_split_bounds(num_documents: int = MOCK_DOCUMENTS) -> list[int]:
    """Document boundaries [0, a, b, n] of the even split, rounded as megatron-core rounds."""
    total = sum(MOCK_SPLIT)
    bookends = [0.0]
    for weight in MOCK_SPLIT:
        bookends.append(bookends[-1] + weight / total)
    return [int(round(bookend * float(num_documents))) for bookend in bookends]
