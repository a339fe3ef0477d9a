"""SFT loss masks: a second indexed dataset beside the tokens, one uint8 per token.

`tools/preprocess_data.py --sft` writes `{prefix}.bin/.idx` (the tokens, as any dataset) and
`{prefix}_loss_mask.bin/.idx` (`LOSS_MASK_SUFFIX`): an indexed dataset of dtype uint8 with the
same documents and sizes, 1 where the token is trained on as a label (an assistant's or a
response's token, and the end-of-document token that ends a conversation on a reply), else 0.
Any megatron-core `IndexedDataset` reads both.

Training reads the mask beside every `--data-path` prefix that has one (and, with `--sft`,
requires it): the GPT dataset cuts it into samples exactly as the tokens (same document,
sample and shuffle indices, which depend on the sizes alone, so SFT and plain runs share the
cached index files), and the batch trains only the labels whose mask is 1. A dataset without
a mask in a run whose other datasets have one is trained on every token
(`UnmaskedDocuments`), as pretraining text mixed into SFT data is.
"""

from __future__ import annotations

import numpy as np

from megatron.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    dataset_exists,
    index_file_path,
)
from megatron.utils import print_rank_0

LOSS_MASK_SUFFIX = "_loss_mask"
"""`{prefix}{LOSS_MASK_SUFFIX}` is the loss mask of the dataset at `{prefix}`."""
LOSS_MASK_DTYPE = np.dtype(np.uint8)


def loss_mask_prefix(prefix: str) -> str:
    """The prefix of the loss mask of the dataset at `prefix`."""
    return prefix + LOSS_MASK_SUFFIX


def has_loss_mask(prefix: str) -> bool:
    """Whether the dataset at `prefix` has a loss mask beside it."""
    return dataset_exists(loss_mask_prefix(prefix))


class UnmaskedDocuments:
    """All-ones loss masks of a dataset that has none (every token is trained on)."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Ones for tokens [offset, offset + length) of document `idx`."""
        stop = int(self.sizes[idx]) if length is None else offset + length
        return np.ones(stop - offset, dtype=LOSS_MASK_DTYPE)


def open_loss_mask(prefix: str, tokens: IndexedDataset) -> IndexedDataset:
    """The loss mask beside `prefix`, checked to match the tokens' documents and dtype."""
    mask_prefix = loss_mask_prefix(prefix)
    masks = IndexedDataset(mask_prefix)
    if masks.dtype != LOSS_MASK_DTYPE:
        raise IndexedDatasetError(
            f"{index_file_path(mask_prefix)}: a loss mask holds uint8, not {masks.dtype.name}"
        )
    if len(masks) != len(tokens) or not np.array_equal(masks.sizes, tokens.sizes):
        raise IndexedDatasetError(
            f"{index_file_path(mask_prefix)}: its {len(masks)} sequences do not have the sizes "
            f"of the {len(tokens)} in {index_file_path(prefix)}; write both with "
            "tools/preprocess_data.py --sft"
        )
    return masks


def loss_masks_of(
    prefix: str, tokens: IndexedDataset, required: bool
) -> IndexedDataset | UnmaskedDocuments:
    """The loss mask beside `prefix`; without one, all ones, or with `required` (--sft) an
    IndexedDatasetError naming the missing files."""
    if has_loss_mask(prefix):
        return open_loss_mask(prefix, tokens)
    if required:
        raise IndexedDatasetError(
            f"--sft: {prefix} has no loss mask beside it (need "
            f"{loss_mask_prefix(prefix)}.bin/.idx; write it with tools/preprocess_data.py --sft)"
        )
    print_rank_0(f" > {prefix}: no loss mask beside it; all of its tokens are trained on")
    return UnmaskedDocuments(tokens.sizes)
