"""A resharded checkpoint resumes with the same loss, across engines and pipeline layouts.

A DeepSpeed pipeline run (PP=2, ZeRO-1) stops at iteration 2. Resumed as it is, its next
iteration has some loss; converted by `tools/checkpoint/reshard.py` to Megatron's layout at
TP=2 (plain torch, 2 ranks) and then to TP=1 (one process), each resumes at iteration 3 with
the same loss (dropout off; only reduction order differs), keeping the run's progress. The
vocabulary is padded to the same 50304 rows at every size (`--make-vocab-size-divisible-by
64`): the padding logits are part of the softmax, as in Megatron.

"The same" losses: equal up to fp32 sums in other orders (`assert_losses_reordered`, the
terms counted from the model's shapes by `loss_terms`). The weights start at
`--init-method-std 0.2`, so that a misplaced or missing weight moves the loss by ~0.1, far
above that bound (at GPT-2's 0.02 such a bug moves the tiny model's loss by 1e-4 to 1e-2).

A 4-layer run at PP=1 stops at iteration 2; its checkpoint is resharded to PP=2, from there
back to PP=1 (and to PP=4 and back, the same weights), to PP=2 x 2 virtual stages, and to
TP=2. Iterations 3-5 log the same losses at PP=1, under Megatron's 1F1B at PP=2 x DP=2 with
the distributed optimizer, its interleaved 1F1B at PP=2 x 2 x DP=2 on FSDP2, TP=2 with
sequence parallelism x DP=2 on FSDP2, and DeepSpeed's pipeline engine loading the PP=2 files
(Megatron's local layer numbers placed at the stage's offset); that engine refuses the
virtual-stage files in one line naming the conversion.

A Mixture-of-Experts run (4 experts per layer over 2 expert-parallel ranks, DeepSpeed's expert
files) saves at iteration 2 and goes on to 3. Resumed at another expert-parallel size with
DeepSpeed's optimizer files (split by expert-parallel rank) it is refused in one line; without
them (`--no-load-optim`) it logs the same iteration-3 losses. Converted to Megatron's layout
(every expert in each rank file, numbered globally) at TP=2, each expert whole on both ranks,
then to TP=1, it logs the same iteration-3 losses (LM and load-balancing) at expert-parallel
size 1 and 2 (each rank picking its own experts); a missing expert file is one line, and
generate_samples_gpt.py samples from the DeepSpeed checkpoint in one process.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing.file_format import flatten_model_state, load_file
from megatron.checkpointing.shards import load_dense_checkpoint
from megatron.config import ModelConfig, MoEConfig
from tests.checkpointing.compare import rolled_back
from tests.conftest import REPO_ROOT
from tests.one_line_errors import assert_one_line_error
from tests.pretrain_runs import cpu_env, iteration_logs, launch, tiny_gpt_flags
from tests.tolerances import assert_losses_reordered, training_loss_terms
from tools.checkpoint import reshard

DS_ZERO1 = ["--deepspeed", "--deepspeed_config", f"{REPO_ROOT}/examples/ds_configs/ds_zero1.json"]
FOUR_LAYERS = [
    "--num-layers", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--global-batch-size", "8", "--train-iters", "5", "--exit-interval", "5",
]  # fmt: skip
"""The pipeline case: 4 micro-batches of 2 per step on every layout (one data-parallel rank)."""
VOCAB = 50304
"""The GPT-2 vocabulary padded to a multiple of 64: the rows each loss's softmax sums over."""
TINY = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
    max_position_embeddings=64,
)  # fmt: skip
"""The model of `tiny_gpt_flags` (micro-batches of 2 x 64 tokens, 4 x 64 tokens a step)."""


def _flags(dataset: str, *extra: str) -> list[str]:
    return tiny_gpt_flags(dataset) + [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4",
        "--train-iters", "4", "--exit-interval", "3", "--init-method-std", "0.2", *extra,
        # 50304 rows at TP 1 and 2: new zero padding rows would join the softmax.
        "--make-vocab-size-divisible-by", "64",
    ]  # fmt: skip


def _assert_same_losses(actual: list[float], expected: list[float], terms: list[int], what: str):
    """Logged losses of two layouts of the same run: equal up to their sums' order."""
    assert_losses_reordered(actual, expected, terms=terms, vocab=VOCAB, what=what)


def _pp(size: int) -> list[str]:
    return ["--pipeline-model-parallel-size", str(size)]


