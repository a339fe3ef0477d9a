"""`torchrun ... pretrain_gpt.py --use-distributed-optimizer / --use-torch-fsdp2` (torch FSDP2 on
the plain engine) on CPU, against DDP.

The tiny LLaMA-style model of `llama_runs` at DP=2 with 2 micro-batches per step (global batch
8). What must hold:

- each strategy (optim_grads: `--use-distributed-optimizer`; optim_grads_params:
  `--use-torch-fsdp2`) logs DDP's losses and gradient norms in fp32 (up to fp32 sums in other
  orders), and in bf16 to bf16's precision (fp16 trains without a skipped step); at TP=2 with
  sequence parallelism on 4 ranks too;
- a checkpoint saved by FSDP2 at DP=2 (weights gathered into Megatron's file, the optimizer
  state into distrib_optim.pt) resumes bit for bit at DP=2, and at DP=1 both sharded and
  unsharded, to the iterations of the run that never stopped.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.training.llama_runs import assert_same, run

BATCH = dict(global_batch_size=8)  # DP=2 x micro-batch 2 x 2 micro-batches
STRATEGIES = {
    "optim_grads": dict(use_distributed_optimizer=True),
    "optim_grads_params": dict(use_torch_fsdp2=True),
}


@pytest.fixture(scope="module")
def ddp(stdlib_dataset: str) -> list[dict]:
    """The reference: DDP at DP=2."""
    return run(stdlib_dataset, 2, **BATCH)


@pytest.fixture(scope="module")
def fsdp2(stdlib_dataset: str) -> list[dict]:
    """`--use-torch-fsdp2` at DP=2, straight through."""
    return run(stdlib_dataset, 2, **BATCH, **STRATEGIES["optim_grads_params"])


@pytest.mark.slow
def test_each_strategy_logs_ddps_losses(stdlib_dataset: str, ddp: list[dict], fsdp2) -> None:
    assert_same(fsdp2, ddp)
    assert_same(run(stdlib_dataset, 2, **BATCH, **STRATEGIES["optim_grads"]), ddp)


def _assert_bf16_close(ours: list[dict], theirs: list[dict]) -> None:
    """bf16 runs: the same rounding points in other orders (bf16's u = 2^-8 on the losses'
    inputs, a few steps compounding): 1e-3 relative on the losses, 1% on the norms."""
    for mine, their in zip(ours, theirs, strict=True):
        assert math.isclose(mine["lm loss"], their["lm loss"], rel_tol=1e-3), (mine, their)
        assert math.isclose(mine["grad norm"], their["grad norm"], rel_tol=1e-2), (mine, their)


@pytest.mark.slow
def test_bf16_both_strategies_track_ddp_and_fp16_trains(stdlib_dataset: str) -> None:
    """bf16: parameters all-gathered in bf16, gradients reduced in fp32. fp16 (parameters
    gathered in fp16, Megatron's loss scaling over the fp32 master shards): no skipped or NaN
    step at a loss scale that suits the model, and the loss falls."""
    reference = run(stdlib_dataset, 2, bf16=True, **BATCH)
    for flags in STRATEGIES.values():
        _assert_bf16_close(run(stdlib_dataset, 2, bf16=True, **BATCH, **flags), reference)
    fp16 = run(stdlib_dataset, 2, fp16=True, initial_loss_scale=1024, use_torch_fsdp2=True, **BATCH)
    assert [log["number of skipped iterations"] for log in fp16] == [0] * len(fp16)
    assert all(math.isfinite(log["lm loss"]) for log in fp16)
    assert fp16[-1]["lm loss"] < fp16[0]["lm loss"] - 0.2


@pytest.mark.slow
def test_tp2_with_sequence_parallelism_on_four_ranks(stdlib_dataset: str) -> None:
    """FSDP2 shards each tensor-parallel rank's shard; the layer norms' sequence-parallel
    gradients are still summed over the TP ranks."""
    sizes = dict(tensor_model_parallel_size=2, sequence_parallel=True, **BATCH)
    assert_same(
        run(stdlib_dataset, 4, use_torch_fsdp2=True, **sizes), run(stdlib_dataset, 4, **sizes)
    )


@pytest.mark.slow
def test_resumes_bit_exactly_and_at_another_data_parallel_size(
    stdlib_dataset: str, ddp: list[dict], fsdp2: list[dict], tmp_path
) -> None:
    save = str(tmp_path / "save")
    first = run(
        stdlib_dataset,
        2,
        use_torch_fsdp2=True,
        save=save,
        save_interval=100,
        exit_interval=3,
        **BATCH,
    )
    assert os.path.isfile(os.path.join(save, "iter_0000003", "mp_rank_00", "distrib_optim.pt"))
    assert_same(first, ddp[:3])
    straight = fsdp2
    resumed = run(stdlib_dataset, 2, use_torch_fsdp2=True, load=save, **BATCH)
    assert [(log["lm loss"], log["grad norm"]) for log in resumed] == [
        (log["lm loss"], log["grad norm"]) for log in straight[3:]
    ]  # bit for bit, as printed
    for flags in (dict(use_torch_fsdp2=True), {}):
        assert_same(run(stdlib_dataset, 1, load=save, **BATCH, **flags), straight[3:])


@pytest.mark.slow
def test_megatron_interleaved_schedule_pp2_dp2(stdlib_dataset: str, tmp_path) -> None:
    """Megatron's interleaved 1F1B at PP=2 x DP=2 (4 layers, 2 virtual stages, GPT-2's tied
    embedding across the first and last stage): each chunk an FSDP2 unit, torch's stages
    reduce-scatter once per step; the same losses as DDP at that layout, also after a resume
    from a checkpoint saved at iteration 2."""
    sizes = dict(
        pipeline_model_parallel_size=2,
        num_layers=4,
        virtual_pipeline_model_parallel_size=2,
        untie_embeddings_and_output_weights=None,
        **BATCH,
    )
    reference = run(stdlib_dataset, 4, **sizes)
    save = str(tmp_path / "save")
    first = run(stdlib_dataset, 4, use_torch_fsdp2=True, save=save, save_interval=100,
                exit_interval=2, **sizes)  # fmt: skip
    resumed = run(stdlib_dataset, 4, use_torch_fsdp2=True, load=save, **sizes)
    assert_same(first + resumed, reference)
