"""Megatron-DeepSpeed's DeepSpeed-Ulysses scripts (examples_deepspeed/sequence_parallel/), scaled
to a tiny GPT and run on CPU through the deepspeed launcher.

The scripts' flags and config shape stay (ZeRO-1 or ZeRO-3, token-based schedule, full
recomputation through DeepSpeed's activation checkpointing); the sizes shrink (2 layers, h 64,
4 heads, 32 tokens) and the initial weights grow with them (`--init-method-std 0.2`: a
misrouted sequence part then moves the loss far above the rounding bound below), the run is
fp32 with dropout 0 (DeepSpeed's CPU accelerator has no fp16, and equality needs no random
masks), and `--use-flash-attn-triton` goes (flash kernels need a GPU; SDPA is the same
attention). What must hold:

- S=2 over 2 ranks logs the losses and gradient norms of one process with the same global
  batch, at ZeRO-1 (the 1.3B script) and ZeRO-3 (the 30B script): equal up to fp32 sums in
  other orders (`assert_losses_reordered`; the norms to the log's 3 decimals);
- a checkpoint saved at S=2 resumes at S=1 and at S=4 to the losses of the run that never
  stopped: the weights load at any S, ZeRO's partitioned optimizer state through DeepSpeed's
  universal checkpoint (a plain resume is refused in one line that says so).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from megatron.config import ModelConfig
from tests.compat.scripts import SCRIPTS_DIR, load_script, localized, with_values
from tests.compat.test_script_runs import GLOBAL_BATCH, SEQ, TINY, _iteration_lines, _launch
from tests.tolerances import assert_losses_reordered, training_loss_terms

ITERATIONS = 6
VOCAB = 50304
"""The GPT-2 vocabulary padded to a multiple of 128 (TINY): the rows the softmax sums over."""
MODEL = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
    max_position_embeddings=SEQ,
)  # fmt: skip
"""TINY's model; a micro-batch is one sequence of SEQ tokens, a step GLOBAL_BATCH of them."""
# The other script runs' tiny sizes, this file's 6-iteration token schedule, fp32, no dropout.
ULYSSES_TINY = {
    **TINY,
    "--eval-interval": ["1000"],
    "--train-samples": [str(ITERATIONS * GLOBAL_BATCH)],
    "--train-tokens": [str(ITERATIONS * GLOBAL_BATCH * SEQ)],
    "--lr-warmup-tokens": [str(2 * GLOBAL_BATCH * SEQ)],
    "--lr-decay-tokens": [str(ITERATIONS * GLOBAL_BATCH * SEQ)],
    "--fp16": None,
    "--use-flash-attn-triton": None,
    "--hidden-dropout": ["0"],
    "--attention-dropout": ["0"],
    # The scripts' 0.013 and 0.008 suit h=2048 and 7168; at h=64 they would leave the logits
    # so small that a wrong sequence split moved the loss by less than rounding may.
    "--init-method-std": ["0.2"],
}
ZERO1 = "sequence_parallel__ds_pretrain_gpt_1.3B_seq_parallel_32k"
ZERO3 = "sequence_parallel__ds_pretrain_gpt_30B_seq_parallel_32k"


def _argv(name: str, scratch: str, dataset: str, sequence_parallel: int, **extra) -> list[str]:
    """The script's argv, scaled, fp32, at `--ds-sequence-parallel-size sequence_parallel`, its
    paths in `scratch`; `extra` flags set after that (a --load of another run's folder)."""
    script = load_script(os.path.join(SCRIPTS_DIR, name + ".json"))
    config = {key: value for key, value in script.ds_config.items() if key != "fp16"}
    config.update(train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=1)
    sizes = {**ULYSSES_TINY, "--ds-sequence-parallel-size": [str(sequence_parallel)]}
    script = dataclasses.replace(script, argv=with_values(script.argv, sizes), ds_config=config)
    return with_values(localized(script, dataset, scratch), extra)


def _logged(run: subprocess.CompletedProcess) -> list[tuple[int, float, float]]:
    """(iteration, lm loss, grad norm) of every iteration line of a run that ended cleanly."""
    assert run.returncode == 0, run.stdout[-4000:]
    return [
        (log["iteration"], log["lm loss"], log["grad norm"]) for log in _iteration_lines(run.stdout)
    ]


