"""GPTDataset, its cached index mappings, splits, blending and the multi-rank cache build."""

from __future__ import annotations

import glob
import json
import os
import random
import re

import numpy as np
import pytest

from megatron.config import DataConfig
from megatron.data import gpt_dataset
from megatron.data.blendable_dataset import BlendableDataset, parse_data_path, samples_per_dataset
from megatron.data.gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    get_train_valid_test_split_,
    train_valid_test_num_samples,
)
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.distributed import run_distributed

WORDS = (
    "the model reads tokens while gradients flow backwards through attention layers and "
    "the optimizer steps; naïve café façade 東京 données Ωμέγα 🙂 x=42 def f(a, b): "
    "return a + b"
).split()


def _documents(seed: int, count: int) -> list[str]:
    """Texts of very different lengths, from one word up to a few hundred tokens."""
    rng = random.Random(seed)
    texts = ["Hello", "\n", "if x:\n    return [i ** 2 for i in range(10)]\n"]
    while len(texts) < count:
        length = rng.choice([1, 2, 5, 20, 60, 150])
        texts.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    return texts


def _build(prefix: str, texts: list[str], tokenizer) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for text in texts:
        builder.add_item(tokenizer.tokenize(text) + [tokenizer.eod])
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    """Two small tokenized datasets (40 and 30 documents) in a fresh folder."""
    folder = tmp_path_factory.mktemp("gpt_corpus")
    first = _build(str(folder / "alpha_text_document"), _documents(1, 40), tokenizer)
    second = _build(str(folder / "beta_text_document"), _documents(2, 30), tokenizer)
    return first, second


def _make(prefix, cache, num_samples=50, seq_length=16, seed=1234, documents=None, name="train"):
    indexed = IndexedDataset(prefix)
    if documents is None:
        documents = np.arange(len(indexed), dtype=np.int32)
    return GPTDataset(
        name, prefix, documents, indexed, num_samples, seq_length, seed, data_cache_path=str(cache)
    )


def _stream(dataset: GPTDataset) -> np.ndarray:
    """All tokens of the dataset's doc_idx order, concatenated."""
    return np.concatenate([dataset.indexed_dataset.get(int(d)) for d in dataset.doc_idx])


def _cache_files(folder) -> set[str]:
    return set(os.listdir(folder))


# ----------------------------------------------------------------------------------- splits


@pytest.mark.parametrize(
    ("split", "size", "expected"),
    [
        ("949,50,1", 1000, [0, 949, 999, 1000]),
        ("969, 30, 1", 1000, [0, 969, 999, 1000]),
        ("98,2,0", 100, [0, 98, 100, 100]),
        ("1", 17, [0, 17, 17, 17]),
        ("80/20", 10, [0, 8, 10, 10]),
        ("80/10/10", 10, [0, 8, 9, 10]),
        # Rounding leaves 9 of 10 documents: every boundary moves up by one.
        ("1,1,1", 10, [0, 4, 7, 10]),
        # Rounding gives 3 of 2 documents: every boundary moves down by one.
        ("1,1,1", 2, [0, 0, 1, 2]),
        # round(1.5) == 2 twice: 4 of 3 documents, the train split shrinks.
        ("1,1", 3, [0, 1, 3, 3]),
        ("0.5,0.5", 7, [0, 3, 7, 7]),
        ("949,50,1", 10, [0, 10, 10, 10]),
    ],
)
def test_split_boundaries(split, size, expected):
    """Document boundaries equal Megatron's, including its rounding-difference adjustment."""
    assert get_train_valid_test_split_(split, size) == expected


@pytest.mark.parametrize("split", ["abc", "1,2,3,4", "-1,1", "0,0,0", "", "1,,2"])
def test_split_errors_name_the_flag(split):
    """Unparseable or impossible --split values are a ValueError naming --split."""
    with pytest.raises(ValueError, match="--split"):
        get_train_valid_test_split_(split, 100)


