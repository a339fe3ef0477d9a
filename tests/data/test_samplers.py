"""Resumable pretraining samplers and the DataLoader built on them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def _ranks(cls, total, consumed, micro, dp, **kwargs):
    return [list(cls(total, consumed, micro, rank, dp, **kwargs)) for rank in range(dp)]


# ------------------------------------------------------------------------ sequential sampler


@pytest.mark.parametrize(("total", "micro", "dp"), [(24, 2, 3), (50, 4, 2), (7, 1, 7), (9, 3, 1)])
def test_sequential_steps_cover_global_micro_batches(total, micro, dp):
    """At each step, the ranks' micro-batches joined in rank order are one global micro-batch."""
    per_rank = _ranks(MegatronPretrainingSampler, total, 0, micro, dp)
    steps = total // (micro * dp)
    assert all(len(batches) == steps for batches in per_rank)
    for step in range(steps):
        joined = list(itertools.chain.from_iterable(per_rank[r][step] for r in range(dp)))
        assert joined == list(range(step * micro * dp, (step + 1) * micro * dp))
        assert all(len(per_rank[r][step]) == micro for r in range(dp))


@pytest.mark.parametrize("accumulation", [1, 3])
def test_sequential_resume_continues_exactly(accumulation):
    """Resuming at any multiple of micro*dp (e.g. after k steps of accumulated micro-batches)
    yields exactly the remainder of the uninterrupted run on every rank."""
    total, micro, dp = 100, 3, 2
    full = _ranks(MegatronPretrainingSampler, total, 0, micro, dp)
    global_batch = micro * dp * accumulation
    for steps_done in range(0, total // global_batch):
        consumed = steps_done * global_batch
        resumed = _ranks(MegatronPretrainingSampler, total, consumed, micro, dp)
        skipped = consumed // (micro * dp)
        for rank in range(dp):
            assert resumed[rank] == full[rank][skipped:]


def test_sequential_drop_last_false_serves_the_tail():
    """drop_last=False adds the final partial global micro-batch, sliced by rank."""
    dropped = _ranks(MegatronPretrainingSampler, 11, 0, 2, 2)
    assert dropped == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    kept = _ranks(MegatronPretrainingSampler, 11, 0, 2, 2, drop_last=False)
    assert kept[0] == [[0, 1], [4, 5], [8, 9]]
    assert kept[1] == [[2, 3], [6, 7], [10]]
    # Resumed inside the tail's global micro-batch range, the tail is still served.
    kept = _ranks(MegatronPretrainingSampler, 11, 8, 2, 2, drop_last=False)
    assert kept == [[[8, 9]], [[10]]]
    assert _ranks(MegatronPretrainingSampler, 11, 8, 2, 2) == [[], []]
    assert len(MegatronPretrainingSampler(11, 0, 2, 0, 2)) == 11
    # A rank past the end of the partial batch gets no (empty) batch at all.
    assert _ranks(MegatronPretrainingSampler, 10, 0, 2, 2, drop_last=False)[1] == [[2, 3], [6, 7]]


def test_sampler_argument_errors():
    """Consumed >= total, bad ranks, sizes: ValueError with the reason."""
    with pytest.raises(ValueError, match="consumed_samples=10"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="consumed_samples=-1"):
        MegatronPretrainingSampler(10, -1, 2, 0, 1)
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="data-parallel rank"):
            MegatronPretrainingSampler(10, 0, 2, rank, size)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="no samples"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="data-parallel rank"):
        MegatronPretrainingRandomSampler(10, 0, 2, 3, 2)
    with pytest.raises(ValueError, match="global micro-batch"):
        MegatronPretrainingRandomSampler(5, 0, 2, 0, 3)


# ---------------------------------------------------------------------------- random sampler


