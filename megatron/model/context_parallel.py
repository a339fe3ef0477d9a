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

The ring's block kernels are torch's attention kernels that return the log-sum-exp: the CPU
flash kernel, the CUDA flash kernel for fp16/bf16 with head sizes it takes, and otherwise
the explicit fp32 math below, which is also what runs with attention dropout (its masks are
drawn from a seed per layer call and block, on the model-parallel stream, which differs
across tensor- and context-parallel ranks, and drawn again identically in the backward).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.process_groups import RankGroup
from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker
from megatron.core.tensor_parallel.mappings import (
    RingTransfer,
    gather_context_parallel_key_values,
    this_ranks_sequence_positions,
)
from megatron.model.attention import CoreAttention, UlyssesAttention
from megatron.model.utils import run_eagerly_when_compiled


def _uses_fused_kernel(query: torch.Tensor, dropout_p: float) -> bool:
    if dropout_p > 0.0:
        return False  # the explicit math redraws its masks in the backward
    if query.device.type == "cpu":
        return True
    head_size = query.size(-1)
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_size % 8 == 0
        and head_size <= 256
    )


def _expand_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, hn] key/value heads -> [b, heads, s, hn]: query head i reads head i // (h/g)."""
    groups = tensor.size(1)
    return tensor if groups == heads else tensor.repeat_interleave(heads // groups, dim=1)


def _reduce_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The transpose of `_expand_heads`: [b, h, s, hn] -> [b, groups, s, hn], summed."""
    b, heads, s, hn = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, s, hn).sum(2)


class BlockKernel:
    """Attention of queries over one key/value block: output with its log-sum-exp, and the
    gradients given the merged output and log-sum-exp (the flash-attention identity)."""

    def __init__(self, scale: float, dropout_p: float, seed: int) -> None:
        self.scale, self.dropout_p, self.seed = scale, dropout_p, seed
        # What the CUDA flash kernel's backward needs from each block's forward, by step.
        self._flash_state: dict[int, tuple] = {}

    def forward(self, q, k, v, causal: bool, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, h, sq, hn] q, k, v (heads expanded) -> (out [b, h, sq, hn], lse fp32 [b, h, sq])."""
        if _uses_fused_kernel(q, self.dropout_p):
            if q.device.type == "cpu":
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, causal, scale=self.scale
                )
                return out, lse
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
                torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, causal, False, scale=self.scale
                )
            )
            self._flash_state[step] = (cum_q, cum_k, max_q, max_k, seed, offset)
            return out, lse
        scores = self._scores(q, k, causal)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None])
        if self.dropout_p > 0.0:
            probs = probs * self._keep(probs, step)
        return torch.matmul(probs, v.float()), lse

    def backward(self, grad_out, q, k, v, out, lse, causal: bool, step: int) -> tuple:
        """dq, dk, dv (fp32 for the math, the inputs' dtype for fused kernels) of this block,
        where `out` and `lse` are the merged ones over every block."""
        if _uses_fused_kernel(q, self.dropout_p):
            out = out.to(q.dtype)
            grad_out = grad_out.to(q.dtype)
            if q.device.type == "cpu":
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad_out, q, k, v, out, lse, 0.0, causal, scale=self.scale
                )
            cum_q, cum_k, max_q, max_k, seed, offset = self._flash_state.pop(step)
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out,
                q,
                k,
                v,
                out,
                lse,
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                causal,
                seed,
                offset,
                scale=self.scale,
            )
        grad_out = grad_out.float()
        probs = torch.exp(self._scores(q, k, causal) - lse[..., None])  # [b, h, sq, sk]
        kept = self._keep(probs, step) if self.dropout_p > 0.0 else None
        dropped = probs if kept is None else probs * kept
        grad_v = torch.matmul(dropped.transpose(-1, -2), grad_out)
        grad_probs = torch.matmul(grad_out, v.float().transpose(-1, -2))
        if kept is not None:
            grad_probs = grad_probs * kept
        delta = (grad_out * out.float()).sum(-1, keepdim=True)  # [b, h, sq, 1]
        grad_scores = probs * (grad_probs - delta) * self.scale
        return grad_scores @ k.float(), grad_scores.transpose(-1, -2) @ q.float(), grad_v

    def _scores(self, q, k, causal: bool) -> torch.Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        if causal:
            sq, sk = scores.shape[-2:]
            hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        return scores

    def _keep(self, probs: torch.Tensor, step: int) -> torch.Tensor:
        """The dropout mask of block `step`, scaled: the same in the forward and backward."""
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(self.seed + step)
        keep = torch.rand(probs.shape, generator=generator, device=probs.device)
        return (keep >= self.dropout_p).float() / (1.0 - self.dropout_p)