@pytest.mark.parametrize("split", ["nan,1", "inf,1,1"])
def test_split_rejects_non_finite_weights(split):
    """nan/inf weights are refused with the --split message, like other bad weights."""
    with pytest.raises(ValueError, match="--split"):
        get_train_valid_test_split_(split, 100)


def test_train_valid_test_num_samples():
    """Sample counts from --train-iters or --train-samples, as Megatron computes them."""
    # 1000 iters * 8: evaluations = 1000 // 100 + 1 = 11, each 10 iters of 8 samples.
    assert train_valid_test_num_samples(8, 10, 100, train_iters=1000) == [8000, 880, 80]
    assert train_valid_test_num_samples(8, 10, 100, train_samples=8000) == [8000, 880, 80]
    # train_samples not a multiple of the batch: iters round down for the eval count.
    assert train_valid_test_num_samples(4, 3, 50, train_samples=399) == [399, 12 * 1 + 12, 12]
    assert train_valid_test_num_samples(2, 5, 7, train_iters=20) == [40, 30, 10]
    with pytest.raises(ValueError, match="--train-iters"):
        train_valid_test_num_samples(8, 10, 100)


# --------------------------------------------------------------------------------- samples


def test_samples_equal_the_token_stream(corpus, tmp_path):
    """Sample i is stream[j*S : j*S+S+1] with j = shuffle_idx[i], as int64, S+1 tokens."""
    prefix = corpus[0]
    seq_length = 16
    dataset = _make(prefix, tmp_path, num_samples=120, seq_length=seq_length)
    stream = _stream(dataset)
    assert len(dataset) >= 120
    assert len(dataset) == len(dataset.sample_idx) - 1 == len(dataset.shuffle_idx)
    assert sorted(dataset.shuffle_idx.tolist()) == list(range(len(dataset)))
    for i in range(len(dataset)):
        sample = dataset[i]["text"]
        j = int(dataset.shuffle_idx[i])
        assert sample.dtype == np.int64
        assert sample.shape == (seq_length + 1,)
        np.testing.assert_array_equal(
            sample, stream[j * seq_length : j * seq_length + seq_length + 1]
        )


def test_samples_with_seq_length_one_and_long(corpus, tmp_path):
    """Extreme sequence lengths (1 token, longer than most documents) also cut the stream."""
    for seq_length in (1, 300):
        dataset = _make(corpus[1], tmp_path, num_samples=30, seq_length=seq_length)
        stream = _stream(dataset)
        for i in range(len(dataset)):
            j = int(dataset.shuffle_idx[i])
            np.testing.assert_array_equal(
                dataset[i]["text"], stream[j * seq_length : (j + 1) * seq_length + 1]
            )


def _megatron_reference(documents, sizes, num_samples, seq_length, seed):
    """Megatron-LM's _build_index_mappings (doc_idx, shuffle_idx), written out in numpy."""
    tokens_per_epoch = int(sizes[documents].sum())
    num_epochs = 0
    while True:
        num_epochs += 1
        if (num_epochs * tokens_per_epoch - 1) // seq_length >= num_samples:
            break
    if num_epochs == 1:
        separate_last_epoch = False
    else:
        before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = num_samples - before_last < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed=seed)

    def doc_idx_for(epochs):
        block = np.mgrid[0:epochs, 0 : len(documents)][1]
        block[:] = documents
        block = block.reshape(-1).astype(np.int32)
        rng.shuffle(block)
        return block

    if separate_last_epoch:
        doc_idx = np.concatenate((doc_idx_for(num_epochs - 1), doc_idx_for(1)))
    else:
        doc_idx = doc_idx_for(num_epochs)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    first_count = before_last if separate_last_epoch else total
    first = np.arange(first_count, dtype=np.uint32)
    rng.shuffle(first)
    if first_count == total:
        return doc_idx, first
    last = np.arange(first_count, total, dtype=np.uint32)
    rng.shuffle(last)
    return doc_idx, np.concatenate((first, last))


