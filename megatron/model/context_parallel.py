"""Context-parallel attention: exact causal attention over a sequence split across C ranks.

Each rank holds two chunks of every sequence (Megatron's load-balanced layout: the sequence
cut into 2C chunks, rank r holding chunks r and 2C-1-r; `mappings.this_ranks_sequence_part`),
its queries, keys and values for them, and all query/key/value heads of its tensor-parallel
rank. Three ways to attend over the whole sequence (`--cp-comm-type`, per layer):

- `p2p`, ring attention (`RingAttention`): key/value blocks travel around the ring of
  context-parallel ranks, each transfer started before the attention of the block in hand so
  that it hides behind it; the partial outputs are merged by their log-sum-exp. The backward
  pass sends the blocks around again, with their gradients travelling behind them back to
  their owners. Any number of key/value heads (they travel unexpanded).
- `allgather`: every rank gathers all keys and values and attends with a mask of positions
  (`CoreAttention`, any backend); the key/value gradients are reduce-scattered back.
- `a2a`: DeepSpeed-Ulysses' all-to-alls over the context-parallel group (whole sequences of
  1/C of the heads), with the chunks put in sequence order around the core attention.

A sliding window (`--window-size`) and packed documents (`--reset-attention-mask`: document
ids [b, s] of the whole sequence, on every rank) come as a `DocumentMask`: `a2a`'s core takes
it over the whole sequence, `allgather` masks its queries' rows with it, and the ring follows
a plan made from it once per forward (`ring_blocks.py`): the blocks (pairs of query and key
chunks) no query may see are skipped, the others computed unmasked where the window and the
documents hide nothing in them, and masked where they do.

The ring's block kernels are torch's attention kernels that return the log-sum-exp
(`block_kernel_name`): the CPU flash kernel (masks as an additive bias), the CUDA flash kernel
for unmasked fp16/bf16 blocks with head sizes it takes, CUDA's memory-efficient kernel for
masked blocks, and otherwise the explicit fp32 math below, which is also what runs with
attention dropout (its masks are drawn from a seed per layer call and block, on the
model-parallel stream, which differs across tensor- and context-parallel ranks, and drawn
again identically in the backward). A masked block's rows that see none of its keys weigh
nothing in the merge (output 0, log-sum-exp -inf).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.process_groups import RankGroup
from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker
from megatron.core.tensor_parallel.mappings import RingTransfer, gather_context_parallel_key_values
from megatron.model.attention import CoreAttention, UlyssesAttention
from megatron.model.document_mask import DocumentMask
from megatron.model.ring_blocks import RingPlan, chunks_of, positions_of, ring_plan
from megatron.model.utils import run_eagerly_when_compiled


def block_kernel_name(query: torch.Tensor, dropout_p: float, masked: bool) -> str:
    """The kernel of one block: `cpu_flash` (takes a mask), `cuda_flash` (fp16/bf16, no
    mask), `cuda_efficient` (CUDA's memory-efficient kernel, for masked blocks) or `math`."""
    if dropout_p > 0.0:
        return "math"  # the explicit math redraws its masks in the backward
    if query.device.type == "cpu":
        return "cpu_flash"
    head_size = query.size(-1)
    if not query.is_cuda or head_size % 8 != 0:
        return "math"
    if masked:
        return "cuda_efficient"
    half = query.dtype in (torch.float16, torch.bfloat16)
    return "cuda_flash" if half and head_size <= 256 else "math"


def _expand_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, hn] key/value heads -> [b, heads, s, hn]: query head i reads head i // (h/g)."""
    groups = tensor.size(1)
    return tensor if groups == heads else tensor.repeat_interleave(heads // groups, dim=1)


def _reduce_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The transpose of `_expand_heads`: [b, h, s, hn] -> [b, groups, s, hn], summed."""
    b, heads, s, hn = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, s, hn).sum(2)


def _bias(allowed: torch.Tensor, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
    """Bool [b|1, sq, sk] (True = may attend) -> additive [b|1, 1, sq, sk] of 0 and -inf.

    `align`: the row stride CUDA's memory-efficient kernel needs (a multiple of 16 elements,
    as SDPA pads its masks), the columns past sk left out of the view."""
    b, sq, sk = allowed.shape
    padded = -(-sk // align) * align
    bias = torch.zeros(b, 1, sq, padded, dtype=dtype, device=allowed.device)[..., :sk]
    return bias.masked_fill_(~allowed[:, None], float("-inf"))


def _blank_dead_rows(out, lse, allowed) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a masked block that see no key: output 0 and log-sum-exp -inf, whatever the
    kernel wrote there (CPU flash writes a log-sum-exp of 0, the math NaN)."""
    dead = ~allowed.any(dim=-1)[:, None]  # [b|1, 1, sq]
    return out.masked_fill(dead[..., None], 0.0), lse.masked_fill(dead, float("-inf"))


