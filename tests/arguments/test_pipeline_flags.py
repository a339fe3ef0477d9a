"""The pipeline flags: DeepSpeed's engine under --deepspeed, Megatron's schedules without it,
virtual stages in either spelling, and one line naming the flags for every bad layout."""

from __future__ import annotations

import json

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.layout import Engine

BASE = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


def validated(extra: str, world_size: int = 2):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_pipeline_without_deepspeed_runs_megatrons_schedule() -> None:
    args = validated("--pipeline-model-parallel-size 2 --global-batch-size 4")
    assert args.layout.engine is Engine.MEGATRON_SCHEDULES
    assert args.virtual_pipeline_model_parallel_size is None  # Megatron's "not interleaved"


def test_fewer_micro_batches_than_stages_is_megatrons_1f1b_too() -> None:
    # Megatron-LM's GPT-3 175B ramp starts at 2 micro-batches on 16 stages.
    args = validated("--pipeline-model-parallel-size 2 --global-batch-size 1")
    assert args.gradient_accumulation_steps == 1 and args.layout.engine is Engine.MEGATRON_SCHEDULES


@pytest.mark.parametrize(
    "flags",
    [
        "--virtual-pipeline-model-parallel-size 2",
        "--num-layers-per-virtual-pipeline-stage 2",
        "--virtual-pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2",
    ],
)
def test_virtual_stages_in_either_spelling(flags: str) -> None:
    args = validated(f"--pipeline-model-parallel-size 2 --global-batch-size 4 {flags}")
    assert args.virtual_pipeline_model_parallel_size == 2


def test_deepspeed_keeps_its_pipeline_engine(tmp_path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 4}))
    args = validated(f"--pipeline-model-parallel-size 2 --deepspeed --deepspeed_config {config}")
    assert args.layout.engine is Engine.DEEPSPEED_PIPE


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (
            "--virtual-pipeline-model-parallel-size 2",
            1,
            "--virtual-pipeline-model-parallel-size 2 needs --pipeline-model-parallel-size above 1",
        ),
        (
            "--pipeline-model-parallel-size 2 --global-batch-size 4 "
            "--virtual-pipeline-model-parallel-size 3",
            2,
            "--num-layers (8) is not divisible by --pipeline-model-parallel-size 2 x 3 virtual",
        ),
        (
            "--pipeline-model-parallel-size 2 --global-batch-size 4 "
            "--num-layers-per-virtual-pipeline-stage 3",
            2,
            "--num-layers-per-virtual-pipeline-stage 3: --num-layers (8) must be a multiple",
        ),
        (
            "--pipeline-model-parallel-size 2 --global-batch-size 4 "
            "--num-layers-per-virtual-pipeline-stage 2 --virtual-pipeline-model-parallel-size 4",
            2,
            "--num-layers-per-virtual-pipeline-stage 2 means "
            "--virtual-pipeline-model-parallel-size 2, not 4",
        ),
        (
            "--pipeline-model-parallel-size 2 --global-batch-size 3 "
            "--virtual-pipeline-model-parallel-size 2",
            2,
            "a global batch of 3 is 3 micro-batches of --micro-batch-size 1 x data-parallel size "
            "1; the interleaved schedule needs a multiple of --pipeline-model-parallel-size (2)",
        ),
        (
            "--pipeline-model-parallel-size 2 --global-batch-size 4 --train-samples 100 "
            "--rampup-batch-size 1 1 50 --virtual-pipeline-model-parallel-size 2",
            2,
            "a global batch of 1 is 1 micro-batches",
        ),
        (
            "--pipeline-model-parallel-size 3 --global-batch-size 4",
            3,
            "--num-layers (8) is not divisible by --pipeline-model-parallel-size 3",
        ),
        (
            "--pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1",
            2,
            "--pipeline-model-parallel-split-rank 1: embedding-only pipeline stages and "
            "encoder-decoder (T5) pipeline splits are not built here",
        ),
        (
            "--pipeline-model-parallel-size 2 --standalone-embedding-stage",
            2,
            "--standalone-embedding-stage: embedding-only pipeline stages",
        ),
    ],
)
def test_bad_layouts_are_one_line_naming_the_flags(extra, world_size, message) -> None:
    with pytest.raises(ArgumentError) as refused:
        _validate_raw(extra, world_size)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value)


def _validate_raw(extra: str, world_size: int):
    base = BASE.replace("--train-iters 10 ", "") if "--train-samples" in extra else BASE
    argv = (base + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_deepspeed_with_megatrons_flags_for_its_pipeline_is_refused(tmp_path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 4}))
    deepspeed = f"--deepspeed --deepspeed_config {config}"
    with pytest.raises(ArgumentError, match="^--no-pipeline-parallel with "):
        validated(f"--pipeline-model-parallel-size 2 --no-pipeline-parallel {deepspeed}")
    with pytest.raises(ArgumentError, match="^--virtual-pipeline-model-parallel-size 2: the int"):
        validated(
            f"--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 {deepspeed}"
        )
