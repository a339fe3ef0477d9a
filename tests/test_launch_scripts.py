"""Tests for the launch scripts (scripts/*pretrain_gpt2*.sh, examples/pretrain_gpt*.sh).

Each script is checked by `bash -n` and shellcheck, then run as shipped (shortened through its
environment variables and extra arguments) on a small dataset built here, on CPU processes over
gloo, the launch it ends in forked from the preloaded process (tests/launcher_shim.py: the
stand-in `python`, `torchrun` and `deepspeed` it puts first on PATH). Launcher lines for GPUs
and several nodes are checked with stand-in `nvidia-smi`, `deepspeed` and `torchrun` commands
that print what they were given.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import pytest

from megatron.arguments.parser import build_parser, typed_flags
from megatron.arguments.validation import validate_args
from megatron.training.monitor import parse_iteration_log, parse_validation_line
from tests.conftest import REPO_ROOT
from tests.launcher_shim import shim_env
from tests.pretrain_runs import cpu_env

# script -> (launcher, processes on a CPU machine, tensor-parallel size)
SCRIPTS = {
    "scripts/ds_pretrain_gpt2.sh": ("deepspeed", 1, 1),
    "scripts/ds_zero2_pretrain_gpt2_model_parallel.sh": ("deepspeed", 2, 2),
    "scripts/pretrain_gpt2.sh": ("python", 1, 1),
    "scripts/pretrain_gpt2_model_parallel.sh": ("torchrun", 2, 2),
    "examples/pretrain_gpt.sh": ("python", 1, 1),
    "examples/pretrain_gpt_distributed.sh": ("torchrun", 2, 1),
}
# Checked for syntax and by shellcheck, and run with stand-in launchers below.
OTHER_SCRIPTS = [
    "examples/pretrain_gpt_slurm.sh",
    "examples/quickstart.sh",
    "examples/pretrain_llama2_distributed.sh",
]
DS_CONFIGS = sorted(glob.glob(os.path.join(REPO_ROOT, "examples", "ds_configs", "*.json")))
# The shortened run: 4 iterations of micro-batches of 2 sequences of 32 tokens, validation
# (and a checkpoint) every 2 iterations. Some settings go through the environment, some as
# extra arguments to pretrain_gpt.py, as a user would pass them.
TRAIN_ITERS = 4
SHORT_ENV = {
    "TRAIN_ITERS": str(TRAIN_ITERS),
    "SEQ_LENGTH": "32",
    "MICRO_BATCH_SIZE": "2",
    "EVAL_INTERVAL": "2",
    "SAVE_INTERVAL": "2",
}
SHORT_ARGS = ["--eval-iters", "1", "--log-interval", "1", "--num-workers", "0"]


_script_env = cpu_env
"""The environment of a CPU run: this venv's launchers first on PATH, no GPU visible."""


