"""Ring attention's plan (megatron/model/ring_blocks.py) against the dense mask, pair by pair.

For every rank and step of rings of 2 and 4 ranks, under sliding windows, packed documents
(boundaries inside chunks, on chunk edges, documents spanning chunks) and both: the pairs the
step's calls attend (all of a full call, the lower triangle of a causal one, the mask of a
masked one) are exactly the pairs the whole sequence's dense mask allows between this rank's
queries and the block's keys, each once. Steps and pieces that see nothing are skipped, blocks
that need no mask take the unmasked kernels, and without a mask the plan is the causal ring's.
"""

from __future__ import annotations

import pytest
import torch

from megatron.model.document_mask import DocumentMask
from megatron.model.ring_blocks import RingPlan, chunks_of, positions_of, ring_plan


def document_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """[b, s] ids: document i of each row repeated its length."""
    return torch.stack(
        [
            torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(row)])
            for row in lengths_per_row
        ]
    )


SEQ = 16
MASKS = {
    "window 2": (None, (2, 0)),
    "window 5": (None, (5, 0)),
    "window 9": (None, (9, 0)),
    "documents": ([[4, 5, 7], [8, 8]], None),
    "one document per row, split at a chunk edge": ([[16], [8, 8]], None),
    "documents and window 3": ([[3, 10, 3], [1, 1, 14]], (3, 0)),
}


def _attended(plan: RingPlan, step: int) -> torch.Tensor:
    """Int [b|1, 2c, 2c]: how many of the step's calls attend each (query, key) pair."""
    chunk = plan.chunk
    rows = 1 if plan.mask is None or plan.mask.document_ids is None else 2
    count = torch.zeros(rows, 2 * chunk, 2 * chunk, dtype=torch.int64)
    for call in plan.steps[step]:
        r, c = call.rows(chunk), call.cols(chunk)
        sq, sk = r.stop - r.start, c.stop - c.start
        if call.masked:
            seen = plan.allowed(step, call, torch.device("cpu")).long()
        elif call.causal:
            seen = torch.ones(sq, sk, dtype=torch.int64).tril()[None]
        else:
            seen = torch.ones(1, sq, sk, dtype=torch.int64)
        count[:, r, c] += seen
    return count


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_calls_attend_exactly_the_allowed_pairs(name: str, size: int) -> None:
    lengths, window = MASKS[name]
    mask = DocumentMask(None if lengths is None else document_ids(lengths), window)
    chunk = SEQ // (2 * size)
    for rank in range(size):
        plan = RingPlan(rank, size, chunk, mask)
        mine = positions_of(chunks_of(rank, size), (0, 1), chunk, torch.device("cpu"))
        for step in range(size):
            theirs = positions_of(chunks_of((rank - step) % size, size), (0, 1), chunk, mine.device)
            expected = mask.allowed_at(mine, theirs).long()
            attended = _attended(plan, step)
            assert torch.equal(attended.expand_as(expected), expected), (rank, step)
            if not expected.any():
                assert plan.steps[step] == [], (rank, step)  # nothing computed


def test_no_mask_is_the_causal_ring() -> None:
    """Step 0: one causal call over both chunks; then the sender's first chunk for all
    queries (an earlier rank) or this rank's second chunk over both (a later one)."""
    plan = RingPlan(1, 4, 2, None)
    calls = [[(c.q_chunks, c.k_chunks, c.causal, c.masked) for c in s] for s in plan.steps]
    assert calls == [
        [((0, 1), (0, 1), True, False)],
        [((0, 1), (0,), False, False)],  # from rank 0
        [((1,), (0, 1), False, False)],  # from rank 3
        [((1,), (0, 1), False, False)],  # from rank 2
    ]


def test_unmasked_pieces_keep_the_unmasked_kernels() -> None:
    """A window wider than a chunk that hides the step-0 cross piece: two causal calls (flash
    on GPUs) instead of one masked one; a piece in one document and in the window: full."""
    plan = RingPlan(0, 2, 4, DocumentMask(None, (4, 0)))  # chunks 0 and 3 of 4 tokens
    assert [(c.q_chunks, c.k_chunks, c.causal, c.masked) for c in plan.steps[0]] == [
        ((0,), (0,), True, False),
        ((1,), (1,), True, False),
    ]
    ids = document_ids([[2, 14], [3, 13]])  # chunks 1-3 hold one document
    plan = RingPlan(1, 2, 4, DocumentMask(ids, None))  # chunks 1 and 2
    assert [(c.q_chunks, c.k_chunks, c.causal, c.masked) for c in plan.steps[0]] == [
        ((0, 1), (0, 1), True, False)
    ]


def test_a_plan_is_made_once_per_mask() -> None:
    mask = DocumentMask(document_ids([[5, 11]]), (3, 0))
    assert ring_plan(0, 2, 4, mask) is ring_plan(0, 2, 4, mask)
    assert ring_plan(1, 2, 4, mask) is not ring_plan(0, 2, 4, mask)


@pytest.mark.parametrize(
    "mask, words",
    [
        (DocumentMask(None, (3, 1)), "takes a causal window (right 0)"),
        (DocumentMask(torch.zeros(1, 12, dtype=torch.long)), "must cover the whole sequence"),
        (DocumentMask(torch.tensor([[0] * 8 + [1] * 4 + [0] * 4])), "decrease along a sample"),
    ],
)
def test_refused_masks_say_why(mask: DocumentMask, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RingPlan(0, 2, 4, mask)
