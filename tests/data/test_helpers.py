"""The compiled C++ helpers against plain Python/numpy reference implementations."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data.cpp_helpers import load_helpers

helpers = load_helpers()


def test_load_helpers_returns_the_module():
    """load_helpers() gives the compiled megatron.data.helpers with both builders."""
    module = load_helpers()
    assert module.__name__ == "megatron.data.helpers"
    assert module is helpers
    assert callable(module.build_sample_idx) and callable(module.build_blending_indices)


# ---------------------------------------------------------------------------- build_sample_idx


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Sample i starts at token i * seq_length of the stream sizes[doc_idx[0]], sizes[...]...

    Row i is (position k in doc_idx of the document holding that token, offset in it):
    consecutive samples overlap by one token, so the starts are exactly seq_length apart.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    ends = np.cumsum(sizes[doc_idx].astype(np.int64))
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - sizes[doc_idx[position]])
    return np.stack([position, offset], axis=1)


def _random_case(rng):
    num_documents = int(rng.integers(1, 30))
    # Plenty of 1-token documents, some long ones.
    sizes = np.where(
        rng.random(num_documents) < 0.3, 1, rng.integers(1, 200, size=num_documents)
    ).astype(np.int32)
    first = int(rng.integers(0, num_documents))
    documents = np.arange(first, int(rng.integers(first + 1, num_documents + 1)), dtype=np.int32)
    num_epochs = int(rng.integers(1, 5))
    doc_idx = np.tile(documents, num_epochs)
    rng.shuffle(doc_idx)
    tokens_per_epoch = int(sizes[documents].sum())
    seq_length = int(rng.integers(1, 65))
    return sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch


def test_build_sample_idx_matches_reference():
    """Random sizes (1-token documents too), seq lengths 1..64, 1..4 epochs, shuffled doc_idx."""
    rng = np.random.default_rng(1234)
    checked = 0
    for _ in range(400):
        sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch = _random_case(rng)
        if num_epochs * tokens_per_epoch < 2:
            continue  # no complete sample can be made
        result = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
        expected = reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
        num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
        assert result.dtype == np.int32
        assert result.shape == (num_samples + 1, 2)
        np.testing.assert_array_equal(result, expected)
        checked += 1
    assert checked > 350


def test_build_sample_idx_small_known_case():
    """A hand-worked case: docs of 3, 5, 2 tokens, seq_length 4."""
    sizes = np.array([3, 5, 2], dtype=np.int32)
    doc_idx = np.array([0, 1, 2], dtype=np.int32)
    # Stream positions 0, 4, 8: (doc 0, 0), (doc 1, 1), (doc 2, 0).
    result = helpers.build_sample_idx(sizes, doc_idx, 4, 1, 10)
    assert result.tolist() == [[0, 0], [1, 1], [2, 0]]
    # Sample ends on the last token of a document: the next starts on that same token.
    result = helpers.build_sample_idx(
        np.array([3, 3], np.int32), np.array([0, 1], np.int32), 2, 1, 6
    )
    assert result.tolist() == [[0, 0], [0, 2], [1, 1]]


def test_build_sample_idx_inconsistent_tokens_per_epoch_raises():
    """A tokens_per_epoch larger than sizes[doc_idx] holds is a ValueError, not a crash."""
    sizes = np.array([3, 5, 2], dtype=np.int32)
    doc_idx = np.array([0, 1, 2], dtype=np.int32)
    with pytest.raises(ValueError, match="tokens_per_epoch"):
        helpers.build_sample_idx(sizes, doc_idx, 4, 1, 100)
    with pytest.raises(ValueError, match="tokens_per_epoch"):
        helpers.build_sample_idx(sizes, doc_idx, 4, 3, 10)  # doc_idx holds one epoch only
    with pytest.raises(ValueError, match="document 7"):
        helpers.build_sample_idx(sizes, np.array([0, 7], np.int32), 4, 1, 10)
    with pytest.raises(ValueError, match="seq_length"):
        helpers.build_sample_idx(sizes, doc_idx, 0, 1, 10)
    with pytest.raises(ValueError, match="positive"):
        helpers.build_sample_idx(sizes, doc_idx, 4, 0, 10)
    with pytest.raises(ValueError, match="positive"):
        helpers.build_sample_idx(sizes, doc_idx, 4, 1, 0)


# ---------------------------------------------------------------------- build_blending_indices


def reference_blending(weights, size):
    """Megatron's greedy rule: take the dataset lagging its target the most (first on ties)."""
    current = [0] * len(weights)
    dataset_index, sample_index = [], []
    for sample in range(size):
        position = max(float(sample), 1.0)
        errors = [w * position - c for w, c in zip(weights, current)]
        best = errors.index(max(errors))
        dataset_index.append(best)
        sample_index.append(current[best])
        current[best] += 1
    return np.array(dataset_index, np.uint8), np.array(sample_index, np.int64)