class BlockKernel:
    """Attention of queries over one key/value block: output with its log-sum-exp, and the
    gradients given the merged output and log-sum-exp (the flash-attention identity).

    `allowed` (bool [b|1, sq, sk], True = may attend, or None) masks a block by a sliding
    window or documents; `causal` is the unmasked diagonal. `key` names the call, for the
    state a CUDA kernel's backward needs from its forward."""

    def __init__(self, scale: float, dropout_p: float, seed: int) -> None:
        self.scale, self.dropout_p, self.seed = scale, dropout_p, seed
        self._cuda_state: dict[tuple, tuple] = {}

    def forward(self, q, k, v, causal: bool, allowed, key: tuple) -> tuple:
        """[b, h, sq, hn] q, [b, h, sk, hn] k, v (heads expanded) -> (out [b, h, sq, hn],
        lse fp32 [b, h, sq])."""
        name = block_kernel_name(q, self.dropout_p, allowed is not None)
        if name == "math":
            scores = self._scores(q, k, causal, allowed)
            lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[..., None])
            if self.dropout_p > 0.0:
                probs = probs * self._keep(probs, key)
            out = torch.matmul(probs, v.float())
        elif name == "cpu_flash":
            bias = None if allowed is None else _bias(allowed, q.dtype)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=bias, scale=self.scale
            )
        elif name == "cuda_flash":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
                torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, causal, False, scale=self.scale
                )
            )
            self._cuda_state[key] = (cum_q, cum_k, max_q, max_k, seed, offset)
        else:  # cuda_efficient
            bias = _bias(allowed, q.dtype, align=16).expand(q.size(0), q.size(1), -1, -1)
            out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, False, scale=self.scale
            )
            lse = lse[..., : q.size(2)]  # the kernel pads its rows to a multiple of 32
            self._cuda_state[key] = (seed, offset)
        if allowed is not None:
            out, lse = _blank_dead_rows(out, lse, allowed)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, causal: bool, allowed, key: tuple) -> tuple:
        """dq, dk, dv (fp32 for the math, the inputs' dtype for fused kernels) of this block,
        where `out` and `lse` are the merged ones over every block."""
        name = block_kernel_name(q, self.dropout_p, allowed is not None)
        if name == "math":
            return self._math_backward(grad_out, q, k, v, out, lse, causal, allowed, key)
        out, grad_out = out.to(q.dtype), grad_out.to(q.dtype)
        if name == "cpu_flash":
            bias = None if allowed is None else _bias(allowed, q.dtype)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=self.scale
            )
        if name == "cuda_flash":
            cum_q, cum_k, max_q, max_k, seed, offset = self._cuda_state.pop(key)
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed,
                offset, scale=self.scale,
            )  # fmt: skip
        seed, offset = self._cuda_state.pop(key)
        bias = _bias(allowed, q.dtype, align=16).expand(q.size(0), q.size(1), -1, -1)
        # The kernel reads its log-sum-exp rows padded to a multiple of 32 (+inf: no weight).
        rows = -(-q.size(2) // 32) * 32
        lse = F.pad(lse, (0, rows - q.size(2)), value=float("inf")).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False],
            False, scale=self.scale,
        )  # fmt: skip
        return dq, dk, dv

    def _math_backward(self, grad_out, q, k, v, out, lse, causal, allowed, key) -> tuple:
        grad_out = grad_out.float()
        probs = torch.exp(self._scores(q, k, causal, allowed) - lse[..., None])  # [b, h, sq, sk]
        kept = self._keep(probs, key) if self.dropout_p > 0.0 else None
        dropped = probs if kept is None else probs * kept
        grad_v = torch.matmul(dropped.transpose(-1, -2), grad_out)
        grad_probs = torch.matmul(grad_out, v.float().transpose(-1, -2))
        if kept is not None:
            grad_probs = grad_probs * kept
        delta = (grad_out * out.float()).sum(-1, keepdim=True)  # [b, h, sq, 1]
        grad_scores = probs * (grad_probs - delta) * self.scale
        return grad_scores @ k.float(), grad_scores.transpose(-1, -2) @ q.float(), grad_v

    def _scores(self, q, k, causal: bool, allowed) -> torch.Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        if causal:
            sq, sk = scores.shape[-2:]
            hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        return scores

    def _keep(self, probs: torch.Tensor, key: tuple) -> torch.Tensor:
        """The dropout mask of call `key` (step, call), scaled: the same in the forward and
        backward."""
        step, call = key
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(self.seed + 4 * step + call)
        keep = torch.rand(probs.shape, generator=generator, device=probs.device)
        return (keep >= self.dropout_p).float() / (1.0 - self.dropout_p)


