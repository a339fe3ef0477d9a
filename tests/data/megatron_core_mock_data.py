"""Oracle script (run with megatron-core 0.16.1 as `megatron`): its MockGPTDataset's samples.

    python megatron_core_mock_data.py CASES.json OUT.npz

Each case holds vocab_size, eod, seq_length, seed, sizes (train/valid/test samples) and
`take` (how many samples of each split to write). OUT holds, for case c and each split, the
tokens + last label of its first `take` samples (`{c}_{split}_text`, shape
[take, seq_length + 1]) and its length (`{c}_{split}_len`), built through megatron-core's
BlendedMegatronDatasetBuilder with no blend (mock), as Megatron-LM's pretrain_gpt.py builds
them for --mock-data.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset


class StubTokenizer:
    """What the mock dataset reads of a tokenizer."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab_size, eod, -1
        self.unique_identifiers = {"class": "StubTokenizer"}


def main(cases_path: str, out_path: str) -> None:
    """Build every case's three mock splits and write their first samples."""
    with open(cases_path) as file:
        cases = json.load(file)
    arrays = {}
    for index, case in enumerate(cases):
        for key, value in mock_samples(case).items():
            arrays[f"{index}_{key}"] = value
    np.savez(out_path, **arrays)


def mock_samples(case: dict) -> dict[str, np.ndarray]:
    """The first samples and the length of each split of one case."""
    config = GPTDatasetConfig(
        random_seed=case["seed"],
        sequence_length=case["seq_length"],
        tokenizer=StubTokenizer(case["vocab_size"], case["eod"]),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    datasets = BlendedMegatronDatasetBuilder(
        MockGPTDataset, case["sizes"], lambda: True, config
    ).build()
    arrays = {}
    for name, dataset in zip(("train", "valid", "test"), datasets):
        samples = [dataset[i] for i in range(case["take"])]
        arrays[f"{name}_text"] = np.stack(
            [np.append(s["tokens"].numpy(), s["labels"].numpy()[-1]) for s in samples]
        )
        arrays[f"{name}_len"] = np.array(len(dataset))
    return arrays


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
