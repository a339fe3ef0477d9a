"""The data sources besides `--data-path`: `--mock-data` (checked against megatron-core 0.16.1's
MockGPTDataset) and the per-split `--train-data-path` / `--valid-data-path` / `--test-data-path`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron.config import DataConfig
from megatron.data.blendable_dataset import BlendableDataset, samples_per_dataset
from megatron.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.mock_dataset import MOCK_DOCUMENTS, MockDocuments, mock_split_bounds
from tests.conftest import run_oracle

ORACLE_SCRIPT = os.path.join(os.path.dirname(__file__), "megatron_core_mock_data.py")


def _mock_config(tmp_path=None, **overrides) -> DataConfig:
    fields = dict(
        data_path=None,
        mock_data=True,
        seq_length=64,
        seed=1234,
        split="99,1,0",  # not read: mock data is split 1,1,1
        vocab_size=1000,
        eod_token_id=999,
        data_cache_path=None if tmp_path is None else str(tmp_path),
    )
    return DataConfig(**{**fields, **overrides})


# ------------------------------------------------------------------------------- mock data


def test_mock_documents_are_megatron_cores() -> None:
    """Lengths from default_rng(0), ids 1..L-1 modulo the vocabulary, then end of document."""
    documents = MockDocuments(vocab_size=50, eod=7)
    expected_sizes = np.random.default_rng(0).integers(1, 4096, size=100_000, dtype=np.int32)
    np.testing.assert_array_equal(documents.sizes, expected_sizes)
    assert len(documents) == MOCK_DOCUMENTS and documents.sizes.dtype == np.int32
    for index in (0, 1, 99_999, int(np.argmin(documents.sizes))):
        size = int(documents.sizes[index])
        whole = np.concatenate([(np.arange(size - 1) + 1) % 50, [7]])
        np.testing.assert_array_equal(documents.get(index), whole)
        np.testing.assert_array_equal(documents.get(index, offset=size // 2), whole[size // 2 :])
        np.testing.assert_array_equal(documents.get(index, 1, length=size - 1), whole[1:])
    assert mock_split_bounds() == [0, 33333, 66667, 100000]


MOCK_CASES = [
    {"vocab_size": 1000, "eod": 999, "seq_length": 64, "seed": 1234},  # NullTokenizer 1000
    {"vocab_size": 50257, "eod": 50256, "seq_length": 128, "seed": 7},  # GPT-2
    {"vocab_size": 100, "eod": 0, "seq_length": 33, "seed": 99},  # ids wrap, eod 0
]


def test_mock_samples_equal_megatron_cores_mock_dataset(tmp_path) -> None:
    """The first samples and the length of every split equal megatron-core 0.16.1's
    MockGPTDataset built as Megatron-LM's pretrain_gpt.py builds it (no blend: mock)."""
    sizes, take = [48, 16, 8], 8
    cases = [{**case, "sizes": sizes, "take": take} for case in MOCK_CASES]
    cases_file, out_file = tmp_path / "cases.json", tmp_path / "out.npz"
    cases_file.write_text(json.dumps(cases))
    run_oracle(ORACLE_SCRIPT, str(cases_file), str(out_file))
    theirs = np.load(out_file)
    for index, case in enumerate(MOCK_CASES):
        config = _mock_config(
            vocab_size=case["vocab_size"],
            eod_token_id=case["eod"],
            seq_length=case["seq_length"],
            seed=case["seed"],
        )
        datasets = build_train_valid_test_datasets(config, sizes)
        for name, dataset in zip(("train", "valid", "test"), datasets):
            assert len(dataset) == int(theirs[f"{index}_{name}_len"]), (case, name)
            ours = np.stack([dataset[i]["text"] for i in range(take)])
            np.testing.assert_array_equal(ours, theirs[f"{index}_{name}_text"], err_msg=name)


def test_mock_data_needs_no_files_and_caches_only_in_the_cache_path(tmp_path) -> None:
    """Without --data-cache-path nothing is written; with it the index arrays are cached there
    and read back unchanged; --split is not read."""
    before = set(os.listdir(tmp_path))
    train, valid, test = build_train_valid_test_datasets(_mock_config(), [8, 4, 4])
    assert set(os.listdir(tmp_path)) == before
    assert (train.doc_idx.min(), train.doc_idx.max()) == (0, 33332)
    assert (valid.doc_idx.min(), valid.doc_idx.max()) == (33333, 66666)
    assert (test.doc_idx.min(), test.doc_idx.max()) == (66667, 99999)
    cached = build_train_valid_test_datasets(_mock_config(tmp_path), [8, 4, 4])
    assert any(name.startswith("mock_gpt_train_indexmap") for name in os.listdir(tmp_path))
    again = build_train_valid_test_datasets(_mock_config(tmp_path), [8, 4, 4])
    for first, second, third in zip((train, valid, test), cached, again):
        np.testing.assert_array_equal(first.shuffle_idx, second.shuffle_idx)
        np.testing.assert_array_equal(first[3]["text"], third[3]["text"])
    other_seed = build_train_valid_test_datasets(_mock_config(seed=5), [8, 4, 4])[0]
    assert not np.array_equal(other_seed.shuffle_idx, train.shuffle_idx)


