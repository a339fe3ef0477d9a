"""`torchrun ... pretrain_gpt.py --use-distributed-optimizer / --use-torch-fsdp2` (torch FSDP2 on
the plain engine) on CPU, against DDP.

The tiny LLaMA-style model of `llama_runs` at DP=2 with 2 micro-batches per step (global batch
8). What must hold:

- each strategy (optim_grads: `--use-distributed-optimizer`; optim_grads_params:
  `--use-torch-fsdp2`) logs DDP's losses and gradient norms in fp32 (up to fp32 sums in other
  orders), under Megatron's interleaved schedule at PP=2 x DP=2 too (bf16 with the
  distributed optimizer runs in tests/compat/test_megatron_lm_recipes.py);
- a checkpoint saved by FSDP2 at DP=2 (weights gathered into Megatron's file, the optimizer
  state into distrib_optim.pt) resumes bit for bit at DP=2, and at DP=1 unsharded, to the
  iterations of the run that never stopped.
"""

from __future__ import annotations

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
    # At DP=1 without sharding: the gathered optimizer state loads into a plain AdamW.
    assert_same(run(stdlib_dataset, 1, load=save, **BATCH), straight[3:])


@pytest.mark.slow
def test_megatron_interleaved_schedule_pp2_dp2(stdlib_dataset: str, tmp_path) -> None:
    """Megatron's interleaved 1F1B at PP=2 x DP=2 (4 layers, 2 virtual stages, GPT-2's tied
    embedding across the first and last stage): each chunk an FSDP2 unit, torch's stages
    reduce-scatter once per step; the same losses as DDP at that layout."""
    sizes = dict(
        pipeline_model_parallel_size=2,
        num_layers=4,
        virtual_pipeline_model_parallel_size=2,
        untie_embeddings_and_output_weights=None,
        **BATCH,
    )
    reference = run(stdlib_dataset, 4, **sizes)
    assert_same(run(stdlib_dataset, 4, use_torch_fsdp2=True, **sizes), reference)