def _assert_same(ours: list, theirs: list) -> None:
    """Equal iterations from the same weights and optimizer state; the i-th loss up to sums in
    other orders over i + 1 steps' paths (`loss_terms`), gradient norms to the log's 3
    decimals (each side rounded there, so 2e-3: a sum of squares over every parameter has no
    useful worst-case bound, and its actual rounding is far below the log's resolution)."""
    assert [step for step, _, _ in ours] == [step for step, _, _ in theirs], (ours, theirs)
    terms = [
        training_loss_terms(MODEL, SEQ, GLOBAL_BATCH * SEQ, steps) for steps in range(len(theirs))
    ]
    losses = [loss for _, loss, _ in ours]
    expected = [loss for _, loss, _ in theirs]
    assert_losses_reordered(losses, expected, terms=terms, vocab=VOCAB, what=str(ours))
    for (step, _, norm), (_, _, their_norm) in zip(ours, theirs):
        assert math.isclose(norm, their_norm, abs_tol=2e-3), (step, norm, their_norm)


def _one_process_and_s2(name: str, dataset: str, scratch: str, **extra) -> tuple[list, list]:
    """(1 process, S=2 on 2 ranks) of `name`, checked equal iteration by iteration."""
    one = _launch("deepspeed", _argv(name, os.path.join(scratch, "s1"), dataset, 1), ranks=1)
    two = _launch("deepspeed", _argv(name, os.path.join(scratch, "s2"), dataset, 2, **extra))
    assert "sequence-parallel (DeepSpeed-Ulysses) 2" in two.stdout, two.stdout[-4000:]
    logged = _logged(one)
    assert [step for step, _, _ in logged] == list(range(1, ITERATIONS + 1))
    assert logged[-1][1] < logged[0][1] - 0.2  # it trains
    # Another order of the same fp32 sums (ZeRO-3 also sums the sequence parts' gradients as
    # (S x part) / (S x DP), see megatron.arguments.ulysses_checks).
    _assert_same(_logged(two), logged)
    return logged, _logged(two)


@pytest.mark.slow
def test_zero3_s2_logs_the_losses_of_one_process(stdlib_dataset: str, tmp_path) -> None:
    """The 30B script (ZeRO-3): S=2 on 2 ranks (data-parallel 1) equals 1 process."""
    _one_process_and_s2(ZERO3, stdlib_dataset, str(tmp_path))


@pytest.mark.slow
def test_zero1_s2_equals_one_process_and_resumes_at_s1_and_s4(stdlib_dataset, tmp_path) -> None:
    """The 1.3B script (ZeRO-1): S=2 equals 1 process; saved at S=2, iteration 3, it resumes
    at S=1 and at S=4 (through DeepSpeed's universal checkpoint) to iterations 4-6 of the run
    that never stopped."""
    _, straight = _one_process_and_s2(
        ZERO1, stdlib_dataset, str(tmp_path), **{"--save-interval": ["3"]}
    )
    expected = straight[3:]
    save = os.path.join(str(tmp_path / "s2"), "save")  # where localized() put the run's --save
    refused = _launch(
        "deepspeed",
        _argv(ZERO1, str(tmp_path / "refused"), stdlib_dataset, 1, **{"--load": [save]}),
        ranks=1,
    )
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and errors, refused.stdout[-4000:]
    assert (
        "partitioned over 2 data x sequence parallel (Ulysses or context) rank(s), this run has 1"
        in errors[0]
    )
    assert "--universal-checkpoint" in errors[0]
    step = os.path.join(save, "global_step3")
    convert = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            step,
            "--output_folder",
            step + "_universal",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert convert.returncode == 0, convert.stdout[-3000:] + convert.stderr[-3000:]
    for sequence_parallel, ranks in ((1, 1), (4, 4)):
        argv = _argv(
            ZERO1,
            str(tmp_path / f"resumed{sequence_parallel}"),
            stdlib_dataset,
            sequence_parallel,
            **{"--load": [save], "--universal-checkpoint": []},
        )
        resumed = _launch("deepspeed", argv, ranks=ranks)
        assert "at iteration 3" in resumed.stdout, resumed.stdout[-4000:]
        # Another S sums the sequence parts in another order, from the state saved at 3.
        _assert_same(_logged(resumed), expected)
