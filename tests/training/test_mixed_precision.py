"""--fp16 / --bf16 without DeepSpeed: fp32 master weights, autocast compute, fp16 loss scaling.

The runs are real `pretrain_gpt.py` runs of a tiny GPT-2 on the stdlib corpus, compared with
the same run in fp32. Half-precision matmuls are slow on CPU, so they are kept short.

Tolerance of the loss comparison: bf16 keeps 8 significant bits and fp16 11, so each matmul
output is rounded by up to 2^-9 (bf16) relative; through a 2-layer model the loss moves by
that order (we measured at most 6e-5 relative for bf16 over 50 iterations). We allow 0.5%
relative: ten times the rounding of one bf16 product, yet ten times smaller than what 12
iterations of training change (10.73 -> 10.0), so a run that does not learn, or learns from
other gradients, fails it.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.config import ModelConfig, model_params_dtype
from megatron.training.optimizer import GuardedAdamW
from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags

ITERATIONS = 12
RELATIVE_TOLERANCE = 5e-3


def _run(dataset: str, *extra: str, iterations: int = ITERATIONS) -> list[dict]:
    flags = tiny_gpt_flags(dataset) + [
        "--global-batch-size", "4", "--train-iters", str(iterations), *extra,
    ]  # fmt: skip
    done = launch(1, flags, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    logs = iteration_logs(done.stdout)
    assert len(logs) == iterations
    return logs


@pytest.fixture(scope="module")
def fp32_losses(stdlib_dataset: str) -> list[float]:
    return [log["lm loss"] for log in _run(stdlib_dataset)]


def _assert_tracks(logs: list[dict], reference: list[float]) -> None:
    assert all(log["number of nan iterations"] == 0 for log in logs)
    assert all(log["number of skipped iterations"] == 0 for log in logs)
    for log, expected in zip(logs, reference):
        assert log["lm loss"] == pytest.approx(expected, rel=RELATIVE_TOLERANCE), log
    assert reference[-1] < reference[0] - 0.3  # the comparison is over real learning


def test_plain_path_keeps_fp32_parameters() -> None:
    for flags in ({"bf16": True}, {"fp16": True}, {}):
        args = argparse.Namespace(**{"deepspeed": False, "bf16": False, "fp16": False, **flags})
        assert model_params_dtype(args) == "float32"
    assert model_params_dtype(argparse.Namespace(deepspeed=True, bf16=True)) == "bfloat16"
    assert model_params_dtype(argparse.Namespace(deepspeed=True, fp16=True)) == "float16"
    # Megatron's own checkpoints store args.params_dtype as a torch.dtype: the rule ignores it.
    megatron_args = argparse.Namespace(
        num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128,
        max_position_embeddings=64, fp16=True, params_dtype=torch.float16,
    )  # fmt: skip
    assert ModelConfig.from_args(megatron_args).params_dtype == "float32"


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_an_update_below_half_resolution_moves_the_fp32_master_weight(half) -> None:
    """100 AdamW steps of 3e-5 on a weight of 1.0: each is below half precision's spacing."""

    def train(dtype: torch.dtype) -> float:
        weight = torch.nn.Parameter(torch.full((4, 4), 1.0, dtype=dtype))
        optimizer = GuardedAdamW([weight], lr=3e-5, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
        for _ in range(100):
            with torch.autocast("cpu", dtype=half):
                loss = (torch.ones(2, 4) @ weight).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return weight.float().mean().item()

    # Adam's step is ~lr per iteration whatever the gradient's size: 1.0 - 100 x 3e-5.
    assert train(torch.float32) == pytest.approx(0.997, abs=1e-5)
    # Stepping the half-precision weight itself loses every update (what we used to do).
    assert train(half) == 1.0


@pytest.mark.slow
def test_plain_bf16_tracks_fp32(stdlib_dataset: str, fp32_losses: list[float]) -> None:
    _assert_tracks(_run(stdlib_dataset, "--bf16"), fp32_losses)


@pytest.mark.slow
def test_plain_fp16_tracks_fp32(stdlib_dataset: str, fp32_losses: list[float]) -> None:
    # An initial scale that never overflows here, so every iteration is applied and comparable.
    _assert_tracks(_run(stdlib_dataset, "--fp16", "--initial-loss-scale", "4096"), fp32_losses)


def megatron_dynamic_grad_scaler(initial: float, found_infs: list[bool]) -> list[float]:
    """The scale after each iteration under Megatron's DynamicGradScaler.update (transcribed;
    min_scale 1, growth 2, backoff 0.5, growth_interval 1000, hysteresis 2: our defaults)."""
    scale, growth_tracker, hysteresis_tracker, scales = initial, 0, 2, []
    for found_inf in found_infs:
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth_tracker += 1
            if growth_tracker == 1000:
                growth_tracker = 0
                hysteresis_tracker = 2
                scale = scale * 2.0
        scales.append(scale)
    return scales


@pytest.mark.slow
def test_fp16_loss_scale_settles_by_megatrons_rule(stdlib_dataset: str) -> None:
    initial = 2.0**20
    logs = _run(stdlib_dataset, "--fp16", "--initial-loss-scale", str(initial), iterations=16)
    skipped = [log["number of skipped iterations"] == 1 for log in logs]
    assert sum(skipped) >= 2  # the scale starts too high: the schedule is exercised
    assert not any(skipped[-8:])  # ... and settles: the last half of the run is all applied
    assert all(log["number of nan iterations"] == 0 for log in logs)
    scales = [log["loss scale"] for log in logs]
    assert scales == megatron_dynamic_grad_scaler(initial, skipped)
    losses = [log["lm loss"] for log in logs if "lm loss" in log]  # skipped ones have none
    assert losses[-1] < losses[0] - 0.2
