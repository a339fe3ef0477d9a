"""`pretrain_gpt.py --multi-latent-attention` trains, saves and resumes (issue 57).

A real run of the tiny GPT with DeepSeek-V3's attention (a query latent, a shared key/value
latent with its norms, decoupled rotary channels, YaRN at factor 4) on the stdlib corpus with
the real GPT-2 vocabulary, torchrun TP=2 with sequence parallelism: the loss falls over 12
iterations, and a second launch resumed from a copy of the iteration-6 checkpoint logs the
first run's losses for iterations 7-12 (the same digits: a bit-exact resume)."""

from __future__ import annotations

import pytest

from tests.checkpointing.compare import rolled_back
from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags

MLA = (
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 24 --qk-head-dim 16 "
    "--qk-pos-emb-head-dim 8 --v-head-dim 12 --rotary-scaling-factor 4 --mscale 1.0 "
    "--mscale-all-dim 1.0 --qk-layernorm --position-embedding-type rope --normalization "
    "RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--tensor-model-parallel-size 2 --sequence-parallel --hidden-dropout 0 --attention-dropout 0"
).split()


@pytest.mark.slow
def test_mla_run_learns_and_resumes_bit_exactly(stdlib_dataset, tmp_path) -> None:
    """12 iterations (saved at 6), then 6 more from that checkpoint: the same losses."""
    save = str(tmp_path / "straight")
    flags = tiny_gpt_flags(stdlib_dataset) + MLA + ["--global-batch-size", "4"]
    flags += ["--train-iters", "12", "--lr", "5e-3", "--min-lr", "5e-4"]
    first = launch(2, flags + ["--save", save, "--save-interval", "6"])
    assert first.returncode == 0, first.stdout[-3000:]
    losses = [log["lm loss"] for log in iteration_logs(first.stdout)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0, losses
    resumed_dir = rolled_back(save, 6, str(tmp_path / "resumed"))
    resumed = launch(
        2, flags + ["--load", resumed_dir, "--save", resumed_dir, "--save-interval", "6"]
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    again = [log["lm loss"] for log in iteration_logs(resumed.stdout)]
    assert again == losses[6:], (again, losses)
