"""`pretrain_gpt.py` on the data sources besides --data-path, run as a user runs it: --mock-data
with NullTokenizer (no file at all), and per-split datasets made by tools/preprocess_data.py
with TikTokenizer."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO_ROOT, run_cli
from tests.pretrain_runs import cpu_env, iteration_logs, launch
from tests.tokenizer.tiktoken_vocab import write_tiktoken_vocab

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
    "--lr 1e-3 --log-interval 1 --eval-interval 2 --eval-iters 1 --num-workers 0 "
    "--distributed-backend gloo"
).split()


def test_mock_data_with_null_tokenizer_trains_without_files(tmp_path) -> None:
    """Megatron-LM's benchmark setting: no dataset, no vocabulary; the checkpoint it saves
    generates text (integer ids) with the NullTokenizer it was trained with."""
    flags = "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --save-interval 3"
    run = launch(1, TINY + flags.split() + ["--save", str(tmp_path / "checkpoints")])
    assert run.returncode == 0, run.stdout[-3000:]
    out = run.stdout
    assert " > padded vocab (size: 1000) with 24 dummy tokens (new size: 1024)" in out
    assert "--mock-data: 100000 synthetic documents" in out
    assert "train: 1065473 samples over 1 epoch(s) of 33333 documents" in out
    logs = iteration_logs(out)
    assert [log["iteration"] for log in logs] == [1, 2, 3]
    assert all(6.0 < log["lm loss"] < 7.5 for log in logs)  # about ln(1000) at the start
    assert "validation loss at iteration 2" in out
    assert "validation loss at the end of training for test data" in out
    generated = run_cli(
        "tools/generate_samples_gpt.py",
        *("--load", str(tmp_path / "checkpoints"), "--prompt", "1 2 3", "--out-seq-length", "4"),
        "--greedy",
        env=cpu_env(),
    )
    assert generated.returncode == 0, generated.stderr[-2000:]
    continuation = generated.stdout.split("Megatron-LM:")[-1].split()
    assert len(continuation) == 4 and all(0 <= int(i) < 1000 for i in continuation)


def _preprocess(texts: list[str], prefix: str, tokenizer_flags: list[str]) -> str:
    import subprocess

    corpus = prefix + ".jsonl"
    with open(corpus, "w", encoding="utf-8") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    command = [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py")]
    command += ["--input", corpus, "--output-prefix", prefix, "--append-eod", *tokenizer_flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return prefix + "_text_document"


def test_per_split_datasets_from_tiktoken_preprocessing(stdlib_texts, tmp_path) -> None:
    """tools/preprocess_data.py with TikTokenizer makes a train and a validation dataset;
    --train-data-path/--valid-data-path train on the first and evaluate on the second, each
    whole (no test split)."""
    pytest.importorskip("tiktoken")
    vocab = write_tiktoken_vocab(str(tmp_path / "vocab.json"))
    tokenizer = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab]
    tokenizer += ["--vocab-size", "1100", "--tiktoken-num-special-tokens", "100"]
    train = _preprocess(stdlib_texts[:20], str(tmp_path / "train"), tokenizer)
    valid = _preprocess(stdlib_texts[20:24], str(tmp_path / "valid"), tokenizer)
    flags = TINY + tokenizer + ["--train-data-path", train, "--valid-data-path", valid]
    run = launch(1, flags + ["--data-cache-path", str(tmp_path / "cache")])
    assert run.returncode == 0, run.stdout[-3000:]
    out = run.stdout
    assert " > padded vocab (size: 1100) with 52 dummy tokens (new size: 1152)" in out
    assert f" > --train-data-path {train}: all 20 documents for train" in out
    assert f" > --valid-data-path {valid}: all 4 documents for valid" in out
    assert [log["iteration"] for log in iteration_logs(out)] == [1, 2, 3]
    assert "validation loss at iteration 2" in out
    assert "for test data" not in out  # no --test-data-path: no test split
