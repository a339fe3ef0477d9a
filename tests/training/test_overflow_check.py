"""ZeRO-0's inf/NaN check in one device read (issue 56) answers and trains as DeepSpeed's loop.

`megatron/training/engines/overflow_check.py` replaces FP16_UnfusedOptimizer's per-gradient
check (a device sync per parameter) with torch's fused non-finite check at scale 1.0. Checked:
its answer on gradients with NaN, +inf, -inf, fp16's largest finite value, mixed dtypes,
missing and empty gradients, with every gradient left bit for bit as it was; and whole runs
(bf16 and fp16 ZeRO-0 on DeepSpeed's engine, fp16 ZeRO-0 on its pipeline engine at PP=1,
where bf16 runs BF16_Optimizer; the harness's tiny GPT, 5 iterations) with a NaN loss in
iteration 3 (a named fault point, the harness's `Poison`): the same skipped iteration,
losses, norms and bf16/fp16 weights after every iteration, bit for bit, as with DeepSpeed's
own check.
"""

from __future__ import annotations

import pytest
import torch

from megatron.training.engines.overflow_check import any_non_finite
from tests.training.harness import GLOBAL_BATCH, ITERATIONS, Layout, dense_state_dict, sample_tokens


def _with_grads(*grads: torch.Tensor | None) -> list[torch.nn.Parameter]:
    params = []
    for grad in grads:
        dtype = torch.float32 if grad is None else grad.dtype
        param = torch.nn.Parameter(torch.zeros(1 if grad is None else grad.shape, dtype=dtype))
        param.grad = grad
        params.append(param)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("bad", "expected"),
    [(float("nan"), True), (float("inf"), True), (float("-inf"), True), (None, False)],
)
def test_the_answer_is_whether_any_element_is_not_finite(dtype, bad, expected) -> None:
    """Any NaN/inf anywhere -> True; finite extremes -> False; gradients unchanged."""
    largest = torch.finfo(dtype).max
    grads = [
        torch.tensor([1.0, -largest, largest], dtype=dtype),
        torch.tensor([[0.5, -0.25]], dtype=torch.float32),  # another dtype, its own kernel
        torch.empty(0, dtype=dtype),
        None,
        torch.tensor([3.0, 2.0 if bad is None else bad], dtype=dtype),
    ]
    copies = [None if grad is None else grad.clone() for grad in grads]
    assert any_non_finite(_with_grads(*grads)) is expected
    for grad, copy in zip(grads, copies):
        if grad is not None:
            assert torch.equal(grad.view(torch.uint8), copy.view(torch.uint8))


def test_no_gradients_is_no_overflow() -> None:
    """Parameters without gradients (or none at all): nothing is non-finite."""
    assert any_non_finite(_with_grads(None, None)) is False
    assert any_non_finite([]) is False


LAYOUTS = [
    Layout("ZeRO-0 bf16", 1, micro_batch=2, zero=0, flags=("--bf16",)),
    Layout("ZeRO-0 fp16", 1, micro_batch=2, zero=0, flags=("--fp16", "--initial-loss-scale", "64")),
    Layout(
        "pipeline ZeRO-0 fp16",
        1,
        micro_batch=2,
        zero=0,
        pipeline_engine=True,
        flags=("--fp16", "--initial-loss-scale", "64"),
    ),
]
POISONED = 3


def _run_both(rank: int, world_size: int, dense: dict, samples, tmp: str) -> dict:
    """Spawned: every layout with the one-read check and with DeepSpeed's own."""
    import os

    import megatron.training.engines.deepspeed as engines
    from megatron.training.engines.overflow_check import check_overflow_in_one_read
    from tests.training.harness import init_deepspeed_comm, run_layout

    del world_size
    init_deepspeed_comm()
    records = {}
    for layout in LAYOUTS:
        for variant in ("one read", "deepspeed"):
            installed = []

            def install(optimizer, variant=variant, installed=installed):  # noqa: ANN001, ANN202
                done = variant == "one read" and check_overflow_in_one_read(optimizer)
                installed.append(done)
                return done

            engines.check_overflow_in_one_read = install
            config_dir = os.path.join(tmp, f"{layout.name}-{variant}-{rank}".replace(" ", "_"))
            os.makedirs(config_dir)
            record = run_layout(
                layout, dense, samples, config_dir, poison_at=POISONED, keep_weights=True
            )
            records[layout.name, variant] = (record, installed)
    engines.check_overflow_in_one_read = check_overflow_in_one_read
    return records


@pytest.fixture(scope="module")
def records() -> dict:
    """The one rank's records of every layout and variant."""
    import tempfile

    from tests.model.helpers import spawn_collect

    dense = dense_state_dict()
    samples = sample_tokens(ITERATIONS * GLOBAL_BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        return spawn_collect(_run_both, 1, dense, samples, tmp)[0]


@pytest.mark.parametrize("layout", [layout.name for layout in LAYOUTS])
def test_zero0_runs_as_with_deepspeeds_check(records: dict, layout: str) -> None:
    """The poisoned iteration skipped in both; everything else equal bit for bit."""
    (ours, installed), (theirs, not_installed) = (
        records[layout, "one read"],
        records[layout, "deepspeed"],
    )
    assert installed == [True] and not_installed == [False]
    skipped = [it.result.skipped for it in ours["iterations"]]
    assert skipped == [number == POISONED for number in range(1, ITERATIONS + 1)]
    for number, (mine, reference) in enumerate(
        zip(ours["iterations"], theirs["iterations"]), start=1
    ):
        assert (mine.result.skipped, mine.result.grad_norm, mine.scheduler_steps) == (
            reference.result.skipped,
            reference.result.grad_norm,
            reference.scheduler_steps,
        ), f"iteration {number}"
        mine_losses, their_losses = mine.result.losses, reference.result.losses
        if number != POISONED:  # NaN != NaN
            assert mine_losses == their_losses, f"iteration {number}"
        for name, weight in reference.weights.items():
            assert torch.equal(mine.weights[name], weight), f"iteration {number}: {name}"