def _tool(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python tools/{script} ARGS` on CPU, as a user runs it."""
    return subprocess.run(
        [sys.executable, f"{REPO_ROOT}/tools/{script}", *args],
        capture_output=True, text=True, env=cpu_env(), timeout=300,
    )  # fmt: skip


def _reshard(source: str, target: str, tp: int, pp: int, virtual: int = 1, *extra: str) -> None:
    """tools/checkpoint/reshard.py's `main` in this process (its command line as a user runs
    it: tests/tools/test_reshard.py and the damaged-file test below)."""
    argv = [
        "--load", source, "--save", target,
        "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp),
        "--target-virtual-pipeline-parallel-size", str(virtual), *extra,
    ]  # fmt: skip
    assert reshard.main(argv) == 0


def _losses(run: subprocess.CompletedProcess, iterations: list[int]) -> list[float]:
    assert run.returncode == 0, run.stdout[-3000:]
    logs = iteration_logs(run.stdout)
    assert [log["iteration"] for log in logs] == iterations
    return [log["lm loss"] for log in logs]


@pytest.mark.slow
def test_resharded_checkpoint_resumes_with_the_same_loss(stdlib_dataset: str, tmp_path) -> None:
    original = str(tmp_path / "pp2")
    first = launch(
        2, _flags(stdlib_dataset, *DS_ZERO1, *_pp(2), "--save", original, "--save-interval",
                  "2", "--exit-interval", "2"),
    )  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:]
    reference = _losses(
        launch(2, _flags(stdlib_dataset, *DS_ZERO1, *_pp(2), "--load", original)), [3]
    )

    tp2, tp1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    _reshard(original, tp2, tp=2, pp=1)
    on_tp2 = _losses(
        launch(2, _flags(stdlib_dataset, "--tensor-model-parallel-size", "2", "--load", tp2)), [3]
    )
    _reshard(tp2, tp1, tp=1, pp=1)
    on_tp1 = _losses(launch(1, _flags(stdlib_dataset, "--load", tp1)), [3])
    # The same weights (resharding copies them): iteration 3's forward, 2 x 64 tokens a
    # micro-batch, its loss the mean over 4 x 64 tokens.
    terms = [training_loss_terms(TINY, micro_tokens=2 * 64, tokens=4 * 64, steps=0)]
    _assert_same_losses(on_tp1, on_tp2, terms, "TP=1 vs TP=2")
    _assert_same_losses(on_tp2, reference, terms, "TP=2 vs DeepSpeed PP=2")
    _assert_same_losses(on_tp1, reference, terms, "TP=1 vs DeepSpeed PP=2")


@pytest.mark.slow
def test_pipeline_layouts_of_a_resharded_checkpoint_log_the_same_losses(
    stdlib_dataset: str, tmp_path
) -> None:
    def flags(*extra: str) -> list[str]:
        return _flags(stdlib_dataset, *FOUR_LAYERS, *extra)

    pp1 = str(tmp_path / "pp1")
    first = launch(1, flags("--save", pp1, "--save-interval", "2", "--exit-interval", "2"))
    assert first.returncode == 0, first.stdout[-3000:]
    names = ("pp2", "back_to_pp1", "pp4", "pp4_to_pp1", "pp2_vpp2", "tp2")
    dirs = {name: str(tmp_path / name) for name in names}
    _reshard(pp1, dirs["pp2"], tp=1, pp=2)
    _reshard(dirs["pp2"], dirs["back_to_pp1"], tp=1, pp=1)
    # PP=4 on disk only (one layer a stage): there and back gives the same weights.
    _reshard(dirs["back_to_pp1"], dirs["pp4"], tp=1, pp=4)
    _reshard(dirs["pp4"], dirs["pp4_to_pp1"], tp=1, pp=1)
    there_and_back = load_dense_checkpoint(dirs["pp4_to_pp1"]).state_dict
    for name, tensor in load_dense_checkpoint(dirs["back_to_pp1"]).state_dict.items():
        assert torch.equal(there_and_back[name], tensor), name
    _reshard(dirs["pp2"], dirs["pp2_vpp2"], tp=1, pp=2, virtual=2)
    _reshard(pp1, dirs["tp2"], tp=2, pp=1)

    iterations = [3, 4, 5]
    reference = _losses(launch(1, flags("--load", dirs["back_to_pp1"])), iterations)
    virtual = ["--virtual-pipeline-model-parallel-size", "2"]
    # The pipelines at DP=2 shard the data-parallel state (torch FSDP2; 2 micro-batches of 2
    # per rank a step, their gradients reduce-scattered once): the same losses as PP=1 x DP=1.
    runs = {
        "1F1B PP=2 x DP=2, distributed optimizer": (
            4, [*_pp(2), "--use-distributed-optimizer", "--load", dirs["pp2"]],
        ),
        "interleaved PP=2 x 2 x DP=2, FSDP2": (
            4, [*_pp(2), *virtual, "--use-torch-fsdp2", "--load", dirs["pp2_vpp2"]],
        ),
        "TP=2 + SP x DP=2, FSDP2": (
            4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-torch-fsdp2",
                "--load", dirs["tp2"]],
        ),
        "DeepSpeed PP=2": (2, [*DS_ZERO1, *_pp(2), "--load", dirs["pp2"]]),
    }  # fmt: skip
    # The same weights and optimizer state at iteration 2; iteration 3 + i after i more steps.
    # 4 layers, micro-batches of 2 x 32 tokens, 8 x 32 tokens a step.
    four_layers = dataclasses.replace(TINY, num_layers=4, max_position_embeddings=32)
    terms = [training_loss_terms(four_layers, 2 * 32, 8 * 32, steps) for steps in range(3)]
    for name, (processes, extra) in runs.items():
        losses = _losses(launch(processes, flags(*extra)), iterations)
        _assert_same_losses(losses, reference, terms, name)

    refused = launch(2, flags(*DS_ZERO1, *_pp(2), "--load", dirs["pp2_vpp2"]))
    assert refused.returncode != 0
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error:")]
    assert errors, refused.stdout[-3000:]
    for error in errors:  # one line from each rank, naming its own file
        assert "saved with 2 virtual pipeline stage(s) per rank, this run has 1" in error
        assert "reshard.py" in error and "--target-virtual-pipeline-parallel-size 1" in error


MOE = [
    "--deepspeed", "--zero-stage", "0", "--no-pipeline-parallel", "--num-experts", "4",
    "--expert-interval", "1", "--topk", "2", "--disable-moe-top2-2nd-expert-sampling",
]  # fmt: skip
"""DeepSpeed-MoE whose gating draws nothing at random (the second expert by argmax): a run
from converted weights, which carry no RNG state, logs the same losses."""
EXPERT = "language_model.encoder.layers.{}.mlp.deepspeed_moe.experts.deepspeed_experts.{}."


MOE_MODEL = dataclasses.replace(TINY, moe=MoEConfig(experts_per_layer=(4, 4), top_k=2))
MOE_TERMS = [training_loss_terms(MOE_MODEL, micro_tokens=2 * 64, tokens=4 * 64, steps=0)]
"""Iteration 3's forward from the same weights (the load-balancing loss sums less)."""


def _moe_losses(run: subprocess.CompletedProcess, iteration: int) -> tuple[float, float]:
    """(LM loss, MoE loss) of `iteration` in the log of `run`."""
    assert run.returncode == 0, run.stdout[-3000:]
    (log,) = [log for log in iteration_logs(run.stdout) if log["iteration"] == iteration]
    return log["lm loss"], log["moe loss"]


def _assert_same_moe_losses(actual: tuple, expected: tuple, what: str) -> None:
    """Equal LM and MoE losses up to their sums' order (the MoE loss has no vocabulary)."""
    assert_losses_reordered(actual[:1], expected[:1], terms=MOE_TERMS, vocab=VOCAB, what=what)
    assert_losses_reordered(actual[1:], expected[1:], terms=MOE_TERMS, vocab=0, what=what)


@pytest.mark.slow
def test_moe_checkpoint_changes_expert_and_tensor_parallel_sizes(
    stdlib_dataset: str, tmp_path
) -> None:
    def run(ep: int, *extra: str) -> subprocess.CompletedProcess:
        flags = _flags(stdlib_dataset, *MOE, "--moe-expert-parallel-size", str(ep), *extra)
        return launch(2, flags, launcher="deepspeed")

    original = str(tmp_path / "ep2")
    reference = _moe_losses(run(2, "--save", original, "--save-interval", "2"), 3)
    at_2 = rolled_back(original, 2, str(tmp_path / "at_2"))
    refused = run(1, "--load", at_2)  # DeepSpeed's optimizer files are split by EP rank
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and errors, refused.stdout[-3000:]
    for error in errors:
        assert "saved with --moe-expert-parallel-size 2, this run has" in error
        assert "--no-load-optim" in error and "reshard.py" in error
    # The weights alone: DeepSpeed reads each expert's file by its global number.
    weights_only = run(1, "--load", at_2, "--no-load-optim")
    _assert_same_moe_losses(_moe_losses(weights_only, 3), reference, "EP=1, --no-load-optim")

    tp2, tp1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    _reshard(original, tp2, 2, 1, 1, "--iteration", "2")
    ranks = [
        flatten_model_state(
            load_file(f"{tp2}/iter_0000002/mp_rank_0{rank}/model_optim_rng.pt")["model"]
        )
        for rank in (0, 1)
    ]
    for layer in (0, 1):
        for expert in range(4):  # every expert, whole on both tensor-parallel ranks
            name = EXPERT.format(layer, expert) + "dense_h_to_4h.weight"
            assert ranks[0][name].shape == (256, 64)
            assert torch.equal(ranks[0][name], ranks[1][name])
    _reshard(tp2, tp1, 1, 1)
    for ep in (1, 2):
        _assert_same_moe_losses(_moe_losses(run(ep, "--load", tp1), 3), reference, f"EP={ep}")

    sampled = _tool(
        "generate_samples_gpt.py", "--load", original, "--prompt", "def", "--greedy",
        "--out-seq-length", "4",
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert "Megatron-LM:" in sampled.stdout

    damaged = str(tmp_path / "damaged")
    shutil.copytree(original, damaged)
    missing = f"{damaged}/global_step3/layer_1_expert_2_mp_rank_00_model_states.pt"
    os.remove(missing)
    result = _tool("checkpoint/reshard.py", "--load", damaged, "--save", str(tmp_path / "out"))
    assert_one_line_error(result.returncode, result.stderr, f"missing expert file {missing}")
