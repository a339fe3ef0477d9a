"""Which attention ring attention computes at each step, and under which mask.

Under context parallelism rank r of C holds chunks r and 2C-1-r of the sequence's 2C chunks
(c tokens each): its queries are local rows [0, c) and [c, 2c), and so are the keys of the
key/value block in hand at step t, which are rank (r - t) mod C's. Each (query chunk, key
chunk) pair of a step, a *piece*, is one of:

- `HIDDEN`: no query of the one may see a key of the other (the key chunk comes later, or a
  sliding window or the document boundaries hide it whole): not computed;
- `CAUSAL`: the same chunk, causal and nothing else (one document, the window wider than it);
- `FULL`: an earlier chunk, every key visible;
- `MASKED`: some keys visible, by the window or by the documents.

A step's live pieces become its `BlockCall`s, each one kernel call over contiguous rows and
columns: without any masked piece the unmasked kernels take them (one causal call over both
chunks at step 0, as before windows and documents came in; one full call over the pieces
sharing a chunk), and with one the whole step is one masked call over the rows and columns of
its live pieces, its mask the window and document rule of `DocumentMask.allowed_at` (which
also hides the pieces around them that are not live). Steps without live pieces compute
nothing (their keys and values still travel on).

The plan comes from the window and from each chunk's first and last document id (document
ids never decrease along a sample: they count the end-of-document tokens before each
token), so it costs no [s, s] work: a piece shares a document only through the document that
crosses from the key chunk's end into the query chunk's start, and that pair (the last key, the
first query) is the closest one in the window too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.model.document_mask import DocumentMask

HIDDEN, CAUSAL, FULL, MASKED = "hidden", "causal", "full", "masked"


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a ring step: this rank's query chunks (local 0 and/or 1), the key
    chunks of the block in hand, causal (the diagonal, unmasked) and/or masked."""

    q_chunks: tuple[int, ...]
    k_chunks: tuple[int, ...]
    causal: bool = False
    masked: bool = False

    def rows(self, chunk: int) -> slice:
        """The local query rows."""
        return slice(self.q_chunks[0] * chunk, (self.q_chunks[-1] + 1) * chunk)

    def cols(self, chunk: int) -> slice:
        """The local key columns of the block in hand."""
        return slice(self.k_chunks[0] * chunk, (self.k_chunks[-1] + 1) * chunk)


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """The sequence chunks rank `rank` of `size` holds (Megatron's load-balanced layout)."""
    return rank, 2 * size - 1 - rank


def positions_of(
    held: tuple[int, int], local: tuple[int, ...], chunk: int, device: torch.device
) -> torch.Tensor:
    """Sequence positions [len(local) * chunk] of the `local` (0, 1) of the `held` chunks."""
    offsets = torch.arange(chunk, device=device)
    return torch.cat([held[index] * chunk + offsets for index in local])


class RingPlan:
    """The `BlockCall`s of every ring step of one rank, and the masks of the masked ones.

    `mask` is the whole sequence's (document ids [b, 2 * size * chunk] and/or a window), or
    None: causal attention, the plan without masks.
    """

    def __init__(self, rank: int, size: int, chunk: int, mask: DocumentMask | None) -> None:
        self.rank, self.size, self.chunk, self.mask = rank, size, chunk, mask
        summary = _ChunkSummary(mask, size, chunk)
        self.steps: list[list[BlockCall]] = []
        for step in range(size):
            source = (rank - step) % size
            pieces = {
                (a, b): summary.piece(q_chunk, k_chunk)
                for a, q_chunk in enumerate(chunks_of(rank, size))
                for b, k_chunk in enumerate(chunks_of(source, size))
            }
            self.steps.append(_calls(pieces))

    def allowed(self, step: int, call: BlockCall, device: torch.device) -> torch.Tensor:
        """Bool [b|1, sq, sk] of a masked call: True where the query may see the key."""
        source = (self.rank - step) % self.size
        q = positions_of(chunks_of(self.rank, self.size), call.q_chunks, self.chunk, device)
        k = positions_of(chunks_of(source, self.size), call.k_chunks, self.chunk, device)
        return self.mask.allowed_at(q, k)


