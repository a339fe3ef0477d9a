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
        # FSDP2 sharding: Megatron-LM's default, the format whose saves stay sharded
        ("--use-distributed-optimizer", "torch_dist"),
        ("--use-torch-fsdp2 --async-save", "torch_dist"),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "torch_dist"),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy no_shard", "torch"),
        ("--ckpt-format torch_dist --deepspeed --no-pipeline-parallel --zero-stage 3 --bf16",
         "torch_dist"),
        ("--ckpt-format torch_dist --deepspeed --no-pipeline-parallel --zero-stage 0 --num-experts "
         "2", "torch_dist"),
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
        ("--dist-ckpt-strictness return_all", "--dist-ckpt-strictness return_all: "
         "megatron-core returns the mismatched keys to an API caller"),
        ("--ckpt-format torch_dist --deepspeed --zero-stage 1", "--ckpt-format torch_dist with "
         "DeepSpeed's pipeline engine"),
        ("--ckpt-format torch_dist --deepspeed --zero-stage 0 --no-pipeline-parallel --bf16",
         "--ckpt-format torch_dist with --deepspeed bf16 at ZeRO stage 0"),
        ("--ckpt-format torch_dist --deepspeed --zero-stage 0 --no-pipeline-parallel --fp16",
         "FP16_UnfusedOptimizer"),
        ("--ckpt-format torch --use-distributed-optimizer", "--ckpt-format torch with "
         "--use-distributed-optimizer: Megatron's per-rank files hold whole tensors"),
        ("--ckpt-format torch --use-torch-fsdp2", "--ckpt-format torch with --use-torch-fsdp2"),
        ("--ckpt-format torch --use-megatron-fsdp --data-parallel-sharding-strategy "
         "optim_grads_params", "--use-megatron-fsdp --data-parallel-sharding-strategy "
         "optim_grads_params: Megatron's per-rank files"),
    ],
)  # fmt: skip
def test_refusals_name_the_flag(flags: str, words: str) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(flags)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def _checkpoint(root) -> str:  # noqa: ANN001 - a pytest tmp_path
    """A directory that holds a checkpoint as far as the flags' checks look (its tracker)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return str(root)


def test_conversion_flags_are_megatron_lms(tmp_path) -> None:
    loaded = _checkpoint(tmp_path / "run")
    args = validated(f"--load {loaded} --ckpt-convert-format torch_dist "
                     f"--ckpt-convert-save {tmp_path / 'out'}")  # fmt: skip
    assert args.ckpt_convert_format == "torch_dist"
    assert args.ckpt_convert_save == str(tmp_path / "out")


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--ckpt-convert-format torch", "--ckpt-convert-format torch needs --ckpt-convert-save"),
        ("--ckpt-convert-save {out}", "--ckpt-convert-save needs --ckpt-convert-format"),
        ("--ckpt-convert-format torch --ckpt-convert-save {out}", "needs --load"),
        ("--load {empty} --ckpt-convert-format torch --ckpt-convert-save {out}",
         "--load {empty} holds no checkpoint"),
        ("--load {run} --ckpt-convert-format torch_dist --ckpt-convert-save {done}",
         "{done}/torch_dist already holds a checkpoint"),
        ("--load {run} --ckpt-convert-format torch --ckpt-convert-save {out} --no-load-optim",
         "with --no-load-optim"),
        ("--load {run} --ckpt-convert-format torch_dist --ckpt-convert-save {out} --deepspeed "
         "--zero-stage 1", "--ckpt-convert-format torch_dist with DeepSpeed's pipeline engine"),
        ("--load {run} --ckpt-convert-format torch --ckpt-convert-save {out} --use-torch-fsdp2",
         "--ckpt-convert-format torch with --use-torch-fsdp2: Megatron's per-rank files would "
         "gather"),
    ],
)  # fmt: skip
def test_conversion_refusals_name_the_flag(flags: str, words: str, tmp_path) -> None:
    places = dict(run=_checkpoint(tmp_path / "run"), out=str(tmp_path / "out"),
                  empty=str(tmp_path / "empty"), done=str(tmp_path / "done"))  # fmt: skip
    (tmp_path / "empty").mkdir()
    _checkpoint(tmp_path / "done" / "torch_dist")
    with pytest.raises(ArgumentError) as refused:
        validated(flags.format(**places))
    assert words.format(**places) in str(refused.value) and "\n" not in str(refused.value)
