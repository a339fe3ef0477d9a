"""The base install, as most users have it: `pip install -e .` without extras.

The rest of the suite runs in the test environment, which holds every extra (torchao,
transformers, pyarrow, matplotlib, wandb, tiktoken, nltk): nothing there notices an import of an
optional package on a path that does not need it. Here a second environment gets only what
`scripts/setup_env.sh` with no extras installs (torch, pinned as there, and the project's own
dependencies), into a copy of the working tree as a user's clone would be; then, each as a
user would run it:

- every module of `megatron` and `tools` imports;
- the quickstart's own steps up to training (files -> JSON lines -> .bin/.idx -> checked ->
  `scripts/ds_pretrain_gpt2.sh`: DeepSpeed ZeRO-1 through the deepspeed launcher on 2
  processes) and its sampling from the checkpoint;
- the plain engine on one process, and on two with `--use-distributed-optimizer` and with
  `--use-torch-fsdp2`;
- each feature that needs an extra stops in one `error:` line that names the package and the
  extra (`pip install -e '.[hf]'`): the Hugging Face export, import and sampling, the loss
  plot, FP8, W&B, tiktoken, Parquet input, sentence splitting, a tokenizer folder.

The environment (tests/base_env.py) is kept in `.cache/` for the next run while the project's
build inputs stay the same (scripts/setup_env.sh's own stamp); scripts/run_tests.sh builds it
while the test environment installs.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests import base_env
from tests.conftest import MERGE_FILE, VOCAB_FILE
from tests.distributed import free_port

pytestmark = pytest.mark.slow  # a virtualenv of its own and launched runs

EXTRAS = {
    "torchao": "fp8",
    "transformers": "hf",
    "safetensors": "hf",
    "pyarrow": "data",
    "matplotlib": "plot",
    "wandb": "wandb",
    "tiktoken": "tiktoken",
    "nltk": "sentences",
}
"""Each optional package and the extra (pyproject.toml) that installs it."""
TINY_GPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
    "--train-iters 3 --split 90,10,0 --eval-iters 1 --eval-interval 1000 --log-interval 1 "
    f"--num-workers 0 --vocab-file {VOCAB_FILE} --merge-file {MERGE_FILE}"
).split()


@pytest.fixture(scope="module")
def base() -> tuple[str, str]:
    """(python of the base environment, the copy of the working tree it installed)."""
    try:
        python, source = base_env.build()
    except base_env.BuildError as error:
        pytest.fail(f"scripts/setup_env.sh failed in the base environment:\n{error}")
    found = _run(python, "-c", _IMPORTABLE, *EXTRAS, cwd=source)
    assert found.returncode == 0 and found.stdout.split() == [], found.stdout + found.stderr
    return python, source


_IMPORTABLE = """import importlib.util, sys
print(" ".join(name for name in sys.argv[1:] if importlib.util.find_spec(name)))"""


def _env(python: str, **overrides: str) -> dict[str, str]:
    """A user's shell with the base environment first on PATH (its launchers), on CPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PATH=os.pathsep.join([os.path.dirname(python), env.get("PATH", "")]),
        CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        MASTER_PORT=str(free_port()),
        # DeepSpeed's JIT-built ops of this environment apart from the test environment's (a
        # build directory that another environment's ninja touched is built again).
        TORCH_EXTENSIONS_DIR=os.path.join(base_env.BASE_DIR, "torch_extensions"),
    )
    env.update(overrides)
    return env


def _run(python: str, *args: str, cwd: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, *args], cwd=cwd, env=_env(python, **env), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def _assert_needs_extra(run: subprocess.CompletedProcess, package: str) -> None:
    """A non-zero exit after one `error:` line, the last, naming the package and its extra."""
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), run.stderr[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1, run.stderr[-3000:]
    for fragment in (package, f"pip install -e '.[{EXTRAS[package]}]'"):
        assert fragment in lines[-1], (fragment, lines[-1])


def test_every_module_imports(base) -> None:
    python, source = base
    script = (
        "import importlib, pkgutil, sys\n"
        "import megatron, tools\n"
        "for package in (megatron, tools):\n"
        "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(module.name)\n"
        "print('imported')\n"
    )
    run = _run(python, "-c", script, cwd=source)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-4000:]


