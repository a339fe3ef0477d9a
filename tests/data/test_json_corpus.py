"""`--train-data` loose JSON tokenized once into `.bin/.idx`, reused while the files are
unchanged, rebuilt when they change, shared by processes through a file lock, and never left
half-written."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os

import numpy as np
import pytest

from megatron.data import json_corpus
from megatron.data.corpus_reader import InputError
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.json_corpus import JsonCorpus, ensure_tokenized
from megatron.tokenizer import GPT2BPETokenizer
from megatron.tokenizer.tokenizer import TokenizerConfig
from tests.conftest import MERGE_FILE, VOCAB_FILE
from tests.one_line_errors import snapshot

TEXTS = ["def f(x):\n    return x + 1\n", "Hello, world.", "naïve café ☕"]


def _corpus(tmp_path, texts=TEXTS, name="data.json") -> JsonCorpus:
    source = tmp_path / "src" / name
    source.parent.mkdir(exist_ok=True)
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return JsonCorpus(
        sources=(str(source),),
        json_key="text",
        cache_dir=str(tmp_path / "cache"),
        tokenizer=TokenizerConfig("GPT2BPETokenizer", VOCAB_FILE, MERGE_FILE),
        label="--train-data src/data.json",
    )


def _documents(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[index].tolist() for index in range(len(dataset))]


def test_tokens_are_gpt2s_with_an_end_of_document_each(tmp_path, capsys) -> None:
    corpus = _corpus(tmp_path)
    prefix = ensure_tokenized(corpus, workers=1)
    assert prefix == corpus.data_prefix and prefix.startswith(str(tmp_path / "cache" / "data-"))
    tokenizer = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)
    assert _documents(prefix) == [tokenizer.tokenize(text) + [tokenizer.eod] for text in TEXTS]
    assert "tokenizing" in capsys.readouterr().err
    manifest = json.loads(open(prefix + ".sources.json").read())
    assert manifest["documents"] == 3 and manifest["sources"][0]["path"] == corpus.sources[0]


def test_an_unchanged_file_is_reused_and_a_changed_one_rebuilt(tmp_path, capsys) -> None:
    corpus = _corpus(tmp_path)
    prefix = ensure_tokenized(corpus, workers=1)
    built = os.stat(prefix + ".bin").st_mtime_ns
    capsys.readouterr()
    assert ensure_tokenized(corpus, workers=1) == prefix
    assert "reusing" in capsys.readouterr().out
    assert os.stat(prefix + ".bin").st_mtime_ns == built
    # Touched but the same bytes: re-hashed once and reused; the new time is remembered.
    source = corpus.sources[0]
    os.utime(source, ns=(built + 10**9, built + 10**9))
    ensure_tokenized(corpus, workers=1)
    assert "reusing" in capsys.readouterr().out
    assert os.stat(prefix + ".bin").st_mtime_ns == built
    manifest = json.loads(open(prefix + ".sources.json").read())
    assert manifest["sources"][0]["mtime_ns"] == built + 10**9
    # Changed (same size, other bytes): tokenized again, under the same prefix.
    with open(source, "r+") as file:
        text = file.read()
        file.seek(0)
        file.write(text.replace("world", "WORLD"))
    (tmp_path / "cache" / (os.path.basename(prefix) + "_train_indexmap_x.npy")).write_bytes(b"x")
    ensure_tokenized(corpus, workers=1)
    assert "tokenizing" in capsys.readouterr().err
    tokenizer = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)
    assert _documents(prefix)[1] == tokenizer.tokenize("Hello, WORLD.") + [tokenizer.eod]
    # The old tokens' sample maps are gone with them.
    assert not list((tmp_path / "cache").glob("*_indexmap_*"))


def test_another_key_or_tokenizer_gets_its_own_files(tmp_path) -> None:
    corpus = _corpus(tmp_path)
    other_key = dataclasses.replace(corpus, json_key="body")
    assert other_key.output_prefix != corpus.output_prefix
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({**json.load(open(VOCAB_FILE)), "extra": 50257}))
    other_vocab = dataclasses.replace(
        corpus, tokenizer=TokenizerConfig("GPT2BPETokenizer", str(vocab), MERGE_FILE)
    )
    assert other_vocab.output_prefix != corpus.output_prefix


def test_the_tokenizer_files_are_hashed_once_per_corpus(tmp_path, monkeypatch) -> None:
    """Start-up reads the prefix several times a rank; the tokenizer files are hashed once
    (issue 36, defect 8: every access hashed them, a whole HF folder with its weights)."""
    hashed = []
    real = json_corpus._file_sha256
    monkeypatch.setattr(json_corpus, "_file_sha256", lambda path: hashed.append(path) or real(path))
    corpus = _corpus(tmp_path)
    prefixes = {corpus.output_prefix, corpus.output_prefix}
    assert corpus.data_prefix == f"{corpus.output_prefix}_text_document"
    assert len(prefixes) == 1 and sorted(hashed) == sorted([VOCAB_FILE, MERGE_FILE])


def test_a_bad_line_names_file_and_line_and_writes_nothing(tmp_path) -> None:
    corpus = _corpus(tmp_path)
    prefix = ensure_tokenized(corpus, workers=1)
    with open(corpus.sources[0], "a") as file:
        file.write('{"text": "fine"}\n{"text": oops}\n')
    before = snapshot(tmp_path / "cache")
    with pytest.raises(InputError) as failed:
        ensure_tokenized(corpus, workers=1)
    message = str(failed.value)
    assert message.startswith(f"{corpus.sources[0]}:5: malformed JSON"), message
    assert message.endswith("(fix or remove the line)")
    # The earlier tokens stay byte for byte; only the manifest that vouched for them is gone,
    # so the next start tokenizes again.
    after = snapshot(tmp_path / "cache")
    assert {name: data for name, data in before.items() if not name.endswith(".json")} == {
        name: data for name, data in after.items() if not name.endswith(".json")
    }
    assert not os.path.exists(prefix + ".sources.json")


def _tokenize_in_child(corpus: JsonCorpus, results) -> None:  # noqa: ANN001
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        prefix = ensure_tokenized(corpus, workers=1)
    results.put((prefix, "tokenizing" in err.getvalue()))


def test_processes_started_together_share_one_build(tmp_path) -> None:
    corpus = _corpus(tmp_path, TEXTS * 200)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    children = [context.Process(target=_tokenize_in_child, args=(corpus, results)) for _ in "ab"]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert [prefix for prefix, _ in outcomes] == [corpus.data_prefix] * 2
    assert sorted(built for _, built in outcomes) == [False, True]  # one tokenized, one reused
    assert len(_documents(corpus.data_prefix)) == 600


def test_a_process_that_waited_for_a_failed_build_does_not_retry(tmp_path, monkeypatch) -> None:
    """Another rank held the lock and stopped without finishing: this one says so at once
    (the builder printed the real error) instead of tokenizing the whole input again."""
    corpus = _corpus(tmp_path)
    real_flock = json_corpus.fcntl.flock
    calls = []

    def flock(file, operation):  # noqa: ANN001, ANN202
        calls.append(operation)
        if operation == json_corpus.fcntl.LOCK_EX | json_corpus.fcntl.LOCK_NB:
            raise BlockingIOError  # the named point: someone else holds the lock right now
        return real_flock(file, operation)

    monkeypatch.setattr(json_corpus.fcntl, "flock", flock)
    with pytest.raises(InputError, match="stopped without finishing .* nothing was written"):
        ensure_tokenized(corpus, workers=1)
    assert not os.path.exists(corpus.data_prefix + ".bin")


def test_the_token_dtype_follows_the_vocabulary(tmp_path) -> None:
    prefix = ensure_tokenized(_corpus(tmp_path), workers=1)
    assert IndexedDataset(prefix).tokens().dtype == np.uint16  # GPT-2's 50,257 ids fit
