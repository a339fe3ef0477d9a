"""Tiny LLaMA-style runs of pretrain_gpt.py through torchrun on CPU, and their comparison.

The model: RMSNorm, SwiGLU, rotary positions, 2 key/value heads for 4 query heads, untied
output layer; fp32, dropout 0, real GPT-2-tokenized data (the `stdlib_dataset` fixture).
`run` launches it with extra flags; `assert_same` compares two runs' iteration lines: token
counts exactly, losses up to fp32 sums in other orders, gradient norms to the log's 3 decimals.
"""

from __future__ import annotations

import math

from megatron.config import ModelConfig
from tests.compat.test_script_runs import _iteration_lines, _launch
from tests.conftest import MERGE_FILE, VOCAB_FILE
from tests.tolerances import assert_losses_reordered, training_loss_terms

SEQ, GLOBAL_BATCH, ITERATIONS = 64, 4, 6
VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 128
MODEL = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=SEQ, activation="swiglu",
    normalization="rmsnorm", position_embedding_type="rope", add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)  # fmt: skip


def argv(dataset: str, **flags: object) -> list[str]:
    """pretrain_gpt.py's flags for the tiny model, with `flags` (name_with_underscores=value;
    True for a switch; None takes one of the model's switches away) added."""
    tokens = (
        f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-key-value-heads 2 "
        f"--seq-length {SEQ} --max-position-embeddings {SEQ} --swiglu --normalization RMSNorm "
        "--use-rotary-position-embeddings --no-position-embedding --disable-bias-linear "
        "--untie-embeddings-and-output-weights --init-method-std 0.2 "
        f"--micro-batch-size 2 --global-batch-size {GLOBAL_BATCH} --train-iters {ITERATIONS} "
        "--lr 1e-3 --lr-decay-style constant --clip-grad 1.0 --attention-dropout 0 "
        "--hidden-dropout 0 --seed 1234 --split 100,0,0 --eval-iters 0 --log-interval 1 "
        f"--data-path {dataset} --vocab-file {VOCAB_FILE} --merge-file {MERGE_FILE}"
    ).split()
    for name, value in flags.items():
        # DeepSpeed's own flag keeps its underscore.
        flag = "--" + (name if name == "deepspeed_config" else name.replace("_", "-"))
        if value is None:
            tokens.remove(flag)
            continue
        tokens.append(flag)
        if value is not True:
            tokens += str(value).split()
    return tokens


def run(dataset: str, ranks: int, **flags: object) -> list[dict]:
    """The parsed iteration lines of a clean torchrun launch."""
    run = _launch("torchrun", argv(dataset, **flags), ranks=ranks)
    assert run.returncode == 0, run.stdout[-4000:]
    if flags.get("context_parallel_size", 1) != 1:
        assert f"CP {flags['context_parallel_size']}" in run.stdout, run.stdout[-4000:]
    return _iteration_lines(run.stdout)


def assert_same(ours: list[dict], theirs: list[dict]) -> None:
    """The same iterations, token counts, losses up to fp32 sums in other orders, gradient
    norms to the log's 3 decimals (each rounded there)."""
    assert [log["iteration"] for log in ours] == [log["iteration"] for log in theirs]
    for key in ("consumed samples", "consumed tokens", "global batch size"):
        assert [log[key] for log in ours] == [log[key] for log in theirs], key
    batch_tokens = int(theirs[0]["global batch size"]) * SEQ
    terms = [training_loss_terms(MODEL, SEQ, batch_tokens, steps) for steps in range(len(theirs))]
    assert_losses_reordered(
        [log["lm loss"] for log in ours],
        [log["lm loss"] for log in theirs],
        terms=terms,
        vocab=VOCAB,
        what=str([(log["lm loss"], log["grad norm"]) for log in ours]),
    )
    for mine, their in zip(ours, theirs, strict=True):
        assert math.isclose(mine["grad norm"], their["grad norm"], abs_tol=2e-3), (mine, their)
