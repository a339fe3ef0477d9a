"""Every parallel layout trains exactly like one process (gloo, fp32, dropout off).

One dense GPT state dict and one stream of global batches feed every layout; each trains
ITERATIONS steps through `TrainingLoop.step` with a warmup + cosine LR schedule, weight decay
and --clip-grad 1.0 (the gradient norm exceeds it, so clipping acts). Per iteration the
reported `lm loss`, the gradient norm, and the scheduler must equal the single-process plain
run, and so must the final weights (gathered to full size). The plain run is itself checked
against a hand-written loop (torch AdamW, `clip_grad_norm_`, the schedule from its formula).

Layouts, by spawned world (each world runs its layouts one after the other):
  1 rank:  plain (the reference); plain 4 x micro-batch 1; DeepSpeed ZeRO 0/1/2/3;
           ZeRO-1 4 x micro-batch 1; the pipeline engine at PP=1 (--deepspeed's default)
  2 ranks: plain DP=2 (DDP); ZeRO 0/1/2/3 at DP=2; plain, ZeRO-2 and ZeRO-3 at DP=2 with
           2 accumulated micro-batches (DDP's no_sync, ZeRO's gradient accumulation);
           TP=2 plain, ZeRO-0 and ZeRO-1; PP=2 on the pipeline engine with ZeRO-0 and ZeRO-1
  4 ranks: TP=2 x PP=2 and PP=2 x DP=2, pipeline engine, ZeRO-1

Tolerances: every layout sums the same fp32 numbers in another order (TP splits matmuls and
the vocab-parallel softmax, DP and ZeRO all-reduce / reduce-scatter flattened buffers,
accumulation adds micro-batch gradients), so each value may differ by the reordering bound of
`tests.tolerances` for the terms summed along its path, counted from the model's shapes
(`tests.tolerances.training_loss_terms`): the loss of iteration k by the forward, the mean
over the step's tokens and every earlier step's forward and backward (errors compound), plus
the softmax over the vocabulary; the gradient norm of iteration k also by that step's backward
and its sum over every parameter; the final weights by every step's forward and backward
(`STEP_TERMS` x ITERATIONS). Observed differences are a few 1e-7; a missing clip or
reduction moves losses and weights by 1e-2 (an O(1) error in some gradient moves its weights
by about the learning rate, 1e-2). The LR is compared to 1e-12 (the same formula). The key
part of the QKV bias is left out of weight comparisons (`harness.without_key_bias`).
"""

from __future__ import annotations

import pytest
import torch

from megatron.model import GPTModel
from tests.tolerances import (
    assert_close_reordered,
    assert_losses_reordered,
    forward_terms,
    reordering_atol,
    training_loss_terms,
)
from tests.training.harness import (
    CLIP,
    GLOBAL_BATCH,
    ITERATIONS,
    SEQ,
    VOCAB,
    Layout,
    dense_state_dict,
    hand_training,
    model_config,
    sample_tokens,
    scheduled_lr,
    spawn_jobs,
    without_key_bias,
)

CONFIG = model_config()
STEP_TOKENS = GLOBAL_BATCH * SEQ  # the most a micro-batch holds, and what a step averages
STEP_TERMS = 2 * forward_terms(CONFIG, STEP_TOKENS) + STEP_TOKENS
"""One step's forward and backward (the contractions transposed, weight gradients summed over
the step's tokens): the terms each step adds to every later value's path."""
PARAMETERS = sum(param.numel() for param in GPTModel(CONFIG).parameters())
"""The squares a gradient norm sums (the word embedding once: the output layer is tied)."""