def _merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Fold a block's (output, log-sum-exp) into the running fp32 ones, in place, for `rows`."""
    merged = torch.logaddexp(lse[:, :, rows], block_lse)
    out[:, :, rows] = (
        out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
        + block_out.float() * torch.exp(block_lse - merged)[..., None]
    )
    lse[:, :, rows] = merged


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values, by `plan`'s
    calls (causal, with any sliding window and document mask; `ring_blocks.py`).

    q [b, h, 2c, hn], k and v [b, g, 2c, hn] (g divides h) -> out [b, h, 2c, hn].
    """

    @staticmethod
    def forward(ctx, q, k, v, kernel: BlockKernel, ring: RankGroup, plan: RingPlan):
        heads, chunk = q.size(1), q.size(2) // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        key_values = (k, v)
        for step in range(ring.size):
            transfer = RingTransfer(list(key_values), ring.group) if step < ring.size - 1 else None
            keys, values = (_expand_heads(t, heads) for t in key_values)
            for index, call in enumerate(plan.steps[step]):
                rows, cols = call.rows(chunk), call.cols(chunk)
                allowed = plan.allowed(step, call, q.device) if call.masked else None
                block_out, block_lse = kernel.forward(
                    q[:, :, rows], keys[:, :, cols], values[:, :, cols], call.causal, allowed,
                    (step, index),
                )  # fmt: skip
                _merge(out, lse, block_out, block_lse, rows)
            if transfer is not None:
                key_values = tuple(transfer.wait())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.ring, ctx.plan = kernel, ring, plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, ring, plan = ctx.kernel, ctx.ring, ctx.plan
        heads, groups, chunk = q.size(1), k.size(1), q.size(2) // 2
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        key_values = (k, v)
        pending: RingTransfer | None = None
        for step in range(ring.size):
            transfer = RingTransfer(list(key_values), ring.group) if step < ring.size - 1 else None
            keys, values = (_expand_heads(t, heads) for t in key_values)
            # This block's key/value gradients: fp32, so the C partial sums add up as one
            # process's would.
            grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
            for index, call in enumerate(plan.steps[step]):
                rows, cols = call.rows(chunk), call.cols(chunk)
                allowed = plan.allowed(step, call, q.device) if call.masked else None
                dq, dk, dv = kernel.backward(
                    grad_out[:, :, rows], q[:, :, rows], keys[:, :, cols], values[:, :, cols],
                    out[:, :, rows], lse[:, :, rows], call.causal, allowed, (step, index),
                )  # fmt: skip
                grad_q[:, :, rows] += dq.float()
                for grad, block_grad in zip(grads, (dk, dv), strict=True):
                    grad[:, :, cols] += _reduce_heads(block_grad.float(), groups)
            if pending is not None:  # what the ranks before this one added to the block
                grads = [mine + theirs for mine, theirs in zip(grads, pending.wait(), strict=True)]
            # Behind the block, to the next rank (the last step's goes to the block's owner).
            pending = RingTransfer(grads, ring.group)
            if transfer is not None:
                key_values = tuple(transfer.wait())
        grad_k, grad_v = pending.wait()
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def draw_dropout_seed() -> int:
    """The seed of one ring attention call's dropout masks, from the model-parallel stream:
    different on every tensor- and context-parallel rank, and the same again when full
    recomputation replays the forward (it restores that stream)."""
    with get_cuda_rng_tracker().fork():
        return int(torch.randint(0, 2**62, (1,)).item())


class ContextParallelAttention(nn.Module):
    """[s/C, b, np, hn] query, [s/C, b, nkv, hn] key/value -> context [s/C, b, np * hn], causal
    over the whole sequence by `comm_type` (`p2p`, `allgather` or `a2a`; module docstring)."""

    def __init__(
        self, core: CoreAttention, comm_type: str, recompute: bool, ring: RankGroup
    ) -> None:
        super().__init__()
        self.core = core
        self.ring = ring  # the context-parallel group
        self.comm_type = comm_type
        self.recompute = recompute
        self.a2a = None
        if comm_type == "a2a":
            self.a2a = UlyssesAttention(core, ring.group, recompute, context_parallel=True)
        # Point-to-point transfers and DeepSpeed's all-to-alls run eagerly inside a compiled
        # layer.
        run_eagerly_when_compiled(self, "forward")

    def forward(self, query, key, value, mask: DocumentMask | None = None) -> torch.Tensor:
        """Causal attention of this rank's tokens over the whole sequence, within the whole
        sequence's documents and sliding window of `mask` (a `DocumentMask`) where given."""
        if mask is not None and not isinstance(mask, DocumentMask):
            raise ValueError(
                "context-parallel attention takes document ids or a window (a DocumentMask), "
                "not a dense [b, 1, s, s] mask: it holds 2 of the sequence's chunks"
            )
        if self.a2a is not None:  # the core sees the whole sequence, in order
            return self.a2a(query, key, value, mask)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
        if self.comm_type == "allgather":
            return self._all_gathered(query, key, value, mask)
        dropout_p = self.core.dropout_p if self.training else 0.0
        seed = draw_dropout_seed() if dropout_p > 0.0 else 0
        kernel = BlockKernel(self.core.scale, dropout_p, seed)
        plan = ring_plan(self.ring.rank, self.ring.size, query.size(2) // 2, mask)
        width = value.size(-1)
        if width != query.size(-1):
            # Multi-latent attention's values are narrower than its queries and keys, and the
            # block kernels take one head size: zero channels weigh nothing in the output.
            value = F.pad(value, (0, query.size(-1) - width))
        # [b, np, s/C, hn]
        context = RingAttention.apply(query, key, value, kernel, self.ring, plan)[..., :width]
        b, heads, s, hn = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, heads * hn)

    def _all_gathered(self, query, key, value, mask: DocumentMask | None) -> torch.Tensor:
        key, value = (gather_context_parallel_key_values(t) for t in (key, value))
        held = chunks_of(self.ring.rank, self.ring.size)
        mine = positions_of(held, (0, 1), query.size(2) // 2, query.device)
        everyone = torch.arange(key.size(2), device=query.device)
        if mask is None:
            hidden = (everyone[None, :] > mine[:, None])[None, None]  # [1, 1, s/C, s]
        else:
            hidden = ~mask.allowed_at(mine, everyone)[:, None]  # [b|1, 1, s/C, s]
        if self.recompute and self.training:  # selective: the core again, not the gather
            return checkpoint(self.core, False, query, key, value, hidden)
        return self.core(query, key, value, hidden)