@pytest.fixture(scope="module")
def corpus(base, tmp_path_factory) -> str:
    """The quickstart's first steps on 40 standard-library files: its corpus prefix."""
    python, source = base
    work = tmp_path_factory.mktemp("base_quickstart")
    files = work / "files"
    files.mkdir()
    stdlib = os.path.dirname(os.__file__)
    for name in sorted(os.listdir(stdlib))[:80]:
        if name.endswith(".py") and len(os.listdir(files)) < 40:
            shutil.copy(os.path.join(stdlib, name), files / name)
    steps = [
        ["tools/files_to_jsonl.py", "--input-dir", str(files), "--extensions", ".py"]
        + ["--output", str(work / "corpus.jsonl")],
        ["tools/preprocess_data.py", "--input", str(work / "corpus.jsonl")]
        + ["--json-keys", "content", "--output-prefix", str(work / "corpus")]
        + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB_FILE]
        + ["--merge-file", MERGE_FILE, "--append-eod", "--workers", "2"],
        ["tools/check_dataset.py", "--prefix", str(work / "corpus_content_document")]
        + ["--input", str(work / "corpus.jsonl"), "--json-key", "content", "--seq-length", "64"],
    ]
    for step in steps:
        run = _run(python, *step, cwd=source)
        assert run.returncode == 0, (step[0], run.stdout[-2000:], run.stderr[-3000:])
    return str(work / "corpus_content_document")


