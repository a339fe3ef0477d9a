"""vocab_parallel_cross_entropy against F.cross_entropy on the gathered logits, tp 1, 2, 4.

Every rank holds the same full logits and keeps its vocabulary slice; the per-token loss must
equal `F.cross_entropy(full, target, reduction="none")` and, after backward with a random
upstream gradient, this rank's logit gradient must equal the slice of the dense gradient.
Cases: fp32, a padded vocabulary (50 real ids padded to 64), bf16 logits (the loss stays
fp32), logits of magnitude 1e4 (still finite) or 1e4 plus small values (the softmax keeps
their low bits), and Megatron's label smoothing, checked against an autograd
re-implementation of its formula and, at tp 1, finite differences.
The loss runs in chunks of tokens: the cases run again with 5 tokens per chunk (12 tokens:
chunks of 5, 5 and 2), where the forward still makes one max and one sum all-reduce and the
backward none; and nothing saved for backward is an fp32 `[tokens, vocab/tp]` tensor (only
the logits as given, and `[tokens]` vectors).
With `check_labels`, a label outside the full (padded) vocabulary is a ValueError naming it;
without, such a label still gives a finite loss, as before.
Worlds of 1, 2 and 4 ranks run with tp = world size, and the 4-rank world also with tp 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import cross_entropy, vocab_parallel_cross_entropy
from tests.core.spawn_checks import BODY, run_checks_per_layout
from tests.tolerances import assert_close_reordered

# (world size, tp): tp = world, and tp 2 inside 4 ranks (two data-parallel replicas), where
# a collective on the wrong group would be caught.
LAYOUTS = [(1, 1), (2, 2), (4, 4), (4, 2)]
LAYOUT_IDS = [f"world{world}-tp{tp}" for world, tp in LAYOUTS]
SEQ, BATCH, VOCAB, REAL_VOCAB = 4, 3, 64, 50
# Ids owned by every shard at tp 4 (16 ids each), both edges of each shard.
TARGETS = [0, 15, 16, 31, 32, 47, 48, 63, 7, 20, 40, 55]
# Only real ids (< 50); the last shard at tp 4 owns just 48 and 49 of them.
PADDED_TARGETS = [0, 15, 16, 31, 32, 47, 48, 49, 7, 20, 40, 49]
# Our loss sums the softmax's VOCAB exponentials as per-rank partial sums (and per chunk of
# tokens) then an all-reduce, F.cross_entropy in one sum: fp32 results agree to a reordering
# bound (tests/tolerances.py). Loss and gradient are elementwise from that log-sum-exp; counted
# generously as twice the vocabulary (the sum, and the roundings of the exponents, whose
# logits reach ~10 here, against a loss of a few units).
CE_TERMS = 2 * VOCAB
# Label smoothing adds the mean of the VOCAB log-probabilities.
SMOOTHED_TERMS = CE_TERMS + VOCAB
CHUNK_TOKENS = 5  # SEQ * BATCH = 12 tokens: chunks of 5, 5 and 2


def _shard(tensor: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's slice of the vocabulary (last) dimension."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    return tensor.chunk(world, dim=-1)[parallel_state.get_tensor_model_parallel_rank()]


def _random(*shape: int, seed: int) -> torch.Tensor:
    """A random tensor, the same on a tensor-parallel group's ranks, not across replicas."""
    seed += 1000 * parallel_state.get_data_parallel_rank()
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(full: torch.Tensor, target: torch.Tensor, probe: torch.Tensor, smoothing=0.0):
    """F.cross_entropy on the full fp32 logits: per-token loss and d(sum(probe*loss))/dlogits."""
    full = full.detach().float().requires_grad_()
    loss = F.cross_entropy(
        full.view(-1, full.size(-1)),
        target.view(-1),
        reduction="none",
        label_smoothing=smoothing,
    ).view(target.shape)
    (loss * probe).sum().backward()
    return loss.detach(), full.grad


