"""The mmap `.bin`/`.idx` writer and reader: exact bytes, round trips, streaming and errors."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatron.data import indexed_dataset
from megatron.data.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    data_file_path,
    dataset_exists,
    index_file_path,
    make_dataset,
)

MAGIC = b"MMIDIDX\x00\x00"


def _write(prefix: str, documents: list[list[int]], dtype=np.uint16) -> str:
    """Write one sequence per document with add_item/end_document; returns the prefix."""
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    for document in documents:
        builder.add_item(np.asarray(document))
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix


def _expected_idx(code: int, sizes: list[int], itemsize: int, doc_idx: list[int]) -> bytes:
    """The .idx bytes assembled by hand from the documented layout."""
    pointers = np.concatenate(([0], np.cumsum(sizes)[:-1])) * itemsize if sizes else []
    return (
        MAGIC
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(sizes))
        + struct.pack("<Q", len(doc_idx))
        + struct.pack(f"<{len(sizes)}i", *sizes)
        + struct.pack(f"<{len(sizes)}q", *(int(p) for p in pointers))
        + struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    )


def _read(path: str) -> bytes:
    with open(path, "rb") as stream:
        return stream.read()


# ------------------------------------------------------------------------------ golden bytes


def test_golden_bytes_uint16(tmp_path):
    """Items, documents and a two-sentence document give exactly Megatron's .idx/.bin bytes."""
    prefix = str(tmp_path / "golden")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()
    builder.add_item(np.array([4, 5], dtype=np.int64))
    builder.end_document()
    builder.add_document([6, 7, 8, 9, 65535], lengths=[2, 3])
    builder.finalize(prefix + ".idx")

    idx = _read(prefix + ".idx")
    assert idx == _expected_idx(8, [3, 2, 2, 3], 2, [0, 1, 2, 4])
    # Spot-check the hand layout itself: header size 34, pointers in bytes.
    assert len(idx) == 34 + 4 * 12 + 4 * 8
    assert struct.unpack_from("<4q", idx, 34 + 16) == (0, 6, 10, 14)
    assert _read(prefix + ".bin") == struct.pack("<10H", 1, 2, 3, 4, 5, 6, 7, 8, 9, 65535)
    # Only the two output files are left: the spools are anonymous temporary files.
    assert sorted(os.listdir(tmp_path)) == ["golden.bin", "golden.idx"]


def test_golden_bytes_int32_and_empty(tmp_path):
    """int32 tokens (code 4, 4-byte pointers steps) and an empty dataset have exact bytes."""
    prefix = _write(str(tmp_path / "wide"), [[70000, 1], [2, 3, 100000]], dtype=np.int32)
    assert _read(prefix + ".idx") == _expected_idx(4, [2, 3], 4, [0, 1, 2])
    assert _read(prefix + ".bin") == struct.pack("<5i", 70000, 1, 2, 3, 100000)

    empty = _write(str(tmp_path / "empty"), [], dtype=np.uint16)
    assert _read(empty + ".idx") == _expected_idx(8, [], 2, [0])
    assert _read(empty + ".bin") == b""


# ------------------------------------------------------------------------------- round trips


def test_reader_round_trip(tmp_path):
    """The reader returns what was written: len, sizes, pointers, doc_idx, get, slices."""
    documents = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    prefix = _write(str(tmp_path / "rt"), documents)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 4
    assert dataset.dtype == np.uint16
    assert dataset.sizes.dtype == np.int32 and dataset.sizes.tolist() == [3, 1, 4, 2]
    assert dataset.pointers.dtype == np.int64 and dataset.pointers.tolist() == [0, 6, 8, 16]
    assert dataset.doc_idx.dtype == np.int64 and dataset.doc_idx.tolist() == [0, 1, 2, 3, 4]
    assert dataset.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert dataset.num_tokens == 10
    for i, document in enumerate(documents):
        assert dataset[i].dtype == np.uint16
        assert dataset[i].tolist() == document
        assert dataset.get(i).tolist() == document
    assert dataset[-1].tolist() == [13, 14]
    assert dataset.get(2, offset=1).tolist() == [10, 11, 12]
    assert dataset.get(2, offset=1, length=2).tolist() == [10, 11]
    assert dataset.get(2, length=0).tolist() == []
    assert dataset.get(np.int64(0), offset=np.int32(2), length=np.int64(1)).tolist() == [7]
    assert [a.tolist() for a in dataset[1:3]] == documents[1:3]
    assert [a.tolist() for a in dataset[::2]] == documents[::2]
    assert [a.tolist() for a in dataset[::-1]] == documents[::-1]
    assert dataset.exists(prefix) and dataset_exists(prefix)
    assert not dataset_exists(str(tmp_path / "nothing"))
    # Warm-up reading and Megatron-DeepSpeed's names give the same view.
    assert IndexedDataset(prefix, skip_warmup=False)[2].tolist() == documents[2]
    assert MMapIndexedDataset is IndexedDataset
    assert MMapIndexedDatasetBuilder is IndexedDatasetBuilder


