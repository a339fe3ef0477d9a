"""Flags a run's engine accepts without acting on them are named at start-up, with why
(megatron/arguments/engine_notes.py), and only where they do nothing."""

from __future__ import annotations

import pytest

from megatron.arguments import build_parser, typed_flags, validate_args

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


def notes(extra: str, world_size: int = 2) -> list[str]:
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(
        parser.parse_args(argv), world_size, typed_flags(parser, argv)
    ).compat_notes


def _said(flag: str, extra: str) -> bool:
    return any(note.startswith(f" > {flag}: no effect") for note in notes(extra))


@pytest.mark.parametrize(
    "flags, noted",
    [
        ("--deepspeed --no-pipeline-parallel --zero-stage 1", True),
        ("--deepspeed --zero-stage 1", True),  # DeepSpeed's pipeline engine
        ("--deepspeed --no-pipeline-parallel --zero-stage 1 --ckpt-format torch_dist", False),
        ("", False),  # the plain engine's files leave the optimizer out
    ],
)
def test_no_save_optim_on_deepspeeds_files(flags: str, noted: bool):
    assert _said("--no-save-optim", f"{flags} --no-save-optim") == noted


@pytest.mark.parametrize(
    "flags, noted",
    [
        ("--pipeline-model-parallel-size 2", True),  # averaged once after the schedule
        ("--pipeline-model-parallel-size 2 --use-torch-fsdp2", False),
        ("", False),  # DDP's buckets overlap the backward
        ("--use-distributed-optimizer", False),
    ],
)
def test_overlap_grad_reduce_under_unsharded_schedules(flags: str, noted: bool):
    assert _said("--overlap-grad-reduce", f"{flags} --overlap-grad-reduce") == noted
