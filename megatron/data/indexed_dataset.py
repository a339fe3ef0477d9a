"""Megatron's mmap indexed dataset: a `.bin` file of tokens and a `.idx` file that indexes it.

Layout of `{prefix}.idx`, little endian, exactly as Megatron-LM writes it::

    9 bytes    magic b"MMIDIDX\\x00\\x00"
    uint64     version, always 1
    uint8      dtype code of the tokens in .bin (see DType)
    uint64     N, the number of sequences (documents, or sentences with --split-sentences)
    uint64     M, the length of doc_idx (number of documents + 1)
    int32[N]   sequence lengths in tokens
    int64[N]   byte offset of each sequence in .bin
    int64[M]   doc_idx: index of the first sequence of each document, then N

`{prefix}.bin` is the sequences' tokens back to back in that dtype.
"""

from __future__ import annotations

import array
import enum
import os
import shutil
import struct
import tempfile
from typing import BinaryIO

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic + version + dtype code + sequence count + doc_idx length
HEADER_SIZE = len(INDEX_HEADER) + 8 + 1 + 8 + 8
# Spool buffers hold this many entries before they are written out, so memory stays bounded.
_SPOOL_FLUSH_ENTRIES = 1 << 20


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair is missing, truncated or corrupted."""


class DType(enum.IntEnum):
    """Token dtype codes stored in the `.idx` header (Megatron-LM's numbering)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: np.dtype | type) -> int:
        """The header code of a numpy dtype."""
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} cannot be stored in an indexed dataset")
        return int(cls[name])

    @classmethod
    def dtype_from_code(cls, code: int) -> np.dtype:
        """The numpy dtype of a header code."""
        return np.dtype(cls(code).name)

    @staticmethod
    def optimal_dtype(vocab_size: int | None) -> type:
        """uint16 when every token id fits (vocab under 65,500, as Megatron decides), else int32."""
        return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(path_prefix: str) -> str:
    """Path of the token file of a dataset prefix."""
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    """Path of the index file of a dataset prefix."""
    return path_prefix + ".idx"


def dataset_exists(path_prefix: str) -> bool:
    """Whether both files of a dataset prefix exist."""
    return os.path.isfile(data_file_path(path_prefix)) and os.path.isfile(
        index_file_path(path_prefix)
    )