def test_add_document_sentences(tmp_path):
    """add_document stores one sequence per sentence and one doc_idx entry per document."""
    prefix = str(tmp_path / "sent")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document([1, 2, 3, 4, 5, 6], lengths=[1, 2, 3])
    builder.add_document([7, 8], lengths=[2])
    builder.finalize(prefix + ".idx")
    dataset = IndexedDataset(prefix)
    assert dataset.sizes.tolist() == [1, 2, 3, 2]
    assert dataset.doc_idx.tolist() == [0, 3, 4]
    assert [a.tolist() for a in dataset] == [[1], [2, 3], [4, 5, 6], [7, 8]]
    assert (builder.num_sequences, builder.num_documents, builder.num_tokens) == (4, 2, 8)


def test_add_documents_batch_equals_one_by_one(tmp_path):
    """add_documents (the batch API) writes the same bytes as the per-document calls."""
    one = str(tmp_path / "one")
    builder = IndexedDatasetBuilder(one + ".bin", dtype=np.uint16)
    builder.add_document([1, 2, 3], lengths=[1, 2])
    builder.add_document([4], lengths=[1])
    builder.add_document([5, 6, 7, 8], lengths=[4])
    builder.finalize(one + ".idx")

    batch = str(tmp_path / "batch")
    builder = IndexedDatasetBuilder(batch + ".bin", dtype=np.uint16)
    builder.add_documents(
        [np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8])],
        sequence_lengths=[1, 2, 1, 4],
        sequences_per_document=[2, 1, 1],
    )
    builder.add_documents([], [], [])  # an empty batch changes nothing
    builder.finalize(batch + ".idx")
    assert _read(batch + ".idx") == _read(one + ".idx")
    assert _read(batch + ".bin") == _read(one + ".bin")
    assert IndexedDataset(batch).doc_idx.tolist() == [0, 2, 3, 4]


def test_add_documents_rejects_inconsistent_counts(tmp_path):
    """Counts that do not add up are a ValueError, not a silently corrupt index."""
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="sequences_per_document"):
        builder.add_documents([np.array([1, 2])], [1, 1], [1])
    with pytest.raises(ValueError, match="sum to"):
        builder.add_documents([np.array([1, 2])], [1, 2], [2])
    builder.close()
    builder = IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="sum to 4 but 3 tokens"):
        builder.add_document([1, 2, 3], lengths=[2, 2])
    builder.close()


def test_add_index_merges(tmp_path):
    """add_index appends a whole dataset: tokens, sizes, shifted doc_idx, sentence structure."""
    first = str(tmp_path / "first")
    builder = IndexedDatasetBuilder(first + ".bin", dtype=np.uint16)
    builder.add_document([1, 2, 3], lengths=[1, 2])
    builder.add_document([4], lengths=[1])
    builder.finalize(first + ".idx")
    second = _write(str(tmp_path / "second"), [[10, 11], [12, 13, 14]])

    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    builder.add_item([99])
    builder.end_document()
    builder.add_index(first)
    builder.add_index(second)
    builder.add_item([100, 101])
    builder.end_document()
    builder.finalize(merged + ".idx")
    assert (builder.num_sequences, builder.num_documents, builder.num_tokens) == (7, 6, 12)

    dataset = IndexedDataset(merged)
    assert [a.tolist() for a in dataset] == [
        [99],
        [1],
        [2, 3],
        [4],
        [10, 11],
        [12, 13, 14],
        [100, 101],
    ]
    assert dataset.sizes.tolist() == [1, 1, 2, 1, 2, 3, 2]
    assert dataset.doc_idx.tolist() == [0, 1, 3, 4, 5, 6, 7]
    assert dataset.pointers.tolist() == [0, 2, 4, 8, 10, 14, 20]


