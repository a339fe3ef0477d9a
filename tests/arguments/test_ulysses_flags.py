"""`--ds-sequence-parallel-size`: Megatron-DeepSpeed's meaning (data-parallel size = world / (TP x
PP x S)) and a one-line refusal, naming the flags, for each layout DeepSpeed-Ulysses cannot run."""

from __future__ import annotations

import json

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


def _config(tmp_path, **zero) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0, **zero}}))
    return f"--deepspeed --deepspeed_config {path}"


def validated(extra: str, world_size: int = 4):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_data_parallel_size_is_world_over_s(tmp_path) -> None:
    args = validated(
        f"{_config(tmp_path)} --no-pipeline-parallel --ds-sequence-parallel-size 2 "
        "--global-batch-size 4"
    )
    assert (args.ds_sequence_parallel_size, args.data_parallel_size) == (2, 2)
    assert args.gradient_accumulation_steps == 2  # 4 = micro 1 x 2 x data-parallel 2
    assert args.deepspeed_config_dict["train_batch_size"] == 4
    assert args.layout.sequence_split_gradient_scale == 1


def test_zero3_scales_each_part_by_s(tmp_path) -> None:
    args = validated(
        f"{_config(tmp_path, stage=3)} --zero-stage 3 --no-pipeline-parallel "
        "--ds-sequence-parallel-size 4"
    )
    assert args.layout.sequence_split_gradient_scale == 4


@pytest.mark.parametrize(
    "extra, world, words",
    [
        ("--ds-sequence-parallel-size 2", 4, "--ds-sequence-parallel-size 2 needs --deepspeed"),
        ("DS --ds-sequence-parallel-size 2", 4, "needs --no-pipeline-parallel"),
        (
            "DS --no-pipeline-parallel --ds-sequence-parallel-size 2 "
            "--tensor-model-parallel-size 2",
            4,
            "--tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1, not 2 and 1",
        ),
        (
            "DS --no-pipeline-parallel --ds-sequence-parallel-size 4",
            6,
            "world size (6) is not divisible by --tensor-model-parallel-size (1) x "
            "--pipeline-model-parallel-size (1) x --ds-sequence-parallel-size (4) = 4",
        ),
        (
            "DS --no-pipeline-parallel --ds-sequence-parallel-size 4 --seq-length 30 "
            "--max-position-embeddings 30",
            4,
            "--seq-length (30) is not divisible by --ds-sequence-parallel-size 4",
        ),
        (
            "DS --no-pipeline-parallel --ds-sequence-parallel-size 4 --num-attention-heads 2 "
            "--kv-channels 32",
            4,
            "--num-attention-heads (2) is not divisible by --ds-sequence-parallel-size 4",
        ),
        (
            "DS --no-pipeline-parallel --ds-sequence-parallel-size 4 --num-key-value-heads 2",
            4,
            "--num-key-value-heads (2) is not divisible by --ds-sequence-parallel-size 4",
        ),
        (
            "DS --no-pipeline-parallel --ds-sequence-parallel-size 2 --num-experts 4",
            4,
            "--ds-sequence-parallel-size 2 with --num-experts",
        ),
        ("DS --ds-sequence-parallel-size 0", 4, "--ds-sequence-parallel-size (0) must be"),
    ],
)
def test_refusals_name_the_flags(tmp_path, extra: str, world: int, words: str) -> None:
    with pytest.raises(ArgumentError) as error:
        validated(extra.replace("DS", _config(tmp_path)), world)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_zero3_without_reduce_scatter_is_refused(tmp_path) -> None:
    with pytest.raises(ArgumentError, match='"zero_optimization.reduce_scatter": false with'):
        validated(
            f"{_config(tmp_path, stage=3, reduce_scatter=False)} --zero-stage 3 "
            "--no-pipeline-parallel --ds-sequence-parallel-size 2"
        )
