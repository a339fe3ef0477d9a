"""Megatron-LM's checkpoint-format flags: what each spelling means here, and a one-line refusal
naming the flag for each choice that is not built."""

from __future__ import annotations

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


def validated(extra: str, world_size: int = 2):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


@pytest.mark.parametrize(
    "flags, chosen",
    [
        ("", "torch"),  # Megatron-DeepSpeed's files stay the default
        ("--ckpt-format torch", "torch"),
        ("--ckpt-format torch_dist", "torch_dist"),
        ("--ckpt-format torch_dcp", "torch_dist"),  # Megatron-LM's name for plain DCP
        ("--use-dist-ckpt", "torch_dist"),
        ("--use-dist-ckpt --ckpt-format torch", "torch"),
        ("--ckpt-format torch_dist --dist-ckpt-format torch_dist --auto-detect-ckpt-format "
         "--ckpt-fully-parallel-save --ckpt-fully-parallel-load --ckpt-assume-constant-structure "
         "--dist-ckpt-strictness assume_ok_unexpected", "torch_dist"),
        ("--ckpt-format torch_dist --use-torch-fsdp2 --pipeline-model-parallel-size 2",
         "torch_dist"),
        ("--ckpt-format torch_dist --async-save", "torch_dist"),
    ],
)  # fmt: skip
def test_each_spelling_means_one_format(flags: str, chosen: str) -> None:
    assert validated(flags).ckpt_format == chosen


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor"),
        ("--async-save", "--async-save needs --ckpt-format torch_dist"),
        ("--dist-ckpt-format zarr", "--dist-ckpt-format zarr"),
        ("--dist-ckpt-strictness raise_all", "--dist-ckpt-strictness raise_all"),
        ("--ckpt-format torch_dist --deepspeed --zero-stage 1", "--ckpt-format torch_dist with "
         "--deepspeed"),
        ("--ckpt-format torch_dist --num-experts 2", "--ckpt-format torch_dist with "
         "--num-experts 2"),
    ],
)  # fmt: skip
def test_refusals_name_the_flag(flags: str, words: str) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(flags)
    assert words in str(refused.value) and "\n" not in str(refused.value)
