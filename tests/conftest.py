"""Shared fixtures: the real GPT-2 files, the reference tokenizer, the megatron-core oracle,
transformers 4.x for the Hugging Face exports."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator

import pytest

from tests.cached import CACHE_DIR, REPO_ROOT, cache_lock  # noqa: F401 - re-exported

# Launchers and ninja from this interpreter's environment, as scripts/run_tests.sh arranges:
# DeepSpeed rebuilds its JIT ops whenever another ninja touched their build directory.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# OpenMP threads that wait for work sleep instead of spinning: the suite runs more threads than
# cores (two workers, their spawned worlds' ranks), and spinning threads took half the CPU time
# of tests/core's worlds (measured). Set before torch is imported; the arithmetic is unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
VOCAB_FILE = os.path.join(REPO_ROOT, "dataset", "gpt2-vocab.json")
MERGE_FILE = os.path.join(REPO_ROOT, "dataset", "gpt2-merges.txt")
# The released megatron-core whose writer, helpers and GPTDataset our outputs must equal.
MEGATRON_CORE_VERSION = "0.16.1"
ORACLE_DIR = os.path.join(CACHE_DIR, f"megatron-core-{MEGATRON_CORE_VERSION}")
# The transformers 4.x release (and the tokenizers / huggingface-hub it needs) that our Hugging
# Face exports must load in besides the installed 5.x: the last 4.46, inside `>=4.45`.
TRANSFORMERS_4 = ("transformers==4.46.3", "tokenizers==0.20.3", "huggingface-hub==0.26.5")
# The last 4.x release, for the families 4.46 lacks (DeepSeek-V2 and -V3).
TRANSFORMERS_4_LAST = ("transformers==4.57.3", "tokenizers==0.22.1", "huggingface-hub==0.36.0")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    """`-n N --dist loadfile`: a test file's tests on one worker, and every module that runs in
    the tests/core spawned worlds on one worker (tests/scheduling.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.scheduling import FileGroupScheduling

    return FileGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the longest scheduling groups first (tests/scheduling.py)."""
    if hasattr(config, "workerinput"):
        from tests.scheduling import longest_groups_first

        longest_groups_first(items)


@pytest.fixture(scope="session")
def gpt2_files() -> tuple[str, str]:
    """Paths of the vendored GPT-2 vocab and merges files."""
    return VOCAB_FILE, MERGE_FILE


@pytest.fixture(scope="session")
def tokenizer():
    """Our GPT-2 tokenizer on the real vocabulary (built once per session)."""
    from megatron.tokenizer import GPT2BPETokenizer

    return GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)


@pytest.fixture(scope="session")
def reference_bpe():
    """The pure-Python reference GPT-2 BPE (the oracle)."""
    from tests.tokenizer.reference_bpe import ReferenceGPT2BPE

    return ReferenceGPT2BPE(VOCAB_FILE, MERGE_FILE)


def ensure_megatron_core_oracle() -> str:
    """Unpack the megatron-core wheel into .cache/ (fetched from PyPI once); returns its dir.

    It is kept out of site-packages because it shares the top-level `megatron` package name
    with this project; oracle code runs in a subprocess with PYTHONPATH pointing here.
    """
    marker = os.path.join(ORACLE_DIR, "megatron", "core", "datasets", "helpers.py")
    if os.path.isfile(marker):
        return ORACLE_DIR
    with cache_lock("megatron-core"):
        if not os.path.isfile(marker):
            _fetch_megatron_core_oracle()
    return ORACLE_DIR


def _fetch_megatron_core_oracle() -> None:
    with tempfile.TemporaryDirectory(
        dir=os.path.dirname(ORACLE_DIR) if os.path.isdir(os.path.dirname(ORACLE_DIR)) else None
    ) as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            scratch,
            f"megatron-core=={MEGATRON_CORE_VERSION}",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(scratch, "megatron_core-*.whl"))
        if result.returncode != 0 or not wheels:
            pytest.fail(
                f"could not fetch megatron-core {MEGATRON_CORE_VERSION}, the oracle for the "
                f"format tests: {' '.join(command)} failed:\n{result.stderr[-2000:]}"
            )
        unpacked = os.path.join(scratch, "unpacked")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked)
        os.makedirs(os.path.dirname(ORACLE_DIR), exist_ok=True)
        os.replace(unpacked, ORACLE_DIR)


def transformers_4_dir(release: tuple[str, ...] = TRANSFORMERS_4) -> str:
    """The .cache/ folder holding `release` (its transformers pin first)."""
    return os.path.join(CACHE_DIR, release[0].replace("==", "-"))


def ensure_transformers_4(release: tuple[str, ...] = TRANSFORMERS_4) -> str:
    """Install `release` (`TRANSFORMERS_4` or `TRANSFORMERS_4_LAST`) into .cache/ (fetched from
    PyPI once); returns its folder.

    `pip install --no-deps --target`: torch, numpy, safetensors and the rest still come from
    this interpreter's environment, which stays untouched; the folder, first on a subprocess's
    PYTHONPATH, only shadows transformers 5 and its newer tokenizers and huggingface-hub.
    """
    folder = transformers_4_dir(release)
    marker = os.path.join(folder, "transformers", "__init__.py")
    if os.path.isfile(marker):
        return folder
    with cache_lock(os.path.basename(folder)):
        if not os.path.isfile(marker):
            _install_transformers_4(release, folder)
    return folder


def _install_transformers_4(release: tuple[str, ...], folder: str) -> None:
    with tempfile.TemporaryDirectory(dir=os.path.dirname(folder)) as scratch:
        target = os.path.join(scratch, "site-packages")
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "--target",
            target,
            *release,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not os.path.isfile(
            os.path.join(target, "transformers", "__init__.py")
        ):
            pytest.fail(
                f"could not fetch {release[0]}, a release our Hugging Face exports must load in "
                f"besides 5.x: {' '.join(command)} failed:\n{result.stderr[-2000:]}"
            )
        os.replace(target, folder)


def run_transformers_4(
    script: str, *args: str, timeout: int = 300, release: tuple[str, ...] = TRANSFORMERS_4
) -> subprocess.CompletedProcess:
    """Run `python {script} {args}` in the repository root with the transformers 4.x `release`
    importable (`ensure_transformers_4`) instead of the installed 5.x; fails the test if it
    fails."""
    env = dict(os.environ, PYTHONPATH=ensure_transformers_4(release), PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{script} under {release[0]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def run_cli(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python {script} {args}` in the repository root, as a user would (forked from the
    preloaded process, tests/preloaded.py); stdout and stderr apart; never raises."""
    from tests import preloaded

    return preloaded.launch(
        [sys.executable, script, *args],
        os.path.join(REPO_ROOT, script),
        list(args),
        1,
        "python",
        dict(os.environ if env is None else env),
        REPO_ROOT,
        timeout=300,
        separate_stderr=True,
    )


def run_oracle(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a script with megatron-core (not this project) importable as `megatron`."""
    oracle = ensure_megatron_core_oracle()
    env = dict(os.environ, PYTHONPATH=oracle, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=oracle,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(
            f"oracle script {script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


@pytest.fixture(scope="session")
def stdlib_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """100 standard-library files tokenized with the real GPT-2 vocabulary; the prefix."""
    from tests.pretrain_runs import build_stdlib_dataset

    return build_stdlib_dataset(str(tmp_path_factory.mktemp("stdlib_data")))


@pytest.fixture(scope="session")
def stdlib_texts() -> list[str]:
    """100 standard-library modules (each cut at 20,000 characters) and a few Unicode texts."""
    from tests.tokenizer.trained_tokenizers import stdlib_texts

    return stdlib_texts()


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory, stdlib_texts) -> str:
    """A LLaMA-style SentencePiece BPE .model (1,000 pieces, byte fallback, <s> 1, </s> 2,
    no pad) trained on `stdlib_texts`: for --tokenizer-model with the SentencePiece types."""
    from tests.tokenizer.trained_tokenizers import train_sentencepiece

    return train_sentencepiece(stdlib_texts, str(tmp_path_factory.mktemp("sentencepiece")))


@pytest.fixture(scope="session")
def _hf_bpe(tmp_path_factory: pytest.TempPathFactory, stdlib_texts) -> tuple[str, str]:
    from tests.tokenizer.trained_tokenizers import train_hf_bpe

    return train_hf_bpe(stdlib_texts, str(tmp_path_factory.mktemp("hf_bpe")))


@pytest.fixture(scope="session")
def hf_tokenizer_json(_hf_bpe) -> str:
    """A byte-level BPE tokenizer.json (1,000 tokens, <|endoftext|> id 0) trained on
    `stdlib_texts`: for --tokenizer-type HFTokenizer --tokenizer-model."""
    return _hf_bpe[0]


@pytest.fixture(scope="session")
def hf_tokenizer_dir(_hf_bpe) -> str:
    """The same tokenizer as a folder AutoTokenizer loads (eos_token <|endoftext|>)."""
    return _hf_bpe[1]


@pytest.fixture(scope="session", autouse=True)
def _preloaded_launchers_end() -> Iterator[None]:
    """End the preloaded processes that launched this session's runs (tests/preloaded.py)."""
    yield
    from tests import preloaded

    preloaded.close_all()


@pytest.fixture(scope="session", autouse=True)
def _no_deepspeed_cpu_inference_comm() -> None:
    """Tests that start DeepSpeed in this process skip its CPU shared-memory op, as runs do.

    (megatron.deepspeed_facts.skip_deepspeed_cpu_inference_comm: a JIT build under a lock that a
    killed process leaves behind, and /dev/shm buffers; spawned worlds do the same.)
    """
    from megatron.deepspeed_facts import skip_deepspeed_cpu_inference_comm

    skip_deepspeed_cpu_inference_comm()


@pytest.fixture(scope="session")
def sentencepiece_dataset(sentencepiece_model: str, stdlib_texts: list[str], tmp_path_factory):
    """The stdlib texts tokenized by tools/preprocess_data.py with the SentencePiece model."""
    work = tmp_path_factory.mktemp("sentencepiece_data")
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in stdlib_texts))
    done = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py")]
        + ["--input", str(corpus), "--output-prefix", str(work / "llama")]
        + [
            "--tokenizer-type",
            "GPTSentencePieceTokenizer",
            "--tokenizer-model",
            sentencepiece_model,
        ]
        + ["--append-eod", "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return str(work / "llama_text_document")