def _megatron_smoothed_loss(full: torch.Tensor, target: torch.Tensor, label_smoothing: float):
    """Megatron's label smoothing written with autograd ops: (1-s) nll - s mean(log p).

    s = label_smoothing * V / (V - 1), so the target keeps 1 - label_smoothing of the mass.
    """
    vocab = full.size(-1)
    smoothing = label_smoothing * vocab / (vocab - 1)
    log_probs = torch.log_softmax(full.float(), dim=-1)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)


def _parallel(full: torch.Tensor, target: torch.Tensor, probe: torch.Tensor, smoothing=0.0):
    """Our loss on this rank's slice, and that slice's gradient; the input must not change."""
    local = _shard(full).detach().clone().requires_grad_()
    before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    (loss * probe).sum().backward()
    assert torch.equal(local.detach(), before), "the logits were modified in place"
    assert local.grad.dtype == local.dtype
    return loss.detach(), local.grad


def _target(ids: list[int]) -> torch.Tensor:
    """Target ids shaped [s, b]."""
    return torch.tensor(ids).view(SEQ, BATCH)


def _check_fp32(padded: bool) -> None:
    """fp32 logits; with `padded`, only the first 50 of 64 ids are ever targets."""
    full = _random(SEQ, BATCH, VOCAB, seed=1) * 3
    target = _target(PADDED_TARGETS if padded else TARGETS)
    if padded:
        assert int(target.max()) < REAL_VOCAB
    probe = _random(SEQ, BATCH, seed=2)
    loss, grad = _parallel(full, target, probe)
    ref_loss, ref_grad = _reference(full, target, probe)
    assert_close_reordered(loss, ref_loss, terms=CE_TERMS)
    assert_close_reordered(grad, _shard(ref_grad), terms=CE_TERMS)


