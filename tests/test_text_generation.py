"""Sampling (`sample_logits`) and generation (`generate`), at TP=1 and across 2 TP ranks."""

from __future__ import annotations

import pytest
import torch

from megatron.core import parallel_state
from megatron.text_generation import (
    generate,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample_logits,
)
from tests.model.helpers import build_model, spawn_collect, tiny_config
from tests.tolerances import forward_terms, reordering_atol

PROMPTS = [[3, 17, 42, 8], [9, 1, 60, 33]]
NEW_TOKENS = 10
TP_CONFIG = dict(use_cpu_initialization=True)
"""CPU initialization draws the full weights then splits them: the same dense model at any TP."""


def next_token_logits(model, prompts: list[list[int]], generated: list[list[int]]):
    """Logits [b, n, v] that chose each of the n generated tokens (one full forward), and
    the reordering bound of logits computed by another code path or TP size."""
    sequences = torch.tensor([prompt + new for prompt, new in zip(prompts, generated)])
    with torch.no_grad():
        logits = model(sequences)[:, len(prompts[0]) - 1 : -1]
    return logits, reordering_atol(logits, forward_terms(model.config, sequences.size(1)))


def assert_far_from_ties(model, prompts, generated, *, kept=1, top_p=0.0, temperature=1.0):
    """Generations by two code paths (cache or not, TP=2 or 1) are compared token for token.

    Exact comparison is sound only if no other order of the logits' sums can change a
    choice: at every step the `kept`-th largest logit (1: greedy, k: top-k's cut) leads the
    next by more than twice the bound, and top-p's cumulative mass at the cut is farther
    from `top_p` than the probabilities can move. (A multinomial draw flips only if its
    uniform lands within that rounding of a boundary, at odds of about 1e-6.)
    """
    logits, atol = next_token_logits(model, prompts, generated)
    top = logits.topk(kept + 1, dim=-1).values
    gap = (top[..., kept - 1] - top[..., kept]).min().item()
    assert gap > 2 * atol, f"a near tie: gap {gap:.3g} at the {kept}-th logit, bound {atol:.3g}"
    if top_p > 0.0:
        # A change of at most atol in every logit moves the cumulative masses by 2 atol / T.
        cumulative = (logits.sort(-1, descending=True).values / temperature).softmax(-1)
        distance = (cumulative.cumsum(-1) - top_p).abs().min().item()
        assert distance > 4 * atol / temperature, f"top-p mass {distance:.3g} from the cut"


def draws(logits: torch.Tensor, n: int, seed: int = 0, **options) -> torch.Tensor:
    """`n` samples [n] from one row of logits [v]."""
    generator = torch.Generator().manual_seed(seed)
    return sample_logits(logits.expand(n, -1), generator=generator, **options)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    filtered = modify_logits_for_top_k_filtering(logits.clone(), 5)
    for row, original in zip(filtered, logits):
        kept = torch.isfinite(row).nonzero().flatten()
        assert set(kept.tolist()) == set(original.topk(5).indices.tolist())
        assert torch.equal(row[kept], original[kept])
    sampled = set(draws(logits[0], 4000, top_k=5).tolist())
    assert sampled == set(logits[0].topk(5).indices.tolist())


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[torch.tensor([2, 0, 3, 1])]  # shuffled: ids 1, 3, 0, 2 by mass
    order = [1, 3, 0, 2]
    expected = {order[i] for i in kept}
    filtered = modify_logits_for_top_p_filtering(logits[None].clone(), top_p)[0]
    assert set(torch.isfinite(filtered).nonzero().flatten().tolist()) == expected
    assert set(draws(logits, 2000, top_p=top_p).tolist()) == expected


def test_greedy_is_argmax():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample_logits(logits, greedy=True), logits.argmax(-1))
    assert torch.equal(sample_logits(logits, top_k=1), logits.argmax(-1))


def test_temperature_reshapes_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 1.0, 3.0):
        counts = torch.bincount(draws(logits, 10000, temperature=temperature), minlength=4)
        expected = torch.softmax(logits / temperature, dim=-1)
        torch.testing.assert_close(counts / 10000, expected, atol=0.02, rtol=0)
    cold = draws(logits, 1000, temperature=1e-3)
    assert torch.all(cold == 0)


@pytest.mark.parametrize(
    "options", [dict(), dict(greedy=True), dict(top_k=3), dict(top_p=0.9)], ids=str
)
def test_padded_ids_are_never_sampled(options):
    logits = torch.zeros(1, 16)
    logits[0, 10:] = 50.0  # padding rows with the highest logits
    sampled = draws(logits[0], 1000, vocab_size=10, **options)
    assert sampled.max() < 10


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (dict(top_k=-1), "--top_k"),
        (dict(top_p=1.5), "--top_p"),
        (dict(top_p=-0.1), "--top_p"),
        (dict(top_k=2, top_p=0.5), "--top_k .* --top_p"),
        (dict(temperature=0.0), "--temperature"),
        (dict(top_k=11), "--top_k"),
        (dict(vocab_size=17), "vocab_size"),
    ],
)
def test_invalid_sampling_arguments_raise(options, flag):
    with pytest.raises(ValueError, match=flag):
        sample_logits(torch.zeros(2, 16), **{"vocab_size": 10, **options})


