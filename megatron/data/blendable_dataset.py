"""Blending several datasets by weight: `--data-path 0.3 a_text_document 0.7 b_text_document`.

Sample i of the blend comes from the dataset whose share so far lags its weight the most
(the C++ helper `build_blending_indices`), so any prefix of the blend, not only the whole,
follows the weights to within a sample or two. Each dataset is asked for 0.5% more samples
than its share, as in Megatron, so the greedy order never runs out.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from megatron.data.cpp_helpers import load_helpers
from megatron.utils import is_rank_0

# Extra samples built per dataset beyond weight * total (Megatron's 1.005 factor).
SAMPLE_MARGIN = 1.005


def parse_data_path(
    data_path: list[str], flag: str = "--data-path"
) -> tuple[list[str], list[float]]:
    """Prefixes and normalized weights of `--data-path` (one prefix, or weight/prefix pairs);
    `flag` is the flag errors name (`--train-data-path` ... take the same form)."""
    if len(data_path) == 1:
        return [data_path[0]], [1.0]
    if len(data_path) == 0 or len(data_path) % 2:
        raise ValueError(
            f"{flag} takes one prefix or weight/prefix pairs (e.g. 0.3 a 0.7 b); "
            f"got {len(data_path)} values: {' '.join(data_path)}"
        )
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[0::2], data_path[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(
                f"{flag}: {weight!r} should be the weight of {prefix!r} (a number)"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag}: weight {weight} of {prefix!r} must be >= 0")
        weights.append(value)
        prefixes.append(prefix.strip())
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"{flag}: the weights add up to 0")
    return prefixes, [w / total for w in weights]


def samples_per_dataset(weights: list[float], num_samples: list[int]) -> list[list[int]]:
    """For each dataset, the samples to build for each split (weight share plus 0.5%)."""
    return [[int(math.ceil(n * w * SAMPLE_MARGIN)) for n in num_samples] for w in weights]


class BlendableDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: list, weights: list[float], size: int) -> None:
        if len(datasets) != len(weights) or not 0 < len(datasets) < 256:
            raise ValueError("blending needs between 1 and 255 datasets, one weight each")
        self.datasets = datasets
        self.size = size
        normalized = np.asarray(weights, dtype=np.float64)
        normalized /= normalized.sum()
        self.weights = normalized
        self.dataset_index = np.zeros(size, dtype=np.uint8)
        self.dataset_sample_index = np.zeros(size, dtype=np.int64)
        load_helpers().build_blending_indices(
            self.dataset_index,
            self.dataset_sample_index,
            normalized,
            len(datasets),
            size,
            is_rank_0(),
        )
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (count, dataset) in enumerate(zip(counts, datasets)):
            if count > len(dataset):
                raise ValueError(
                    f"blended dataset {d} must provide {count} samples but has {len(dataset)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """The sample at `idx` of the blend, from the dataset the blending index names."""
        dataset = self.datasets[self.dataset_index[idx]]
        return dataset[int(self.dataset_sample_index[idx])]
