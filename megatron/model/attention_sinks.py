"""Attention sinks: one extra logit per head beside every query's scores, in the softmax's
denominator but attending to nothing (Megatron-LM's `--softmax-type off-by-one` (logit 0) and
`learnable` (a learned logit per head: gpt-oss's `sinks`)).

    out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)) = out_plain * sigmoid(lse - sink)

with lse the log-sum-exp of the plain scores, so any kernel that returns its lse computes it
(megatron-core's `_apply_sink_softmax_correction`). Three kernels, chosen as the core
attention's (`CoreAttention`):
- `dense_sink_attention`: the explicit math with the sink as one more column (the reference;
  also where attention dropout is on, or a dense mask came in);
- `cpu_flash_sink_attention`: torch's CPU flash kernel, its output rescaled; the backward is
  the same kernel's, given the rescaled output and the scaled gradient (the lse term of the
  rescale then comes out of its own row sums), memory linear in the sequence;
- `flex_sink_attention`: FlexAttention (GPUs) with its lse, rescaled under autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.document_mask import DocumentMask


def dense_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = True,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """[b, np, sq, hn] q, [b, nkv, sk, hn] k/v, sinks [np] -> [b, np, sq, hn]; `mask`: bool
    [b|1, 1, sq, sk], True = may not attend (None: causal, or nothing with `causal` False)."""
    b, heads, sq, _ = query.shape
    if key.size(1) != heads:  # grouped-query: each key/value head serves np / nkv queries
        key, value = (t.repeat_interleave(heads // key.size(1), dim=1) for t in (key, value))
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale  # [b, np, sq, sk]
    if mask is None and causal:
        mask = torch.ones(sq, key.size(2), dtype=torch.bool, device=query.device).triu(1)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    sink_column = sinks.float().view(1, heads, 1, 1).expand(b, heads, sq, 1)
    probs = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
    probs = F.dropout(probs.to(query.dtype), dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, value)


class _CpuFlashWithSinks(torch.autograd.Function):
    """torch's CPU flash attention with sinks (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, additive_mask, causal, scale):  # noqa: ANN001, ANN205
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        plain, lse = kernel(query, key, value, 0.0, causal, attn_mask=additive_mask, scale=scale)
        weight = torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)  # [b, np, s, 1]
        # Laid out [s, b, np, hn], so the output projection's input is a view of it.
        b, heads, s, hn = plain.shape
        out = torch.empty((s, b, heads, hn), dtype=query.dtype, device=query.device)
        out = torch.mul(plain, weight, out=out.permute(1, 2, 0, 3))
        ctx.save_for_backward(query, key, value, sinks, additive_mask, out, lse, weight)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        query, key, value, sinks, additive_mask, out, lse, weight = ctx.saved_tensors
        # d out_plain = weight * grad; the kernel's row sums over (weight * grad) . out then
        # carry the lse term of the rescale: the gradient of the sink-softmax exactly.
        scaled = (grad * weight).to(query.dtype)
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        d_query, d_key, d_value = kernel(
            scaled, query, key, value, out, lse, 0.0, ctx.causal,
            attn_mask=additive_mask, scale=ctx.scale,
        )  # fmt: skip
        # d sink = -sum over rows of (grad . out) (1 - weight)
        rows = (grad.float() * out.float()).sum(-1) * (1 - weight.squeeze(-1))  # [b, np, s]
        d_sinks = -rows.sum(dim=(0, 2)).to(sinks.dtype)
        return d_query, d_key, d_value, d_sinks, None, None, None


def cpu_flash_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """As `dense_sink_attention` without dropout, on torch's CPU flash kernel; `allowed`: bool
    [b|1, 1, sq, sk], [b|1, sq, sk] or [sq, sk], True = may attend."""
    additive = None
    if allowed is not None:
        if allowed.dim() == 3:
            allowed = allowed.unsqueeze(1)
        additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        additive = additive.masked_fill(~allowed, float("-inf"))
        causal = False
    return _CpuFlashWithSinks.apply(query, key, value, sinks, additive, causal, scale)


def flex_sink_attention(
    mask: DocumentMask,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    compiled: bool | None = None,
) -> torch.Tensor:
    """[b, np, s, hn] q, [b, nkv, s, hn] k/v through FlexAttention (`flex_attention_with`),
    rescaled by sigmoid(lse - sink) under autograd."""
    from megatron.model.document_mask import flex_attention_with

    out, lse = flex_attention_with(mask, query, key, value, scale, compiled, return_lse=True)
    weight = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    return (out * weight).to(query.dtype)