@pytest.mark.parametrize(
    ("num_samples", "seq_length", "first_doc"),
    [(10, 8, 0), (200, 16, 5), (333, 7, 0), (20, 64, 30)],
)
def test_index_mappings_equal_megatron_reference(
    corpus, tmp_path, num_samples, seq_length, first_doc
):
    """doc_idx and shuffle_idx equal Megatron's algorithm replayed with the same RandomState."""
    indexed = IndexedDataset(corpus[0])
    documents = np.arange(first_doc, len(indexed), dtype=np.int32)
    dataset = _make(corpus[0], tmp_path, num_samples, seq_length, seed=77, documents=documents)
    doc_idx, shuffle_idx = _megatron_reference(
        documents, indexed.sizes, num_samples, seq_length, 77
    )
    assert dataset.doc_idx.dtype == np.int32
    assert dataset.shuffle_idx.dtype == np.uint32
    np.testing.assert_array_equal(dataset.doc_idx, doc_idx)
    np.testing.assert_array_equal(dataset.shuffle_idx, shuffle_idx)


# ------------------------------------------------------------------- separate last epoch rule


def _epoch_facts(prefix, seq_length):
    indexed = IndexedDataset(prefix)
    tokens = int(indexed.sizes.sum())
    return len(indexed), (tokens - 1) // seq_length, tokens


def test_last_epoch_kept_apart_when_barely_needed(corpus, tmp_path):
    """Needing < 80% of the last epoch: its documents and samples are shuffled on their own."""
    seq_length = 8
    num_docs, per_epoch, tokens = _epoch_facts(corpus[0], seq_length)
    num_samples = per_epoch + 1  # one sample into epoch 2
    dataset = _make(corpus[0], tmp_path, num_samples, seq_length)
    total = (2 * tokens - 1) // seq_length
    assert len(dataset) == total
    docs = list(range(num_docs))
    assert sorted(dataset.doc_idx[:num_docs].tolist()) == docs
    assert sorted(dataset.doc_idx[num_docs:].tolist()) == docs
    shuffle = dataset.shuffle_idx.tolist()
    assert sorted(shuffle[:per_epoch]) == list(range(per_epoch))
    assert sorted(shuffle[per_epoch:]) == list(range(per_epoch, total))
    assert min(shuffle[per_epoch:]) >= per_epoch


def test_last_epoch_kept_apart_over_three_epochs(corpus, tmp_path):
    """With 3 epochs the first two are shuffled together, the barely-used third apart."""
    seq_length = 8
    num_docs, _, tokens = _epoch_facts(corpus[1], seq_length)
    before_last = (2 * tokens - 1) // seq_length
    dataset = _make(corpus[1], tmp_path, before_last + 2, seq_length)
    first_block = dataset.doc_idx[: 2 * num_docs].tolist()
    assert sorted(first_block) == sorted(list(range(num_docs)) * 2)
    assert sorted(dataset.doc_idx[2 * num_docs :].tolist()) == list(range(num_docs))
    # Epochs 1 and 2 are mixed: some document appears twice within the first num_docs slots.
    assert len(set(first_block[:num_docs])) < num_docs
    assert sorted(dataset.shuffle_idx[:before_last].tolist()) == list(range(before_last))
    assert min(dataset.shuffle_idx[before_last:].tolist()) >= before_last


def test_last_epoch_shuffled_globally_when_mostly_needed(corpus, tmp_path):
    """Needing >= 80% of the last epoch: one global shuffle over all epochs' samples."""
    seq_length = 8
    num_docs, per_epoch, tokens = _epoch_facts(corpus[0], seq_length)
    num_samples = per_epoch + int(0.8 * per_epoch)
    dataset = _make(corpus[0], tmp_path, num_samples, seq_length)
    total = (2 * tokens - 1) // seq_length
    shuffle = dataset.shuffle_idx.tolist()
    assert sorted(shuffle) == list(range(total))
    # Later-epoch samples are spread over the front, earlier ones reach the back.
    assert max(shuffle[:per_epoch]) >= per_epoch
    assert min(shuffle[per_epoch:]) < per_epoch
    # The two epochs' documents are mixed in one shuffle.
    assert sorted(dataset.doc_idx.tolist()) == sorted(list(range(num_docs)) * 2)
    assert len(set(dataset.doc_idx[:num_docs].tolist())) < num_docs


