"""DeepSpeed's Megatron-LM GPT-2 tutorial (Megatron-LM v1 scripts) runs as written.

The five command lines (tests/compat/v1_scripts/*.json, captured from DeepSpeedExamples) parse
and validate with v1's meanings at the world size where their batch arithmetic holds, and
are refused in one line naming the numbers where it does not. Two of them, scaled to a tiny
GPT, run on CPU through their own launchers from a working directory holding v1's
`data/webtext/data.json`, with no vocabulary flags: the loose JSON is tokenized once, the
loss falls, and a second launch resumes from the first one's checkpoint.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest

from megatron.arguments.errors import ArgumentError
from megatron.arguments.parser import build_parser, typed_flags
from megatron.arguments.validation import SHIPPED_GPT2_VOCAB, validate_args
from megatron.layout import Engine
from megatron.training.monitor import parse_iteration_log
from tests.compat.scripts import bf16_for_cpu, load_script, localized, with_values
from tests.conftest import REPO_ROOT
from tests.distributed import free_port
from tests.preloaded import launch_command
from tests.pretrain_runs import cpu_env

V1_DIR = os.path.join(os.path.dirname(__file__), "v1_scripts")
NAMES = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(f"{V1_DIR}/*.json"))
# Where DeepSpeedExamples' own scripts launch a world their config's batch does not fit.
REFUSED_AT = {
    "ds_pretrain_gpt2": (1, "but 16 != 8 x 1 x 1"),
    "ds_zero2_pretrain_gpt2_model_parallel": (16, "but 16 != 8 x 1 x 4"),
}


def _script(name: str):
    return load_script(os.path.join(V1_DIR, name + ".json"))


@pytest.fixture
def v1_work_dir(tmp_path, monkeypatch, stdlib_texts):
    """A working directory as v1 expected: data/webtext/data.json, data/wikipedia/..."""
    for relative in ("data/webtext/data.json", "data/wikipedia/wikidump_lines.json"):
        path = tmp_path / "work" / relative
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in stdlib_texts))
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "work"


def _validate(name: str, dataset: str, scratch: str, world_size: int):
    argv = localized(_script(name), dataset, scratch)
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_the_tutorial_scripts_are_all_here() -> None:
    assert NAMES == [
        "ds_pretrain_gpt2",
        "ds_zero2_pretrain_gpt2_model_parallel",
        "pretrain_gpt2",
        "pretrain_gpt2_model_parallel",
        "v1.1.5_3D_parallelism__ds_pretrain_gpt2_pipe",
    ]
    for name in NAMES:
        assert _script(name).source.startswith("microsoft/DeepSpeedExamples@")


@pytest.mark.parametrize("name", NAMES)
def test_script_validates_with_v1_meanings(name, v1_work_dir, stdlib_dataset, tmp_path) -> None:
    script = _script(name)
    args = _validate(name, stdlib_dataset, str(tmp_path / "out"), script.world_size)
    argv = script.argv
    value = {flag: argv[argv.index(flag) + 1] for flag in ("--batch-size",) if flag in argv}
    assert args.micro_batch_size == int(value["--batch-size"])
    model_parallel = (
        int(argv[argv.index("--model-parallel-size") + 1])
        if ("--model-parallel-size" in argv)
        else 1
    )
    assert args.tensor_model_parallel_size == model_parallel
    sizes = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    assert sizes * args.data_parallel_size == script.world_size
    assert args.global_batch_size == (
        args.micro_batch_size * args.gradient_accumulation_steps * args.data_parallel_size
    )
    assert args.lr_warmup_fraction == 0.01  # --warmup .01: v1's fraction of the decay iterations
    assert args.recompute_granularity == "full"  # --checkpoint-activations
    if "--train-data" in argv:
        corpus = args.train_data_corpus
        v1_path = {
            "webtext": "data/webtext/data.json",
            "wikipedia": "data/wikipedia/wikidump_lines.json",
        }
        expected = v1_path[argv[argv.index("--train-data") + 1]]
        assert corpus.sources == (str(v1_work_dir / expected),)
        assert args.data_path == [corpus.data_prefix]
        assert args.vocab_file == SHIPPED_GPT2_VOCAB  # the scripts give no vocabulary
    if script.ds_config is not None:
        assert args.deepspeed_config_dict["train_batch_size"] == args.global_batch_size


def test_each_script_means_what_v1_meant(v1_work_dir, stdlib_dataset, tmp_path) -> None:
    out = str(tmp_path / "out")
    tutorial = _validate("ds_pretrain_gpt2", stdlib_dataset, out, 2)
    assert tutorial.zero_stage == 1  # "zero_optimization": true, DeepSpeed's early form
    assert tutorial.save_interval == 5000  # v1's default; the script gives --save only
    zero2 = _validate("ds_zero2_pretrain_gpt2_model_parallel", stdlib_dataset, out, 8)
    assert (zero2.zero_stage, zero2.layout.engine) == (2, Engine.DEEPSPEED)
    assert zero2.deepspeed_activation_checkpointing and zero2.partition_activations
    plain = _validate("pretrain_gpt2", stdlib_dataset, out, 1)
    assert not plain.deepspeed and plain.global_batch_size == 8
    bare = _validate("pretrain_gpt2_model_parallel", stdlib_dataset, out, 8)
    assert bare.deepspeed and bare.deepspeed_config_dict["train_batch_size"] == 32
    assert bare.deepspeed_config_dict["fp16"]["enabled"]  # built from the flags
    pipe = _validate("v1.1.5_3D_parallelism__ds_pretrain_gpt2_pipe", stdlib_dataset, out, 16)
    assert (pipe.pipeline_model_parallel_size, pipe.layout.engine) == (2, Engine.DEEPSPEED_PIPE)
    assert (pipe.micro_batch_size, pipe.gradient_accumulation_steps, pipe.data_parallel_size) == (
        4,
        16,
        4,
    )


@pytest.mark.parametrize("name", sorted(REFUSED_AT))
def test_scripts_whose_batch_cannot_hold_are_refused_in_one_line(
    name, v1_work_dir, stdlib_dataset, tmp_path
) -> None:
    world_size, numbers = REFUSED_AT[name]
    with pytest.raises(ArgumentError) as refused:
        _validate(name, stdlib_dataset, str(tmp_path / "out"), world_size)
    message = str(refused.value)
    assert "train_micro_batch_size_per_gpu (--batch-size)" in message and numbers in message
    assert "\n" not in message


# ------------------------------------------------------------------ runs through launchers

TINY = {
    "--num-layers": ["2"],
    "--hidden-size": ["64"],
    "--num-attention-heads": ["4"],
    "--batch-size": ["2"],
    "--seq-length": ["32"],
    "--max-position-embeddings": ["32"],
    "--train-iters": ["10"],
    "--lr-decay-iters": ["10"],
    "--lr": ["3e-3"],
    "--log-interval": ["1"],
    "--save-interval": ["5"],
    "--eval-interval": ["5"],
    "--eval-iters": ["1"],
    "--num-workers": ["0"],
}


def _launch(
    launcher: str, argv: list[str], cwd: str, for_real: bool = True
) -> subprocess.CompletedProcess:
    """pretrain_gpt2.py with `argv` on 2 ranks through `launcher` itself, or (not `for_real`)
    forked from the preloaded process as it would start them (tests/preloaded.py)."""
    script = os.path.join(REPO_ROOT, "pretrain_gpt2.py")
    bin_dir = os.path.dirname(sys.executable)
    port = str(free_port())
    commands = {
        # DeepSpeed's launcher under the name the 2020 script calls it by.
        "deepspeed.pt": [os.path.join(bin_dir, "deepspeed.pt"), "--num_nodes", "1"]
        + ["--num_gpus", "2", "--master_port", port, script],
        "torch.distributed.launch": [sys.executable, "-m", "torch.distributed.launch"]
        + ["--nproc_per_node", "2", "--nnodes", "1", "--master_port", port, script],
    }
    if not for_real:
        return launch_command(commands[launcher] + argv, cpu_env(OMP_NUM_THREADS="1"), cwd, 600)
    return subprocess.run(
        commands[launcher] + argv,
        cwd=cwd,
        env=cpu_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


def _iterations(output: str) -> list[dict]:
    logs = [
        parse_iteration_log(line) for line in output.splitlines() if "consumed samples:" in line
    ]
    return [log for log in logs if "lm loss" in log]


def _run_twice(name: str, launcher: str, sizes: dict, work: str, scratch: str) -> None:
    """First launch stops at iteration 5 (--exit-interval), the second resumes to 10."""
    script = _script(name)
    argv, config = bf16_for_cpu(script.argv, script.ds_config)  # no fp16 on DeepSpeed's CPU
    if config is not None:
        config = dict(config, train_batch_size=4)  # 2 x 1 x data-parallel 2, as 16 = 8 x 1 x 2
    argv = with_values(argv, {**TINY, **sizes})
    argv = localized(dataclasses.replace(script, argv=argv, ds_config=config), "unused", scratch)
    # As written, --save and --load are one folder (checkpoints/...) in the working directory.
    save = script.argv[script.argv.index("--save") + 1]
    argv = with_values(argv, {"--save": [save], "--load": [save]})
    assert not {"--vocab-file", "--merge-file", "--data-path"} & set(argv)
    first = _launch(launcher, with_values(argv, {"--exit-interval": ["5"]}), work)
    assert first.returncode == 0, first.stdout[-4000:]
    assert "--train-data webtext: tokenizing" in first.stdout
    losses = [log["lm loss"] for log in _iterations(first.stdout)]
    assert [log["iteration"] for log in _iterations(first.stdout)] == [1, 2, 3, 4, 5]
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.5, losses
    # The resume: the launcher's part was seen in the first launch.
    second = _launch(launcher, argv, work, for_real=False)
    assert second.returncode == 0, second.stdout[-4000:]
    assert "--train-data webtext: tokenizing" not in second.stdout  # the cached tokens serve
    assert "at iteration 5" in second.stdout  # loaded the first launch's checkpoint
    assert os.path.isdir(os.path.join(work, save))
    logs = _iterations(second.stdout)
    assert [log["iteration"] for log in logs] == [6, 7, 8, 9, 10]
    assert logs[0]["consumed samples"] == 6 * 4  # the data position resumed, too
    assert logs[-1]["lm loss"] < losses[0] - 0.5


@pytest.mark.slow
def test_ds_pretrain_gpt2_runs_through_deepspeed_and_resumes(v1_work_dir, tmp_path) -> None:
    """The tutorial's single-GPU script: deepspeed.pt, "zero_optimization": true (ZeRO-1),
    --train-data webtext, --cache-dir cache, --checkpoint-activations; 2 CPU ranks."""
    _run_twice("ds_pretrain_gpt2", "deepspeed.pt", {}, str(v1_work_dir), str(tmp_path / "out"))
    assert os.listdir(v1_work_dir / "cache")  # --cache-dir cache, in the working directory


@pytest.mark.slow
def test_pretrain_gpt2_model_parallel_runs_through_torch_launch_and_resumes(
    v1_work_dir, tmp_path
) -> None:
    """Megatron-LM v1's model-parallel script: python -m torch.distributed.launch, model
    parallel 2, a bare --deepspeed (its config built from the flags), --no-load-optim."""
    sizes = {"--model-parallel-size": ["2"], "--batch-size": ["4"]}
    _run_twice(
        "pretrain_gpt2_model_parallel",
        "torch.distributed.launch",
        sizes,
        str(v1_work_dir),
        str(tmp_path / "out"),
    )
