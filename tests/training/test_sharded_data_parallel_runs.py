"""`torchrun ... pretrain_gpt.py --use-distributed-optimizer / --use-torch-fsdp2` (torch FSDP2 on
the plain engine) on CPU, against DDP.

The tiny LLaMA-style model of `llama_runs` at DP=2 with 2 micro-batches per step (global batch
8). What must hold:

- each strategy (optim_grads: `--use-distributed-optimizer`; optim_grads_params:
  `--use-torch-fsdp2`) logs DDP's losses and gradient norms in fp32 (up to fp32 sums in other
  orders; the distributed optimizer's run under `--torch-compile`); fp16 and bf16 track
  them to half precision's accuracy, and in bf16 both strategies log bf16 DDP's losses to
  bf16's precision; at TP=2 with sequence parallelism on 4 ranks FSDP2 logs the unsharded
  run's (Megatron's schedules at PP=2 x DP=2 and TP=2 with sequence parallelism x DP=2,
  against PP=1 x DP=1: tests/checkpointing/test_reshard_resume.py);
- a checkpoint saved by FSDP2 at DP=2 (torch_dist, the default with sharding: each rank writes
  its own slices of the weights and Adam's moments) resumes bit for bit at DP=2, and at DP=1
  both sharded and
  unsharded, to the iterations of the run that never stopped; that unsharded run's own
  checkpoint resumes with the distributed optimizer at DP=2 (the optimizer state sharded on
  loading).
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
def fsdp2(stdlib_dataset: str, tmp_path_factory) -> tuple[list[dict], str]:
    """`--use-torch-fsdp2` at DP=2, straight through, saving at iterations 3 and 6: its logs
    and its checkpoint directory, whose tracker is set back to 3."""
    save = str(tmp_path_factory.mktemp("fsdp2") / "save")
    logs = run(stdlib_dataset, 2, save=save, save_interval=3, **BATCH,
               **STRATEGIES["optim_grads_params"])  # fmt: skip
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("3")  # as a user rolls a run back
    return logs, save


@pytest.mark.slow
def test_each_strategy_logs_ddps_losses(stdlib_dataset: str, ddp: list[dict], fsdp2) -> None:
    assert_same(fsdp2[0], ddp)
    # Compiled: each FSDP2 unit's layer is one graph between its all-gather and reduce hooks.
    compiled = run(stdlib_dataset, 2, **BATCH, **STRATEGIES["optim_grads"], torch_compile=True)
    assert_same(compiled, ddp)


@pytest.mark.slow
def test_resumes_bit_exactly_and_at_another_data_parallel_size(
    stdlib_dataset: str, fsdp2: tuple[list[dict], str], tmp_path
) -> None:
    straight, save = fsdp2
    assert os.path.isfile(os.path.join(save, "iter_0000003", ".metadata"))  # torch_dist
    resumed = run(stdlib_dataset, 2, use_torch_fsdp2=True, load=save, **BATCH)
    assert [(log["lm loss"], log["grad norm"]) for log in resumed] == [
        (log["lm loss"], log["grad norm"]) for log in straight[3:]
    ]  # bit for bit, as printed
    # At DP=1 without sharding: the saved optimizer state loads into a plain AdamW; its
    # own checkpoint at iteration 4 (torch's optimizer state dict in the model file) loads
    # back into the distributed optimizer at DP=2, Adam's moments kept.
    assert_same(run(stdlib_dataset, 1, load=save, use_torch_fsdp2=True, **BATCH), straight[3:])
    unsharded = str(tmp_path / "unsharded")
    flags = dict(save=unsharded, save_interval=100, exit_interval=4, **BATCH)
    assert_same(run(stdlib_dataset, 1, load=save, **flags), straight[3:4])
    back = run(stdlib_dataset, 2, load=unsharded, **BATCH, **STRATEGIES["optim_grads"])
    assert_same(back, straight[4:])


@pytest.mark.slow
def test_half_precision_tracks_fp32_ddp(stdlib_dataset: str, ddp: list[dict]) -> None:
    """fp16 (Megatron's dynamic loss scaling, overflow decided on the global norm over every
    shard) on FSDP2 with full recomputation and prefetched all-gathers, and bf16 with the
    distributed optimizer and bf16 gradient reduction: fp16/bf16 parameters gathered, fp32
    master shards stepped; no step skipped or NaN, the losses fp32 DDP's within 0.5% (the
    precision argument of tests/training/test_mixed_precision.py), while they fall by 0.7."""
    runs = {
        "fp16": run(
            stdlib_dataset, 2, fp16=True, initial_loss_scale=4096, recompute_granularity="full",
            recompute_method="uniform", overlap_param_gather=True, **BATCH,
            **STRATEGIES["optim_grads_params"],
        ),
        "bf16": run(
            stdlib_dataset, 2, bf16=True, grad_reduce_in_bf16=True, overlap_grad_reduce=True,
            **BATCH, **STRATEGIES["optim_grads"],
        ),
    }  # fmt: skip
    assert ddp[0]["lm loss"] - ddp[-1]["lm loss"] > 0.5
    for precision, logs in runs.items():
        assert [log["iteration"] for log in logs] == [log["iteration"] for log in ddp]
        for log, reference in zip(logs, ddp, strict=True):
            assert log["number of skipped iterations"] == 0, (precision, log)
            assert log["number of nan iterations"] == 0, (precision, log)
            assert log["lm loss"] == pytest.approx(reference["lm loss"], rel=5e-3), precision


def _assert_bf16_close(ours: list[dict], theirs: list[dict]) -> None:
    """bf16 runs: the same rounding points in other orders (bf16's u = 2^-8 on the losses'
    inputs, a few steps compounding): 1e-3 relative on the losses, 1% on the norms."""
    for mine, their in zip(ours, theirs, strict=True):
        assert math.isclose(mine["lm loss"], their["lm loss"], rel_tol=1e-3), (mine, their)
        assert math.isclose(mine["grad norm"], their["grad norm"], rel_tol=1e-2), (mine, their)


@pytest.mark.slow
def test_bf16_both_strategies_track_bf16_ddp(stdlib_dataset: str) -> None:
    """bf16: parameters all-gathered in bf16, gradients reduced in fp32, the fp32 master shards
    stepped: DDP's bf16 run, rounded at the same points."""
    reference = run(stdlib_dataset, 2, bf16=True, **BATCH)
    for name, flags in STRATEGIES.items():
        logs = run(stdlib_dataset, 2, bf16=True, **BATCH, **flags)
        assert len(logs) == len(reference), name
        _assert_bf16_close(logs, reference)


@pytest.mark.slow
def test_tp2_with_sequence_parallelism_on_four_ranks(stdlib_dataset: str) -> None:
    """FSDP2 shards each tensor-parallel rank's shard; the layer norms' sequence-parallel
    gradients are still summed over the TP ranks."""
    sizes = dict(tensor_model_parallel_size=2, sequence_parallel=True, **BATCH)
    assert_same(
        run(stdlib_dataset, 4, use_torch_fsdp2=True, **sizes), run(stdlib_dataset, 4, **sizes)
    )