class IndexedDatasetBuilder:
    """Streams sequences into a `.bin` file and writes the matching `.idx` on `finalize`.

    Sizes and document boundaries are spooled to anonymous temporary files beside the output,
    so memory does not grow with the corpus.
    """

    def __init__(self, bin_path: str, dtype: np.dtype | type = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)  # reject unsupported dtypes up front
        self.bin_path = bin_path
        self._bin: BinaryIO = open(bin_path, "wb")
        spool_dir = os.path.dirname(os.path.abspath(bin_path))
        self._sizes_spool = tempfile.TemporaryFile(dir=spool_dir)
        self._doc_idx_spool = tempfile.TemporaryFile(dir=spool_dir)
        self._sizes = array.array("i")
        self._doc_idx = array.array("q", [0])
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._last_length = 0
        # Sequence count at the last closed document: sequences after it belong to none yet.
        self._document_end = 0

    def add_item(self, tokens: object) -> None:
        """Append one sequence (any array-like of token ids)."""
        self._write_tokens(self._as_tokens(tokens))
        self._sizes.append(self._last_length)
        self.num_sequences += 1
        self._maybe_flush()

    def add_document(self, tokens: object, lengths: list[int]) -> None:
        """Append a document made of sequences of `lengths` tokens, then close it."""
        values = self._as_tokens(tokens)
        if sum(lengths) != values.size:
            raise ValueError(f"lengths sum to {sum(lengths)} but {values.size} tokens given")
        self._write_tokens(values)
        self._sizes.extend(lengths)
        self.num_sequences += len(lengths)
        self.end_document()

    def add_documents(
        self,
        tokens: list[np.ndarray],
        sequence_lengths: list[int],
        sequences_per_document: list[int],
    ) -> None:
        """Append many documents at once: `tokens` holds their sequences back to back."""
        if sum(sequences_per_document) != len(sequence_lengths):
            raise ValueError("sequences_per_document does not add up to the sequence count")
        values = self._as_tokens(np.concatenate(tokens) if tokens else np.empty(0, self.dtype))
        if sum(sequence_lengths) != values.size:
            raise ValueError(
                f"sequence lengths sum to {sum(sequence_lengths)} but {values.size} tokens given"
            )
        self._write_tokens(values)
        self._sizes.extend(sequence_lengths)
        ends = np.cumsum(sequences_per_document, dtype=np.int64) + self.num_sequences
        self._doc_idx.extend(ends.tolist())
        self.num_sequences += len(sequence_lengths)
        self.num_documents += len(sequences_per_document)
        self._document_end = self.num_sequences
        self._maybe_flush()

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form it."""
        self._doc_idx.append(self.num_sequences)
        self.num_documents += 1
        self._document_end = self.num_sequences
        self._maybe_flush()

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (same dtype), keeping its document boundaries."""
        if self._document_end != self.num_sequences:
            raise ValueError("call end_document() before add_index()")
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index_file_path(path_prefix)}: tokens are {other.dtype.name}, "
                f"but this dataset is being written as {self.dtype.name}"
            )
        self._flush()
        with open(data_file_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, 16 << 20)
        self._sizes_spool.write(np.ascontiguousarray(other.sizes, dtype=np.int32).tobytes())
        doc_idx = np.asarray(other.doc_idx[1:], dtype=np.int64) + self.num_sequences
        self._doc_idx_spool.write(doc_idx.tobytes())
        self.num_sequences += len(other)
        self.num_documents += len(other.doc_idx) - 1
        self.num_tokens += int(other.sizes.sum(dtype=np.int64))
        self._document_end = self.num_sequences

    def finalize(self, idx_path: str) -> None:
        """Close the `.bin` file and write the `.idx` file."""
        if self._document_end != self.num_sequences:
            raise ValueError(
                "sequences were added after the last end_document(); call end_document() "
                "before finalize() so that every sequence belongs to a document"
            )
        self._flush()
        self._bin.close()
        with open(idx_path, "wb") as index:
            index.write(INDEX_HEADER)
            index.write(struct.pack("<Q", INDEX_VERSION))
            index.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
            index.write(struct.pack("<Q", self.num_sequences))
            index.write(struct.pack("<Q", self.num_documents + 1))
            self._sizes_spool.seek(0)
            shutil.copyfileobj(self._sizes_spool, index)
            self._write_pointers(index)
            self._doc_idx_spool.seek(0)
            shutil.copyfileobj(self._doc_idx_spool, index)
        self.close()

    def close(self) -> None:
        """Release the open files without writing an index (used on failure)."""
        self._bin.close()
        self._sizes_spool.close()
        self._doc_idx_spool.close()

    def _as_tokens(self, tokens: object) -> np.ndarray:
        """Token ids as a contiguous array of the dataset dtype; ids that do not fit raise."""
        values = np.asarray(tokens)
        if values.dtype == self.dtype:
            return np.ascontiguousarray(values)
        if values.size and values.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {values.dtype.name} values")
        if values.size:
            info = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token id {high if high > info.max else low} does not fit "
                    f"{self.dtype.name}; the vocabulary is too large for this dtype"
                )
        return np.ascontiguousarray(values, dtype=self.dtype)

    def _write_tokens(self, values: np.ndarray) -> None:
        self._bin.write(values.data)
        self._last_length = int(values.size)
        self.num_tokens += self._last_length

    def _maybe_flush(self) -> None:
        if len(self._sizes) >= _SPOOL_FLUSH_ENTRIES or len(self._doc_idx) >= _SPOOL_FLUSH_ENTRIES:
            self._flush()

    def _flush(self) -> None:
        self._sizes_spool.write(self._sizes.tobytes())
        self._doc_idx_spool.write(self._doc_idx.tobytes())
        self._sizes = array.array("i")
        self._doc_idx = array.array("q")

    def _write_pointers(self, index: BinaryIO) -> None:
        """Byte offsets of every sequence: an exclusive running sum of sizes * itemsize."""
        self._sizes_spool.seek(0)
        offset = 0
        chunk_bytes = 4 * _SPOOL_FLUSH_ENTRIES
        while chunk := self._sizes_spool.read(chunk_bytes):
            sizes = np.frombuffer(chunk, dtype=np.int32).astype(np.int64) * self.dtype.itemsize
            ends = np.cumsum(sizes) + offset
            index.write((ends - sizes).tobytes())
            offset = int(ends[-1])