@pytest.mark.parametrize(("total", "micro", "dp"), [(24, 2, 3), (27, 2, 3), (40, 4, 2)])
def test_random_epoch_covers_every_sample_once(total, micro, dp):
    """Across ranks an epoch uses each of the first total - total % (micro*dp) samples once."""
    per_rank = _ranks(MegatronPretrainingRandomSampler, total, 0, micro, dp)
    active = total - total % (micro * dp)
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(active))
    assert all(len(batch) == micro for batches in per_rank for batch in batches)
    assert len({len(batches) for batches in per_rank}) == 1
    # Not the sequential order.
    assert [i for batch in per_rank[0] for i in batch] != sorted(
        i for batch in per_rank[0] for i in batch
    )


def test_random_resume_mid_epoch_continues_same_order():
    """A sampler resumed at consumed = k * micro * dp continues the uninterrupted order."""
    total, micro, dp = 48, 2, 3
    full = _ranks(MegatronPretrainingRandomSampler, total, 0, micro, dp)
    for k in range(0, total // (micro * dp)):
        resumed = _ranks(MegatronPretrainingRandomSampler, total, k * micro * dp, micro, dp)
        for rank in range(dp):
            assert resumed[rank] == full[rank][k:]


def test_random_resume_must_be_whole_global_micro_batches():
    """A consumed count between global micro-batches is refused, not silently misaligned."""
    with pytest.raises(ValueError, match="not a whole number of global micro-batches"):
        list(MegatronPretrainingRandomSampler(48, 5, 2, 0, 3))


def test_random_new_epoch_reshuffles():
    """Iterating again starts the next epoch: same samples, another order, tracked in
    consumed_samples; a sampler resumed at that point gives the same second epoch."""
    total, micro, dp = 40, 2, 2
    samplers = [MegatronPretrainingRandomSampler(total, 0, micro, r, dp) for r in range(dp)]
    first = [list(s) for s in samplers]
    assert all(s.consumed_samples == total for s in samplers)
    second = [list(s) for s in samplers]
    for rank in range(dp):
        flat_first = [i for b in first[rank] for i in b]
        flat_second = [i for b in second[rank] for i in b]
        assert sorted(flat_first) == sorted(flat_second)
        assert flat_first != flat_second
    resumed = _ranks(MegatronPretrainingRandomSampler, total, total, micro, dp)
    assert resumed == second
    # Half-way into epoch 2.
    resumed = _ranks(MegatronPretrainingRandomSampler, total, total + 8, micro, dp)
    assert resumed == [batches[2:] for batches in second]


# -------------------------------------------------------------------------------- DataLoader


@pytest.fixture(scope="module")
def small_gpt_dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampler_data")
    prefix = str(folder / "toy_text_document")
    rng = np.random.default_rng(3)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(30):
        builder.add_item(rng.integers(0, 50257, size=int(rng.integers(1, 40))))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    indexed = IndexedDataset(prefix)
    return GPTDataset(
        "train",
        prefix,
        np.arange(30, dtype=np.int32),
        indexed,
        40,
        8,
        1,
        data_cache_path=str(folder),
    )


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_data_loader_batches(small_gpt_dataset, dataloader_type):
    """num_workers=0 loader: int64 tensors [micro, seq+1] holding the sampler's samples."""
    dataset = small_gpt_dataset
    loader = build_pretraining_data_loader(
        dataset, 8, 4, 1, 2, num_workers=0, dataloader_type=dataloader_type
    )
    sampler_cls = (
        MegatronPretrainingSampler
        if dataloader_type == "single"
        else MegatronPretrainingRandomSampler
    )
    expected = list(sampler_cls(len(dataset), 8, 4, 1, 2))
    batches = list(loader)
    assert len(batches) == len(expected) > 0
    for batch, indices in zip(batches, expected):
        text = batch["text"]
        assert isinstance(text, torch.Tensor)
        assert text.dtype == torch.int64
        assert tuple(text.shape) == (4, 9)
        for row, index in zip(text, indices):
            np.testing.assert_array_equal(row.numpy(), dataset[index]["text"])


def test_data_loader_errors(small_gpt_dataset):
    """No dataset gives no loader; an unknown --dataloader-type is a ValueError naming it."""
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None
    with pytest.raises(ValueError, match="--dataloader-type external"):
        build_pretraining_data_loader(
            small_gpt_dataset, 0, 4, 0, 1, num_workers=0, dataloader_type="external"
        )
