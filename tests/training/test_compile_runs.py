"""`pretrain_gpt.py --torch-compile` through DeepSpeed trains like the eager run.

Real runs of the tiny GPT-2 on the stdlib corpus (fp32, dropout off, 10 iterations, two
ranks over gloo), each eager and compiled: DeepSpeed's pipeline engine at PP=1 over DP=2
(the whole stage one graph), at PP=2 with its ZeRO-1 optimizer (each stage one graph) and
with activation recomputation (each layer compiled), and the plain engine
with ZeRO-3 at DP=2 (where the whole-model graph of TP=1 is turned off: its parameter
gathering hooks are not replayed by one graph). The logged losses (7 significant digits) must
agree at every iteration up to fp32 sums in other orders (inductor fuses and reorders them),
the i-th after i steps whose errors compound (`assert_losses_reordered`, `loss_terms`). The
weights start at `--init-method-std 0.2`: a graph computing something else then moves the
loss far above that bound (at GPT-2's 0.02 the tiny model's logits are too small for that).
"""

from __future__ import annotations

import json

import pytest

from megatron.config import ModelConfig
from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags
from tests.tolerances import assert_losses_reordered, training_loss_terms

ITERATIONS = 10
VOCAB = 50304
"""The GPT-2 vocabulary padded as `tiny_gpt_flags` pads it (a multiple of 128)."""
TINY = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
    max_position_embeddings=64,
)  # fmt: skip
"""The model of `tiny_gpt_flags` (micro-batches of 2 x 64 tokens, 4 x 64 tokens a step)."""
CASES = {
    # What `--deepspeed` runs by default (scripts/ds_pretrain_gpt2.sh): the pipeline engine at
    # PP=1, its whole stage one graph (GPTModelPipe.compiled_stage).
    "pipeline-pp1-dp2-zero1": "--zero-stage 1",
    "pipeline-pp2-zero1": "--pipeline-model-parallel-size 2 --zero-stage 1",  # a graph a stage
    "pipeline-pp2-zero1-recompute": "--pipeline-model-parallel-size 2 --zero-stage 1 "
    "--checkpoint-activations",
    "zero3-dp2": "--zero-stage 3 --no-pipeline-parallel",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_compiled_run_logs_the_eager_losses(case, stdlib_dataset, tmp_path):
    """Eager and --torch-compile runs of `case` log the same lm loss at each iteration."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    flags = tiny_gpt_flags(stdlib_dataset) + [
        *("--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.2"),
        *("--train-iters", str(ITERATIONS), "--global-batch-size", "4"),
        *("--deepspeed", "--deepspeed_config", str(config)),
        *CASES[case].split(),
    ]
    losses = {}
    for mode, extra in (("eager", []), ("compiled", ["--torch-compile"])):
        done = launch(2, flags + extra, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-3000:]
        losses[mode] = [log["lm loss"] for log in iteration_logs(done.stdout)]
    assert len(losses["eager"]) == ITERATIONS
    terms = [training_loss_terms(TINY, 2 * 64, 4 * 64, steps) for steps in range(ITERATIONS)]
    assert_losses_reordered(
        losses["compiled"], losses["eager"], terms=terms, vocab=VOCAB, what="compiled vs eager"
    )
    assert losses["eager"][-1] < losses["eager"][0]
