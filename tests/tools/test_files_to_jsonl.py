"""tools/files_to_jsonl.py through its command line: records, skips, order and hand-off."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron.data.indexed_dataset import IndexedDataset
from tests.conftest import run_cli
from tests.one_line_errors import assert_one_line_error, file_under_a_file, snapshot

GOOD_FILES = {
    "b.py": "print('b')\n",
    "zz.py": "LAST = True\n",
    "pkg/__init__.py": "# package\n",
    "pkg/mod.py": "π = 3.14159  # ünïcödé\n\n\ndef f(x):\n\treturn x * π\n",
    "pkg-extra/tool.py": "import os\r\nprint(os.sep)\r\n",
}


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """Run tools/files_to_jsonl.py in the repository root."""
    return run_cli("tools/files_to_jsonl.py", *args)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tree with good, empty, non-UTF-8, cached, too large and non-.py files, converted."""
    root = tmp_path_factory.mktemp("tree") / "myrepo"
    for path, text in GOOD_FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(text.encode("utf-8"))
    (root / "empty.py").write_bytes(b"")
    (root / "pkg" / "latin1.py").write_bytes(b"name = 'caf\xe9'\n")
    (root / "pkg" / "big.py").write_text("x = 1\n" * 100)  # 600 bytes > 200
    (root / "notes.txt").write_text("not python\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "cached.py").write_text("cached = True\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "deep.py").write_text("deep = True\n")
    output = root.parent / "out" / "files.jsonl"
    result = run_tool("--input-dir", str(root), "--output", str(output), "--max-file-bytes", "200")
    return root, output, result


def _records(output) -> list[dict]:
    with open(output, encoding="utf-8") as stream:
        return [json.loads(line) for line in stream]


def test_records_hold_the_file_text(converted):
    """One record per qualifying file with repo_name/path/size/content; content is the text."""
    root, output, result = converted
    assert result.returncode == 0, result.stderr
    records = _records(output)
    assert {r["path"] for r in records} == set(GOOD_FILES)
    for record in records:
        assert set(record) == {"repo_name", "path", "size", "content"}
        assert record["repo_name"] == "myrepo"
        text = GOOD_FILES[record["path"]]
        assert record["content"] == text
        assert record["size"] == len(text.encode("utf-8"))
        assert record["content"] == (root / record["path"]).read_bytes().decode("utf-8")
    assert not [n for n in os.listdir(output.parent) if ".partial-" in n]


def test_skip_counts_are_reported(converted):
    """Empty, too large and non-UTF-8 files are counted; cached and .txt files never seen."""
    _, output, result = converted
    assert f"wrote {output}: 5 documents" in result.stderr
    assert "skipped 1 empty, 1 over 200 bytes, 1 not UTF-8" in result.stderr


def test_lines_are_sorted_by_path(converted):
    """Output lines come in sorted path order, so the file is reproducible and predictable."""
    _, output, _ = converted
    paths = [r["path"] for r in _records(output)]
    assert paths == sorted(GOOD_FILES)


def test_nothing_qualifies_is_an_error(tmp_path):
    """A folder with only skipped files: exit 1, no output (not even a partial file)."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "empty.py").write_bytes(b"  \n")
    (root / "readme.md").write_text("# hi\n")
    output = tmp_path / "out.jsonl"
    result = run_tool("--input-dir", str(root), "--output", str(output))
    assert result.returncode == 1
    assert "nothing written" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["repo"]


def test_output_feeds_preprocess_data(converted, tmp_path, reference_bpe):
    """preprocess_data.py --json-keys content tokenizes the output, one document per file."""
    _, output, _ = converted
    result = run_cli(
        "tools/preprocess_data.py",
        *("--input", str(output), "--output-prefix", str(tmp_path / "code")),
        *("--json-keys", "content", "--append-eod"),
    )
    assert result.returncode == 0, result.stderr
    dataset = IndexedDataset(str(tmp_path / "code_content_document"))
    expected = [reference_bpe.encode(r["content"]) + [50256] for r in _records(output)]
    assert [a.tolist() for a in dataset] == expected


# case -> (flags, the fragments the error line must name)
BAD_RUNS = {
    "missing_input_dir": (["--input-dir", "{d}/nope", "--output", "{out}"], ["--input-dir"]),
    "output_under_a_file": (["--input-dir", "{repo}", "--output", "{blocked}"], ["--output"]),
    "output_is_a_folder": (["--input-dir", "{repo}", "--output", "{repo}"], ["--output {repo}"]),
    "nothing_qualifies": (["--input-dir", "{repo}", "--output", "{out}", "--extensions", ".c"],
                          ["no .c files", "{repo}"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(tmp_path, capsys, case):
    """Exit 1, one last `error:` line naming the flag or folder; an earlier output unchanged."""
    from tools import files_to_jsonl

    paths = {"d": tmp_path, "repo": tmp_path / "repo", "out": tmp_path / "out.jsonl"}
    paths["repo"].mkdir()
    (paths["repo"] / "a.py").write_text("A = 1\n")
    paths["out"].write_text('{"content": "an earlier output"}\n')
    paths["blocked"] = file_under_a_file(tmp_path)
    before = snapshot(tmp_path)
    flags, named = BAD_RUNS[case]
    code = files_to_jsonl.main([f.format(**paths) for f in flags])
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])
    assert snapshot(tmp_path) == before