def _check_bf16() -> None:
    """bf16 logits: fp32 loss equal to the reference on the same (rounded) values."""
    full32 = _random(SEQ, BATCH, VOCAB, seed=3) * 3
    full = full32.bfloat16()
    target, probe = _target(TARGETS), _random(SEQ, BATCH, seed=4)
    loss, grad = _parallel(full, target, probe)
    assert grad.dtype == torch.bfloat16
    ref_loss, ref_grad = _reference(full, target, probe)
    # The math runs in fp32 on the bf16 values: the loss is as exact as fp32.
    assert_close_reordered(loss, ref_loss, terms=CE_TERMS, dtype=torch.float32)
    # The gradient is rounded to bf16 (u = 2^-8): bf16's own tolerances.
    torch.testing.assert_close(grad.float(), _shard(ref_grad), atol=1e-2, rtol=1.6e-2)
    # Against the unrounded fp32 logits only bf16's rounding of the inputs separates them.
    ref32_loss, ref32_grad = _reference(full32, target, probe)
    torch.testing.assert_close(loss, ref32_loss, atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(grad.float(), _shard(ref32_grad), atol=2e-2, rtol=5e-2)


def _check_large_logits() -> None:
    """Logits ~1e4: finite loss and gradient, equal to the (stable) reference."""
    full = _random(SEQ, BATCH, VOCAB, seed=5) * 1e4
    assert full.abs().max() > 1e4
    target, probe = _target(TARGETS), _random(SEQ, BATCH, seed=6)
    loss, grad = _parallel(full, target, probe)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    ref_loss, ref_grad = _reference(full, target, probe)
    assert (ref_loss > 1e3).any()  # the case really is large
    # One exponential dominates each sum: the loss is max - logit (up to ~6e4) rounded once
    # or twice, ulp <= 4e-3 there, within atol 1e-2 + rtol 1e-6 * |loss| in any order.
    torch.testing.assert_close(loss, ref_loss, atol=1e-2, rtol=1e-6)
    assert_close_reordered(grad, _shard(ref_grad), terms=CE_TERMS)


def _check_offset_logits() -> None:
    """Logits ~1e4 + N(0, 3): the softmax ignores the offset, so its low bits must survive."""
    full = _random(SEQ, BATCH, VOCAB, seed=11) * 3 + 1e4
    target, probe = _target(TARGETS), _random(SEQ, BATCH, seed=12)
    loss, grad = _parallel(full, target, probe)
    ref_loss, ref_grad = _reference(full, target, probe)
    # A softmax from exp(x - lse) with lse = max + log(sum) rounded in fp32 (ulp ~1e-3 at 1e4)
    # would be off by ~1e-3 relative here, far outside the reordering bound (1.5e-5 x max).
    assert_close_reordered(loss, ref_loss, terms=CE_TERMS)
    assert_close_reordered(grad, _shard(ref_grad), terms=CE_TERMS)


def _check_label_smoothing(padded: bool) -> None:
    """Forward and backward against the autograd formula and F.cross_entropy's smoothing."""
    label_smoothing = 0.1
    full = _random(SEQ, BATCH, VOCAB, seed=7) * 3
    target = _target(PADDED_TARGETS if padded else TARGETS)
    probe = _random(SEQ, BATCH, seed=8)
    loss, grad = _parallel(full, target, probe, smoothing=label_smoothing)

    dense = full.clone().requires_grad_()
    ref_loss = _megatron_smoothed_loss(dense, target, label_smoothing)
    (ref_loss * probe).sum().backward()
    assert_close_reordered(loss, ref_loss.detach(), terms=SMOOTHED_TERMS)
    assert_close_reordered(grad, _shard(dense.grad), terms=SMOOTHED_TERMS)
    # The same thing in torch's terms: its label_smoothing of s = eps * V / (V - 1).
    torch_loss, _ = _reference(full, target, probe, smoothing=label_smoothing * VOCAB / (VOCAB - 1))
    assert_close_reordered(loss, torch_loss, terms=SMOOTHED_TERMS)
    # And it really smooths: not the plain loss.
    assert not torch.allclose(loss, _reference(full, target, probe)[0], atol=1e-3)


def _check_labels(bad: int, position: tuple[int, int]) -> None:
    """`bad` at [s, b] `position`: ValueError naming it, its position and the full vocab."""
    full = _random(SEQ, BATCH, VOCAB, seed=9)
    target = _target(TARGETS)
    local = _shard(full)
    # In range: the check passes and changes nothing.
    checked = vocab_parallel_cross_entropy(local, target, check_labels=True)
    # The same kernels on the same logits (the check only reads the labels): bitwise.
    assert torch.equal(checked, vocab_parallel_cross_entropy(local, target))
    target[position] = bad
    target[SEQ - 1, BATCH - 1] = bad  # a later offender: the first one is named
    with pytest.raises(ValueError) as raised:
        vocab_parallel_cross_entropy(local, target, check_labels=True)
    s, b = position
    assert str(raised.value).startswith(
        f"label {bad} at sequence position {s}, batch index {b} is outside the vocabulary "
        f"of {VOCAB} "  # the whole vocabulary, not this rank's slice
    )
    # Off (the default): no check, a finite loss as before.
    assert torch.isfinite(vocab_parallel_cross_entropy(local, target)).all()


@contextlib.contextmanager
def _small_chunks() -> Iterator[None]:
    """Within: CHUNK_TOKENS tokens per chunk at this tp (the budgets are per fp32 chunk)."""
    partition_vocab = VOCAB // parallel_state.get_tensor_model_parallel_world_size()
    defaults = cross_entropy.CHUNK_BYTES, cross_entropy.CPU_CHUNK_BYTES
    cross_entropy.CHUNK_BYTES = cross_entropy.CPU_CHUNK_BYTES = CHUNK_TOKENS * 4 * partition_vocab
    try:
        chunks = cross_entropy._token_chunks(torch.empty(SEQ * BATCH, partition_vocab))
        assert [c.stop - c.start for c in chunks] == [5, 5, 2]
        yield
    finally:
        cross_entropy.CHUNK_BYTES, cross_entropy.CPU_CHUNK_BYTES = defaults


def _check_chunked(check: Callable[..., None], *args: object) -> None:
    """`check` with 5-token chunks, counting the all-reduces: one max, one sum, all forward."""
    calls = {"max": 0, "sum": 0}

    def counted(name: str, reduce: Callable) -> Callable:
        def wrapper(tensor: torch.Tensor) -> torch.Tensor:
            calls[name] += 1
            return reduce(tensor)

        return wrapper

    originals = (
        cross_entropy.all_reduce_max_over_tensor_parallel,
        cross_entropy.all_reduce_sum_over_tensor_parallel,
    )
    cross_entropy.all_reduce_max_over_tensor_parallel = counted("max", originals[0])
    cross_entropy.all_reduce_sum_over_tensor_parallel = counted("sum", originals[1])
    try:
        with _small_chunks():
            check(*args)
    finally:
        (
            cross_entropy.all_reduce_max_over_tensor_parallel,
            cross_entropy.all_reduce_sum_over_tensor_parallel,
        ) = originals
    # Each check calls the loss once (forward and backward): one all-reduce of each kind.
    assert calls == {"max": 1, "sum": 1}, calls


def _saved_for_backward(local: torch.Tensor, smoothing: float) -> list[torch.Tensor]:
    """Every tensor the loss saves for backward (then runs the backward, which must work)."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = vocab_parallel_cross_entropy(local, _target(TARGETS), label_smoothing=smoothing)
    loss.sum().backward()
    assert local.grad.dtype == local.dtype
    return saved


def _check_saved_tensors() -> None:
    """Saved for backward: the logits as given (no copy) and [N]-sized vectors, nothing more."""
    tokens = SEQ * BATCH
    for dtype in (torch.float32, torch.bfloat16):
        for smoothing in (0.0, 0.1):
            local = _shard(_random(SEQ, BATCH, VOCAB, seed=10)).to(dtype, copy=True)
            local.requires_grad_()
            saved = _saved_for_backward(local, smoothing)
            storage = local.untyped_storage().data_ptr()
            logits = [t for t in saved if t.untyped_storage().data_ptr() == storage]
            assert len(logits) == 1 and logits[0].dtype == dtype, [t.dtype for t in logits]
            assert logits[0].shape == local.shape
            others = [t for t in saved if t.untyped_storage().data_ptr() != storage]
            # No [N, v/tp] tensor (fp32 or not), nor a view of one: at most a few [N] rows.
            assert max(t.numel() for t in others) <= tokens, [t.shape for t in others]
            assert max(t.untyped_storage().nbytes() for t in others) <= 4 * tokens * 4
            assert local.size(-1) * tokens * 4 > 4 * tokens * 4  # the bound means something


CHECKS = {
    "fp32": (_check_fp32, False),
    "padded vocab": (_check_fp32, True),
    "bf16": (_check_bf16,),
    "large logits": (_check_large_logits,),
    "offset logits": (_check_offset_logits,),
    "label smoothing": (_check_label_smoothing, False),
    "label smoothing padded vocab": (_check_label_smoothing, True),
    "label too large": (_check_labels, VOCAB, (2, 1)),
    "label negative": (_check_labels, -1, (0, 2)),
    "fp32 chunked": (_check_chunked, _check_fp32, False),
    "padded vocab chunked": (_check_chunked, _check_fp32, True),
    "bf16 chunked": (_check_chunked, _check_bf16),
    "large logits chunked": (_check_chunked, _check_large_logits),
    "offset logits chunked": (_check_chunked, _check_offset_logits),
    "label smoothing chunked": (_check_chunked, _check_label_smoothing, False),
    "label smoothing padded vocab chunked": (_check_chunked, _check_label_smoothing, True),
    "saved tensors": (_check_saved_tensors,),
}


SPAWN_WORLD_SIZES = sorted({world for world, _ in LAYOUTS})


def spawn_body(checks, rank: int, world: int) -> None:
    """Every cross-entropy case for each layout of this world size."""
    run_checks_per_layout(checks, world, LAYOUTS, CHECKS)


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's check outcomes by world size (from the session's spawned worlds)."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("case", ["fp32", "padded vocab"])
def test_matches_cross_entropy_fp32(spawned, world, tp, case):
    """Per-token loss and logit gradient == F.cross_entropy on the gathered logits."""
    spawned[world].assert_ok(f"tp={tp} {case}")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
def test_bf16_logits_give_fp32_loss(spawned, world, tp):
    """bf16 logits: fp32 loss, bf16 gradient, both close to the fp32 reference."""
    spawned[world].assert_ok(f"tp={tp} bf16")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("case", ["large logits", "offset logits"])
def test_large_logits_stay_finite(spawned, world, tp, case):
    """Logits of magnitude 1e4 (or 1e4 + small) give a loss and gradient equal to the reference."""
    spawned[world].assert_ok(f"tp={tp} {case}")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("case", ["label smoothing", "label smoothing padded vocab"])
def test_label_smoothing_matches_autograd_formula(spawned, world, tp, case):
    """Smoothed loss and gradient == autograd on Megatron's formula over the whole vocab."""
    spawned[world].assert_ok(f"tp={tp} {case}")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(
    "case",
    [
        "fp32 chunked",
        "padded vocab chunked",
        "bf16 chunked",
        "large logits chunked",
        "offset logits chunked",
        "label smoothing chunked",
        "label smoothing padded vocab chunked",
    ],
)
def test_chunks_give_the_same_loss_with_one_all_reduce_each(spawned, world, tp, case):
    """5-token chunks over 12 tokens: same checks, one max and one sum all-reduce in all."""
    spawned[world].assert_ok(f"tp={tp} {case}")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
def test_no_fp32_logits_are_saved_for_backward(spawned, world, tp):
    """fp32 and bf16 logits: backward keeps the logits as given and [tokens] vectors only."""
    spawned[world].assert_ok(f"tp={tp} saved tensors")


@pytest.mark.parametrize("world", SPAWN_WORLD_SIZES)
def test_spawned_body_ran_every_check(spawned, world):
    """Nothing escaped the checks, and every check has a test."""
    expected = {f"tp={tp} {name}" for w, tp in LAYOUTS if w == world for name in CHECKS}
    assert spawned[world].names() == expected, spawned[world].per_rank[0].get(BODY)


def _finite_difference_grad(fn, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Central differences of the scalar fn at x, one coordinate at a time."""
    grad = torch.zeros_like(x)
    flat, flat_grad = x.view(-1), grad.view(-1)
    for i in range(flat.numel()):
        saved = flat[i].item()
        flat[i] = saved + eps
        upper = fn(x)
        flat[i] = saved - eps
        lower = fn(x)
        flat[i] = saved
        flat_grad[i] = (upper - lower) / (2 * eps)
    return grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_gradient_matches_finite_differences_single_rank(label_smoothing):
    """At tp 1 (no process groups) the analytic gradient equals central differences."""
    parallel_state.destroy_model_parallel()
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 2, 8, generator=generator, dtype=torch.float64)
    target = torch.tensor([[0, 7], [3, 3], [5, 1]])
    probe = torch.randn(3, 2, generator=generator, dtype=torch.float64)

    def objective(x: torch.Tensor) -> float:
        """The probed sum of losses at logits x."""
        loss = vocab_parallel_cross_entropy(x, target, label_smoothing=label_smoothing)
        return float((loss.double() * probe).sum())

    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, label_smoothing=label_smoothing)
    (loss * probe).sum().backward()
    numeric = _finite_difference_grad(objective, logits.clone(), eps=1e-2)
    torch.testing.assert_close(x.grad, numeric, atol=2e-3, rtol=1e-3)
    assert x.grad.abs().max() > 0.05


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("case", ["label too large", "label negative"])
def test_check_labels_names_a_label_outside_the_vocabulary(spawned, world, tp, case):
    """check_labels: ValueError with the label, its [s, b] position and the full vocab size."""
    spawned[world].assert_ok(f"tp={tp} {case}")
