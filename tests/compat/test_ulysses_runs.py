"""Megatron-DeepSpeed's DeepSpeed-Ulysses scripts (examples_deepspeed/sequence_parallel/), scaled
to a tiny GPT and run on CPU through the deepspeed launcher.

The scripts' flags and config shape stay (ZeRO-1 or ZeRO-3, token-based schedule, full
recomputation through DeepSpeed's activation checkpointing); the sizes shrink (2 layers, h 64,
4 heads, 32 tokens), the run is fp32 with dropout 0 (DeepSpeed's CPU accelerator has no fp16,
and equality needs no random masks), and `--use-flash-attn-triton` goes (flash kernels need a
GPU; SDPA is the same attention). What must hold:

- S=2 over 2 ranks logs the losses and gradient norms of one process with the same global
  batch, at ZeRO-1 (the 1.3B script) and ZeRO-3 (the 30B script);
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

from tests.compat.scripts import SCRIPTS_DIR, load_script, localized, with_values
from tests.compat.test_script_runs import GLOBAL_BATCH, SEQ, TINY, _iteration_lines, _launch

ITERATIONS = 6
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


def _assert_same(ours: list, theirs: list, rel_tol: float = 1e-5) -> None:
    """Equal iterations; losses to `rel_tol`, gradient norms to the log's 3 decimals."""
    assert [step for step, _, _ in ours] == [step for step, _, _ in theirs], (ours, theirs)
    for (step, loss, norm), (_, their_loss, their_norm) in zip(ours, theirs):
        assert math.isclose(loss, their_loss, rel_tol=rel_tol), (step, loss, their_loss)
        assert math.isclose(norm, their_norm, abs_tol=2e-3), (step, norm, their_norm)


def _one_process_and_s2(name: str, dataset: str, scratch: str, **extra) -> tuple[list, list]:
    """(1 process, S=2 on 2 ranks) of `name`, checked equal iteration by iteration."""
    one = _launch("deepspeed", _argv(name, os.path.join(scratch, "s1"), dataset, 1), ranks=1)
    two = _launch("deepspeed", _argv(name, os.path.join(scratch, "s2"), dataset, 2, **extra))
    assert "sequence-parallel (DeepSpeed-Ulysses) 2" in two.stdout, two.stdout[-4000:]
    logged = _logged(one)
    assert [step for step, _, _ in logged] == list(range(1, ITERATIONS + 1))
    assert logged[-1][1] < logged[0][1] - 0.2  # it trains
    # ZeRO-3 sums the sequence parts' gradients as (S x part) / (S x DP) (see
    # megatron.arguments.ulysses_checks): fp32 roundings of its own, which Adam's first steps
    # at this learning rate grow to 2e-5 of the loss by iteration 6 (1e-6 at iteration 4).
    _assert_same(_logged(two), logged, rel_tol=1e-4 if name == ZERO3 else 1e-5)
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
    assert "partitioned over 2 data x sequence parallel rank(s), this run has 1" in errors[0]
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
        # Another S sums the sequence parts in another order: fp32 roundings that Adam's
        # steps grow to about 1e-5 of the loss over 3 iterations.
        _assert_same(_logged(resumed), expected, rel_tol=1e-4)
