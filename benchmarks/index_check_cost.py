"""What validating every `.idx` entry on open costs: IndexedDataset() with and without it.

    python benchmarks/index_check_cost.py

Indexes shaped like the stdlib corpus of the preprocessing benchmark (1,758 documents of its
length distribution, 15.3M tokens, uint16), 20 copies of it (612 MB of tokens), and 10M
sequences (a corpus of ~3B tokens). The `.bin` files are sparse (the check reads only their
length). Baseline, measured in the same run: the same open with `check_index_arrays` replaced
by a no-op (what opening cost before issue 17). Median of 5 opens each.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data import indexed_dataset  # noqa: E402
from megatron.data.indexed_dataset import HEADER_SIZE, INDEX_HEADER, IndexedDataset  # noqa: E402


def write_index(prefix: str, sizes: np.ndarray) -> None:
    """A valid uint16 index for `sizes` (one sequence per document) and a sparse .bin."""
    import struct

    sizes = sizes.astype(np.int32)
    pointers = np.zeros(len(sizes), np.int64)
    pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64) * 2)
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as index:
        index.write(INDEX_HEADER + struct.pack("<QBQQ", 1, 8, len(sizes), len(doc_idx)))
        assert index.tell() == HEADER_SIZE
        index.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    with open(prefix + ".bin", "wb") as data:
        data.truncate(int(sizes.astype(np.int64).sum()) * 2)


def median_open_ms(prefix: str, checked: bool) -> float:
    original = indexed_dataset.check_index_arrays
    if not checked:
        indexed_dataset.check_index_arrays = lambda *args: None
    try:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            IndexedDataset(prefix)
            times.append((time.perf_counter() - start) * 1000.0)
        return statistics.median(times)
    finally:
        indexed_dataset.check_index_arrays = original


def main() -> None:
    rng = np.random.default_rng(0)
    # The stdlib corpus: 1,758 documents, 15.3M tokens, a long-tailed length distribution.
    stdlib = np.maximum(1, rng.lognormal(8.3, 1.2, 1758)).astype(np.int64)
    stdlib = np.maximum(1, stdlib * 15_300_000 // stdlib.sum())
    cases = {
        "stdlib corpus (1,758 docs, 15.3M tokens)": stdlib,
        "20 copies (35,160 docs, 306M tokens, 612 MB)": np.tile(stdlib, 20),
        "10M sequences of 300 tokens (3B tokens)": np.full(10_000_000, 300),
    }
    print(
        "| index | entries | open, unchecked (ms) | open, checked (ms) | check cost (ms) | ratio |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for number, (name, sizes) in enumerate(cases.items()):
            prefix = os.path.join(work, f"case{number}")
            write_index(prefix, sizes)
            plain, checked = median_open_ms(prefix, False), median_open_ms(prefix, True)
            print(
                f"| {name} | {len(sizes):,} | {plain:.2f} | {checked:.2f} | "
                f"{checked - plain:.2f} | {checked / plain:.2f}x |"
            )


if __name__ == "__main__":
    main()