@pytest.fixture(scope="module")
def model():
    """A tiny eval-mode GPT (vocab 64, 16 positions)."""
    return build_model(tiny_config(**TP_CONFIG)).eval()


def test_greedy_with_cache_equals_without(model):
    cached = generate(model, PROMPTS, NEW_TOKENS, greedy=True)
    uncached = generate(model, PROMPTS, NEW_TOKENS, greedy=True, use_cache=False)
    assert_far_from_ties(model, PROMPTS, uncached)
    assert cached == uncached
    assert [len(row) for row in cached] == [NEW_TOKENS, NEW_TOKENS]


def test_seeded_sampling_is_reproducible(model):
    first = generate(model, PROMPTS, NEW_TOKENS, top_k=20, seed=5)
    assert generate(model, PROMPTS, NEW_TOKENS, top_k=20, seed=5) == first  # the same path
    assert_far_from_ties(model, PROMPTS, first, kept=20)  # without the cache: another path
    assert generate(model, PROMPTS, NEW_TOKENS, top_k=20, seed=5, use_cache=False) == first
    assert generate(model, PROMPTS, NEW_TOKENS, top_k=20, seed=6) != first


def test_stops_at_eod_per_sequence(model):
    free = generate(model, PROMPTS, NEW_TOKENS, greedy=True)
    eod = free[0][2]
    stopped = generate(model, PROMPTS, NEW_TOKENS, greedy=True, eod_token_id=eod)
    for row, full in zip(stopped, free):
        end = full.index(eod) + 1 if eod in full else len(full)
        assert row == full[:end]
    assert stopped[0][-1] == eod and len(stopped[0]) <= 3


def test_lengths_prompts_and_mode(model):
    model.train()
    out = generate(model, PROMPTS[0], 100, greedy=True)  # a flat list is one prompt
    assert model.training  # mode put back
    assert len(out) == 1 and len(out[0]) == 16 - len(PROMPTS[0])  # stops at the last position
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        generate(model, [1] * 17, 1)
    with pytest.raises(ValueError, match="equal lengths"):
        generate(model, [[1, 2], [3]], 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [1, 50], 1, vocab_size=40)
    assert generate(model, PROMPTS, 0) == [[], []]
    low_ids = [[3, 17, 22, 8], [9, 1, 30, 33]]
    sampled = generate(model, low_ids, NEW_TOKENS, temperature=5.0, vocab_size=40)
    assert max(max(row) for row in sampled) < 40


def generation_body(rank: int, world: int) -> dict[str, list[list[int]]]:
    """Greedy and top-k generations of the CPU-initialized model at TP=world."""
    parallel_state.initialize_model_parallel(world, 1)
    gathered_by_model = build_model(tiny_config(**TP_CONFIG, parallel_output=False)).eval()
    split = build_model(tiny_config(**TP_CONFIG)).eval()
    return {
        "greedy": generate(split, PROMPTS, NEW_TOKENS, greedy=True),
        "greedy-gathered": generate(gathered_by_model, PROMPTS, NEW_TOKENS, greedy=True),
        "top-k": generate(split, PROMPTS, NEW_TOKENS, top_k=8, seed=3),
        "top-p": generate(split, PROMPTS, NEW_TOKENS, top_p=0.9, temperature=0.7, seed=4),
    }


def test_tensor_parallel_generation_equals_tp1(model):
    ranks = spawn_collect(generation_body, 2)
    assert ranks[0] == ranks[1]  # every rank continues with the first rank's tokens
    # TP=2 sums the logits in another order: exact tokens only away from ties.
    greedy = generate(model, PROMPTS, NEW_TOKENS, greedy=True)
    assert_far_from_ties(model, PROMPTS, greedy)
    assert ranks[0]["greedy"] == greedy
    assert ranks[0]["greedy-gathered"] == greedy
    top_k = generate(model, PROMPTS, NEW_TOKENS, top_k=8, seed=3)
    assert_far_from_ties(model, PROMPTS, top_k, kept=8)
    assert ranks[0]["top-k"] == top_k
    top_p = generate(model, PROMPTS, NEW_TOKENS, top_p=0.9, temperature=0.7, seed=4)
    assert_far_from_ties(model, PROMPTS, top_p, top_p=0.9, temperature=0.7)
    assert ranks[0]["top-p"] == top_p
