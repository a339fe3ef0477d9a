"""Our outputs against the released megatron-core (the oracle), run side by side.

- tools/preprocess_data.py writes byte for byte the .bin/.idx files that Megatron-LM's
  preprocess loop writes with megatron-core's IndexedDatasetBuilder;
- our GPTDataset yields exactly megatron-core's GPTDataset samples (one epoch, several epochs
  with and without the separate last epoch, short and long sequences);
- our C++ helpers build the same sample and blending indices.

All oracle work runs in one subprocess (megatron-core takes seconds to import).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from megatron.data.cpp_helpers import load_helpers
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset
from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE, run_oracle

ORACLE_JOBS = os.path.join(os.path.dirname(__file__), "megatron_core_jobs.py")
# (first document, end document, num_samples, seq_length, seed) of each GPTDataset compared.
SAMPLE_CASES = [
    (0, 120, 50, 128, 1234),  # one epoch
    (0, 120, 2000, 256, 7),  # several epochs, the last one separated (< 80% needed)
    (10, 40, 900, 64, 99),  # several epochs, last epoch nearly whole (>= 80%): shuffled together
    (100, 130, 300, 7, 3),  # very short sequences: many samples per document
]


def _corpus(path: str) -> None:
    """JSON lines with two keys: real stdlib code, and hard unicode/whitespace cases."""
    stdlib = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:140]
    extra = ["It's 😀 naïve — 日本語\n\n  \t x", " " * 70, "a" * 3000, "x", "\r\n\r\n'll'LL"]
    with open(path, "w", encoding="utf-8") as out:
        for i, file in enumerate(stdlib):
            text = open(file, encoding="utf-8", errors="replace").read() or "empty file"
            record = {"text": text, "title": extra[i % len(extra)] + os.path.basename(file)}
            out.write(json.dumps(record, ensure_ascii=bool(i % 2)) + "\n")


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory):
    """Run our preprocess_data, then every oracle job once; returns the paths involved."""
    work = tmp_path_factory.mktemp("oracle")
    corpus = str(work / "corpus.jsonl")
    _corpus(corpus)
    ours = str(work / "ours")
    ours_no_eod = str(work / "ours_noeod")
    for prefix, flags in (
        (ours, ["--append-eod", "--json-keys", "text", "title"]),
        (ours_no_eod, []),
    ):
        subprocess.run(
            [
                sys.executable,
                "tools/preprocess_data.py",
                "--input",
                corpus,
                "--output-prefix",
                prefix,
                "--workers",
                "2",
                *flags,
            ],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
        )
    rng = np.random.RandomState(0)
    jobs = [
        {
            "kind": "preprocess",
            "input": corpus,
            "out": str(work / "mcore"),
            "append_eod": True,
            "json_keys": ["text", "title"],
            "vocab_file": VOCAB_FILE,
            "merge_file": MERGE_FILE,
        },
        {
            "kind": "preprocess",
            "input": corpus,
            "out": str(work / "mcore_noeod"),
            "append_eod": False,
            "json_keys": ["text"],
            "vocab_file": VOCAB_FILE,
            "merge_file": MERGE_FILE,
        },
    ]
    for n, (start, stop, num_samples, seq_length, seed) in enumerate(SAMPLE_CASES):
        jobs.append(
            {
                "kind": "samples",
                "prefix": f"{ours}_text_document",
                "start": start,
                "stop": stop,
                "num_samples": num_samples,
                "seq_length": seq_length,
                "seed": seed,
                "cache": str(work / "mcore_cache"),
                "out": str(work / f"samples{n}.npy"),
            }
        )
    sample_idx_cases = []
    for n in range(6):
        sizes = rng.randint(1, 40, size=rng.randint(1, 60)).astype(np.int32)
        epochs = int(rng.randint(1, 4))
        doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_idx)
        case = {
            "kind": "sample_idx",
            "sizes": sizes.tolist(),
            "doc_idx": doc_idx.tolist(),
            "seq_length": int(rng.randint(1, 50)),
            "num_epochs": epochs,
            "tokens_per_epoch": int(sizes.sum()),
            "out": str(work / f"sample_idx{n}.npy"),
        }
        sample_idx_cases.append(case)
    blend_cases = []
    for n in range(5):
        weights = rng.dirichlet(np.ones(rng.randint(2, 6))).tolist()
        blend_cases.append(
            {
                "kind": "blending",
                "weights": weights,
                "size": int(rng.randint(1, 5000)),
                "out": str(work / f"blend{n}.npy"),
            }
        )
    jobs_file = work / "jobs.json"
    jobs_file.write_text(json.dumps(jobs + sample_idx_cases + blend_cases))
    run_oracle(ORACLE_JOBS, str(jobs_file))
    return {
        "work": work,
        "ours": ours,
        "ours_no_eod": ours_no_eod,
        "sample_idx": sample_idx_cases,
        "blend": blend_cases,
    }


def _same_bytes(path_a: str, path_b: str) -> bool:
    with open(path_a, "rb") as a, open(path_b, "rb") as b:
        return a.read() == b.read()


def test_preprocess_output_is_byte_identical_to_megatron(oracle_run):
    """.bin and .idx equal megatron-core's, with and without --append-eod, for every key."""
    work = oracle_run["work"]
    pairs = [
        (oracle_run["ours"] + "_text_document", work / "mcore_text_document"),
        (oracle_run["ours"] + "_title_document", work / "mcore_title_document"),
        (oracle_run["ours_no_eod"] + "_text_document", work / "mcore_noeod_text_document"),
    ]
    for ours, theirs in pairs:
        for suffix in (".bin", ".idx"):
            assert _same_bytes(ours + suffix, f"{theirs}{suffix}"), ours + suffix
    assert len(IndexedDataset(pairs[0][0])) == 140