def ring_plan(rank: int, size: int, chunk: int, mask: DocumentMask | None) -> RingPlan:
    """The plan of this rank's ring for `mask`, made once per mask (a mask is made once per
    forward pass and shared by every layer)."""
    if mask is None:
        return RingPlan(rank, size, chunk, None)
    key = (rank, size, chunk)
    if key not in mask._ring_plans:
        mask._ring_plans[key] = RingPlan(rank, size, chunk, mask)
    return mask._ring_plans[key]


class _ChunkSummary:
    """Per chunk of the sequence: the window and each sample's first and last document id."""

    def __init__(self, mask: DocumentMask | None, size: int, chunk: int) -> None:
        self.chunk = chunk
        window = None if mask is None else mask.window
        if window is not None and window[1] != 0:
            raise ValueError(
                f"--window-size {window}: context parallelism takes a causal window (right 0)"
            )
        self.left = None if window is None else window[0]
        self.first = self.last = None
        ids = None if mask is None else mask.document_ids
        if ids is None:
            return
        if ids.size(1) != 2 * size * chunk:
            raise ValueError(
                f"document ids of {ids.size(1)} tokens for a context-parallel sequence of "
                f"{2 * size * chunk}: the ids must cover the whole sequence"
            )
        if bool((ids[:, 1:] < ids[:, :-1]).any()):
            raise ValueError("document ids decrease along a sample; they must count documents")
        chunks = ids.reshape(ids.size(0), 2 * size, chunk)
        self.first = chunks[:, :, 0].tolist()  # [b][2C]: ids never decrease
        self.last = chunks[:, :, -1].tolist()

    def piece(self, q_chunk: int, k_chunk: int) -> str:
        """HIDDEN, CAUSAL, FULL or MASKED for queries of `q_chunk` over keys of `k_chunk`."""
        if k_chunk > q_chunk:
            return HIDDEN
        c, left = self.chunk, self.left
        if k_chunk == q_chunk:
            whole = (left is None or left >= c - 1) and self._one_document(q_chunk)
            return CAUSAL if whole else MASKED
        nearest = (q_chunk - k_chunk) * c - (c - 1)  # the first query to the last key
        farthest = (q_chunk - k_chunk) * c + (c - 1)
        if left is not None and nearest > left:
            return HIDDEN
        if self.first is not None and all(
            last[k_chunk] != first[q_chunk] for first, last in zip(self.first, self.last)
        ):
            return HIDDEN  # no document crosses from the key chunk into the query chunk
        whole = (left is None or farthest <= left) and self._one_document(q_chunk, k_chunk)
        return FULL if whole else MASKED

    def _one_document(self, *chunks: int) -> bool:
        """Whether, in every sample, the chunks hold one and the same document."""
        if self.first is None:
            return True
        return all(
            len({row[chunk] for row in (first, last) for chunk in chunks}) == 1
            for first, last in zip(self.first, self.last)
        )


def _calls(pieces: dict[tuple[int, int], str]) -> list[BlockCall]:
    """A step's kernel calls for its pieces {(query chunk, key chunk): kind} (local indices)."""
    live = {pair: kind for pair, kind in pieces.items() if kind != HIDDEN}
    if not live:
        return []
    rows = tuple(sorted({a for a, _ in live}))
    cols = tuple(sorted({b for _, b in live}))
    if MASKED in live.values():
        return [BlockCall(rows, cols, masked=True)]
    if set(live.values()) == {FULL} and len(live) == len(rows) * len(cols):
        return [BlockCall(rows, cols)]
    if live == {(0, 0): CAUSAL, (1, 0): FULL, (1, 1): CAUSAL}:
        return [BlockCall((0, 1), (0, 1), causal=True)]  # step 0: one causal call
    return [BlockCall((a,), (b,), causal=kind == CAUSAL) for (a, b), kind in sorted(live.items())]