# ---------------------------------------------------------------------------------- caching


def test_deterministic_across_cache_dirs(corpus, tmp_path):
    """Two builds in separate empty cache folders give identical arrays and samples."""
    one = _make(corpus[0], tmp_path / "one", num_samples=80)
    two = _make(corpus[0], tmp_path / "two", num_samples=80)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(one, name), getattr(two, name))
    for i in range(len(one)):
        np.testing.assert_array_equal(one[i]["text"], two[i]["text"])
    # A different seed gives a different order of the same samples.
    three = _make(corpus[0], tmp_path / "three", num_samples=80, seed=4321)
    assert three.shuffle_idx.tolist() != one.shuffle_idx.tolist()


def test_cache_files_and_reload_without_rebuild(corpus, tmp_path, monkeypatch):
    """The first build writes 3 arrays + description; the second loads them, building nothing."""
    cache = tmp_path / "cache"
    first = _make(corpus[0], cache, num_samples=60, seq_length=16, seed=5)
    files = sorted(_cache_files(cache))
    assert len(files) == 4
    stem = files[0][: -len("_description.json")]
    assert stem.startswith("alpha_text_document_train_indexmap_60ns_16sl_5s_")
    assert sorted(f[len(stem) :] for f in files) == [
        "_description.json",
        "_doc_idx.npy",
        "_sample_idx.npy",
        "_shuffle_idx.npy",
    ]
    description = json.loads((cache / f"{stem}_description.json").read_text())
    assert description["num_samples"] == 60
    assert description["seq_length"] == 16
    assert description["seed"] == 5
    assert description["split"] == "train"
    assert description["data_prefix"] == os.path.abspath(corpus[0])
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}

    def no_rebuild(*args, **kwargs):
        raise AssertionError("index mappings were rebuilt although they are cached")

    monkeypatch.setattr(gpt_dataset, "_build_arrays", no_rebuild)
    again = _make(corpus[0], cache, num_samples=60, seq_length=16, seed=5)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
    assert {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes
    np.testing.assert_array_equal(again[3]["text"], first[3]["text"])


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 6},
        {"seq_length": 17},
        {"num_samples": 61},
        {"documents": slice(0, 30)},
        {"name": "valid"},
    ],
    ids=["seed", "seq_length", "num_samples", "split", "name"],
)
def test_changed_parameters_do_not_reuse_cache(corpus, tmp_path, change):
    """Any change of split/seed/seq_length/num_samples writes new files with fresh arrays."""
    cache = tmp_path / "cache"
    base = {"num_samples": 60, "seq_length": 16, "seed": 5}
    _make(corpus[0], cache, **base)
    before = _cache_files(cache)
    params = dict(base)
    params.update(change)
    if "documents" in params:
        params["documents"] = np.arange(len(IndexedDataset(corpus[0])), dtype=np.int32)[
            params["documents"]
        ]
    changed = _make(corpus[0], cache, **params)
    after = _cache_files(cache)
    assert before < after and len(after - before) == 4
    fresh = _make(corpus[0], tmp_path / "fresh", **params)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(changed, name), getattr(fresh, name))


def test_default_cache_folder_is_beside_the_data(tokenizer, tmp_path):
    """Without data_cache_path the arrays are written next to the dataset files."""
    prefix = _build(str(tmp_path / "local_text_document"), _documents(3, 10), tokenizer)
    indexed = IndexedDataset(prefix)
    GPTDataset("train", prefix, np.arange(len(indexed), dtype=np.int32), indexed, 5, 8, 1)
    assert len(glob.glob(str(tmp_path / "local_text_document_train_indexmap_5ns_8sl_1s_*"))) == 4