def test_add_index_dtype_mismatch(tmp_path):
    """Merging an int32 dataset into a uint16 builder is an error naming the source .idx."""
    wide = _write(str(tmp_path / "wide"), [[1, 2]], dtype=np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "out.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="wide.idx.*int32.*uint16"):
        builder.add_index(wide)
    builder.close()


def test_int32_large_ids_and_empty_dataset(tmp_path):
    """int32 keeps ids above 65535; an empty dataset opens with zero sequences."""
    prefix = _write(str(tmp_path / "wide"), [[70000, 1], [2, 3, 2**31 - 1]], dtype=np.int32)
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.int32
    assert [a.tolist() for a in dataset] == [[70000, 1], [2, 3, 2**31 - 1]]

    empty = IndexedDataset(_write(str(tmp_path / "empty"), []))
    assert len(empty) == 0
    assert empty.num_tokens == 0
    assert empty.doc_idx.tolist() == [0]
    assert empty[:] == []
    with pytest.raises(IndexError):
        empty.get(0)


def test_dtype_codes_and_optimal_dtype():
    """Header codes follow Megatron's numbering; uint16 is used below 65,500 tokens."""
    expected = {
        np.uint8: 1,
        np.int8: 2,
        np.int16: 3,
        np.int32: 4,
        np.int64: 5,
        np.float64: 6,
        np.float32: 7,
        np.uint16: 8,
    }
    for dtype, code in expected.items():
        assert DType.code_from_dtype(dtype) == code
        assert DType.dtype_from_code(code) == np.dtype(dtype)
    with pytest.raises(ValueError, match="float16"):
        DType.code_from_dtype(np.float16)
    with pytest.raises(ValueError, match="float16"):
        IndexedDatasetBuilder("unused.bin", dtype=np.float16)
    assert DType.optimal_dtype(50257) is np.uint16
    assert DType.optimal_dtype(65499) is np.uint16
    assert DType.optimal_dtype(65500) is np.int32
    assert DType.optimal_dtype(None) is np.int32


def test_values_that_do_not_fit_raise(tmp_path):
    """Token ids outside the dtype's range raise ValueError instead of wrapping around."""
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="65536"):
        builder.add_item([1, 65536])
    with pytest.raises(ValueError, match="-1"):
        builder.add_item(np.array([-1, 3], dtype=np.int64))
    with pytest.raises(ValueError):
        builder.add_document(np.array([2**40]), lengths=[1])
    builder.close()
    builder = IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match="int32"):
        builder.add_item(np.array([2**31], dtype=np.int64))
    builder.close()
    # Nothing was written by the rejected calls.
    assert os.path.getsize(tmp_path / "x.bin") == 0


def test_float_values_that_do_not_fit_raise(tmp_path):
    """Float token arrays outside the dtype's range are refused too, not wrapped around."""
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError):
        builder.add_item(np.array([1.0, -2.0]))
    with pytest.raises(ValueError):
        builder.add_item(np.array([70000.0]))
    builder.close()
    assert os.path.getsize(tmp_path / "x.bin") == 0


def test_rejected_document_leaves_the_builder_usable(tmp_path):
    """After add_document/add_documents refuse inconsistent lengths, nothing of them is kept:
    the builder goes on and writes a valid dataset of the accepted documents only."""
    prefix = str(tmp_path / "after_error")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document([1, 2], lengths=[2])
    with pytest.raises(ValueError):
        builder.add_document([3, 4, 5], lengths=[2, 2])
    with pytest.raises(ValueError):
        builder.add_documents([np.array([6, 7])], [1, 2], [2])
    builder.add_document([8], lengths=[1])
    builder.finalize(prefix + ".idx")
    assert builder.num_tokens == 3
    dataset = IndexedDataset(prefix)
    assert [a.tolist() for a in dataset] == [[1, 2], [8]]
    assert dataset.doc_idx.tolist() == [0, 1, 2]


# --------------------------------------------------------------------------------- streaming


def _write_many(prefix: str, tmp_path) -> None:
    """A mixed workload over every builder entry point, large enough to flush many times."""
    rng = np.random.default_rng(7)
    small = _write(str(tmp_path / "small_for_merge"), [[1, 2], [3], [4, 5, 6]])
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for round_ in range(40):
        for _ in range(int(rng.integers(1, 4))):
            builder.add_item(rng.integers(0, 50000, size=int(rng.integers(1, 9))))
        builder.end_document()
        lengths = rng.integers(1, 5, size=int(rng.integers(1, 5))).tolist()
        builder.add_document(rng.integers(0, 50000, size=sum(lengths)), lengths)
        per_doc = rng.integers(1, 4, size=3).tolist()
        seq_lengths = rng.integers(1, 6, size=sum(per_doc)).tolist()
        builder.add_documents([rng.integers(0, 50000, size=sum(seq_lengths))], seq_lengths, per_doc)
        if round_ % 13 == 0:
            builder.add_index(small)
    builder.finalize(prefix + ".idx")