# Megatron-DeepSpeed's name for the builder.
MMapIndexedDatasetBuilder = IndexedDatasetBuilder


# Entries checked per vectorised pass: bounds the temporary arrays (~100 MB) on huge corpora.
_CHECK_CHUNK = 1 << 22


def check_index_arrays(
    idx_path: str,
    sizes: np.ndarray,
    pointers: np.ndarray,
    doc_idx: np.ndarray,
    dtype: np.dtype,
) -> None:
    """Every entry of an index agrees with the others; the first that does not is an error.

    Sizes are non-negative; each pointer is the previous one plus the previous size in bytes
    (so a flipped byte in either array is caught where it is, not as wrong tokens later); the
    document index never decreases. Vectorised in chunks: a 300B-token corpus takes seconds.
    """
    itemsize = np.dtype(dtype).itemsize
    expected_offset = 0
    for start in range(0, len(sizes), _CHECK_CHUNK):
        chunk = sizes[start : start + _CHECK_CHUNK].astype(np.int64)
        negative = np.flatnonzero(chunk < 0)
        if negative.size:
            index = start + int(negative[0])
            raise IndexedDatasetError(
                f"{idx_path}: corrupted index: sequence {index} has size {int(sizes[index])}"
            )
        ends = np.cumsum(chunk * itemsize) + expected_offset
        starts = ends - chunk * itemsize
        wrong = np.flatnonzero(pointers[start : start + len(chunk)] != starts)
        if wrong.size:
            index = start + int(wrong[0])
            previous = (
                f"; sequence {index - 1} has size {int(sizes[index - 1])}" if index > 0 else ""
            )
            raise IndexedDatasetError(
                f"{idx_path}: corrupted index: sequence {index} starts at byte "
                f"{int(pointers[index])}, but the sizes before it put it at byte "
                f"{int(starts[wrong[0]])}{previous}"
            )
        expected_offset = int(ends[-1])
    backwards = np.flatnonzero(np.diff(doc_idx) < 0)
    if backwards.size:
        index = int(backwards[0]) + 1
        raise IndexedDatasetError(
            f"{idx_path}: corrupted index: document {index} starts at sequence "
            f"{int(doc_idx[index])}, before document {index - 1} ({int(doc_idx[index - 1])})"
        )


