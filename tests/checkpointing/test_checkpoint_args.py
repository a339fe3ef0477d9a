"""--use-checkpoint-args: the model's flags come from the checkpoint in --load, as Megatron-LM's
`load_args_from_checkpoint` takes them (sizes given on the command line kept, the other model
flags overridden, each printed), before validation builds the model config.

A run saved in each format (Megatron's per-rank files, torch_dist, DeepSpeed's) resumes from a
command line without one architecture flag (DeepSpeed's ZeRO-3 rank files are read from a
hand-written one too); the rule itself is checked on a hand-written checkpoint file; a --load
without a checkpoint is refused in one line.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from megatron.arguments import parse_args
from megatron.checkpointing.file_format import CHECKPOINT_VERSION
from tests.conftest import MERGE_FILE, VOCAB_FILE

# A LLaMA-style shape, none of it the parser's defaults.
ARCHITECTURE = (
    "--num-layers 3 --hidden-size 48 --num-attention-heads 4 --num-key-value-heads 2 "
    "--seq-length 32 --max-position-embeddings 64 --normalization rmsnorm --swiglu "
    "--use-rotary-position-embeddings --rotary-base 500000 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0"
).split()


def _run_flags(data_prefix: str, save: str) -> list[str]:
    """Data, batch and iteration flags: what a resuming command line still says."""
    return (
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 1e-3 --min-lr 1e-4 "
        "--lr-warmup-iters 1 --lr-decay-style cosine --clip-grad 1.0 "
        f"--data-path {data_prefix} --vocab-file {VOCAB_FILE} --merge-file {MERGE_FILE} "
        "--split 90,10,0 --eval-iters 0 --log-interval 1 --num-workers 0 "
        f"--distributed-backend gloo --seed 1234 --save {save} --save-interval 2 "
        "--log-num-zeros-in-grad"
    ).split()


FORMATS = {
    "torch": [],
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "deepspeed": ["--deepspeed", "--zero-stage", "1", "--no-pipeline-parallel"],
}


def _model_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(" > model: "))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_command_without_the_architecture_resumes_with_the_saved_shape(
    fmt: str, stdlib_dataset: str, tmp_path
) -> None:
    from tests.pretrain_runs import iteration_logs, launch

    save = str(tmp_path / "checkpoints")
    flags = _run_flags(stdlib_dataset, save) + FORMATS[fmt]
    if fmt == "deepspeed":
        config = tmp_path / "ds_config.json"
        config.write_text("{}")
        flags += ["--deepspeed_config", str(config)]
    first = launch(1, ARCHITECTURE + flags + ["--exit-interval", "2"])
    assert first.returncode == 0, first.stdout[-3000:]
    resumed = launch(1, flags + ["--load", save, "--use-checkpoint-args"])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    out = resumed.stdout
    for line in (
        "Setting num_layers to 3 from checkpoint",
        "Setting hidden_size to 48 from checkpoint",
        "Setting num_key_value_heads to 2 from checkpoint",
        "Setting swiglu to True from checkpoint",
        "Setting normalization to rmsnorm from checkpoint",
        "Setting rope_theta to 500000.0 from checkpoint",
    ):
        assert line in out.splitlines(), line
    assert _model_line(out) == _model_line(first.stdout)
    assert "at iteration 2" in next(line for line in out.splitlines() if "> loaded" in line)
    logs = iteration_logs(out)
    assert [log["iteration"] for log in logs] == [3, 4]
    assert all(log["num zeros"] >= 0.0 for log in logs)
    if fmt == "torch":  # the same iterations as one uninterrupted run
        whole = launch(1, ARCHITECTURE + _run_flags(stdlib_dataset, str(tmp_path / "whole")))
        assert whole.returncode == 0, whole.stdout[-3000:]
        expected = iteration_logs(whole.stdout)[2:]
        assert [log["lm loss"] for log in logs] == [log["lm loss"] for log in expected]


@pytest.mark.parametrize(
    "filename", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
)
def test_deepspeeds_files_give_their_saved_args(filename: str, tmp_path) -> None:
    """DeepSpeed's layout (`latest` naming the tag; ZeRO-3 names its rank file apart)."""
    from megatron.checkpointing.saved_args import read_saved_args

    tag = tmp_path / "global_step7"
    tag.mkdir()
    saved = {"num_layers": 3, "hidden_size": 48, "swiglu": True}
    content = {"args": argparse.Namespace(**saved), "checkpoint_version": 3.0, "iteration": 7}
    torch.save(content, tag / filename)
    (tmp_path / "latest").write_text("global_step7")
    found = read_saved_args(str(tmp_path))
    assert found is not None and found.path == str(tag / filename)
    assert {key: found.args[key] for key in saved} == saved and found.version == 3.0


