"""tools/merge_datasets.py through its command line: concatenation and refused inputs."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.conftest import run_cli
from tests.one_line_errors import assert_one_line_error, file_under_a_file, snapshot
from tools import merge_datasets


def run_merge(*args: str) -> subprocess.CompletedProcess:
    """Run tools/merge_datasets.py in the repository root."""
    return run_cli("tools/merge_datasets.py", *args)


def _write(prefix, documents, dtype=np.uint16) -> str:
    """documents: list of documents, each a list of sentences (token lists)."""
    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for sentences in documents:
        builder.add_document(
            np.concatenate([np.asarray(s) for s in sentences]), [len(s) for s in sentences]
        )
    builder.finalize(prefix + ".idx")
    return prefix


def _content(prefix):
    dataset = IndexedDataset(str(prefix))
    return [a.tolist() for a in dataset], dataset.sizes.tolist(), dataset.doc_idx.tolist()


def _concatenation(prefixes):
    """Expected tokens, sizes and doc_idx of the merge, computed from the inputs."""
    tokens, sizes, doc_idx = [], [], [0]
    for prefix in prefixes:
        t, s, d = _content(prefix)
        doc_idx += [x + len(sizes) for x in d[1:]]
        tokens += t
        sizes += s
    return tokens, sizes, doc_idx


A_DOCS = [[[1, 2, 3]], [[4], [5, 6]], [[7]]]
B_DOCS = [[[10, 11], [12]], [[13, 14, 15, 16]]]
C_DOCS = [[[20]], [[21, 22]], [[23], [24], [25]]]


def test_merge_prefixes_and_glob(tmp_path):
    """Prefixes then a glob, in the given order: tokens, sizes and doc_idx concatenated."""
    a = _write(tmp_path / "a", A_DOCS)
    _write(tmp_path / "g_2", C_DOCS)
    _write(tmp_path / "g_1", B_DOCS)
    out = tmp_path / "out" / "merged"
    result = run_merge("--input", a, str(tmp_path / "g_*"), "--output-prefix", str(out))
    assert result.returncode == 0, result.stderr
    expected = _concatenation([a, tmp_path / "g_1", tmp_path / "g_2"])
    assert _content(out) == expected
    assert expected[2] == [0, 1, 3, 4, 6, 7, 8, 9, 12]
    assert "wrote" in result.stderr and "8 documents" in result.stderr
    assert sorted(os.listdir(out.parent)) == ["merged.bin", "merged.idx"]


def test_merge_folder_excludes_its_earlier_output(tmp_path):
    """A folder merges its pairs in sorted order; run again, the earlier output inside the
    folder is not merged into itself."""
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder / "b_shard", B_DOCS)
    _write(folder / "a_shard", A_DOCS)
    out = folder / "all"
    expected = _concatenation([folder / "a_shard", folder / "b_shard"])
    for _ in range(2):
        result = run_merge("--input", str(folder), "--output-prefix", str(out))
        assert result.returncode == 0, result.stderr
        assert _content(out) == expected
    assert sorted(os.listdir(folder)) == [
        "a_shard.bin",
        "a_shard.idx",
        "all.bin",
        "all.idx",
        "b_shard.bin",
        "b_shard.idx",
    ]


def test_dtype_mismatch_is_an_error(tmp_path):
    """uint16 and int32 inputs: exit 1, both files named, no output written."""
    a = _write(tmp_path / "a", A_DOCS)
    wide = _write(tmp_path / "wide", B_DOCS, dtype=np.int32)
    result = run_merge("--input", a, wide, "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 1
    assert f"{wide}.idx" in result.stderr and f"{a}.idx" in result.stderr
    assert "int32" in result.stderr and "uint16" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "wide.bin", "wide.idx"]


def test_folder_with_orphan_bin_is_an_error(tmp_path):
    """A .bin without its .idx in the input folder: exit 1 naming the missing .idx."""
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder / "a", A_DOCS)
    _write(folder / "b", B_DOCS)
    os.remove(folder / "b.idx")
    result = run_merge("--input", str(folder), "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 1
    assert f"{folder / 'b'}.idx: missing" in result.stderr
    assert not os.path.exists(tmp_path / "out.bin")
    assert not os.path.exists(tmp_path / "out.idx")


def test_output_equal_to_an_input_is_an_error(tmp_path):
    """--output-prefix naming one of the inputs: exit 1, the input left unchanged."""
    a = _write(tmp_path / "a", A_DOCS)
    b = _write(tmp_path / "b", B_DOCS)
    before = [(tmp_path / n).read_bytes() for n in ("a.bin", "a.idx")]
    result = run_merge("--input", a, b, "--output-prefix", a)
    assert result.returncode == 1
    assert "is also an input" in result.stderr
    assert [(tmp_path / n).read_bytes() for n in ("a.bin", "a.idx")] == before
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "b.bin", "b.idx"]


# ------------------------------------------------------- one-line errors (issue 17), in-process


def _truncated(prefix) -> str:
    """A dataset whose .idx lost its tail."""
    prefix = _write(prefix, A_DOCS)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:40])
    return prefix


# case -> (arguments after --input, the fragments the error line must name)
BAD_RUNS = {
    "missing_input": (["{d}/nope", "--output-prefix", "{out}"], ["--input", "{d}/nope", "nothing"]),
    "truncated_idx": (["{cut}", "--output-prefix", "{out}"], ["{cut}.idx", "truncated"]),
    "output_under_a_file": (["{good}", "--output-prefix", "{blocked}"], ["--output-prefix"]),
    "output_folder": (["{good}", "--output-prefix", "{d}/"], ["--output-prefix {d}/"]),
    "no_output_flag": (["{good}"], ["--output-prefix", "required"]),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(tmp_path, capsys, case):
    """Exit 1 and one last `error:` line naming the file or flag; the earlier output intact."""
    paths = dict(
        d=tmp_path,
        good=_write(tmp_path / "good", B_DOCS),
        out=_write(tmp_path / "out", C_DOCS),  # an earlier merge under the output prefix
        cut=_truncated(tmp_path / "cut"),
        blocked=file_under_a_file(tmp_path),
    )
    before = snapshot(tmp_path)
    args, named = BAD_RUNS[case]
    code = merge_datasets.main(["--input"] + [a.format(**paths) for a in args])
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])
    assert snapshot(tmp_path) == before


def test_debug_variable_shows_the_traceback(tmp_path):
    """The command line: one line by default; MEGATRON_DEBUG_TRACEBACKS=1 gives the traceback."""
    argv = ["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "out")]
    result = run_merge(*argv)
    assert_one_line_error(result.returncode, result.stderr, "--input")
    debug = run_cli(
        "tools/merge_datasets.py", *argv, env=dict(os.environ, MEGATRON_DEBUG_TRACEBACKS="1")
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("megatron.data.indexed_dataset")
