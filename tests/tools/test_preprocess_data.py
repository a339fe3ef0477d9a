"""tools/preprocess_data.py through its command line: tokens, inputs, progress and failures."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from tests.conftest import run_cli
from tests.one_line_errors import assert_one_line_error, file_under_a_file, snapshot

EOD = 50256
BOM = b"\xef\xbb\xbf"

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    'def add(a, b):\n    """Add two numbers."""\n    return a + b\n\n\nprint(add(1, 2))\n',
    "Ünïcödé façade — naïve café, Ωμέγα, Привет мир, 東京タワー, 한국어, עברית, العربية",
    "Emoji 🙂🚀👩\u200d💻 flags 🇫🇷, combining e\u0301 a\u0308, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Tabs\tand\r\nWindows newlines\r\n  trailing spaces   ",
    "<|endoftext|> is plain text here, then more words",
    "Numbers 1234567890 3.14159 1e-10 0xDEADBEEF and it's they'll we've I'm",
    "   leading whitespace and a long word: " + "supercalifragilistic" * 6,
    '{"json": [1, 2, {"nested": null}]} a \\ backslash and "quotes"',
    "x",
    "line\u2028separator\u2029paragraph\u0085next and NUL-free control \x07 bell",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n" * 20,
    " ".join(f"word{i} 數{i}" for i in range(300)),
]
TITLES = [f"Title {i}: {text[:12]}" for i, text in enumerate(TEXTS)]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """Run tools/preprocess_data.py in the repository root."""
    return run_cli("tools/preprocess_data.py", *args)


def _line(text: str, title: str, ascii_only: bool) -> bytes:
    record = {"title": title, "text": text}
    return (json.dumps(record, ensure_ascii=ascii_only) + "\n").encode("utf-8")


def _documents(folder) -> list[list[int]]:
    return [a.tolist() for a in IndexedDataset(str(folder))]


def _read(path) -> bytes:
    with open(path, "rb") as stream:
        return stream.read()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four input files (BOM, blank lines, a glob pair, a .gz) and the text order they hold."""
    folder = tmp_path_factory.mktemp("pp_inputs")
    parts = [TEXTS[0:4], TEXTS[4:7], TEXTS[7:10], TEXTS[10:]]
    titles = [TITLES[0:4], TITLES[4:7], TITLES[7:10], TITLES[10:]]
    first = folder / "first.jsonl"
    lines = [
        _line(t, h, ascii_only=i % 2 == 0) for i, (t, h) in enumerate(zip(parts[0], titles[0]))
    ]
    lines.insert(2, b"\n")
    lines.insert(3, b"   \t \n")
    first.write_bytes(BOM + b"".join(lines) + b"\n")
    (folder / "shard_1.jsonl").write_bytes(
        b"".join(_line(t, h, False) for t, h in zip(parts[1], titles[1]))
    )
    # The last line of a file needs no newline.
    (folder / "shard_2.jsonl").write_bytes(
        b"".join(_line(t, h, True) for t, h in zip(parts[2], titles[2])).rstrip(b"\n")
    )
    with gzip.open(folder / "last.jsonl.gz", "wb") as stream:
        stream.write(b"".join(_line(t, h, False) for t, h in zip(parts[3], titles[3])))
    inputs = [str(first), str(folder / "shard_*.jsonl"), str(folder / "last.jsonl.gz")]
    return {"folder": folder, "inputs": inputs, "blank_lines": 3}


@pytest.fixture(scope="module")
def two_runs(corpus, tmp_path_factory):
    """The corpus tokenized with 2 workers (small chunks) and with 1 worker."""
    out = tmp_path_factory.mktemp("pp_out")
    common = ["--json-keys", "text", "title", "--append-eod", "--log-interval", "1"]
    multi = run_tool(
        "--input",
        *corpus["inputs"],
        "--output-prefix",
        str(out / "multi"),
        "--workers",
        "2",
        "--chunk-size",
        "3",
        *common,
    )
    single = run_tool(
        "--input",
        *corpus["inputs"],
        "--output-prefix",
        str(out / "single"),
        "--workers",
        "1",
        *common,
    )
    return out, multi, single


def test_documents_equal_reference_bpe(two_runs, reference_bpe, tokenizer):
    """Each document is the reference BPE of its text + <|endoftext|>, in input order."""
    out, multi, _ = two_runs
    assert multi.returncode == 0, multi.stderr
    for key, texts in (("text", TEXTS), ("title", TITLES)):
        dataset = IndexedDataset(str(out / f"multi_{key}_document"))
        assert dataset.dtype == np.uint16
        assert dataset.doc_idx.tolist() == list(range(len(texts) + 1))
        for tokens, text in zip(_documents(out / f"multi_{key}_document"), texts):
            assert tokens == reference_bpe.encode(text) + [EOD]
            assert tokenizer.detokenize(tokens[:-1]) == text
        assert len(dataset) == len(texts)


