"""tools/preprocess_data.py --input as Parquet, Arrow and saved Hugging Face dataset folders.

The same records as JSON lines, as a Parquet file (several row groups), as an Arrow file and
as a folder in the layout `datasets.Dataset.save_to_disk` writes (state.json listing two IPC
stream shards, dataset_info.json) give byte for byte the same .bin/.idx files.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO_ROOT, run_cli
from tests.one_line_errors import assert_one_line_error, snapshot
from tests.tools.test_preprocess_data import TEXTS, TITLES

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SFT_DATA = os.path.join(REPO_ROOT, "tests", "data", "sft_tiny.jsonl")


def write_saved_dataset(table, folder) -> str:  # noqa: ANN001
    """`table` in save_to_disk's layout: two IPC stream shards listed by state.json."""
    folder.mkdir()
    half = table.num_rows // 2
    names = []
    for index, shard in enumerate((table.slice(0, half), table.slice(half))):
        name = f"data-{index:05d}-of-00002.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink:
            with pa.ipc.new_stream(sink, shard.schema) as writer:
                writer.write_table(shard, max_chunksize=3)
        names.append(name)
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"description": "", "features": {}}))
    return str(folder)


def write_inputs(records: list[dict], folder) -> dict[str, str]:  # noqa: ANN001
    """The records as a JSON-lines file, a Parquet file, an Arrow file and a saved dataset."""
    jsonl = folder / "records.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    keys = list(dict.fromkeys(key for record in records for key in record))
    table = pa.table({key: [record.get(key) for record in records] for key in keys})
    pq.write_table(table, folder / "records.parquet", row_group_size=4)
    with pa.OSFile(str(folder / "records.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
    return {
        "jsonl": str(jsonl),
        "parquet": str(folder / "records.parquet"),
        "arrow": str(folder / "records.arrow"),
        "saved": write_saved_dataset(table, folder / "saved"),
    }


def _preprocess(*flags: str) -> int:
    from tools import preprocess_data

    return preprocess_data.main(list(flags))


def _outputs(folder, prefix: str) -> dict[str, bytes]:  # noqa: ANN001
    names = sorted(n for n in os.listdir(folder) if n.startswith(prefix + "_"))
    assert names
    return {n[len(prefix) :]: (folder / n).read_bytes() for n in names}


@pytest.mark.parametrize("workers", [1, 2])
def test_text_tables_give_the_same_bytes(tmp_path, workers):
    """--json-keys text title, three rows per batch across the row groups and shards."""
    records = [{"title": title, "text": text, "other": 7} for title, text in zip(TITLES, TEXTS)]
    inputs = write_inputs(records, tmp_path)
    for kind, path in inputs.items():
        assert _preprocess(
            "--input", path, "--output-prefix", str(tmp_path / kind), "--json-keys", "text",
            "title", "--append-eod", "--chunk-size", "3", "--workers", str(workers),
        ) == 0, kind  # fmt: skip
    reference = _outputs(tmp_path, "jsonl")
    assert sorted(reference) == [
        "_text_document.bin", "_text_document.idx", "_title_document.bin", "_title_document.idx"
    ]  # fmt: skip
    for kind in ("parquet", "arrow", "saved"):
        assert _outputs(tmp_path, kind) == reference, kind


def test_sft_tables_give_the_same_bytes(tmp_path):
    """SFT records of every kind in one table (absent keys become nulls, read as absent)."""
    with open(SFT_DATA, encoding="utf-8") as file:
        records = [json.loads(line) for line in file]
    inputs = write_inputs(records, tmp_path)
    for kind, path in inputs.items():
        assert _preprocess(
            "--input", path, "--output-prefix", str(tmp_path / kind), "--sft",
            "--sft-tokenizer-prompt-format", "chatml", "--chunk-size", "4",
        ) == 0, kind  # fmt: skip
    reference = _outputs(tmp_path, "jsonl")
    assert len(reference) == 4
    for kind in ("parquet", "arrow", "saved"):
        assert _outputs(tmp_path, kind) == reference, kind


def test_without_pyarrow_one_line_names_the_file(tmp_path):
    """Without pyarrow: exit 1, one line naming the Parquet file and `pip install pyarrow`."""
    hidden = tmp_path / "hide" / "pyarrow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named pyarrow')\n")
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["hello"]}), source)
    result = run_cli(
        "tools/preprocess_data.py",
        *("--input", str(source), "--output-prefix", str(tmp_path / "o")),
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "hide")),
    )
    line = assert_one_line_error(result.returncode, result.stderr, f"--input {source}")
    assert "Parquet needs pyarrow: pip install pyarrow" in line
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".bin", ".idx"))]


# case -> (what to write, the fragments the error line names)
BAD_TABLES = {
    "dataset_dict": ("dict", ["--input {d}/dd: a DatasetDict", "{d}/dd/train, {d}/dd/test"]),
    "no_such_column": ("nocol", ["--input {d}/nocol.parquet: no column 'text'", "body, id"]),
    "null_text": ("null", ["{d}/null.parquet:3: key 'text' holds a NoneType"]),
    "missing_shard": ("shardless", ["{d}/saved/data-00001-of-00002.arrow", "is missing"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_table_errors_are_one_line(tmp_path, capsys, case):
    """One last `error:` line naming the input (and the row); nothing written."""
    kind, named = BAD_TABLES[case]
    if kind == "dict":
        (tmp_path / "dd").mkdir()
        (tmp_path / "dd" / "dataset_dict.json").write_text(
            json.dumps({"splits": ["train", "test"]})
        )
        source = tmp_path / "dd"
    elif kind == "nocol":
        source = tmp_path / "nocol.parquet"
        pq.write_table(pa.table({"body": ["a"], "id": [1]}), source)
    elif kind == "null":
        source = tmp_path / "null.parquet"
        pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), source)
    else:
        source = write_saved_dataset(pa.table({"text": ["a", "b", "c", "d"]}), tmp_path / "saved")
        os.remove(os.path.join(source, "data-00001-of-00002.arrow"))
    before = snapshot(tmp_path)
    code = _preprocess("--input", str(source), "--output-prefix", str(tmp_path / "o"))
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(d=tmp_path) for n in named])
    assert snapshot(tmp_path) == before