def test_dataset_errors_name_the_prefix(tokenizer, tmp_path):
    """Too few tokens, no documents or documents out of range: ValueError naming the prefix."""
    prefix = str(tmp_path / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for tokens in ([5], [6, 7, 8]):
        builder.add_item(tokens)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    indexed = IndexedDataset(prefix)
    with pytest.raises(ValueError, match=f"{re.escape(prefix)}.*1 tokens"):
        GPTDataset("valid", prefix, np.array([0], np.int32), indexed, 1, 4, 1, str(tmp_path))
    with pytest.raises(ValueError, match=f"{re.escape(prefix)}.*no documents"):
        GPTDataset("test", prefix, np.array([], np.int32), indexed, 1, 4, 1, str(tmp_path))
    with pytest.raises(ValueError, match=f"{re.escape(prefix)}.*out of range"):
        GPTDataset("train", prefix, np.array([1, 2], np.int32), indexed, 1, 4, 1, str(tmp_path))
    # Two tokens are enough for one sample of seq_length 1.
    ok = GPTDataset("train", prefix, np.array([1], np.int32), indexed, 1, 1, 1, str(tmp_path))
    assert [ok[i]["text"].tolist() for i in range(len(ok))] in ([[6, 7], [7, 8]], [[7, 8], [6, 7]])


# -------------------------------------------------------------------- train/valid/test builds


def test_build_single_prefix(corpus, tmp_path):
    """One prefix: three GPTDatasets over their split's documents, each long enough."""
    config = DataConfig(
        data_path=[corpus[0]], seq_length=16, split="80,10,10", data_cache_path=str(tmp_path)
    )
    train, valid, test = build_train_valid_test_datasets(config, [100, 20, 5])
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset)
    assert len(train) >= 100 and len(valid) >= 20 and len(test) >= 5
    assert set(train.doc_idx.tolist()) == set(range(0, 32))
    assert set(valid.doc_idx.tolist()) == set(range(32, 36))
    assert set(test.doc_idx.tolist()) == set(range(36, 40))
    assert train[0]["text"].shape == (17,)
    # A split with no documents gives None.
    config = DataConfig(
        data_path=[corpus[0]], seq_length=16, split="100,0,0", data_cache_path=str(tmp_path)
    )
    train, valid, test = build_train_valid_test_datasets(config, [10, 10, 10])
    assert isinstance(train, GPTDataset) and valid is None and test is None


def test_build_blend(corpus, tmp_path):
    """0.3/0.7 blend: exact lengths, every prefix within one sample of the weights, and
    each blended sample equal to its underlying dataset's sample."""
    config = DataConfig(
        data_path=["0.3", corpus[0], "0.7", corpus[1]],
        seq_length=8,
        split="90,5,5",
        data_cache_path=str(tmp_path),
    )
    requested = [1500, 40, 10]
    datasets = build_train_valid_test_datasets(config, requested)
    weights = np.array([0.3, 0.7])
    for blend, size in zip(datasets, requested):
        assert isinstance(blend, BlendableDataset)
        assert len(blend) == size
        counts = np.cumsum(np.eye(2)[blend.dataset_index], axis=0)
        n = np.arange(1, size + 1)[:, None]
        assert np.all(np.abs(counts - weights * n) <= 1)
        for d in range(2):
            taken = blend.dataset_sample_index[blend.dataset_index == d]
            np.testing.assert_array_equal(taken, np.arange(len(taken)))
            assert len(taken) <= len(blend.datasets[d])
    train = datasets[0]
    assert train.datasets[0].indexed_dataset.path_prefix == corpus[0]
    assert train.datasets[1].indexed_dataset.path_prefix == corpus[1]
    for i in (0, 1, 2, 500, 1499):
        d, j = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        np.testing.assert_array_equal(train[i]["text"], train.datasets[d][j]["text"])
    # Each dataset was built with Megatron's 0.5% margin over its share.
    assert samples_per_dataset([0.3, 0.7], requested) == [[453, 13, 4], [1056, 29, 8]]