def test_streaming_flushes_are_byte_identical(tmp_path, monkeypatch):
    """Flushing the spools every 3 entries gives exactly the bytes of the default buffering."""
    default = str(tmp_path / "default")
    _write_many(default, tmp_path)
    monkeypatch.setattr(indexed_dataset, "_SPOOL_FLUSH_ENTRIES", 3)
    small = str(tmp_path / "small")
    _write_many(small, tmp_path)
    assert _read(small + ".idx") == _read(default + ".idx")
    assert _read(small + ".bin") == _read(default + ".bin")
    dataset = IndexedDataset(small)
    assert len(dataset) > 300  # many flushes happened
    # Pointers are the running sum of sizes, across every flush boundary.
    sizes = dataset.sizes.astype(np.int64)
    assert dataset.pointers.tolist() == (np.concatenate(([0], np.cumsum(sizes)[:-1])) * 2).tolist()


# ------------------------------------------------------------------------------ open errors


def _good(tmp_path, name: str = "ds") -> str:
    return _write(str(tmp_path / name), [[1, 2, 3], [4, 5]])


def _rewrite(path: str, data: bytes) -> None:
    with open(path, "wb") as stream:
        stream.write(data)


def _corrupt_cases():
    """(name, function(prefix) -> path named in the error, message fragment)."""

    def missing_idx(prefix):
        os.remove(prefix + ".idx")
        return prefix + ".idx", "no such file"

    def missing_bin(prefix):
        os.remove(prefix + ".bin")
        return prefix + ".bin", "no such file"

    def empty_idx(prefix):
        _rewrite(prefix + ".idx", b"")
        return prefix + ".idx", "empty"

    def bad_magic(prefix):
        data = _read(prefix + ".idx")
        _rewrite(prefix + ".idx", b"TNTIDX\x00\x00" + data[8:])
        return prefix + ".idx", "not a Megatron mmap index"

    def short_header(prefix):
        _rewrite(prefix + ".idx", MAGIC + b"\x01\x00")
        return prefix + ".idx", "truncated"

    def bad_version(prefix):
        data = _read(prefix + ".idx")
        _rewrite(prefix + ".idx", data[:9] + struct.pack("<Q", 2) + data[17:])
        return prefix + ".idx", "version 2"

    def bad_dtype(prefix):
        data = _read(prefix + ".idx")
        _rewrite(prefix + ".idx", data[:17] + bytes([9]) + data[18:])
        return prefix + ".idx", "dtype code 9"

    def truncated_idx(prefix):
        _rewrite(prefix + ".idx", _read(prefix + ".idx")[:-1])
        return prefix + ".idx", "truncated"

    def extra_idx(prefix):
        _rewrite(prefix + ".idx", _read(prefix + ".idx") + b"\x00" * 8)
        return prefix + ".idx", "truncated"

    def truncated_bin(prefix):
        _rewrite(prefix + ".bin", _read(prefix + ".bin")[:-2])
        return prefix + ".bin", "truncated"

    def extra_bin(prefix):
        _rewrite(prefix + ".bin", _read(prefix + ".bin") + b"\x00\x00")
        return prefix + ".bin", "does not belong"

    def doc_idx_end(prefix):
        data = _read(prefix + ".idx")
        _rewrite(prefix + ".idx", data[:-8] + struct.pack("<q", 1))
        return prefix + ".idx", "doc_idx"

    return [
        missing_idx,
        missing_bin,
        empty_idx,
        bad_magic,
        short_header,
        bad_version,
        bad_dtype,
        truncated_idx,
        extra_idx,
        truncated_bin,
        extra_bin,
        doc_idx_end,
    ]


@pytest.mark.parametrize("corrupt", _corrupt_cases(), ids=lambda f: f.__name__)
def test_open_errors_name_the_file(tmp_path, corrupt):
    """Every damaged or missing file is an IndexedDatasetError naming that file and the fault."""
    prefix = _good(tmp_path)
    path, fragment = corrupt(prefix)
    with pytest.raises(IndexedDatasetError) as caught:
        IndexedDataset(prefix)
    message = str(caught.value)
    assert path in message
    assert fragment in message
    assert isinstance(caught.value, ValueError)


def test_get_out_of_range(tmp_path):
    """Sequence and token ranges outside the dataset raise IndexError."""
    dataset = IndexedDataset(_good(tmp_path))
    for index in (2, -3, 100):
        with pytest.raises(IndexError, match="out of range"):
            dataset.get(index)
    with pytest.raises(IndexError):
        dataset[2]
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        dataset.get(0, offset=4)
    with pytest.raises(IndexError):
        dataset.get(0, offset=-1)
    with pytest.raises(IndexError):
        dataset.get(1, length=-1)


