"""DeepSpeed's own checkpoint tools on our checkpoints: zero_to_fp32.py and universal ones.

A ZeRO-2 run on 2 ranks saves a checkpoint; `zero_to_fp32.py` (which DeepSpeed copies next to
it) rebuilds fp32 weights equal to the model's; `ds_to_universal` converts it, and
`--universal-checkpoint` resumes it on ONE rank with the optimizer state carried: the next
iterations' losses match a 2-rank resume of the original checkpoint (dropout off, so only the
reduction order differs: `assert_losses_reordered`). The weights start at `--init-method-std
0.2`, so that a misplaced weight moves the loss far above that bound (at GPT-2's 0.02 it
would move the tiny model's loss by 1e-4 to 1e-2, under it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron.config import ModelConfig
from tests.checkpointing.compare import load_any
from tests.conftest import REPO_ROOT
from tests.pretrain_runs import cpu_env, iteration_logs, launch, tiny_gpt_flags
from tests.tolerances import assert_losses_reordered, training_loss_terms

DS_ZERO2 = ["--deepspeed", "--deepspeed_config", f"{REPO_ROOT}/examples/ds_configs/ds_zero2.json"]
VOCAB = 50304
"""The GPT-2 vocabulary padded as `tiny_gpt_flags` pads it (a multiple of 128)."""
TINY = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
    max_position_embeddings=64,
)  # fmt: skip
"""The model of `tiny_gpt_flags` (micro-batches of 2 x 64 tokens, 4 x 64 tokens a step)."""


def _flags(dataset: str, iterations: int) -> list[str]:
    return tiny_gpt_flags(dataset) + DS_ZERO2 + [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4",
        "--train-iters", str(iterations), "--use-checkpoint-lr-scheduler",
        "--init-method-std", "0.2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def zero2_checkpoint(stdlib_dataset: str, tmp_path_factory) -> str:
    """A ZeRO-2, 2-rank checkpoint at iteration 2."""
    save = str(tmp_path_factory.mktemp("zero2") / "ckpt")
    run = launch(2, _flags(stdlib_dataset, 2) + ["--save", save, "--save-interval", "100"])
    assert run.returncode == 0, run.stdout[-3000:]
    return save


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=cpu_env(), timeout=300
    )


@pytest.mark.slow
def test_zero_to_fp32_rebuilds_the_model_weights(zero2_checkpoint: str, tmp_path) -> None:
    script = os.path.join(zero2_checkpoint, "zero_to_fp32.py")
    result = _python(script, zero2_checkpoint, str(tmp_path / "fp32"), "-t", "global_step2")
    assert result.returncode == 0, result.stderr[-3000:]
    rebuilt = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    module = load_any(os.path.join(zero2_checkpoint, "global_step2", "mp_rank_00_model_states.pt"))
    weights = module["module"]
    assert rebuilt.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(rebuilt[name], tensor), name


@pytest.mark.slow
def test_universal_checkpoint_resumes_on_a_different_number_of_ranks(
    zero2_checkpoint: str, stdlib_dataset: str, tmp_path
) -> None:
    universal = str(tmp_path / "universal")
    same_ranks = str(tmp_path / "same")
    for target in (universal, same_ranks):
        subprocess.run(["cp", "-r", zero2_checkpoint, target], check=True)
    result = _python(
        "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", f"{universal}/global_step2",
        "--output_folder", f"{universal}/global_step2_universal",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]

    one_rank = launch(
        1, _flags(stdlib_dataset, 4) + ["--load", universal, "--universal-checkpoint"]
    )
    assert one_rank.returncode == 0, one_rank.stdout[-3000:]
    assert "global_step2_universal at iteration 2" in one_rank.stdout
    two_ranks = launch(2, _flags(stdlib_dataset, 4) + ["--load", same_ranks])
    assert two_ranks.returncode == 0, two_ranks.stdout[-3000:]
    ours = [log["lm loss"] for log in iteration_logs(one_rank.stdout)]
    theirs = [log["lm loss"] for log in iteration_logs(two_ranks.stdout)]
    assert len(ours) == len(theirs) == 2
    # The same weights and optimizer state at iteration 2; iteration 3 + i after i more steps.
    terms = [
        training_loss_terms(TINY, micro_tokens=2 * 64, tokens=4 * 64, steps=steps)
        for steps in (0, 1)
    ]
    assert_losses_reordered(ours, theirs, terms=terms, vocab=VOCAB, what="1 rank vs 2 ranks")