REFERENCE = Layout("plain", 1, micro_batch=4)
PLAIN_ACCUMULATED = Layout("plain, 4 x micro-batch 1", 1, micro_batch=1)
ZERO1 = Layout("ZeRO-1", 1, micro_batch=4, zero=1)
ZERO1_ACCUMULATED = Layout("ZeRO-1, 4 x micro-batch 1", 1, micro_batch=1, zero=1)
LAYOUTS = [
    PLAIN_ACCUMULATED,
    Layout("ZeRO-0", 1, micro_batch=4, zero=0),
    ZERO1,
    Layout("ZeRO-2", 1, micro_batch=4, zero=2),
    Layout("ZeRO-3", 1, micro_batch=4, zero=3),
    ZERO1_ACCUMULATED,
    Layout("pipeline engine PP=1 ZeRO-1", 1, micro_batch=4, zero=1, pipeline_engine=True),
    Layout("plain DP=2", 2, micro_batch=2),
    Layout("ZeRO-0 DP=2", 2, micro_batch=2, zero=0),
    Layout("ZeRO-1 DP=2", 2, micro_batch=2, zero=1),
    Layout("ZeRO-2 DP=2", 2, micro_batch=2, zero=2),
    Layout("ZeRO-3 DP=2", 2, micro_batch=2, zero=3),
    Layout("plain DP=2, 2 x micro-batch 1", 2, micro_batch=1),
    Layout("ZeRO-2 DP=2, 2 x micro-batch 1", 2, micro_batch=1, zero=2),
    Layout("ZeRO-3 DP=2, 2 x micro-batch 1", 2, micro_batch=1, zero=3),
    Layout("plain TP=2", 2, micro_batch=4, tp=2),
    Layout("ZeRO-0 TP=2", 2, micro_batch=4, tp=2, zero=0),
    Layout("ZeRO-1 TP=2", 2, micro_batch=4, tp=2, zero=1),
    Layout("PP=2 ZeRO-0", 2, micro_batch=2, pp=2, zero=0, pipeline_engine=True),
    Layout("PP=2 ZeRO-1", 2, micro_batch=2, pp=2, zero=1, pipeline_engine=True),
    Layout("TP=2 x PP=2 ZeRO-1", 4, micro_batch=2, tp=2, pp=2, zero=1, pipeline_engine=True),
    Layout("PP=2 x DP=2 ZeRO-1", 4, micro_batch=1, pp=2, zero=1, pipeline_engine=True),
]
XFAIL: dict[str, str] = {}  # layout name -> known bug, strict xfail


@pytest.fixture(scope="module")
def dense() -> dict[str, torch.Tensor]:
    """The initial weights of every layout."""
    return dense_state_dict()


@pytest.fixture(scope="module")
def samples():
    """ITERATIONS global batches of tokens."""
    return sample_tokens(ITERATIONS * GLOBAL_BATCH)


def _world(world_size: int, dense, samples) -> dict[str, list[dict]]:
    layouts = [REFERENCE] * (world_size == 1) + [x for x in LAYOUTS if x.world_size == world_size]
    jobs = [(layout.name, "steps", layout, {}) for layout in layouts]
    return spawn_jobs(world_size, jobs, dense, samples)


@pytest.fixture(scope="module")
def world1(dense, samples) -> dict[str, list[dict]]:
    """{layout name: [record per rank]} of the 1-rank layouts."""
    return _world(1, dense, samples)


@pytest.fixture(scope="module")
def world2(dense, samples) -> dict[str, list[dict]]:
    """{layout name: [record per rank]} of the 2-rank layouts."""
    return _world(2, dense, samples)


@pytest.fixture(scope="module")
def world4(dense, samples) -> dict[str, list[dict]]:
    """{layout name: [record per rank]} of the 4-rank layouts."""
    return _world(4, dense, samples)


@pytest.fixture(scope="module")
def reference(world1) -> dict:
    """The single-process plain run."""
    return world1[REFERENCE.name][0]


def records_of(request, layout: Layout) -> list[dict]:
    """The per-rank records of `layout` (spawning its world on first use)."""
    return request.getfixturevalue(f"world{layout.world_size}")[layout.name]


def losses(record: dict) -> list[float]:
    """Reported `lm loss` per iteration."""
    return [iteration.result.losses["lm loss"] for iteration in record["iterations"]]


def grad_norms(record: dict) -> list[float]:
    """Gradient norm per iteration (DeepSpeed may report a 0-d tensor)."""
    return [float(iteration.result.grad_norm) for iteration in record["iterations"]]


def assert_losses_close(actual: list[float], expected: list[float], what: str) -> None:
    """Loss k (from 1) after k - 1 steps from the same state: up to the sums' order."""
    terms = [
        training_loss_terms(CONFIG, STEP_TOKENS, STEP_TOKENS, steps)
        for steps in range(len(expected))
    ]
    assert_losses_reordered(actual, expected, terms=terms, vocab=VOCAB, digits=None, what=what)


def assert_norms_close(actual: list[float], expected: list[float], what: str) -> None:
    """Gradient norm k (from 1): loss k's path, that step's backward, the sum of squares."""
    assert len(actual) == len(expected), (what, actual, expected)
    for steps, (norm, want) in enumerate(zip(actual, expected)):
        terms = (
            training_loss_terms(CONFIG, STEP_TOKENS, STEP_TOKENS, steps) + STEP_TERMS + PARAMETERS
        )
        atol = reordering_atol(torch.tensor(want), terms)
        assert abs(norm - want) <= atol, f"{what}: gradient norm {steps + 1}: {norm} vs {want}"


def assert_weights_close(actual: dict, expected: dict, what: str) -> None:
    """Every parameter in `actual` equals its `expected` counterpart (key bias aside), up to
    ITERATIONS steps' forward and backward sums in other orders."""
    assert actual, f"{what}: no weights recorded"
    for name, tensor in actual.items():
        assert_close_reordered(
            without_key_bias(name, tensor),
            without_key_bias(name, expected[name]),
            terms=ITERATIONS * STEP_TERMS,
            msg=f"{what}: {name}",
        )


