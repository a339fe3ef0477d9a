"""Megatron-LM's gpt-oss recipe (examples/gptoss/02_train.sh, as captured in
tests/compat/megatron_lm/) here (issue 58).

- As written (8 GPUs: PP 8) it stops in one line: its 12 layers do not divide into 8 pipeline
  stages, which Megatron-LM's own validation asserts too ("Number of layers should be
  divisible by the pipeline-model-parallel size"). With 4 GPUs a node (the script's
  GPUS_PER_NODE: PP 4) it validates and `--dry-run` plans it: gpt-oss's attention sinks, the
  alternating 128-token windows, the clamped quick-GeGLU and `--enable-gpt-oss`'s YaRN, 12
  routed MoE layers, FP8 (hybrid, tensorwise here), its mock data.
- Scaled down (4 layers, 4 experts top-2, window 16 over 64-token sequences; TP 2 with
  sequence parallelism and EP 2 folded over the TP ranks on 2 ranks, `--expert-tensor-parallel-
  size 1` as Megatron-LM's DeepSeek-V3 recipe passes it; GPT-2's vocabulary and real text for
  its mock data; bf16 and its FP8 flags) it trains through torchrun, the loss falling, and a
  second launch from a copy of the iteration-3 checkpoint logs the same iterations 4-6, digit
  for digit (without the recipe's --no-load-optim / --no-load-rng, which start a fine-tune from
  the weights alone).
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from megatron.arguments import ArgumentError
from megatron.dry_run import run_dry_run
from tests.checkpointing.compare import rolled_back
from tests.compat.scripts import load_script, with_values
from tests.compat.test_megatron_lm_recipes import _hf_gpt2_folder, _validate
from tests.compat.test_script_runs import _iteration_lines, _launch

RECIPE = os.path.join(os.path.dirname(__file__), "megatron_lm", "gptoss__02_train.json")
FOUR_GPUS = {"--pipeline-model-parallel-size": ["4"]}
"""GPUS_PER_NODE=4: the script sets PP to the world size."""
TINY = {
    "--num-layers": ["4"],
    "--hidden-size": ["64"],
    "--ffn-hidden-size": ["128"],
    "--num-attention-heads": ["4"],
    "--num-query-groups": ["2"],
    "--seq-length": ["64"],
    "--max-position-embeddings": ["64"],
    "--window-size": ["15,0"],
    "--moe-ffn-hidden-size": ["64"],
    "--micro-batch-size": ["2"],
    "--global-batch-size": ["4"],
    "--train-samples": ["24"],
    "--lr-decay-samples": ["24"],
    "--lr": ["0.003"],
    "--min-lr": ["0.0003"],
    "--tensor-model-parallel-size": ["2"],
    "--pipeline-model-parallel-size": ["1"],
    "--expert-model-parallel-size": ["2"],
    "--expert-tensor-parallel-size": ["1"],  # experts whole, EP folded over the TP ranks
    "--make-vocab-size-divisible-by": ["64"],
    "--save-interval": ["3"],
    "--eval-interval": ["3"],
    "--eval-iters": ["1"],
    "--num-workers": ["0"],
    "--use-flash-attn": None,  # a CUDA GPU's (refused on this CPU in one line)
}


def _real_data(argv: list[str], dataset: str, scratch: str) -> list[str]:
    """The script's real-data branch (HuggingFaceTokenizer, --data-path) on fixtures."""
    checkpoints = os.path.join(scratch, "checkpoints")
    return with_values(
        argv,
        {
            "--mock-data": None,
            "--vocab-size": None,
            "--tiktoken-pattern": None,
            "--tokenizer-type": ["HuggingFaceTokenizer"],
            "--tokenizer-model": [_hf_gpt2_folder(os.path.join(scratch, "tokenizer"))],
            "--data-path": [dataset],
            "--data-cache-path": [os.path.join(scratch, "cache")],
            "--save": [checkpoints],
            "--load": [checkpoints],
            "--tensorboard-dir": [os.path.join(scratch, "tensorboard")],
        },
    )


def test_the_recipe_validates_and_plans_at_four_gpus() -> None:
    script = load_script(RECIPE)
    assert script.source.startswith("NVIDIA/Megatron-LM@")
    with pytest.raises(ArgumentError) as refused:
        _validate(script.argv + ["--dry-run"], script.world_size)
    message = str(refused.value)
    assert "--num-layers (12) is not divisible by --pipeline-model-parallel-size 8" in message
    assert "\n" not in message
    argv = with_values(script.argv, FOUR_GPUS) + ["--dry-run"]
    args = _validate(argv, 4)
    assert (args.softmax_type, args.quick_geglu, args.glu_linear_offset) == ("learnable", True, 1)
    assert (args.window_size, args.window_attn_skip_freq) == ((127, 0), 2)
    assert args.activation_func_clamp_value == 7.0
    # --enable-gpt-oss: YaRN with Megatron-LM's gpt-oss values over the script's rope.
    assert (args.position_embedding_type, args.rotary_scaling_factor) == ("yarn", 32.0)
    assert args.yarn_original_max_position_embeddings == 131072
    assert args.yarn_correction_range_round_to_int is False
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dry_run(argv + ["--dry-run-world-size", "4"])
    plan = printed.getvalue()
    assert "dry run: 4 ranks = TP 1 x PP 4 x DP 1" in plan
    assert "routed MoE: 12 of 12 layers, top-2 of 4 experts, EP 1" in plan
    assert "FP8 matmuls hybrid tensorwise" in plan


@pytest.mark.slow
def test_scaled_recipe_trains_and_resumes_bit_exactly(stdlib_dataset: str, tmp_path) -> None:
    script = load_script(RECIPE)
    argv = _real_data(with_values(script.argv, TINY), stdlib_dataset, str(tmp_path))
    first = _launch("torchrun", argv, ranks=2)
    assert first.returncode == 0, first.stdout[-4000:]
    assert "TP 2 (SP) x PP 1 x DP 1 x EP 2, bf16, FSDP2 optim_grads on plain" in first.stdout
    assert "FP8 matmuls hybrid tensorwise (torchao)" in first.stdout
    logged = _iteration_lines(first.stdout)
    assert [log["iteration"] for log in logged] == [1, 2, 3, 4, 5, 6]
    lm = [log["lm loss"] for log in logged]
    assert lm[-1] < lm[0] - 0.3, lm
    assert all("load_balancing_loss" in log and "z_loss" in log for log in logged)
    checkpoints = os.path.join(str(tmp_path), "checkpoints")
    resumed_dir = rolled_back(checkpoints, 3, str(tmp_path / "resumed"))
    resume = {"--load": [resumed_dir], "--save": [resumed_dir]}
    resume.update({"--no-load-optim": None, "--no-load-rng": None})
    second = _launch("torchrun", with_values(argv, resume), ranks=2)
    assert second.returncode == 0, second.stdout[-4000:]
    resumed = _iteration_lines(second.stdout)
    names = ("lm loss", "moe loss", "load_balancing_loss", "z_loss", "grad norm")
    assert [[log[n] for n in names] for log in resumed] == [
        [log[n] for n in names] for log in logged[3:]
    ]
