"""Megatron-LM's Mixtral 8x7B recipe (examples/mixtral/train_mixtral_8x7b_distributed.sh, as
captured in tests/compat/megatron_lm/) runs here as written.

- Its layout, PP=4 x EP=8 with the distributed optimizer, cannot hold on the 8 GPUs the script
  launches (Megatron-LM carves the experts out of the data-parallel ranks too: DP = 8 / 4 = 2
  cannot hold EP = 8): at 8 ranks it is refused in one line naming the flag; at 32, the
  smallest world that holds it, it validates and `--dry-run` prints its plan, counting
  Mixtral's 46.9B parameters (GPT-2's vocabulary assumed) with one expert per layer per rank.
- Scaled down (PP=2, EP=2, top-2 of 4 experts, 2 layers, h 64; the rest of its flags as
  written: aux loss, all-to-all dispatch, grouped GEMM, the distributed optimizer on FSDP2,
  bf16, Llama2Tokenizer) it trains on CPU through torchrun on 4 ranks: the loss and the MoE
  loss stays near its balanced minimum (the aux loss pulls the load back after the router first
  skews it), the log lines parse; a run interrupted after its iteration-5 checkpoint resumes
  from it to the same iteration-10 weights, bit for bit, as the run that was not; and
  `tools/checkpoint/convert_to_hf.py` exports it as a Hugging Face Mixtral whose logits are
  ours. The scaled run drops the recipe's `--no-load-optim --no-load-rng` (a resume without
  the optimizer state cannot be bit-exact).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.dry_run import run_dry_run
from tests.compat.scripts import load_script, with_values
from tests.compat.test_script_runs import _iteration_lines, _launch
from tests.conftest import REPO_ROOT

RECIPE = os.path.join(
    os.path.dirname(__file__), "megatron_lm", "mixtral__train_mixtral_8x7b_distributed.json"
)
TINY = {
    "--num-layers": ["2"],
    "--hidden-size": ["64"],
    "--ffn-hidden-size": ["128"],
    "--num-attention-heads": ["4"],
    "--num-query-groups": ["2"],
    "--seq-length": ["64"],
    "--max-position-embeddings": ["64"],
    "--num-experts": ["4"],
    "--global-batch-size": ["4"],
    "--train-iters": ["10"],
    "--lr-decay-iters": ["10"],
    "--lr-warmup-iters": ["1"],
    "--lr": ["0.01"],
    "--min-lr": ["0.001"],
    "--pipeline-model-parallel-size": ["2"],
    "--expert-model-parallel-size": ["2"],
    "--eval-interval": ["5"],
    "--eval-iters": ["1"],
    "--save-interval": ["5"],
    "--no-load-optim": None,
    "--no-load-rng": None,
}


def _validate(argv: list[str], world_size: int):
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_at_its_own_8_ranks_the_layout_is_refused_in_one_line() -> None:
    script = load_script(RECIPE)
    assert script.world_size == 8
    with pytest.raises(ArgumentError) as refused:
        _validate(script.argv + ["--dry-run"], script.world_size)
    message = str(refused.value)
    assert "--expert-model-parallel-size 8" in message and "1 x 1 x 2 = 2" in message
    assert "\n" not in message


def test_at_32_ranks_it_validates_and_plans() -> None:
    script = load_script(RECIPE)
    args = _validate(script.argv + ["--dry-run"], 32)
    assert (
        args.layout.describe()
        == "TP 1 x PP 4 x DP 8 x EP 8, bf16, FSDP2 optim_grads on megatron_schedules"
    )
    assert args.routed_moe and args.moe_router_topk == 2 and args.moe_grouped_gemm
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        plan = run_dry_run(script.argv + ["--dry-run", "--dry-run-world-size", "32"])
    text = printed.getvalue()
    assert "TP 1 x PP 4 x DP 8 (EP 8)" in text, text
    assert "model: 46,852,739,072 parameters" in text, text
    # One of the 8 experts per layer on each rank: 8 layers a stage, 1/8 of their experts.
    first_stage = plan.roles[0].role
    assert 1.9e9 < first_stage.num_parameters < 2.0e9, first_stage.num_parameters
    # Of them the experts': 8 layers x 1 expert x 3 x 4096 x 14336.
    assert first_stage.expert_parameters == 8 * 3 * 4096 * 14336


def _scaled_argv(dataset: str, tokenizer: str, scratch: str) -> list[str]:
    checkpoints = os.path.join(scratch, "checkpoints")
    values = {
        **TINY,
        "--data-path": [dataset],
        "--tokenizer-model": [tokenizer],
        "--save": [checkpoints],
        "--load": [checkpoints],
        "--tensorboard-dir": [os.path.join(scratch, "tensorboard")],
    }
    return with_values(load_script(RECIPE).argv, values) + ["--num-workers", "0"]


def _weights(directory: str) -> dict[str, torch.Tensor]:
    """The weights and Adam state of a torch_dist checkpoint (the recipe's format: Megatron-LM's
    default, and FSDP2's), each tensor whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = directory.rstrip("/") + ".whole.pt"
    dcp_to_torch_save(directory, whole)
    saved = torch.load(whole, weights_only=False)
    os.remove(whole)
    return {
        name: value
        for name, value in saved.items()
        if torch.is_tensor(value) and not name.startswith("rng_state")
    }


@pytest.mark.slow
def test_scaled_recipe_trains_resumes_bit_exactly_and_exports(
    sentencepiece_dataset: str, sentencepiece_model: str, tmp_path
) -> None:
    straight = str(tmp_path / "straight")
    argv = _scaled_argv(sentencepiece_dataset, sentencepiece_model, straight)
    done = _launch("torchrun", argv, ranks=4)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "TP 1 x PP 2 x DP 2 x EP 2, bf16, FSDP2 optim_grads on megatron_schedules" in done.stdout
    logged = _iteration_lines(done.stdout)
    assert [log["iteration"] for log in logged] == list(range(1, 11))
    losses, moe = [log["lm loss"] for log in logged], [log["moe loss"] for log in logged]
    assert losses[-1] < losses[0] - 0.5, losses
    # 'moe loss': 2 layers x 0.01 x the switch loss, 1 at a balanced load (the recipe's router
    # starts near uniform). As the router learns the load skews and the loss rises; the aux
    # loss then pulls it back toward balance.
    assert 0.019 < min(moe) and max(moe) < 0.025, moe
    assert moe[-1] < max(moe), moe
    # Megatron-LM's own field: the unweighted loss, averaged over the MoE layers of both
    # pipeline stages (one each).
    balancing = [log["load_balancing_loss"] for log in logged]
    assert all(abs(0.01 * 2 * b - m) <= 1e-5 * m for b, m in zip(balancing, moe)), balancing
    # The same run interrupted after its iteration-5 checkpoint: that checkpoint alone.
    interrupted = tmp_path / "interrupted" / "checkpoints"
    shutil.copytree(
        os.path.join(straight, "checkpoints", "iter_0000005"), interrupted / "iter_0000005"
    )
    (interrupted / "latest_checkpointed_iteration.txt").write_text("5")
    argv = _scaled_argv(sentencepiece_dataset, sentencepiece_model, str(interrupted.parent))
    resumed = _launch("torchrun", argv, ranks=4)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert [log["iteration"] for log in _iteration_lines(resumed.stdout)] == [6, 7, 8, 9, 10]
    ours = _weights(str(interrupted / "iter_0000010"))
    theirs = _weights(os.path.join(straight, "checkpoints", "iter_0000010"))
    assert ours.keys() == theirs.keys() and any(".mlp.experts." in name for name in ours)
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
    _export_matches_transformers(os.path.join(straight, "checkpoints"), str(tmp_path / "hf"))


def _export_matches_transformers(checkpoints: str, folder: str) -> None:
    """convert_to_hf.py's Mixtral computes our logits (eval, bf16 weights in fp32)."""
    from transformers import MixtralForCausalLM

    from megatron.checkpointing.shards import load_dense_checkpoint
    from megatron.config import ModelConfig
    from megatron.model import GPTModel

    tool = os.path.join(REPO_ROOT, "tools", "checkpoint", "convert_to_hf.py")
    done = subprocess.run(
        [sys.executable, tool, "--load", checkpoints, "--save", folder],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MixtralForCausalLM" in done.stdout, done.stdout
    dense = load_dense_checkpoint(checkpoints)
    args = argparse.Namespace(**dense.args)
    args.padded_vocab_size = dense.true_vocab_size
    args.params_dtype = torch.float32
    model = GPTModel(ModelConfig.from_args(args)).eval()
    model.load_state_dict({k: v.float() for k, v in dense.state_dict.items()})
    hf = MixtralForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tokens = torch.randint(
        0, dense.true_vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours = model(tokens, torch.arange(32).expand(2, 32), None).float()
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