def _write_checkpoint(root: Path, saved: dict, version: float = CHECKPOINT_VERSION) -> None:
    """A Megatron-layout checkpoint of iteration 5 holding only `args`."""
    directory = root / "iter_0000005" / "mp_rank_00"
    directory.mkdir(parents=True)
    content = {"args": argparse.Namespace(**saved), "checkpoint_version": version, "iteration": 5}
    torch.save(content, directory / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("5")


def _parse(extra: str, world_size: int = 1) -> argparse.Namespace:
    argv = (
        f"--micro-batch-size 1 --train-iters 10 --lr 1e-3 --dry-run --vocab-file {VOCAB_FILE} "
        f"--merge-file {MERGE_FILE} {extra}"
    ).split()
    return parse_args(argv, world_size=world_size)


def test_megatron_lms_rule_sizes_given_are_kept_the_rest_overridden(tmp_path) -> None:
    saved = dict(
        num_layers=6,
        hidden_size=64,
        num_attention_heads=8,
        seq_length=128,
        max_position_embeddings=256,
        normalization="rmsnorm",
        swiglu=True,
        rotary_base=50000.0,  # Megatron-LM's name for --rotary-position-embeddings-theta
        use_rotary_position_embeddings=True,
        hidden_dropout=0.0,
        tensor_model_parallel_size=2,
    )
    _write_checkpoint(tmp_path, saved)
    args = _parse(f"--load {tmp_path} --use-checkpoint-args --num-layers 4 --hidden-dropout 0.2")
    assert args.num_layers == 4  # a size the command line gives wins
    assert (args.hidden_size, args.num_attention_heads, args.seq_length) == (64, 8, 128)
    assert args.max_position_embeddings == 256
    assert args.normalization == "rmsnorm" and args.swiglu
    assert args.use_rotary_position_embeddings and args.rope_theta == 50000.0
    assert args.hidden_dropout == 0.0  # the checkpoint's, over the command line's
    assert args.tensor_model_parallel_size == 1  # parallel sizes only when asked for
    mp = _parse(
        f"--load {tmp_path} --use-checkpoint-args --use-mp-args-from-checkpoint-args", world_size=2
    )
    assert mp.tensor_model_parallel_size == 2


def test_the_notices_are_printed_at_start_up(tmp_path) -> None:
    _write_checkpoint(tmp_path, dict(num_layers=2, hidden_size=32, num_attention_heads=4))
    args = _parse(f"--load {tmp_path} --use-checkpoint-args --seq-length 16")
    notes = args.compat_notes
    assert notes[0].startswith(" > --use-checkpoint-args: model flags from ")
    assert os.path.join("iter_0000005", "mp_rank_00", "model_optim_rng.pt") in notes[0]
    assert "Setting num_layers to 2 from checkpoint" in notes
    assert "Checkpoint did not provide arguments ffn_hidden_size" in notes
    assert not any("seq_length" in note for note in notes)  # given, and not forced


@pytest.mark.parametrize(
    "load, words",
    [
        (None, ["--use-checkpoint-args needs --load"]),
        ("empty", ["--use-checkpoint-args", "no checkpoint in --load"]),
        ("missing", ["--use-checkpoint-args", "no checkpoint in --load"]),
    ],
)
def test_no_checkpoint_to_read_is_refused_in_one_line(
    load: str | None, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    extra = "--use-checkpoint-args"
    if load is not None:
        directory = tmp_path / load
        if load == "empty":
            directory.mkdir()
        extra += f" --load {directory}"
    with pytest.raises(SystemExit):
        _parse(extra)
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error, error
    assert all(word in error for word in words), error


def test_a_megatron_lm_moe_checkpoint_keeps_its_family_and_layers(tmp_path) -> None:
    """An imported Mixtral (top-2: the parser's default; every layer MoE) and a DeepSeek-style
    model (dense first layer, group-limited routing) resume from the checkpoint's MoE flags
    alone: Megatron-LM's MoE with its layer pattern, not DeepSpeed-MoE's every-other layer."""
    from megatron.checkpointing.checks import check_checkpoint_args
    from megatron.checkpointing.huggingface_routed import routed_moe_args

    shape = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16)
    mixtral = dict(shape, **routed_moe_args(4, 2), expert_interval=2)
    deepseek = dict(
        shape,
        **routed_moe_args(
            8, 4, moe_layer_freq=[0, 1, 1, 1], moe_router_num_groups=4, moe_router_group_topk=2
        ),
    )
    for saved in (mixtral, deepseek):
        root = tmp_path / str(len(os.listdir(tmp_path)))
        _write_checkpoint(root, saved)
        args = _parse(f"--load {root} --use-checkpoint-args")
        assert args.routed_moe and args.num_experts == saved["num_experts"]
        assert args.moe_layer_freq == saved["moe_layer_freq"]
        assert args.moe_router_topk == saved["moe_router_topk"]
        assert args.moe_router_num_groups == saved["moe_router_num_groups"]
        check_checkpoint_args(saved, args, str(root), False)  # raises on another MoE shape