def _run(script: str, *args: str, env: dict[str, str], timeout: int = 600):
    """`bash script args`, stdout and stderr together; never raises on a non-zero exit."""
    return subprocess.run(
        ["bash", os.path.join(REPO_ROOT, script), *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def _iterations(output: str) -> list[dict]:
    return [
        parse_iteration_log(line) for line in output.splitlines() if line.startswith(" iteration")
    ]


def _validations(output: str) -> list[dict]:
    """Validation lines, each with the two dashed lines Megatron frames it with."""
    lines = output.splitlines()
    found = []
    for line in lines:
        if line.startswith(" validation loss at "):
            # Ranks share the output, so another rank's line may fall inside the frame.
            assert lines.count("-" * (len(line) + 1)) >= 2, line
            found.append(parse_validation_line(line))
    return found


@pytest.fixture(scope="session")
def dataset(stdlib_dataset: str) -> str:
    """A 100-document GPT-2 dataset cut from the standard library; returns its prefix."""
    return stdlib_dataset


@pytest.mark.parametrize("script", [*sorted(SCRIPTS), *OTHER_SCRIPTS])
def test_syntax(script: str) -> None:
    result = subprocess.run(["bash", "-n", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck() -> None:
    files = [*sorted(SCRIPTS), *OTHER_SCRIPTS, "scripts/common.sh"]
    result = subprocess.run(
        ["shellcheck", "-x", *files], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("config", DS_CONFIGS, ids=os.path.basename)
def test_ds_configs_reconcile(config: str) -> None:
    """Each shipped ds_config is valid JSON that our flags complete without a conflict."""
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    argv += ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8"]
    argv += ["--train-iters", "4", "--lr", "1e-3", "--deepspeed", "--deepspeed_config", config]
    # The flags' logic alone: whether this machine's accelerator runs fp16 is parse_args'
    # separate device check (tests/arguments/test_precision.py).
    parser = build_parser()
    args = validate_args(parser.parse_args(argv), 2, typed_flags(parser, argv))
    dsc = args.deepspeed_config_dict
    assert dsc["train_batch_size"] == 8 and dsc["gradient_accumulation_steps"] == 2
    assert args.zero_stage == dsc["zero_optimization"]["stage"]
    assert args.fp16 == ("fp16" in os.path.basename(config))


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_missing_data_is_a_clear_error(script: str, tmp_path) -> None:
    missing = str(tmp_path / "no_such_dataset")
    env = _script_env(DATA_PATH=missing, GPUS_PER_NODE="2", CHECKPOINT_PATH=str(tmp_path / "c"))
    result = _run(script, env=env, timeout=60)
    assert result.returncode == 1, result.stdout
    assert f"no dataset at DATA_PATH={missing}" in result.stdout
    assert "bash examples/quickstart.sh" in result.stdout
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_trains(script: str, dataset: str, tmp_path) -> None:
    """Run as shipped, shortened: iteration lines, validation, checkpoints, TensorBoard."""
    launcher, processes, tp = SCRIPTS[script]
    checkpoints, tensorboard = tmp_path / "checkpoints", tmp_path / "tensorboard"
    env = _script_env(
        DATA_PATH=dataset,
        CHECKPOINT_PATH=str(checkpoints),
        TENSORBOARD_DIR=str(tensorboard),
        **SHORT_ENV,
    )
    result = _run(script, *SHORT_ARGS, env=shim_env(env))
    output = result.stdout
    assert result.returncode == 0, output[-6000:]
    command = output.splitlines()[0]
    assert command.startswith("==> ") and launcher in command.split()[1], command
    assert f"initialized {processes} process(es)" in output, output[-6000:]
    assert f"tensor-parallel {tp} x" in output

    # Every script's default global batch is 4 sequences here (examples/pretrain_gpt.sh: 8).
    global_batch = 8 if script == "examples/pretrain_gpt.sh" else 4
    iterations = _iterations(output)
    assert [fields["iteration"] for fields in iterations] == list(range(1, TRAIN_ITERS + 1))
    for fields in iterations:
        assert fields["train iters"] == TRAIN_ITERS
        assert fields["global batch size"] == global_batch
        assert fields["consumed samples"] == fields["iteration"] * global_batch
        assert fields["consumed tokens"] == fields["consumed samples"] * 32
        assert 0 < fields["lm loss"] < 12

    validations = _validations(output)
    assert [values.get("iteration") for values in validations] == [2, 4, None, None]
    assert all(0 < values["lm loss value"] < 12 for values in validations)
    assert "validation loss at the end of training for val data" in output
    assert "validation loss at the end of training for test data" in output

    with open(checkpoints / "latest_checkpointed_iteration.txt") as file:
        assert file.read().strip() == str(TRAIN_ITERS)
    assert glob.glob(str(tensorboard / "events.out.tfevents.*"))


@pytest.mark.slow
def test_rerun_resumes_from_the_checkpoint(dataset: str, tmp_path) -> None:
    """A rerun with a larger TRAIN_ITERS and --override-lr-scheduler continues the run."""
    env = _script_env(
        DATA_PATH=dataset,
        CHECKPOINT_PATH=str(tmp_path / "checkpoints"),
        TENSORBOARD_DIR=str(tmp_path / "tensorboard"),
        **SHORT_ENV,
    )
    env = shim_env(dict(env, TRAIN_ITERS="2"))
    first = _run("scripts/pretrain_gpt2.sh", *SHORT_ARGS, "--eval-iters", "0", env=env)
    assert first.returncode == 0, first.stdout[-6000:]
    assert [fields["iteration"] for fields in _iterations(first.stdout)] == [1, 2]

    env.update(TRAIN_ITERS="4")
    more = ["--eval-iters", "0", "--override-lr-scheduler"]
    second = _run("scripts/pretrain_gpt2.sh", *SHORT_ARGS, *more, env=env)
    assert second.returncode == 0, second.stdout[-6000:]
    iterations = _iterations(second.stdout)
    assert [fields["iteration"] for fields in iterations] == [3, 4]
    assert [fields["consumed samples"] for fields in iterations] == [12, 16]


def _fake_commands(tmp_path, gpus: int, compute_capability: str = "9.0") -> str:
    """A PATH whose nvidia-smi lists `gpus` GPUs of `compute_capability` and whose launchers
    print their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"GPU {index}: NVIDIA H100 (UUID: GPU-{index})\\n" for index in range(gpus))
    capabilities = f"{compute_capability}\\n" * gpus
    commands = {
        "nvidia-smi": f'if [ "$1" = --query-gpu=compute_cap ]; then printf "{capabilities}"; '
        f'else printf "{listing}"; fi',
        "deepspeed": 'printf "%s\\n" deepspeed "$@"',
        "torchrun": 'printf "%s\\n" torchrun "$@"',
    }
    for name, body in commands.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    return os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])


def _launch(script: str, dataset: str, path: str, **overrides: str) -> tuple[int, list, str]:
    """Run a script with the stand-in commands on `path`; (exit code, launcher argv, output)."""
    env = _script_env(DATA_PATH=dataset, PATH=path, **overrides)
    if "CUDA_VISIBLE_DEVICES" not in overrides:
        del env["CUDA_VISIBLE_DEVICES"]
    result = _run(script, env=env, timeout=60)
    lines = result.stdout.splitlines()
    argv = lines[1:] if lines and lines[0].startswith("==> ") else []
    return result.returncode, argv, result.stdout


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _processes(argv: list[str]) -> str:
    return _flag(argv, "--num_gpus" if argv[0] == "deepspeed" else "--nproc_per_node")


@pytest.mark.parametrize(
    "script, tp",
    [
        ("scripts/ds_pretrain_gpt2.sh", 1),
        ("scripts/ds_zero2_pretrain_gpt2_model_parallel.sh", 2),
        ("scripts/pretrain_gpt2_model_parallel.sh", 2),
        ("examples/pretrain_gpt_distributed.sh", 1),
    ],
)
def test_gpus_per_node_defaults_to_the_gpu_count(script: str, tp: int, dataset, tmp_path):
    """One process per GPU that nvidia-smi lists (or CUDA_VISIBLE_DEVICES keeps)."""
    path = _fake_commands(tmp_path, gpus=8)
    accumulation = 1 if script.startswith("examples/") else 2
    for visible, gpus in ((None, 8), ("2,3", 2)):
        overrides = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        code, argv, output = _launch(script, dataset, path, **overrides)
        assert code == 0, output
        assert _processes(argv) == str(gpus)
        assert _flag(argv, "--tensor-model-parallel-size") == str(tp)
        # micro-batch 4 x data-parallel size x gradient accumulation
        assert _flag(argv, "--global-batch-size") == str(4 * gpus // tp * accumulation)
        assert os.path.join(REPO_ROOT, "pretrain_gpt.py") in argv


def test_precision_defaults_to_what_the_gpu_computes_in(dataset: str, tmp_path) -> None:
    """--bf16 on compute capability 8.0+, --fp16 below, fp32 on a CPU; a precision the
    command line, DS_CONFIG or PRECISION names is kept and never doubled."""
    fp16_config = os.path.join(REPO_ROOT, "examples", "ds_configs", "ds_zero2_fp16.json")
    cases = [
        # (script, GPUs, compute capability, environment, extra arguments, expected flags)
        ("scripts/ds_pretrain_gpt2.sh", 8, "9.0", {}, [], ["--bf16"]),
        ("examples/pretrain_gpt_distributed.sh", 1, "8.0", {}, [], ["--bf16"]),
        ("scripts/pretrain_gpt2_model_parallel.sh", 2, "7.0", {}, [], ["--fp16"]),
        ("scripts/ds_pretrain_gpt2.sh", 8, "9.0", {}, ["--fp16"], ["--fp16"]),
        ("scripts/ds_pretrain_gpt2.sh", 8, "9.0", {"DS_CONFIG": fp16_config}, [], []),
        ("scripts/ds_pretrain_gpt2.sh", 8, "9.0", {"PRECISION": "fp32"}, [], []),
        ("scripts/ds_pretrain_gpt2.sh", 8, "7.5", {"PRECISION": "bf16"}, [], ["--bf16"]),
        ("scripts/ds_pretrain_gpt2.sh", 0, "", {"GPUS_PER_NODE": "1"}, [], []),
    ]
    for script, gpus, capability, env, extra, expected in cases:
        path = _fake_commands(tmp_path, gpus, capability)
        env = _script_env(DATA_PATH=dataset, PATH=path, **env)
        if gpus:
            del env["CUDA_VISIBLE_DEVICES"]
        result = _run(script, *extra, env=env, timeout=60)
        argv = result.stdout.splitlines()[1:]
        assert result.returncode == 0, result.stdout
        assert [a for a in argv if a in ("--bf16", "--fp16")] == expected, (script, gpus, env)

    env = _script_env(DATA_PATH=dataset, PATH=_fake_commands(tmp_path, 8), PRECISION="tf32")
    result = _run("scripts/ds_pretrain_gpt2.sh", env=env, timeout=60)
    assert result.returncode == 1
    assert result.stdout.strip() == "error: PRECISION=tf32 is not one of bf16, fp16, fp32, auto"


def test_launcher_lines_for_several_nodes(dataset: str, tmp_path) -> None:
    path = _fake_commands(tmp_path, gpus=8)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    nodes = dict(NNODES="2", MASTER_ADDR="worker-1", MASTER_PORT="6010", GPUS_PER_NODE="8")

    script = "scripts/ds_pretrain_gpt2.sh"
    code, argv, output = _launch(script, dataset, path, **nodes)
    assert code == 1 and "NNODES=2 needs HOSTFILE" in output

    code, argv, output = _launch(script, dataset, path, HOSTFILE=str(hostfile), **nodes)
    assert code == 0, output
    assert argv[: argv.index(os.path.join(REPO_ROOT, "pretrain_gpt.py"))] == [
        "deepspeed",
        "--num_gpus",
        "8",
        "--master_port",
        "6010",
        "--hostfile",
        str(hostfile),
        "--num_nodes",
        "2",
        "--master_addr",
        "worker-1",
    ]
    assert _flag(argv, "--global-batch-size") == "128"  # 4 x 16 data-parallel ranks x 2

    code, argv, output = _launch(
        script, dataset, path, HOSTFILE=str(hostfile), DS_NO_SSH="1", NODE_RANK="1", **nodes
    )
    assert code == 0, output
    assert argv[argv.index("--no_ssh") + 1 : argv.index("--no_ssh") + 3] == ["--node_rank", "1"]

    code, argv, output = _launch(
        "examples/pretrain_gpt_distributed.sh", dataset, path, NODE_RANK="1", **nodes
    )
    assert code == 0, output
    assert argv[: argv.index(os.path.join(REPO_ROOT, "pretrain_gpt.py"))] == [
        "torchrun",
        "--nproc_per_node",
        "8",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "worker-1",
        "--master_port",
        "6010",
    ]


def test_sizes_that_do_not_divide_are_refused(dataset: str, tmp_path) -> None:
    path = _fake_commands(tmp_path, gpus=3)
    code, argv, output = _launch("scripts/pretrain_gpt2_model_parallel.sh", dataset, path)
    assert code == 1 and not argv
    assert re.search(r"3 process\(es\).*cannot be split into tensor-parallel 2", output)


@pytest.mark.parametrize(
    "script", [name for name in sorted(SCRIPTS) if SCRIPTS[name][0] != "python"]
)
def test_model_size_presets(script: str, dataset: str, tmp_path) -> None:
    """MODEL_SIZE sets GPT-2's shape and Megatron's recipe; the environment still overrides."""
    path = _fake_commands(tmp_path, gpus=8)
    code, argv, output = _launch(script, dataset, path, MODEL_SIZE="345M", LR="1e-4", TP="1")
    assert code == 0, output
    expected = {
        "--num-layers": "24",
        "--hidden-size": "1024",
        "--num-attention-heads": "16",
        "--seq-length": "1024",
        "--micro-batch-size": "8",
        "--global-batch-size": "512",
        "--train-iters": "500000",
        "--lr-decay-iters": "320000",
        "--split": "949,50,1",
        "--lr": "1e-4",
        "--min-lr": "3e-5",
    }
    assert {flag: _flag(argv, flag) for flag in expected} == expected

    code, argv, output = _launch(script, dataset, path, MODEL_SIZE="2B")
    assert code == 1 and not argv
    assert "error: MODEL_SIZE=2B is not one of 124M, 345M, 1.5B, tiny" in output


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_llama2_script_model_size_and_launchers(launcher: str, dataset: str, tmp_path) -> None:
    """examples/pretrain_llama2_distributed.sh: Megatron-DeepSpeed's LLaMA flags, a LLaMA-2
    preset with its GQA shape, bf16 written into the DeepSpeed config on an H100, either
    launcher; a SentencePiece TOKENIZER_MODEL replaces the GPT-2 files."""
    script = "examples/pretrain_llama2_distributed.sh"
    path = _fake_commands(tmp_path, gpus=8)
    run_dir = tmp_path / "run"
    code, argv, output = _launch(
        script,
        dataset,
        path,
        MODEL_SIZE="llama2-70B",
        TP="8",
        PP="1",
        LAUNCHER=launcher,
        RUN_DIR=str(run_dir),
        TOKENIZER_MODEL="tokenizer.model",
    )
    assert code == 0, output
    assert argv[0] == launcher and _processes(argv) == "8"
    expected = {
        "--num-layers": "80",
        "--hidden-size": "8192",
        "--ffn-hidden-size": "28672",
        "--num-attention-heads": "64",
        "--num-key-value-heads": "8",
        "--seq-length": "4096",
        "--global-batch-size": "1024",
        "--normalization": "rmsnorm",
        "--tokenizer-type": "GPTSentencePieceTokenizer",
        "--tokenizer-model": "tokenizer.model",
    }
    assert {flag: _flag(argv, flag) for flag in expected} == expected
    for switch in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
        assert switch in argv
    assert "--bf16" in argv and "--vocab-file" not in argv
    config = json.loads((run_dir / "deepspeed.json").read_text())
    assert config["bf16"] == {"enabled": True} and config["train_batch_size"] == 1024

    code, argv, output = _launch(script, dataset, path, MODEL_SIZE="llama3")
    assert code == 1 and not argv
    assert "error: MODEL_SIZE=llama3 is not one of llama-tiny" in output


def _fake_slurm(tmp_path, nodes: list[str]) -> str:
    """Stand-ins for scontrol (the job's host names) and srun (runs each node's task in turn)."""
    path = _fake_commands(tmp_path, gpus=8)
    bin_dir = tmp_path / "bin"
    commands = {
        "scontrol": 'printf "%s\\n" ' + " ".join(nodes),
        "srun": "while [[ $1 == --* ]]; do shift; done\n"
        f'for node in $(seq 0 {len(nodes) - 1}); do SLURM_NODEID=$node "$@" || exit $?; done',
    }
    for name, body in commands.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return path


@pytest.mark.parametrize(
    "launch_script, launcher",
    [
        ("scripts/ds_pretrain_gpt2.sh", "deepspeed"),
        ("examples/pretrain_gpt_distributed.sh", "torchrun"),
    ],
)
def test_slurm_script_starts_one_launcher_per_node(launch_script, launcher, dataset, tmp_path):
    path = _fake_slurm(tmp_path, ["gpu-node-7", "gpu-node-8"])
    hostfile = tmp_path / "hostfile"
    env = _script_env(
        DATA_PATH=dataset,
        PATH=path,
        SLURM_JOB_NODELIST="gpu-node-[7-8]",
        SLURM_NNODES="2",
        SLURM_SUBMIT_DIR=REPO_ROOT,
        SLURM_JOB_ID="42",
        LAUNCH_SCRIPT=launch_script,
        HOSTFILE=str(hostfile),
        MODEL_SIZE="124M",
    )
    del env["CUDA_VISIBLE_DEVICES"]
    result = _run("examples/pretrain_gpt_slurm.sh", "--bf16", env=env, timeout=60)
    assert result.returncode == 0, result.stdout
    assert "2 node(s) x 8 process(es): gpu-node-7 gpu-node-8" in result.stdout
    # Each launch prints '==> the command', then the stand-in launcher prints its argv.
    commands = [block.splitlines()[1:] for block in result.stdout.split("==> ")[2:]]
    assert [argv[0] for argv in commands] == [launcher, launcher]
    for node_rank, argv in enumerate(commands):
        assert _flag(argv, "--master_addr") == "gpu-node-7"
        assert _flag(argv, "--node_rank") == str(node_rank)
        assert _flag(argv, "--hidden-size") == "768"
        assert "--bf16" in argv and "--exit-signal-handler" in argv
        if launcher == "deepspeed":
            assert "--no_ssh" in argv and _flag(argv, "--hostfile") == str(hostfile)
        else:
            assert _flag(argv, "--nnodes") == "2"
    assert hostfile.read_text() == "gpu-node-7 slots=8\ngpu-node-8 slots=8\n"


def test_slurm_script_outside_a_job_is_a_clear_error(tmp_path) -> None:
    env = _script_env(SLURM_SUBMIT_DIR=REPO_ROOT)
    env.pop("SLURM_JOB_NODELIST", None)
    result = _run("examples/pretrain_gpt_slurm.sh", env=env, timeout=60)
    assert result.returncode == 1
    assert "error: SLURM_JOB_NODELIST is not set" in result.stdout
