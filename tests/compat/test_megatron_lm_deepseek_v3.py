"""Megatron-LM's DeepSeek-V3 recipe (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh, as
captured in tests/compat/megatron_lm/) here (issue 57).

- As written it stops at `--ckpt-format fsdp_dtensor` (Megatron-FSDP's own format, not built:
  torch_dist saves FSDP2 runs at any layout) in one line naming the flag. With `--ckpt-format
  torch_dist` (and its `--dist-ckpt-strictness log_all`) it validates at its 8 ranks (FSDP2
  over DP 8, its 256 experts over EP 8;
  `--moe-token-dispatcher-type flex` runs as alltoall, said at start-up) and `--dry-run`
  prints its plan: MLA, multi-token prediction, 58 routed MoE layers after 3 dense ones.
- Scaled down (4 layers: 1 dense then 3 with 8 routed experts, group-limited top-2 in the best
  2 of 4 groups, sigmoid scores with expert bias and scaling, a shared expert, seq_aux_loss;
  MLA with YaRN; one MTP module; EP 2 on 2 ranks; FSDP2 over them; bf16; the recipe's
  --recompute-modules, force-balanced routing and per-token loss; GPT-2's vocabulary) it
  trains through torchrun: the loss and the logged 'mtp_1 loss' fall, and a second launch
  from a copy of the iteration-3 checkpoint logs the same iterations 4-6, digit for digit.
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

RECIPE = os.path.join(
    os.path.dirname(__file__), "megatron_lm", "megatron_fsdp__sbatch_mfsdp_deepseek_v3.json"
)
NOT_BUILT = {"--ckpt-format": ["torch_dist"]}
"""Megatron-FSDP's checkpoint format (torch_dist instead)."""
TINY = {
    "--num-layers": ["4"],
    "--hidden-size": ["64"],
    "--ffn-hidden-size": ["128"],
    "--num-attention-heads": ["4"],
    "--kv-channels": ["16"],
    "--seq-length": ["64"],
    "--max-position-embeddings": ["64"],
    "--micro-batch-size": ["2"],
    "--global-batch-size": ["4"],
    "--train-samples": ["24"],
    "--lr-decay-samples": ["24"],
    "--lr-warmup-samples": ["4"],
    "--lr": ["0.003"],
    "--min-lr": ["0.0003"],
    "--lr-warmup-init": ["0.0003"],
    "--num-experts": ["8"],
    "--moe-layer-freq": ["[0]*1+[1]*3"],
    "--moe-ffn-hidden-size": ["32"],
    "--moe-shared-expert-intermediate-size": ["32"],
    "--moe-router-topk": ["2"],
    "--moe-router-num-groups": ["4"],
    "--moe-router-group-topk": ["2"],
    "--expert-model-parallel-size": ["2"],
    "--q-lora-rank": ["32"],
    "--kv-lora-rank": ["24"],
    "--qk-head-dim": ["16"],
    "--qk-pos-emb-head-dim": ["8"],
    "--v-head-dim": ["12"],
    "--make-vocab-size-divisible-by": ["64"],
    "--eval-iters": ["1"],
    "--eval-interval": ["3"],
    "--save-interval": ["3"],
    "--num-workers": ["0"],
    "--use-flash-attn": None,  # a CUDA GPU's (refused on this CPU in one line)
}


def _localized(argv: list[str], dataset: str, scratch: str) -> list[str]:
    checkpoints = os.path.join(scratch, "checkpoints")
    return with_values(
        argv,
        {
            "--data-path": [dataset],
            "--tokenizer-model": [_hf_gpt2_folder(os.path.join(scratch, "tokenizer"))],
            "--data-cache-path": [os.path.join(scratch, "cache")],
            "--save": [checkpoints],
            "--load": [checkpoints],
            "--tensorboard-dir": [os.path.join(scratch, "tensorboard")],
        },
    )


def test_the_recipe_validates_and_plans_at_its_world_size(stdlib_dataset: str, tmp_path) -> None:
    script = load_script(RECIPE)
    argv = _localized(script.argv, stdlib_dataset, str(tmp_path))
    with pytest.raises(ArgumentError) as refused:
        _validate(argv, script.world_size)
    message = str(refused.value)
    assert message.startswith("--ckpt-format fsdp_dtensor") and "\n" not in message
    args = _validate(with_values(argv, NOT_BUILT), script.world_size)
    assert args.dist_ckpt_strictness == "log_all"
    assert (
        args.layout.describe()
        == "TP 1 x PP 1 x DP 8 x EP 8, bf16, FSDP2 optim_grads_params on plain"
    )
    assert (args.multi_latent_attention, args.mtp_num_layers, args.moe_router_group_topk) == (
        True,
        1,
        4,
    )
    assert any("flex: runs as alltoall here (HybridEP" in note for note in args.compat_notes)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dry_run(
            with_values(script.argv, NOT_BUILT) + ["--dry-run", "--dry-run-world-size", "8"]
        )
    plan = printed.getvalue()
    assert "dry run: 8 ranks = TP 1 x PP 1 x DP 8 (EP 8); plain FSDP2 optim_grads_params" in plan
    assert "routed MoE: 58 of 61 layers, top-8 of 256 experts, EP 8, alltoall" in plan
    assert "model: 681,524,457,472 parameters" in plan  # with GPT-2's vocabulary assumed


@pytest.mark.slow
def test_scaled_recipe_trains_and_resumes_bit_exactly(stdlib_dataset: str, tmp_path) -> None:
    script = load_script(RECIPE)
    argv = with_values(script.argv, {**NOT_BUILT, **TINY})
    argv = _localized(argv, stdlib_dataset, str(tmp_path))
    first = _launch("torchrun", argv, ranks=2)
    assert first.returncode == 0, first.stdout[-4000:]
    assert "TP 1 x PP 1 x DP 2 x EP 2, bf16, FSDP2 optim_grads_params on plain" in first.stdout
    logged = _iteration_lines(first.stdout)
    assert [log["iteration"] for log in logged] == [1, 2, 3, 4, 5, 6]
    lm, mtp = [log["lm loss"] for log in logged], [log["mtp_1 loss"] for log in logged]
    assert lm[-1] < lm[0] - 0.5 and mtp[-1] < mtp[0] - 0.5, (lm, mtp)
    assert all("seq_load_balancing_loss" in log and "moe loss" in log for log in logged)
    checkpoints = os.path.join(str(tmp_path), "checkpoints")
    resumed_dir = rolled_back(checkpoints, 3, str(tmp_path / "resumed"))
    second = _launch(
        "torchrun", with_values(argv, {"--load": [resumed_dir], "--save": [resumed_dir]}), ranks=2
    )
    assert second.returncode == 0, second.stdout[-4000:]
    resumed = _iteration_lines(second.stdout)
    names = ("lm loss", "mtp_1 loss", "moe loss", "grad norm")
    assert [[log[n] for n in names] for log in resumed] == [
        [log[n] for n in names] for log in logged[3:]
    ]
