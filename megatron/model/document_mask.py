"""Attention masks without a dense [s, s] tensor: packed documents and sliding windows.

A sample packs several documents end to end (each ends with the end-of-document token);
under `--reset-attention-mask` a token attends only to earlier tokens of its own document.
The batch carries this as document ids [b, s] (one integer per token, `document_ids`), a
tensor that pipeline stages can pass along, instead of Megatron's bool [b, 1, s, s] mask.
A sliding window (`--window-size (left, right)`, Mistral's `sliding_window`) further limits a
query at position q to the keys k with q - left <= k <= q + right (right is 0: causal).

`DocumentMask` is made once per forward from the two and handed to every layer; the core
attention computes it with one of three kernels (`kernel_for`):
- `flex`: torch's FlexAttention with a block-sparse `BlockMask` built at block granularity
  from the document ids (never an [s, s] tensor), compiled; memory linear in the sequence.
  The GPU kernel (torch has no FlexAttention backward on CPU).
- `varlen`: one causal SDPA call per document (variable-length attention by hand), which
  CPU's flash kernel runs in memory linear in the document; the CPU kernel.
- `dense`: the bool [b, 1, s, s] mask (the `unfused` backend; the reference of the others).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128
"""FlexAttention's block size (its default): the block mask's granularity."""


@dataclass
class DocumentMask:
    """Documents (`document_ids` [b, s], or None: one document per sample) and a window."""

    document_ids: torch.Tensor | None
    window: tuple[int, int] | None = None
    _block_masks: dict = field(default_factory=dict, repr=False)
    # Context parallelism's ring plans, by (rank, size, chunk): made once per forward.
    _ring_plans: dict = field(default_factory=dict, repr=False)

    def allowed(self, sq: int, sk: int, device: torch.device, q_offset: int = 0) -> torch.Tensor:
        """Bool [b|1, sq, sk], True where query q_offset + i may attend key j (FlexAttention's
        `mask_mod` over every pair)."""
        q = torch.arange(q_offset, q_offset + sq, device=device)
        return self.allowed_at(q, torch.arange(sk, device=device))

    def allowed_at(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """Bool [b|1, sq, sk], True where the query at sequence position `q_positions[i]` may
        attend the key at `k_positions[j]` (any positions: a context-parallel rank's chunks)."""
        device = q_positions.device
        rows = 1 if self.document_ids is None else self.document_ids.size(0)
        b = torch.arange(rows, device=device)[:, None, None]
        return _mask_mod(self, device)(
            b, None, q_positions[None, :, None], k_positions[None, None, :]
        )

    def dense(self, sq: int, sk: int, device: torch.device, q_offset: int = 0) -> torch.Tensor:
        """Megatron's bool mask [b|1, 1, sq, sk], True = may not attend."""
        return ~self.allowed(sq, sk, device, q_offset).unsqueeze(1)

    def block_mask(self, s: int, device: torch.device):  # noqa: ANN201 - torch's BlockMask
        """FlexAttention's block-sparse mask over s queries and keys, made once per mask."""
        key = (s, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = _block_mask(self, s, device)
        return self._block_masks[key]

    def spans(self, row: int) -> list[tuple[int, int]]:
        """[start, end) of each document of sample `row`, in order."""
        ids = self.document_ids[row]
        starts = torch.nonzero(ids[1:] != ids[:-1]).flatten().add(1).tolist()
        bounds = [0, *starts, ids.numel()]
        return list(zip(bounds[:-1], bounds[1:]))


def _block_mask(mask: DocumentMask, s: int, device: torch.device):  # noqa: ANN202
    """The `BlockMask` from per-block summaries: O((s / 128)^2) work, no [s, s] tensor.

    A (query block, key block) pair is skipped when no query of the one may see a key of the
    other, computed whole ("full", no mask_mod call) when every pair may, else partially.
    """
    from torch.nn.attention.flex_attention import BlockMask

    blocks = -(-s // FLEX_BLOCK)
    start = torch.arange(blocks, device=device) * FLEX_BLOCK
    end = torch.clamp(start + FLEX_BLOCK, max=s) - 1  # last position of each block
    q_first, q_last = start[:, None], end[:, None]
    k_first, k_last = start[None, :], end[None, :]
    right = mask.window[1] if mask.window else 0
    some = k_first <= q_last + right  # [Qb, Kb]
    every = k_last <= q_first + right
    if mask.window is not None:
        left = mask.window[0]
        some = some & (k_last >= q_first - left)
        every = every & (k_first >= q_last - left)
    some, every = some[None], every[None]  # [1|b, Qb, Kb]
    if mask.document_ids is not None:
        ids = _padded(mask.document_ids.to(device), blocks * FLEX_BLOCK).view(
            -1, blocks, FLEX_BLOCK
        )
        low, high = ids.amin(dim=2), ids.amax(dim=2)  # [b, blocks]: ids rise along a sample
        some = some & (low[:, :, None] <= high[:, None, :]) & (high[:, :, None] >= low[:, None, :])
        single = low == high
        same = single[:, :, None] & single[:, None, :] & (low[:, :, None] == low[:, None, :])
        every = every & same
    partial = some & ~every
    kv_num, kv_indices = _block_lists(partial)
    full_num, full_indices = _block_lists(every.expand_as(partial))
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=_mask_mod(mask, device),
        seq_lengths=(s, s),
    )


def _padded(ids: torch.Tensor, length: int) -> torch.Tensor:
    """Pad [b, s] document ids to `length` with each row's last id (padding keys are past
    every query, so the causal rule hides them)."""
    if ids.size(1) == length:
        return ids
    return torch.cat((ids, ids[:, -1:].expand(-1, length - ids.size(1))), dim=1)


def _block_lists(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [b, Qb, Kb] -> FlexAttention's (count [b, 1, Qb], indices [b, 1, Qb, Kb]) int32,
    selected key blocks first."""
    counts = selected.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(selected.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[:, None].contiguous(), order.to(torch.int32)[:, None].contiguous()


def _mask_mod(mask: DocumentMask, device: torch.device):  # noqa: ANN202
    """FlexAttention's per-element rule for the partially visible blocks."""
    ids = None if mask.document_ids is None else mask.document_ids.to(device)
    right = mask.window[1] if mask.window else 0
    left = mask.window[0] if mask.window else None

    def mask_mod(b, h, q, k):  # noqa: ANN001, ANN202 - FlexAttention's signature
        allowed = k <= q + right
        if left is not None:
            allowed = allowed & (k >= q - left)
        if ids is not None:
            allowed = allowed & (ids[b, q] == ids[b, k])
        return allowed

    return mask_mod


def kernel_for(backend: str, device: torch.device, dropout_p: float = 0.0) -> str:
    """`dense`, `varlen` or `flex` for the core attention's backend, device and dropout.

    CPU takes `varlen`: torch has no FlexAttention backward there, and its forward compiles
    for seconds per sequence length where SDPA's CPU flash kernel is already linear. So does
    attention dropout (`--attention-dropout`, Megatron's default 0.1), which FlexAttention
    has not: SDPA drops per document.
    """
    if backend == "unfused":
        return "dense"
    return "varlen" if device.type == "cpu" or dropout_p > 0.0 else "flex"


def flex_attention_with(
    mask: DocumentMask,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    compiled: bool | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[b, np, s, hn] q, [b, nkv, s, hn] k/v -> [b, np, s, hn] through FlexAttention, and with
    `return_lse` each row's log-sum-exp [b, np, s] (differentiable: attention sinks use it).

    `compiled` (default: on GPUs) runs torch's fused kernel; eager FlexAttention computes the
    whole score matrix (the block mask's reference, on CPU).
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    block_mask = mask.block_mask(query.size(2), query.device)
    gqa = key.size(1) != query.size(1)
    compiled = query.device.type != "cpu" if compiled is None else compiled
    kernel = compiled_flex_attention() if compiled else flex_attention
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=gqa)
    if not return_lse:
        return kernel(query, key, value, **kwargs)
    out, aux = kernel(query, key, value, **kwargs, return_aux=AuxRequest(lse=True))
    return out, aux.lse


@functools.cache
def compiled_flex_attention():  # noqa: ANN201
    """torch's `flex_attention` under `torch.compile` (its fused kernel), made once."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def varlen_attention(
    mask: DocumentMask,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    dropout_p: float,
    attend: Callable | None = None,
) -> torch.Tensor:
    """[b, np, s, hn] q, [b, nkv, s, hn] k/v -> [b, np, s, hn], one SDPA call per document.

    Causal documents without a window use SDPA's causal kernel; with a window each document
    gets its own band mask ([len, len]: quadratic in the document, not the sample).
    `attend(q, k, v, band, scale=)` (band: bool, True = may attend, or None: causal) replaces
    SDPA (attention sinks' CPU kernel).
    """
    gqa = key.size(1) != query.size(1)
    rows = []
    for row in range(query.size(0)):
        spans = mask.spans(row) if mask.document_ids is not None else [(0, query.size(2))]
        parts = []
        for start, end in spans:
            q, k, v = (t[row : row + 1, :, start:end] for t in (query, key, value))
            band = None
            if mask.window is not None:
                band = DocumentMask(None, mask.window).allowed(end - start, end - start, q.device)
            if attend is not None:
                parts.append(attend(q, k, v, band, scale=scale))
                continue
            parts.append(
                F.scaled_dot_product_attention(
                    q, k, v, attn_mask=band, dropout_p=dropout_p, is_causal=band is None,
                    scale=scale, enable_gqa=gqa,
                )
            )  # fmt: skip
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def layer_attention_mask(
    mask: torch.Tensor | DocumentMask | None, window: tuple[int, int] | None
) -> torch.Tensor | DocumentMask | None:
    """What the layers get for a model input `mask`: document ids [b, s] (integers) and any
    window become one `DocumentMask`; a bool [b|1, 1, s, s] mask (True = masked) gets the
    window added; None stays None (causal) without a window."""
    if isinstance(mask, DocumentMask):
        return mask
    if mask is not None and not mask.is_floating_point() and mask.dtype != torch.bool:
        return DocumentMask(mask, window)
    if window is None:
        return mask
    if mask is None:
        return DocumentMask(None, window)
    s = mask.size(-1)
    return mask | DocumentMask(None, window).dense(s, s, mask.device)