def test_make_dataset_impls(tmp_path):
    """make_dataset opens mmap (and 'infer'); 'lazy'/'cached' are refused naming the flag."""
    prefix = _good(tmp_path)
    assert make_dataset(prefix, "mmap")[1].tolist() == [4, 5]
    assert make_dataset(prefix, "infer", skip_warmup=False)[0].tolist() == [1, 2, 3]
    for impl in ("lazy", "cached"):
        with pytest.raises(IndexedDatasetError, match=f"--dataset-impl {impl}"):
            make_dataset(prefix, impl)


def test_finalize_refuses_an_unclosed_document(tmp_path):
    """Sequences added after the last end_document() would make an unreadable index."""
    builder = IndexedDatasetBuilder(str(tmp_path / "open.bin"), dtype=np.uint16)
    builder.add_item([1, 2])
    builder.end_document()
    builder.add_item([3])
    with pytest.raises(ValueError, match="end_document"):
        builder.add_index(_write(str(tmp_path / "other"), [[4]]))
    with pytest.raises(ValueError, match="call end_document\\(\\) before finalize"):
        builder.finalize(str(tmp_path / "open.idx"))
    builder.close()


def _fifty_documents(tmp_path) -> tuple[str, int]:
    """50 one-sequence documents of 1..50 tokens; the prefix and the sequence count."""
    prefix = str(tmp_path / "fifty")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for length in range(1, 51):
        builder.add_item(np.arange(length, dtype=np.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix, 50


def _patch_index(prefix: str, array: str, entry: int, value: int, count: int = 50) -> None:
    """Overwrite entry `entry` of the index's sizes (int32), pointers or doc_idx (int64)."""
    header = indexed_dataset.HEADER_SIZE
    offsets = {"sizes": header, "pointers": header + 4 * count}
    offsets["doc_idx"] = offsets["pointers"] + 8 * count
    width = 4 if array == "sizes" else 8
    data = bytearray(_read(prefix + ".idx"))
    start = offsets[array] + width * entry
    data[start : start + width] = value.to_bytes(width, "little", signed=True)
    _rewrite(prefix + ".idx", bytes(data))


@pytest.mark.parametrize(
    "array, entry, value, fragment",
    [
        # A wrong size is caught at the next sequence, whose offset no longer follows.
        ("sizes", 0, 7, "sequence 1 starts at byte 2, but the sizes before it put it at byte 14"),
        ("sizes", 25, 27, "sequence 26 starts at byte"),
        ("sizes", 30, -5, "sequence 30 has size -5"),
        ("pointers", 40, 12, "sequence 40 starts at byte 12"),
        ("doc_idx", 20, 3, "document 20 starts at sequence 3, before document 19 (19)"),
    ],
)
def test_every_index_entry_is_checked_on_open(tmp_path, array, entry, value, fragment):
    """A flipped entry anywhere in the index is an error naming the file and the entry, not
    wrong tokens later (issue 17: a changed sizes[500] trained on the next document)."""
    prefix, count = _fifty_documents(tmp_path)
    assert IndexedDataset(prefix)[49].tolist() == list(range(50))
    _patch_index(prefix, array, entry, value, count)
    with pytest.raises(IndexedDatasetError) as caught:
        IndexedDataset(prefix)
    assert str(caught.value).startswith(prefix + ".idx: corrupted index: "), caught.value
    assert fragment in str(caught.value)


def test_a_wrong_last_size_is_caught_by_the_bin_length(tmp_path):
    prefix, count = _fifty_documents(tmp_path)
    _patch_index(prefix, "sizes", 49, 51, count)
    with pytest.raises(IndexedDatasetError, match="index describes"):
        IndexedDataset(prefix)


def test_first_token_outside_vocabulary_names_document_and_position(tmp_path):
    prefix = str(tmp_path / "oov")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in range(5):
        tokens = np.full(10 + document, 7)
        if document == 3:
            tokens[4] = 65535
        builder.add_item(tokens[:6])
        builder.add_item(tokens[6:])  # two sequences per document
        builder.end_document()
    builder.finalize(prefix + ".idx")
    dataset = IndexedDataset(prefix)
    assert dataset.first_token_outside_vocabulary(50257) == (3, 4, 65535)
    assert dataset.first_token_outside_vocabulary(65536) is None