def _ring_block(rank: int, step: int, size: int) -> str:
    """Which part of the attention the key/value block in hand at `step` takes part in:
    `diagonal` (its own chunks, causal), `first_keys` (all queries over the sender's first
    chunk, which precedes both of this rank's), or `last_queries` (this rank's second chunk
    over both of the sender's, which precede it)."""
    if step == 0:
        return "diagonal"
    source = (rank - step) % size
    return "first_keys" if source < rank else "last_queries"


def _merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Fold a block's (output, log-sum-exp) into the running fp32 ones, in place, for `rows`."""
    merged = torch.logaddexp(lse[:, :, rows], block_lse)
    out[:, :, rows] = (
        out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
        + block_out.float() * torch.exp(block_lse - merged)[..., None]
    )
    lse[:, :, rows] = merged


def _block_inputs(kind: str, q, k, v, chunk: int) -> tuple:
    """(rows of q, q, k, v, causal) of a block (see `_ring_block`)."""
    if kind == "diagonal":
        return slice(None), q, k, v, True
    if kind == "first_keys":
        return slice(None), q, k[:, :, :chunk], v[:, :, :chunk], False
    return slice(chunk, None), q[:, :, chunk:], k, v, False


def _scatter_key_grad(kind: str, grad: torch.Tensor, chunk: int) -> torch.Tensor:
    """A block's key/value gradient at the full two-chunk size."""
    if kind != "first_keys":
        return grad
    return torch.cat((grad, torch.zeros_like(grad)), dim=2)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys and values.

    q [b, h, 2c, hn], k and v [b, g, 2c, hn] (g divides h) -> out [b, h, 2c, hn].
    """

    @staticmethod
    def forward(ctx, q, k, v, kernel: BlockKernel, ring: RankGroup):
        size, rank = ring.size, ring.rank
        heads, chunk = q.size(1), q.size(2) // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        key_values = (k, v)
        for step in range(size):
            transfer = RingTransfer(list(key_values), ring.group) if step < size - 1 else None
            kind = _ring_block(rank, step, size)
            keys, values = (_expand_heads(t, heads) for t in key_values)
            rows, q_in, k_in, v_in, causal = _block_inputs(kind, q, keys, values, chunk)
            block_out, block_lse = kernel.forward(q_in, k_in, v_in, causal, step)
            _merge(out, lse, block_out, block_lse, rows)
            if transfer is not None:
                key_values = tuple(transfer.wait())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.ring = kernel, ring
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, ring = ctx.kernel, ctx.ring
        size, rank = ring.size, ring.rank
        heads, groups, chunk = q.size(1), k.size(1), q.size(2) // 2
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        key_values = (k, v)
        # The gradient of the block in hand, from the ranks it visited before this one: fp32,
        # so the C partial sums add up as one process's would.
        incoming = None
        pending: RingTransfer | None = None
        for step in range(size):
            transfer = RingTransfer(list(key_values), ring.group) if step < size - 1 else None
            kind = _ring_block(rank, step, size)
            keys, values = (_expand_heads(t, heads) for t in key_values)
            rows, q_in, k_in, v_in, causal = _block_inputs(kind, q, keys, values, chunk)
            dq, dk, dv = kernel.backward(
                grad_out[:, :, rows],
                q_in,
                k_in,
                v_in,
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                step,
            )
            grad_q[:, :, rows] += dq.float()
            grads = [
                _scatter_key_grad(kind, _reduce_heads(g.float(), groups), chunk) for g in (dk, dv)
            ]
            if pending is not None:
                incoming = pending.wait()
                grads = [mine + theirs for mine, theirs in zip(grads, incoming, strict=True)]
            # Behind the block, to the next rank (the last step's goes to the block's owner).
            pending = RingTransfer(grads, ring.group)
            if transfer is not None:
                key_values = tuple(transfer.wait())
        grad_k, grad_v = pending.wait()
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


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

    def forward(self, query, key, value) -> torch.Tensor:
        """Causal attention of this rank's tokens over the whole sequence."""
        if self.a2a is not None:
            return self.a2a(query, key, value, None)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
        if self.comm_type == "allgather":
            return self._all_gathered(query, key, value)
        dropout_p = self.core.dropout_p if self.training else 0.0
        seed = draw_dropout_seed() if dropout_p > 0.0 else 0
        kernel = BlockKernel(self.core.scale, dropout_p, seed)
        context = RingAttention.apply(query, key, value, kernel, self.ring)  # [b, np, s/C, hn]
        b, heads, s, hn = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, heads * hn)

    def _all_gathered(self, query, key, value) -> torch.Tensor:
        key, value = (gather_context_parallel_key_values(t) for t in (key, value))
        mine = this_ranks_sequence_positions(query.size(2), query.device)
        everyone = torch.arange(key.size(2), device=query.device)
        mask = (everyone[None, :] > mine[:, None])[None, None]  # [1, 1, s/C, s] True = hidden
        if self.recompute and self.training:  # selective: the core again, not the gather
            return checkpoint(self.core, False, query, key, value, mask)
        return self.core(query, key, value, mask)