def test_workers_do_not_change_the_bytes(two_runs):
    """--workers 2 with small chunks writes exactly the bytes of --workers 1."""
    out, multi, single = two_runs
    assert single.returncode == 0, single.stderr
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            assert _read(out / f"multi_{key}_document{ext}") == _read(
                out / f"single_{key}_document{ext}"
            )
    assert not [name for name in os.listdir(out) if ".partial-" in name]


def test_progress_and_summary(two_runs):
    """With --log-interval 1 progress lines show docs/s, MB/s and ETA; then the summary."""
    _, multi, _ = two_runs
    progress = [line for line in multi.stderr.splitlines() if line.startswith("Processed ")]
    assert progress
    for line in progress:
        assert "docs/s" in line and "MB/s" in line and "ETA" in line
    assert f"Processed {len(TEXTS)} documents" in progress[-1]
    assert f"Done: {len(TEXTS)} documents" in multi.stderr
    assert "ignored 3 blank lines" in multi.stderr
    assert f"multi_text_document.bin/.idx: {len(TEXTS)} documents" in multi.stderr
    assert "multi_title_document.bin/.idx" in multi.stderr


def test_without_eod_and_keep_newlines_note(corpus, tmp_path, reference_bpe):
    """Without --append-eod no 50256 is added; --keep-newlines alone prints a note."""
    result = run_tool(
        "--input", corpus["inputs"][0], "--output-prefix", str(tmp_path / "p"), "--keep-newlines"
    )
    assert result.returncode == 0, result.stderr
    assert "note: --keep-newlines only matters with --split-sentences" in result.stderr
    assert _documents(tmp_path / "p_text_document") == [reference_bpe.encode(t) for t in TEXTS[:4]]
    assert not os.path.exists(tmp_path / "p_title_document.bin")


def test_split_sentences(tmp_path, reference_bpe):
    """--split-sentences: one sequence per sentence in _sentence files, grouped by document."""
    source = tmp_path / "s.jsonl"
    text = "The first sentence is here. A second one follows! Is this the third?"
    source.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "One only."}) + "\n")
    result = run_tool(
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "s"),
        "--split-sentences",
        "--append-eod",
    )
    assert importlib.util.find_spec("nltk"), "nltk is a test dependency (pip install -e .[test])"
    assert result.returncode == 0, result.stderr
    dataset = IndexedDataset(str(tmp_path / "s_text_sentence"))
    assert dataset.doc_idx.tolist() == [0, 3, 4]
    sentences = ["The first sentence is here.", "A second one follows!", "Is this the third?"]
    expected = [reference_bpe.encode(s) for s in sentences] + [reference_bpe.encode("One only.")]
    expected[2] += [EOD]
    expected[3] += [EOD]
    assert _documents(tmp_path / "s_text_sentence") == expected


def test_split_sentences_without_nltk(tmp_path):
    """Without NLTK: a one-line error with the install command, exit 1, nothing written."""
    hidden = tmp_path / "hide_nltk" / "nltk"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named nltk')\n")
    source = tmp_path / "s.jsonl"
    source.write_text(json.dumps({"text": "One. Two."}) + "\n")
    result = run_cli(
        "tools/preprocess_data.py",
        *("--input", str(source), "--output-prefix", str(tmp_path / "s"), "--split-sentences"),
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "hide_nltk")),
    )
    assert result.returncode == 1
    assert "error: --split-sentences needs NLTK: pip install nltk" in result.stderr
    assert "Traceback" not in result.stderr
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".bin", ".idx"))]


# ------------------------------------------------------------------------------ bad lines

