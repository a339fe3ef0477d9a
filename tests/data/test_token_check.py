"""Token ids at or above the vocabulary size are found at start-up, naming the document; the
scan's result is cached per `.bin` so a large corpus is read once."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data import token_check
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError


def _dataset(tmp_path, bad: int | None) -> str:
    prefix = str(tmp_path / "data")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in range(8):
        tokens = np.arange(50, dtype=np.int64) + document
        if bad is not None and document == 6:
            tokens[9] = bad
        builder.add_item(tokens)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_an_id_outside_the_vocabulary_names_document_position_and_size(tmp_path):
    prefix = _dataset(tmp_path, bad=65535)
    with pytest.raises(IndexedDatasetError) as caught:
        token_check.check_token_ids(IndexedDataset(prefix), prefix, 50257)
    assert str(caught.value).startswith(
        f"{prefix}: document 6 has token 65535 (at position 9) >= vocabulary size 50257"
    )


def test_the_scan_is_cached_per_bin_and_redone_when_it_changes(tmp_path, monkeypatch):
    prefix = _dataset(tmp_path, bad=None)
    token_check.check_token_ids(IndexedDataset(prefix), prefix, 60)
    cache = str(tmp_path / "data_largest_token_id.json")
    assert os.path.isfile(cache)

    def no_scan(dataset):
        raise AssertionError("scanned again although the .bin did not change")

    monkeypatch.setattr(token_check, "largest_token_id", no_scan)
    token_check.check_token_ids(IndexedDataset(prefix), prefix, 60)
    with pytest.raises(
        IndexedDatasetError, match="document 7 has token 56 .* >= vocabulary size 56"
    ):
        token_check.check_token_ids(IndexedDataset(prefix), prefix, 56)  # from the cache too
    monkeypatch.undo()
    _dataset(tmp_path, bad=65535)  # rewritten: new size or mtime, so scanned again
    os.utime(prefix + ".bin", ns=(1, 1))
    with pytest.raises(IndexedDatasetError, match="document 6 has token 65535"):
        token_check.check_token_ids(IndexedDataset(prefix), prefix, 50257)


def test_a_read_only_folder_still_checks(tmp_path, monkeypatch):
    prefix = _dataset(tmp_path, bad=None)
    monkeypatch.setattr(token_check, "_cache_path", lambda *args: "/proc/no/such/dir/cache.json")
    token_check.check_token_ids(IndexedDataset(prefix), prefix, 50257)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["token outside the vocabulary", "corrupted index"])
def test_pretrain_gpt_ends_with_one_error_line(tmp_path, fault):
    """As a user sees it: exit 1 at start-up, the last line is the error naming the file."""
    from tests.conftest import MERGE_FILE, VOCAB_FILE
    from tests.pretrain_runs import launch

    prefix = _dataset(tmp_path, bad=65535 if fault.startswith("token") else None)
    if fault == "corrupted index":
        data = bytearray(open(prefix + ".idx", "rb").read())
        data[34 + 4 * 3] ^= 0x01  # sizes[3]: 53 -> 52
        open(prefix + ".idx", "wb").write(bytes(data))
    flags = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --num-workers 0 "
        f"--data-path {prefix} --vocab-file {VOCAB_FILE} --merge-file {MERGE_FILE}"
    ).split()
    done = launch(1, flags)
    assert done.returncode == 1, done.stdout[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    expected = {
        "token outside the vocabulary": f"error: {prefix}: document 6 has token 65535",
        "corrupted index": f"error: {prefix}.idx: corrupted index: sequence 4 starts at byte",
    }[fault]
    assert last.startswith(expected), last
    assert "Traceback" not in done.stdout