def test_quickstart_trains_with_deepspeed_and_samples(base, corpus, tmp_path) -> None:
    python, source = base
    checkpoint = tmp_path / "checkpoint"
    env = _env(
        python,
        DATA_PATH=corpus,
        CHECKPOINT_PATH=str(checkpoint),
        TENSORBOARD_DIR=str(tmp_path / "tensorboard"),
        GPUS_PER_NODE="2",
        TRAIN_ITERS="4",
        SEQ_LENGTH="64",
        LOG_INTERVAL="1",
        SAVE_INTERVAL="4",
        EVAL_INTERVAL="4",
    )
    train = subprocess.run(
        ["bash", "scripts/ds_pretrain_gpt2.sh"], cwd=source, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    output = train.stdout + train.stderr
    assert train.returncode == 0, output[-4000:]
    assert "iteration        4/       4" in output, output[-4000:]
    assert (checkpoint / "latest").is_file()
    sample = _run(
        python, "tools/generate_samples_gpt.py", "--load", str(checkpoint), "--prompt",
        "def __init__(self", "--greedy", "--out-seq-length", "8", cwd=source,
    )  # fmt: skip
    assert sample.returncode == 0 and "def __init__(self" in sample.stdout, sample.stderr[-3000:]
    # The quickstart's export, its check with transformers and its plot need the hf and plot
    # extras (which the quickstart installs): without them, one line each.
    hf_dir = str(tmp_path / "hf")
    export = _run(python, "tools/checkpoint/convert_to_hf.py", "--load", str(checkpoint),
                  "--save", hf_dir, cwd=source)  # fmt: skip
    _assert_needs_extra(export, "transformers")
    assert not os.path.exists(hf_dir)
    folder = tmp_path / "a_hf_folder"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    sample_hf = _run(python, "tools/checkpoint/sample_hf.py", "--load", str(folder), "--prompt",
                     "x", cwd=source)  # fmt: skip
    _assert_needs_extra(sample_hf, "transformers")
    log = tmp_path / "train.log"
    log.write_text(output)
    plot = _run(python, "tools/plot_loss.py", "--log", str(log), "--output",
                str(tmp_path / "loss.png"), cwd=source)  # fmt: skip
    _assert_needs_extra(plot, "matplotlib")


@pytest.mark.parametrize(
    "processes, flags",
    [
        (1, []),
        (2, ["--use-distributed-optimizer"]),
        (2, ["--use-torch-fsdp2"]),
    ],
    ids=["plain-1", "distributed-optimizer-2", "fsdp2-2"],
)
def test_plain_engine_trains(base, corpus, processes: int, flags: list[str], tmp_path) -> None:
    python, source = base
    argv = ["pretrain_gpt.py", *TINY_GPT, "--data-path", corpus, *flags]
    argv += ["--save", str(tmp_path / "checkpoint"), "--save-interval", "3"]
    if processes > 1:
        launcher = os.path.join(os.path.dirname(python), "torchrun")
        port = free_port()
        run = subprocess.run(
            [launcher, f"--nproc_per_node={processes}", f"--master_port={port}", *argv],
            cwd=source, env=_env(python), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    else:
        run = _run(python, *argv, cwd=source)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "iteration        3/       3" in output, output[-4000:]
    assert (tmp_path / "checkpoint" / "iter_0000003").is_dir()


# pretrain_gpt.py's flags that need an extra, each with the package it needs.
_PRETRAIN_EXTRAS = {
    "fp8": (["--bf16", "--fp8-format", "hybrid"], "torchao"),
    "wandb": (["--wandb-project", "base-install"], "wandb"),
    "tiktoken": (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "x.tiktoken"],
                 "tiktoken"),
}  # fmt: skip


@pytest.mark.parametrize("feature", sorted(_PRETRAIN_EXTRAS))
def test_a_flag_that_needs_an_extra_stops_in_one_line(base, corpus, feature, tmp_path) -> None:
    python, source = base
    flags, package = _PRETRAIN_EXTRAS[feature]
    save = tmp_path / "checkpoint"
    argv = ["pretrain_gpt.py", *TINY_GPT, "--data-path", corpus, *flags, "--save", str(save)]
    argv += ["--save-interval", "3"]
    run = _run(python, *argv, cwd=source, WANDB_MODE="offline")
    _assert_needs_extra(run, package)
    assert not save.exists()


def test_tools_that_need_an_extra_stop_in_one_line(base, tmp_path) -> None:
    python, source = base
    (tmp_path / "corpus.parquet").write_bytes(b"PAR1")
    preprocess = ["tools/preprocess_data.py", "--output-prefix", str(tmp_path / "out")]
    preprocess += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB_FILE]
    preprocess += ["--merge-file", MERGE_FILE, "--workers", "1"]
    parquet = _run(python, *preprocess, "--input", str(tmp_path / "corpus.parquet"), cwd=source)
    _assert_needs_extra(parquet, "pyarrow")
    (tmp_path / "corpus.jsonl").write_text('{"text": "One. Two."}\n')
    sentences = _run(python, *preprocess, "--input", str(tmp_path / "corpus.jsonl"),
                     "--split-sentences", cwd=source)  # fmt: skip
    _assert_needs_extra(sentences, "nltk")
    folder = tmp_path / "hf_folder"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    hf_folder = _run(python, *preprocess[:2], str(tmp_path / "out2"), "--input",
                     str(tmp_path / "corpus.jsonl"), "--tokenizer-type", "HFTokenizer",
                     "--tokenizer-model", str(folder), "--workers", "1", cwd=source)  # fmt: skip
    _assert_needs_extra(hf_folder, "transformers")
    imported = _run(python, "tools/checkpoint/convert_from_hf.py", "--load", str(folder),
                    "--save", str(tmp_path / "imported"), cwd=source)  # fmt: skip
    _assert_needs_extra(imported, "transformers")
    assert not (tmp_path / "out_text_document.bin").exists()
