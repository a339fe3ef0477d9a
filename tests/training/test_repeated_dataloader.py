"""--repeated-dataloader (Megatron-DeepSpeed's RepeatingLoader): the training samples are read
again from the first when they run out, and a resumed run reads what it would have read."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron.data.corpus_reader import InputError
from megatron.data.samplers import build_pretraining_data_loader
from megatron.training.training import repeated_train_iterator

SAMPLES, MICRO, DP = 10, 2, 2  # a pass is 2 global micro-batches of 4: samples 8 and 9 left out


class Numbers(torch.utils.data.Dataset):
    """Sample i is {"text": [i]}."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        return {"text": torch.tensor([index])}


def _stream(rank: int, consumed: int, count: int = 7) -> list[list[int]]:
    """The first `count` micro-batches (sample numbers) rank `rank` reads from `consumed` on."""

    def loader_from(start: int):  # noqa: ANN202 - a DataLoader
        return build_pretraining_data_loader(Numbers(), start, MICRO, rank, DP, num_workers=0)

    batches = repeated_train_iterator(loader_from, SAMPLES, MICRO * DP, consumed)
    return [batch["text"].flatten().tolist() for batch in itertools.islice(batches, count)]


def test_passes_start_again_from_the_first_sample() -> None:
    assert _stream(0, 0) == [[0, 1], [4, 5]] * 3 + [[0, 1]]
    assert _stream(1, 0) == [[2, 3], [6, 7]] * 3 + [[2, 3]]


@pytest.mark.parametrize("consumed", [4, 8, 12, 20])
def test_a_resumed_run_reads_what_the_straight_run_read(consumed: int) -> None:
    """`consumed` samples (global micro-batches of 4) into the straight run, past its passes."""
    for rank in range(DP):
        straight = _stream(rank, 0, 14)
        skipped = consumed // (MICRO * DP)
        assert _stream(rank, consumed) == straight[skipped : skipped + 7]


def test_fewer_samples_than_a_global_micro_batch_is_one_line() -> None:
    with pytest.raises(InputError, match="--repeated-dataloader: the training data has 3"):
        repeated_train_iterator(lambda start: [], 3, 4, 0)