def test_blend_with_an_empty_split_is_an_error(corpus, tokenizer, tmp_path):
    """A split that is empty for one blended prefix only cannot be blended: ValueError."""
    small = _build(str(tmp_path / "small_text_document"), _documents(4, 2), tokenizer)
    config = DataConfig(
        data_path=["1", corpus[0], "1", small],
        seq_length=8,
        split="90,5,5",
        data_cache_path=str(tmp_path),
    )
    with pytest.raises(ValueError, match=f"--split.*valid.*{re.escape(small)}"):
        build_train_valid_test_datasets(config, [20, 4, 4])


def test_parse_data_path():
    """One prefix, or weight/prefix pairs normalized; bad values name --data-path."""
    assert parse_data_path(["a"]) == (["a"], [1.0])
    assert parse_data_path(["1", "a", "3", " b"]) == (["a", "b"], [0.25, 0.75])
    for bad in (
        ["0.3", "a", "0.7"],
        [],
        ["x", "a", "0.7", "b"],
        ["-1", "a", "2", "b"],
        ["0", "a", "0", "b"],
        ["nan", "a", "1", "b"],
    ):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)


# ------------------------------------------------------------------------------ distributed


def _distributed_build(rank, world_size, cache_dir, prefix, out_dir):
    """Both ranks open the same empty cache; only rank 0 may build, both get equal arrays."""
    import torch.distributed as dist

    if rank != 0:

        def forbidden(*args, **kwargs):
            raise AssertionError("rank 1 rebuilt the index mappings instead of waiting")

        gpt_dataset._build_arrays = forbidden
    indexed = IndexedDataset(prefix)
    dataset = GPTDataset(
        "train",
        prefix,
        np.arange(len(indexed), dtype=np.int32),
        indexed,
        70,
        12,
        99,
        data_cache_path=cache_dir,
    )
    arrays = {
        name: np.array(getattr(dataset, name)) for name in ("doc_idx", "sample_idx", "shuffle_idx")
    }
    gathered = [None] * world_size
    dist.all_gather_object(gathered, arrays)
    for other in gathered:
        for name, array in arrays.items():
            np.testing.assert_array_equal(other[name], array)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays, sample0=dataset[0]["text"])


def test_distributed_cache_build(corpus, tmp_path):
    """Two gloo ranks share one cache folder: rank 0 builds, rank 1 loads identical arrays."""
    cache = tmp_path / "cache"
    out = tmp_path / "out"
    out.mkdir()
    run_distributed(_distributed_build, 2, str(cache), corpus[0], str(out))
    assert len(glob.glob(str(cache / "alpha_text_document_train_indexmap_70ns_12sl_99s_*"))) == 4
    assert not glob.glob(str(cache / "*.partial-*"))
    ranks = [np.load(out / f"rank{r}.npz") for r in range(2)]
    single = _make(corpus[0], tmp_path / "single", num_samples=70, seq_length=12, seed=99)
    for name in ("doc_idx", "sample_idx", "shuffle_idx", "sample0"):
        expected = single[0]["text"] if name == "sample0" else getattr(single, name)
        for data in ranks:
            np.testing.assert_array_equal(data[name], expected)


def test_more_documents_than_32_bit_ids_is_an_error_naming_the_limit(monkeypatch):
    """The split code and the index helpers hold int32 document ids: 2^31 or more sequences in
    one dataset is a clear error, not a wrapped index ("test documents out of range")."""

    class Huge:
        def __len__(self) -> int:
            return 2**31

    monkeypatch.setattr(gpt_dataset, "make_dataset", lambda *args, **kwargs: Huge())
    config = DataConfig(data_path=["huge"], seq_length=8)
    with pytest.raises(ValueError, match=r"huge: 2,147,483,648 sequences, more than the "):
        gpt_dataset._build_splits("huge", config, [1, 1, 1], None)