def _blend(weights, size):
    dataset_index = np.zeros(size, dtype=np.uint8)
    sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        dataset_index, sample_index, np.asarray(weights, np.float64), len(weights), size, False
    )
    return dataset_index, sample_index


def test_build_blending_indices_matches_reference():
    """Random weights over 2-5 datasets: both output arrays equal the Python reference."""
    rng = np.random.default_rng(99)
    for _ in range(150):
        k = int(rng.integers(2, 6))
        weights = rng.random(k) ** 2 + 1e-3
        weights /= weights.sum()
        size = int(rng.integers(1, 700))
        dataset_index, sample_index = _blend(weights, size)
        expected_index, expected_sample = reference_blending(weights.tolist(), size)
        np.testing.assert_array_equal(dataset_index, expected_index)
        np.testing.assert_array_equal(sample_index, expected_sample)
        # Each dataset's samples are taken in order 0, 1, 2, ...
        for d in range(k):
            taken = sample_index[dataset_index == d]
            np.testing.assert_array_equal(taken, np.arange(len(taken)))


def test_build_blending_indices_known_values_and_verbose(capfd):
    """0.3/0.7 over 10 samples, and the verbose report of the achieved ratios."""
    dataset_index = np.zeros(10, dtype=np.uint8)
    sample_index = np.zeros(10, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, sample_index, np.array([0.3, 0.7]), 2, 10, True)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    out = capfd.readouterr().out
    assert "achieved: 0.3" in out and "achieved: 0.7" in out


def test_build_blending_indices_argument_checks():
    """Wrong dtypes are a TypeError (noconvert: no silent copy); bad sizes a ValueError."""
    weights = np.array([0.5, 0.5])
    with pytest.raises(TypeError):
        helpers.build_blending_indices(
            np.zeros(4, np.int64), np.zeros(4, np.int64), weights, 2, 4, False
        )
    with pytest.raises(TypeError):
        helpers.build_blending_indices(
            np.zeros(4, np.uint8), np.zeros(4, np.int32), weights, 2, 4, False
        )
    with pytest.raises(ValueError, match="sizes"):
        helpers.build_blending_indices(
            np.zeros(4, np.uint8), np.zeros(4, np.int64), weights, 2, 5, False
        )
    with pytest.raises(ValueError, match="sizes"):
        helpers.build_blending_indices(
            np.zeros(4, np.uint8), np.zeros(4, np.int64), weights, 3, 4, False
        )
    with pytest.raises(ValueError, match="255"):
        helpers.build_blending_indices(
            np.zeros(4, np.uint8), np.zeros(4, np.int64), weights, 0, 4, False
        )


def test_missing_extension_error_says_how_to_fix(monkeypatch):
    """When the compiled module cannot be imported, the error names the build command."""
    import importlib

    from megatron.data import cpp_helpers

    def fail(name):
        raise ImportError(f"No module named '{name}'")

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(cpp_helpers.HelpersNotBuiltError) as error:
        cpp_helpers.load_helpers()
    message = str(error.value)
    assert "megatron.data.helpers" in message and "pip install -e ." in message
    assert "g++" in message and "No module named" in message