GOOD = [_line(f"good document number {i}", f"title {i}", True) for i in range(8)]
BAD_LINES = {
    "malformed_json": (b'{"text": "oops", "title": \n', "malformed JSON"),
    "missing_key": (b'{"title": "only a title"}\n', "no key 'text'"),
    "non_string": (b'{"text": 42, "title": "t"}\n', "expected a string"),
    "non_utf8": (b'{"text": "caf\xe9", "title": "t"}\n', "not valid UTF-8"),
    "empty_document": (b'{"text": "", "title": "t"}\n', "empty document"),
    "json_array": (b'["text", "title"]\n', "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_stops_without_touching_output(tmp_path, case):
    """A bad line 5: exit 1, 'path:5: reason', no new output, no partial files, and the
    earlier output under the same prefix byte-for-byte unchanged."""
    bad, reason = BAD_LINES[case]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(GOOD[:4]) + bad + b"".join(GOOD[4:]))
    out = tmp_path / "out"
    out.mkdir()
    old_bin, old_idx = b"earlier bin bytes", b"earlier idx bytes"
    (out / "d_text_document.bin").write_bytes(old_bin)
    (out / "d_text_document.idx").write_bytes(old_idx)
    result = run_tool(
        "--input",
        str(source),
        "--output-prefix",
        str(out / "d"),
        "--json-keys",
        "text",
        "title",
        "--chunk-size",
        "2",
    )
    assert result.returncode == 1
    assert f"{source}:5: " in result.stderr
    assert reason in result.stderr
    assert sorted(os.listdir(out)) == ["d_text_document.bin", "d_text_document.idx"]
    assert (out / "d_text_document.bin").read_bytes() == old_bin
    assert (out / "d_text_document.idx").read_bytes() == old_idx


def test_skip_bad_lines_keeps_the_good_documents(tmp_path, reference_bpe):
    """--skip-bad-lines: exit 0, only good documents (both keys), every bad line reported."""
    source = tmp_path / "in.jsonl"
    lines, good_numbers = [], []
    bad = [BAD_LINES[case][0] for case in sorted(BAD_LINES)]
    for i in range(8):
        lines.append(GOOD[i])
        good_numbers.append(len(lines) - 1)
        if i < len(bad):
            lines.append(bad[i])
    source.write_bytes(b"".join(lines))
    result = run_tool(
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "k"),
        "--json-keys",
        "text",
        "title",
        "--skip-bad-lines",
        "--chunk-size",
        "3",
    )
    assert result.returncode == 0, result.stderr
    assert "skipped 6 bad lines" in result.stderr
    for number in (2, 4, 6, 8, 10, 12):
        assert f"{source}:{number}: " in result.stderr
    assert _documents(tmp_path / "k_text_document") == [
        reference_bpe.encode(f"good document number {i}") for i in range(8)
    ]
    assert _documents(tmp_path / "k_title_document") == [
        reference_bpe.encode(f"title {i}") for i in range(8)
    ]
    assert "Done: 8 documents" in result.stderr


def test_input_without_documents_is_an_error(tmp_path):
    """Only blank lines: exit 1, 'no documents found', nothing written."""
    source = tmp_path / "blank.jsonl"
    source.write_bytes(b"\n  \n\n")
    result = run_tool("--input", str(source), "--output-prefix", str(tmp_path / "b"))
    assert result.returncode == 1
    assert "no documents found" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["blank.jsonl"]


def test_all_lines_skipped_keeps_earlier_output(tmp_path):
    """--skip-bad-lines with no good line left: exit 1, and earlier output is not replaced."""
    prefix = tmp_path / "out"
    good = tmp_path / "good.jsonl"
    good.write_bytes(GOOD[0])
    assert run_tool("--input", str(good), "--output-prefix", str(prefix)).returncode == 0
    before = _read(f"{prefix}_text_document.bin"), _read(f"{prefix}_text_document.idx")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(BAD_LINES["malformed_json"][0] + BAD_LINES["empty_document"][0])
    result = run_tool("--input", str(bad), "--output-prefix", str(prefix), "--skip-bad-lines")
    assert result.returncode == 1
    assert "no documents found after skipping 2 bad lines" in result.stderr
    after = _read(f"{prefix}_text_document.bin"), _read(f"{prefix}_text_document.idx")
    assert after == before


# ---------------------------------------------------------------------------- flag errors


@pytest.mark.parametrize(
    ("make_args", "fragment"),
    [
        (lambda d: ["--input", str(d / "missing.jsonl")], "--input"),
        (lambda d: ["--input", str(d)], "is a directory"),
        (lambda d: ["--input", str(d / "nothing_*.jsonl")], "no file matches"),
        (lambda d: ["--input", str(d / "ok.jsonl"), "--workers", "0"], "--workers"),
        (
            lambda d: ["--input", str(d / "ok.jsonl"), "--dataset-impl", "lazy"],
            "--dataset-impl lazy",
        ),
    ],
    ids=["missing_input", "directory_input", "empty_glob", "workers_0", "dataset_impl_lazy"],
)
def test_flag_errors(tmp_path, make_args, fragment):
    """Unusable flags: non-zero exit, a message naming the flag, no output files."""
    (tmp_path / "ok.jsonl").write_text('{"text": "fine"}\n')
    result = run_tool(*make_args(tmp_path), "--output-prefix", str(tmp_path / "o"))
    assert result.returncode != 0
    assert fragment in result.stderr
    if fragment == "--input":
        assert "missing.jsonl" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["ok.jsonl"]


