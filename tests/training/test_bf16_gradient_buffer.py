"""DeepSpeed's BF16_Optimizer with flat bf16 gradient buffers (issue 56) trains bit-identically
to DeepSpeed's own per-parameter accumulation.

`megatron/training/engines/bf16_gradient_buffer.py` makes each bf16 `.grad` a view of one flat
buffer per parameter group and accumulates each micro-batch with one `add_` of that buffer
into DeepSpeed's fp32 one. The same bf16 runs (the harness's tiny GPT, 5 iterations, clipping
active, 2-4 micro-batches per iteration) are trained with and without it in one gloo world of
2 ranks: ZeRO-1 over DP=2 (the engine's backward epilogue, the reduction of the fp32 buffer),
DeepSpeed's pipeline engine at PP=1 over DP=2 (the tied embedding's `_hp_grad`) and at PP=2
(the first stage's explicit `clear_lp_grads` / `update_hp_grads`, the last stage's tied copy).
Losses, gradient norms and every local bf16 weight after every iteration must be equal bit
for bit. A third run replaces one parameter's `.grad` with a copy after each accumulation (a
named fault point: what code that sets `.grad` itself does); its group then goes through
DeepSpeed's loop, and the run is still bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.training.harness import (
    GLOBAL_BATCH,
    ITERATIONS,
    Layout,
    dense_state_dict,
    sample_tokens,
)

BF16 = ("--bf16",)
LAYOUTS = [
    Layout("ZeRO-1 DP=2 bf16", 2, micro_batch=1, zero=1, flags=BF16),
    Layout("pipeline PP=1 DP=2 bf16", 2, micro_batch=1, zero=1, pipeline_engine=True, flags=BF16),
    Layout("pipeline PP=2 bf16", 2, micro_batch=1, pp=2, zero=1, pipeline_engine=True, flags=BF16),
]
VARIANTS = ("flat", "deepspeed", "foreign grad")


def _run_variants(rank: int, world_size: int, dense: dict, samples, tmp: str) -> dict:
    """Spawned: every layout in every variant; {(layout, variant): record + what was built}."""
    import os

    import megatron.training.engines.deepspeed as engines
    from megatron.training.engines.bf16_gradient_buffer import accumulate_in_flat_buffers
    from tests.training.harness import init_deepspeed_comm, run_layout

    del world_size
    init_deepspeed_comm()
    records = {}
    for layout in LAYOUTS:
        for variant in VARIANTS:
            installed = []

            def install(optimizer, variant=variant, installed=installed):  # noqa: ANN001, ANN202
                if variant == "deepspeed":
                    return None
                flat = accumulate_in_flat_buffers(optimizer)
                installed.append(flat is not None)
                if variant == "foreign grad" and flat is not None:
                    param = optimizer.bf16_groups[0][0]

                    def own_copy(param: torch.nn.Parameter) -> None:
                        param.grad = param.grad.clone()

                    param.register_post_accumulate_grad_hook(own_copy)
                return flat

            engines.accumulate_in_flat_buffers = install
            config_dir = os.path.join(tmp, f"{layout.name}-{variant}-rank{rank}".replace(" ", "_"))
            os.makedirs(config_dir)
            record = run_layout(layout, dense, samples, config_dir, keep_weights=True)
            record["installed"] = installed
            records[layout.name, variant] = record
    engines.accumulate_in_flat_buffers = accumulate_in_flat_buffers
    return records


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """Each rank's records of every layout and variant."""
    import tempfile

    from tests.model.helpers import spawn_collect

    dense = dense_state_dict()
    samples = sample_tokens(ITERATIONS * GLOBAL_BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        return spawn_collect(_run_variants, 2, dense, samples, tmp)


def _iterations(record: dict) -> list[tuple]:
    return [
        (it.result.losses, it.result.grad_norm, it.result.skipped) for it in record["iterations"]
    ]


@pytest.mark.parametrize("layout", [layout.name for layout in LAYOUTS])
@pytest.mark.parametrize("variant", ["flat", "foreign grad"])
def test_flat_buffers_train_bit_identically(records: list[dict], layout: str, variant: str) -> None:
    """Losses, norms and every weight after every iteration equal DeepSpeed's own loop's."""
    for rank, by_run in enumerate(records):
        ours, theirs = by_run[layout, variant], by_run[layout, "deepspeed"]
        assert ours["installed"] == [True], f"rank {rank}: flat buffers not installed"
        assert theirs["installed"] == []
        assert _iterations(ours) == _iterations(theirs), f"rank {rank}"
        assert not any(it.result.skipped for it in ours["iterations"])
        for number, (mine, reference) in enumerate(
            zip(ours["iterations"], theirs["iterations"]), start=1
        ):
            for name, weight in reference.weights.items():
                assert torch.equal(mine.weights[name], weight), (
                    f"rank {rank}, iteration {number}: {name} differs"
                )


def test_the_runs_learn_and_clip(records: list[dict]) -> None:
    """The compared runs are real training: losses fall and the gradients were clipped."""
    for layout in LAYOUTS:
        iterations = records[-1][layout.name, "flat"]["iterations"]
        losses = [it.result.losses["lm loss"] for it in iterations]
        assert losses[-1] < losses[0] - 0.1, (layout.name, losses)
        assert max(it.result.grad_norm for it in iterations) > 1.0, layout.name