# --- the reference --------------------------------------------------------------------------


def test_reference_equals_hand_written_training(reference, dense, samples):
    """The plain path = torch AdamW + clip_grad_norm_ + Megatron's schedule written out."""
    hand = hand_training(dense, samples)
    assert_losses_close(losses(reference), hand["losses"], "plain vs hand-written")
    assert_norms_close(grad_norms(reference), hand["grad_norms"], "plain vs hand-written")
    assert_weights_close(reference["final"], hand["final"], "plain vs hand-written")
    assert set(reference["final"]) == set(hand["final"])
    # The schedule after each step, from its formula (warmup, then cosine decay).
    lrs = [iteration.lr for iteration in reference["iterations"]]
    assert lrs == pytest.approx([scheduled_lr(n * GLOBAL_BATCH) for n in range(1, ITERATIONS + 1)])


def test_reference_run_exercises_clipping_and_the_schedule(reference, dense):
    """The comparisons below mean something: clipping acts, the LR moves, weights train."""
    assert max(grad_norms(reference)) > CLIP  # so every layout must clip identically
    assert min(grad_norms(reference)) < max(grad_norms(reference))
    lrs = [iteration.lr for iteration in reference["iterations"]]
    assert len(set(lrs)) == len(lrs)  # warmup then decay: a different LR every step
    moved = max(
        (reference["final"][name] - tensor).abs().max().item() for name, tensor in dense.items()
    )
    assert moved > 1e-2  # far beyond the tolerance
    assert reference["unset"] == []


# --- every layout against the reference ------------------------------------------------------


def _with_known_bugs(layout: Layout):  # noqa: ANN202 - a pytest ParameterSet
    """`layout` as a test parameter, xfail (strict) where it shows a known bug."""
    if layout.name in XFAIL:
        bug = pytest.mark.xfail(strict=True, reason=XFAIL[layout.name])
        return pytest.param(layout, id=layout.name, marks=bug)
    return pytest.param(layout, id=layout.name)


@pytest.mark.parametrize("layout", [_with_known_bugs(layout) for layout in LAYOUTS])
def test_layout_trains_like_one_process(request, layout, reference):
    """Per iteration: same loss, gradient norm, LR and sample count; then the same weights."""
    records = records_of(request, layout)
    assert len(records) == layout.world_size
    for record in records:
        where = f"{layout.name}, rank {record['rank']}"
        assert record["unset"] == [], f"{where}: parameters the loader did not set"
        # The norm first: a wrong norm (clip coefficient) is the earliest possible divergence.
        assert_norms_close(grad_norms(record), grad_norms(reference), where)
        assert_losses_close(losses(record), losses(reference), where)
        for iteration, expected in zip(record["iterations"], reference["iterations"]):
            assert not iteration.result.skipped and not iteration.result.nan, where
            assert iteration.scheduler_steps == expected.scheduler_steps, where
            assert iteration.lr == pytest.approx(expected.lr, rel=1e-12), where
        assert_weights_close(record["final"], reference["final"], where)
    # Together the ranks hold every parameter of the model.
    held = set().union(*(record["final"] for record in records))
    assert held == set(reference["final"]), layout.name


@pytest.mark.parametrize(
    "layout", [pytest.param(x, id=x.name) for x in LAYOUTS if x.world_size > 1]
)
def test_copies_of_a_parameter_are_bit_identical(request, layout):
    """DP replicas, TP-replicated parameters and the pipeline's two tied embeddings agree
    bit for bit: the same reduced gradients and the same update on every copy."""
    records = records_of(request, layout)
    compared = 0
    for name in set().union(*(record["final"] for record in records)):
        copies = [record["final"][name] for record in records if name in record["final"]]
        for copy in copies[1:]:
            assert torch.equal(copy, copies[0]), f"{layout.name}: {name}"
            compared += 1
    assert compared > 0


@pytest.mark.parametrize(
    "accumulated, single",
    [(PLAIN_ACCUMULATED, REFERENCE), (ZERO1_ACCUMULATED, ZERO1)],
    ids=["plain", "ZeRO-1"],
)
def test_gradient_accumulation_equals_one_micro_batch(world1, accumulated, single):
    """--micro-batch-size 1 --global-batch-size 4 (4 accumulated) = --micro-batch-size 4."""
    many, one = world1[accumulated.name][0], world1[single.name][0]
    assert_losses_close(losses(many), losses(one), accumulated.name)
    assert_norms_close(grad_norms(many), grad_norms(one), accumulated.name)
    assert [i.scheduler_steps for i in many["iterations"]] == [
        i.scheduler_steps for i in one["iterations"]
    ]
    assert_weights_close(many["final"], one["final"], accumulated.name)
