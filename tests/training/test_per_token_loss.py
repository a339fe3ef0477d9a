"""`--calculate-per-token-loss`: every unmasked token of the global batch weighs the same.

The batches hold many end-of-document tokens (0) and the runs mask them (`--eod-mask-loss`),
so the micro-batches hold different numbers of tokens and the two normalisations differ: the
mean of micro-batch means (Megatron's default) against the mean over the global batch's
tokens (Megatron-LM's per-token loss). Each layout trains with the per-token loss and must
equal a hand-written single-process loop whose loss is the global token mean: with several
micro-batches per step, over data-parallel ranks, and through Megatron's pipeline schedules
(whose torch schedule divides the gradients by the micro-batches itself). The same plain run
without the flag must not (the comparison has teeth). Tolerances as tests/training/
test_equivalence.py (sums in other orders); the reported loss is the token-weighted mean.
"""

from __future__ import annotations

import pytest

from megatron.arguments import parse_args
from tests.training.harness import GLOBAL_BATCH, ITERATIONS, Layout, hand_training, spawn_jobs
from tests.training.test_equivalence import (
    assert_losses_close,
    assert_norms_close,
    assert_weights_close,
    grad_norms,
    losses,
)

PER_TOKEN = ("--calculate-per-token-loss", "--eod-mask-loss")
LAYOUTS = [
    Layout("plain, 1 micro-batch", 1, micro_batch=4, flags=PER_TOKEN),
    Layout("plain, 4 x micro-batch 1", 1, micro_batch=1, flags=PER_TOKEN),
    Layout("plain DP=2, 2 x micro-batch 1", 2, micro_batch=1, flags=PER_TOKEN),
    Layout("Megatron schedules PP=2, 4 x micro-batch 1", 2, micro_batch=1, pp=2, flags=PER_TOKEN),
]
MEAN_OF_MEANS = Layout("plain, 4 x micro-batch 1, default", 1, micro_batch=1, flags=PER_TOKEN[1:])
# Megatron-LM's MoE, every token counted: both normalisations are the same training, the
# load-balancing loss included (its factor cancels the division by the step's tokens).
ROUTED = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.1")
ROUTED_RUNS = [
    Layout("routed MoE, default", 1, micro_batch=1, flags=ROUTED),
    Layout("routed MoE, per token", 1, micro_batch=1, flags=(*ROUTED, PER_TOKEN[0])),
]


@pytest.fixture(scope="module")
def samples():
    """ITERATIONS global batches in which about one token in four ends a document."""
    from tests.training.harness import sample_tokens

    tokens = sample_tokens(ITERATIONS * GLOBAL_BATCH)
    tokens[tokens % 4 == 0] = 0
    return tokens


@pytest.fixture(scope="module")
def dense():
    """The initial weights of every run."""
    from tests.training.harness import dense_state_dict

    return dense_state_dict()


@pytest.fixture(scope="module")
def records(dense, samples) -> dict[str, list[dict]]:
    """{layout name: [record per rank]}, one spawned world per size."""
    jobs = {1: [], 2: []}
    for layout in [*LAYOUTS, MEAN_OF_MEANS, *ROUTED_RUNS]:
        jobs[layout.world_size].append((layout.name, "steps", layout, {}))
    found = {}
    for world_size, world_jobs in jobs.items():
        found.update(spawn_jobs(world_size, world_jobs, dense, samples))
    return found


@pytest.fixture(scope="module")
def reference(dense, samples) -> dict:
    """The global token mean, by hand in one process."""
    return hand_training(dense, samples, eod_mask=True)


@pytest.mark.parametrize("layout", [pytest.param(x, id=x.name) for x in LAYOUTS])
def test_per_token_loss_equals_the_global_token_mean(records, reference, layout):
    """Losses, gradient norms and final weights of the hand-written global token mean."""
    for record in records[layout.name]:
        where = f"{layout.name}, rank {record['rank']}"
        assert record["unset"] == [], f"{where}: parameters the loader did not set"
        assert_norms_close(grad_norms(record), reference["grad_norms"], where)
        assert_losses_close(losses(record), reference["losses"], where)
        assert not any(it.result.skipped for it in record["iterations"]), where
        assert_weights_close(record["final"], reference["final"], where)


def test_the_default_mean_of_means_differs(records, reference):
    """Without the flag the same masked batches train to other weights: the micro-batches'
    token counts differ enough for the normalisation to matter beyond the tolerances."""
    record = records[MEAN_OF_MEANS.name][0]
    with pytest.raises(AssertionError):
        assert_weights_close(record["final"], reference["final"], "default")


def test_moe_load_balancing_loss_keeps_its_weight(records):
    """Unmasked batches: per-token loss trains the MoE model as the default does, so the
    auxiliary loss's gradient has the same scale in both (a missing factor moves the routers
    by the learning rate)."""
    default, per_token = (records[layout.name][0] for layout in ROUTED_RUNS)
    assert losses(default)[-1] != losses(default)[0]
    routers = [name for name in default["final"] if "router" in name]
    assert routers, sorted(default["final"])
    assert_losses_close(losses(per_token), losses(default), "routed MoE")
    assert_weights_close(per_token["final"], default["final"], "routed MoE")


def test_refused_on_deepspeed_in_one_line(tmp_path, capsys):
    """DeepSpeed's engine reduces inside its step: the flag is refused there, naming both."""
    argv = Layout("ZeRO-1", 1, micro_batch=4, zero=1, flags=PER_TOKEN).argv(str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv, world_size=1)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--calculate-per-token-loss with --deepspeed" in error[0], error