def test_missing_vocab_file(tmp_path):
    """A missing --vocab-file: exit 1 and a message naming the file."""
    (tmp_path / "ok.jsonl").write_text('{"text": "fine"}\n')
    vocab = tmp_path / "no-such-vocab.json"
    result = run_tool(
        "--input",
        str(tmp_path / "ok.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        "--vocab-file",
        str(vocab),
    )
    assert result.returncode == 1
    assert f"--vocab-file {vocab}" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["ok.jsonl"]


def test_spawn_workers_write_the_same_bytes(corpus, tmp_path):
    """The spawn start method (used off Linux) builds each worker's encoder itself and
    produces the same files as fork."""
    from megatron.data.corpus_tokenizer import TokenizeOptions, tokenize_corpus
    from megatron.data.document_encoder import EncoderConfig
    from megatron.tokenizer.tokenizer import TokenizerConfig
    from tools import preprocess_data

    outputs = {}
    for method in ("fork", "spawn"):
        prefix = str(tmp_path / method)
        args = preprocess_data.get_args(
            ["--input", *corpus["inputs"], "--output-prefix", prefix, "--json-keys", "text"]
            + ["title"]
        )
        config = EncoderConfig(
            json_keys=args.json_keys,
            tokenizer=TokenizerConfig.from_args(args),
            append_eod=True,
        )
        tokenize_corpus(args.input_files, prefix, config, TokenizeOptions(workers=2), method)
        outputs[method] = [
            _read(f"{prefix}_{key}_document{s}") for key in args.json_keys for s in (".bin", ".idx")
        ]
    assert outputs["fork"] == outputs["spawn"]


# ------------------------------------------------------- one-line errors (issue 17), in-process

# case -> (flags besides --output-prefix, the fragments the error line must name)
BAD_RUNS = {
    "missing_input": (["--input", "{d}/nope.jsonl"], ["--input {d}/nope.jsonl: no such file"]),
    "directory_input": (["--input", "{d}/sub"], ["--input {d}/sub: is a directory"]),
    "bad_line": (["--input", "{bad}"], ["{bad}:2: malformed JSON", "--skip-bad-lines"]),
    "tokenizer_type": (["--input", "{ok}", "--tokenizer-type", "Foo"], ["--tokenizer-type"]),
    "no_tokenizer_model": (
        ["--input", "{ok}", "--tokenizer-type", "Llama2Tokenizer"],
        ["--tokenizer-type Llama2Tokenizer needs --tokenizer-model"],
    ),
    "missing_tokenizer_model": (
        ["--input", "{ok}", "--tokenizer-type", "HFTokenizer", "--tokenizer-model", "{d}/t.json"],
        ["--tokenizer-model {d}/t.json: no such file"],
    ),
    "bad_tokenizer_model": (
        ["--input", "{ok}", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
        + ["{binary}"],
        ["--tokenizer-model {binary}: not a SentencePiece model"],
    ),
    "merges_not_utf8": (["--input", "{ok}", "--merge-file", "{binary}"], ["--merge-file {binary}"]),
    "workers_not_int": (["--input", "{ok}", "--workers", "x"], ["--workers", "'x'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(tmp_path, capsys, case):
    """Exit 1 (even for a bad flag) and one last `error:` line naming the file or flag, no
    traceback; the earlier output under the prefix is byte for byte the same."""
    from tools import preprocess_data

    (tmp_path / "sub").mkdir()
    (tmp_path / "ok.jsonl").write_bytes(GOOD[0])
    (tmp_path / "bad.jsonl").write_bytes(GOOD[0] + BAD_LINES["malformed_json"][0])
    (tmp_path / "binary").write_bytes(b"\xff\xfe not text")
    (tmp_path / "o_text_document.bin").write_bytes(b"earlier bin bytes")
    (tmp_path / "o_text_document.idx").write_bytes(b"earlier idx bytes")
    before = snapshot(tmp_path)
    paths = {"d": tmp_path, **{n: tmp_path / f"{n}.jsonl" for n in ("ok", "bad")}}
    paths["binary"] = tmp_path / "binary"
    flags, named = BAD_RUNS[case]
    argv = [f.format(**paths) for f in flags] + ["--output-prefix", str(tmp_path / "o")]
    code = preprocess_data.main(argv)
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])
    assert snapshot(tmp_path) == before


def test_output_under_a_file_is_one_line(tmp_path, capsys):
    """An --output-prefix whose folder is a file: refused before any work, naming the flag."""
    from tools import preprocess_data

    (tmp_path / "ok.jsonl").write_bytes(GOOD[0])
    blocked = file_under_a_file(tmp_path)
    code = preprocess_data.main(["--input", str(tmp_path / "ok.jsonl"), "--output-prefix", blocked])
    assert_one_line_error(code, capsys.readouterr().err, f"--output-prefix {blocked}", "a file")