@pytest.mark.parametrize("case", range(len(SAMPLE_CASES)))
def test_gpt_samples_equal_megatron(oracle_run, case, tmp_path):
    """Every sample of our GPTDataset equals megatron-core's, in the same order."""
    start, stop, num_samples, seq_length, seed = SAMPLE_CASES[case]
    prefix = oracle_run["ours"] + "_text_document"
    dataset = GPTDataset(
        "train",
        prefix,
        np.arange(start, stop, dtype=np.int32),
        IndexedDataset(prefix),
        num_samples,
        seq_length,
        seed,
        str(tmp_path),
    )
    expected = np.load(oracle_run["work"] / f"samples{case}.npy")
    assert len(dataset) == len(expected) >= num_samples
    ours = np.stack([dataset[i]["text"] for i in range(len(dataset))])
    np.testing.assert_array_equal(ours, expected)


def test_sample_idx_equals_megatron(oracle_run):
    """build_sample_idx matches megatron-core's on random documents and sequence lengths."""
    helpers = load_helpers()
    for case in oracle_run["sample_idx"]:
        ours = helpers.build_sample_idx(
            np.asarray(case["sizes"], np.int32),
            np.asarray(case["doc_idx"], np.int32),
            case["seq_length"],
            case["num_epochs"],
            case["tokens_per_epoch"],
        )
        np.testing.assert_array_equal(ours, np.load(case["out"]))


def test_blending_indices_equal_megatron(oracle_run):
    """build_blending_indices picks the same dataset and sample for every position."""
    helpers = load_helpers()
    for case in oracle_run["blend"]:
        size = case["size"]
        dataset_index = np.zeros(size, dtype=np.uint8)
        sample_index = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(
            dataset_index,
            sample_index,
            np.asarray(case["weights"]),
            len(case["weights"]),
            size,
            False,
        )
        expected = np.load(case["out"])
        np.testing.assert_array_equal(dataset_index, expected[0])
        np.testing.assert_array_equal(sample_index, expected[1])
