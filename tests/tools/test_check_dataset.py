"""tools/check_dataset.py: a damaged index or a token outside the vocabulary is exit 1 with
one `error:` line naming the file and the entry or document."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDatasetBuilder
from tests.conftest import MERGE_FILE, VOCAB_FILE
from tests.one_line_errors import assert_one_line_error
from tools import check_dataset


def _dataset(tmp_path, bad_token: int | None = None) -> str:
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in range(20):
        tokens = np.arange(100 + document) % 50000
        if bad_token is not None and document == 12:
            tokens[30] = bad_token
        builder.add_item(tokens)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _check(prefix: str, capsys) -> tuple[int, str]:
    argv = ["--prefix", prefix, "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE]
    code = check_dataset.main(argv + ["--seq-length", "64"])
    return code, capsys.readouterr().err.strip()


def test_a_good_dataset_passes(tmp_path, capsys):
    assert _check(_dataset(tmp_path), capsys) == (0, "")


def test_a_token_outside_the_vocabulary_is_named(tmp_path, capsys):
    prefix = _dataset(tmp_path, bad_token=60000)
    code, error = _check(prefix, capsys)
    assert code == 1
    assert error == (
        f"error: {prefix}: document 12 has token 60000 (at position 30) >= vocabulary size "
        f"50257 of {VOCAB_FILE}; was it tokenized with another vocabulary?"
    )


def test_a_changed_size_in_the_middle_is_named(tmp_path, capsys):
    prefix = _dataset(tmp_path)
    data = bytearray(open(prefix + ".idx", "rb").read())
    offset = 34 + 4 * 10  # sizes[10], after the 34-byte header
    data[offset : offset + 4] = (211).to_bytes(4, "little")
    open(prefix + ".idx", "wb").write(bytes(data))
    code, error = _check(prefix, capsys)
    assert code == 1 and "\n" not in error
    assert error.startswith(f"error: {prefix}.idx: corrupted index: sequence 11 starts at byte")
    assert error.endswith("; sequence 10 has size 211")


# case -> (extra flags, the fragments the error line must name)
BAD_RUNS = {
    "missing_input": (["--input", "{d}/nope.jsonl"], ["--input {d}/nope.jsonl: no such file"]),
    "input_is_a_folder": (["--input", "{d}"], ["--input {d}: is a folder"]),
    "input_not_json": (["--input", "{notjson}"], ["{notjson}:1: malformed JSON"]),
    "missing_json_key": (["--input", "{text}", "--json-key", "content"], ["{text}:1", "'content'"]),
    "seq_length_0": (["--seq-length", "0"], ["--seq-length must be at least 1"]),
    "missing_vocab": (["--vocab-file", "{d}/nope.json"], ["--vocab-file {d}/nope.json"]),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(tmp_path, capsys, case):
    """Exit 1, no traceback, and one last `error:` line naming the file, line or flag."""
    prefix = _dataset(tmp_path)
    paths = {"d": tmp_path, "notjson": tmp_path / "a.bin", "text": tmp_path / "t.jsonl"}
    paths["notjson"].write_bytes(b"\x00\x01 not JSON\n")
    paths["text"].write_text('{"text": "hi"}\n')
    flags, named = BAD_RUNS[case]
    argv = ["--prefix", prefix, "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE]
    argv += [f.format(**paths) for f in flags]  # a later --vocab-file wins
    code = check_dataset.main(argv)
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])


def test_a_truncated_index_is_one_line(tmp_path, capsys):
    prefix = _dataset(tmp_path)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:40])
    code, error = _check(prefix, capsys)
    assert_one_line_error(code, error, f"{prefix}.idx", "truncated")