def test_mock_data_needs_the_end_of_document_inside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"--mock-data needs an end-of-document id \(5\)"):
        MockDocuments(vocab_size=5, eod=5)


# ---------------------------------------------------------------------- per-split data paths


def _dataset(path: str, documents: int, first_id: int) -> str:
    """`documents` documents of 3..12 ids counting up from `first_id`; the prefix."""
    builder = IndexedDatasetBuilder(path + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(first_id)
    for _ in range(documents):
        length = int(rng.integers(3, 13))
        builder.add_item(list(range(first_id, first_id + length)))
        builder.end_document()
    builder.finalize(path + ".idx")
    return path


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory) -> dict[str, str]:
    """Three small datasets whose ids tell them apart (100s, 200s, 300s)."""
    folder = tmp_path_factory.mktemp("per_split")
    return {
        name: _dataset(str(folder / name), documents, first)
        for name, documents, first in (("a", 30, 100), ("b", 12, 200), ("c", 9, 300))
    }


def _per_split_config(tmp_path, **paths) -> DataConfig:
    return DataConfig(
        data_path=None, seq_length=8, data_cache_path=str(tmp_path), vocab_size=400, **paths
    )


def test_each_split_is_the_whole_of_its_own_dataset(split_corpus, tmp_path) -> None:
    """--train-data-path a --valid-data-path b: every document of each, --split not read;
    the samples are a GPTDataset's over all documents, seeded as --data-path's."""
    config = _per_split_config(
        tmp_path, train_data_path=[split_corpus["a"]], valid_data_path=[split_corpus["b"]]
    )
    train, valid, test = build_train_valid_test_datasets(config, [40, 10, 5])
    assert test is None
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset)
    assert set(train.doc_idx.tolist()) == set(range(30))
    assert set(valid.doc_idx.tolist()) == set(range(12))
    assert len(train) >= 40 and len(valid) >= 10
    assert all(100 <= t < 200 for i in range(len(train)) for t in train[i]["text"])
    assert all(200 <= t < 300 for i in range(len(valid)) for t in valid[i]["text"])
    indexed = IndexedDataset(split_corpus["a"])
    direct = GPTDataset(
        "train", split_corpus["a"], np.arange(30, dtype=np.int32), indexed, 40, 8, 1234,
        data_cache_path=str(tmp_path / "direct"),
    )  # fmt: skip
    for i in (0, 7, 39):
        np.testing.assert_array_equal(train[i]["text"], direct[i]["text"])


def test_a_split_blends_its_datasets_by_weight(split_corpus, tmp_path) -> None:
    """--train-data-path 0.25 a 0.75 c: both whole, blended by weight with Megatron's margin."""
    config = _per_split_config(
        tmp_path,
        train_data_path=["0.25", split_corpus["a"], "0.75", split_corpus["c"]],
        test_data_path=[split_corpus["b"]],
    )
    train, valid, test = build_train_valid_test_datasets(config, [200, 0, 6])
    assert valid is None and isinstance(test, GPTDataset)
    assert isinstance(train, BlendableDataset) and len(train) == 200
    first, second = train.datasets
    assert set(first.doc_idx.tolist()) == set(range(30))
    assert set(second.doc_idx.tolist()) == set(range(9))
    counts = np.bincount(train.dataset_index, minlength=2)
    assert abs(counts[0] - 50) <= 1 and abs(counts[1] - 150) <= 1
    wanted = [n[0] for n in samples_per_dataset([0.25, 0.75], [200])]
    assert len(first) >= wanted[0] and len(second) >= wanted[1]
    for i in (0, 1, 2, 199):
        source = 100 if train.dataset_index[i] == 0 else 300
        assert all(source <= t < source + 100 for t in train[i]["text"])


def test_per_split_errors_name_their_flag(split_corpus, tmp_path) -> None:
    config = _per_split_config(
        tmp_path, train_data_path=[split_corpus["a"]], valid_data_path=["x", split_corpus["b"]]
    )
    with pytest.raises(ValueError, match="--valid-data-path: 'x' should be the weight"):
        build_train_valid_test_datasets(config, [10, 10, 0])
    with pytest.raises(ValueError, match="no data: give --data-path, --train-data-path"):
        build_train_valid_test_datasets(_per_split_config(tmp_path), [10, 10, 0])