class IndexedDataset:
    """Read-only, memory-mapped view of a `.bin`/`.idx` pair, validated on open."""

    def __init__(self, path_prefix: str, skip_warmup: bool = True) -> None:
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: no such file (dataset prefix {path_prefix!r})")
        self._read_index(idx_path)
        self._check_data_file(bin_path)
        self._bin_mmap = np.memmap(bin_path, mode="r") if self._bin_size else np.empty(0, np.uint8)
        self._bin_buffer = memoryview(self._bin_mmap)
        if not skip_warmup:
            # Touch every page once so later reads do not stall on the file system.
            np.add.reduce(self._bin_mmap[::4096], dtype=np.int64)

    def _read_index(self, idx_path: str) -> None:
        file_size = os.path.getsize(idx_path)
        if file_size == 0:
            raise IndexedDatasetError(f"{idx_path}: empty file, not a Megatron mmap index")
        with open(idx_path, "rb") as stream:
            header = stream.read(HEADER_SIZE)
        if header[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise IndexedDatasetError(
                f"{idx_path}: not a Megatron mmap index (starts with {header[:9]!r}, expected "
                f"{INDEX_HEADER!r}); was it written with --dataset-impl mmap?"
            )
        if len(header) < HEADER_SIZE:
            raise IndexedDatasetError(f"{idx_path}: truncated header ({file_size} bytes)")
        version, code, num_sequences, doc_idx_len = struct.unpack("<QBQQ", header[9:])
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{idx_path}: index version {version}, only 1 is supported")
        if code not in DType._value2member_map_:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} in the header")
        expected = HEADER_SIZE + num_sequences * (4 + 8) + doc_idx_len * 8
        if file_size != expected:
            raise IndexedDatasetError(
                f"{idx_path}: corrupted or truncated index: the header announces {num_sequences} "
                f"sequences and {doc_idx_len} doc_idx entries ({expected} bytes), "
                f"the file has {file_size} bytes"
            )
        self.dtype = DType.dtype_from_code(code)
        buffer = np.memmap(idx_path, mode="r")
        self._idx_mmap = buffer
        offset = HEADER_SIZE
        self._sizes = np.frombuffer(buffer, np.int32, num_sequences, offset)
        offset += self._sizes.nbytes
        self._pointers = np.frombuffer(buffer, np.int64, num_sequences, offset)
        offset += self._pointers.nbytes
        self._doc_idx = np.frombuffer(buffer, np.int64, doc_idx_len, offset)
        if doc_idx_len == 0 or self._doc_idx[0] != 0 or self._doc_idx[-1] != num_sequences:
            raise IndexedDatasetError(
                f"{idx_path}: corrupted index: doc_idx must run from 0 to {num_sequences}"
            )
        check_index_arrays(idx_path, self._sizes, self._pointers, self._doc_idx, self.dtype)

    def _check_data_file(self, bin_path: str) -> None:
        self._bin_size = os.path.getsize(bin_path)
        expected = 0
        if len(self._sizes):
            expected = int(self._pointers[-1]) + int(self._sizes[-1]) * self.dtype.itemsize
            if self._pointers[0] != 0:
                raise IndexedDatasetError(f"{bin_path}: corrupted index: first offset is not 0")
        if self._bin_size != expected:
            raise IndexedDatasetError(
                f"{bin_path}: has {self._bin_size} bytes but its index describes {expected} "
                f"bytes of {self.dtype.name} tokens; the .bin is truncated or does not belong "
                "to this .idx"
            )

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def sizes(self) -> np.ndarray:
        """Length in tokens of every sequence (int32)."""
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of every sequence in the `.bin` file (int64)."""
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """First sequence of each document, then the sequence count (int64)."""
        return self._doc_idx

    document_indices = doc_idx  # Megatron-LM core's name

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in the dataset."""
        return int(self._sizes.sum(dtype=np.int64))

    def tokens(self) -> np.ndarray:
        """Every token of the `.bin`, in order, as one memory-mapped array (no copy)."""
        if not self._bin_size:
            return np.empty(0, self.dtype)
        return np.frombuffer(self._bin_buffer, dtype=self.dtype)

    def first_token_outside_vocabulary(self, vocab_size: int) -> tuple[int, int, int] | None:
        """(document, token position in it, token id) of the first id >= `vocab_size`, or None.

        Scans the `.bin` in vectorised chunks of 64M tokens.
        """
        tokens = self.tokens()
        chunk = 1 << 26
        for start in range(0, len(tokens), chunk):
            outside = np.flatnonzero(tokens[start : start + chunk] >= vocab_size)
            if outside.size:
                position = start + int(outside[0])
                token = int(tokens[position])
                # The sequence holding that token, then its document.
                byte = position * self.dtype.itemsize
                sequence = int(np.searchsorted(self._pointers, byte, side="right")) - 1
                document = int(np.searchsorted(self._doc_idx, sequence, side="right")) - 1
                first = int(self._pointers[int(self._doc_idx[document])])
                return document, (byte - first) // self.dtype.itemsize, token
        return None

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (all of it by default)."""
        idx, offset = int(idx), int(offset)
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        size = int(self._sizes[idx])
        length = size - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                f"of {size} tokens"
            )
        start = int(self._pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both files of the dataset prefix exist."""
        return dataset_exists(path_prefix)


# Megatron-DeepSpeed's name for the reader.
MMapIndexedDataset = IndexedDataset


def make_dataset(path_prefix: str, impl: str = "mmap", skip_warmup: bool = True) -> IndexedDataset:
    """Open a dataset as Megatron's `make_dataset` does; only `--dataset-impl mmap` exists here."""
    if impl not in ("mmap", "infer"):
        raise IndexedDatasetError(
            f"--dataset-impl {impl} is not supported; only 'mmap' (Megatron's default) is"
        )
    return IndexedDataset(path_prefix, skip_warmup=skip_warmup)
