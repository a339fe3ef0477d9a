"""Ring attention's block kernels (megatron/model/context_parallel.py `BlockKernel`), one
process.

Every kernel gives a block's output and log-sum-exp, and its gradients given the merged
output and log-sum-exp, as the explicit fp32 math does, which is itself checked against
autograd: the CPU flash kernel with and without a mask (a sliding window, documents, rows that
see no key of the block); with dropout the math's backward redraws its forward's masks. On a
GPU (`gpu` marker): CUDA's flash kernel for unmasked blocks and its memory-efficient kernel for
masked ones, chosen by `block_kernel_name`, against the same fp32 autograd reference.
"""

from __future__ import annotations

import pytest
import torch

from megatron.model.context_parallel import BlockKernel, block_kernel_name
from megatron.model.document_mask import DocumentMask

SCALE = 0.25


def _qkv(heads: int, sq: int = 8, sk: int = 8, dtype=torch.float32, device="cpu") -> tuple:
    generator = torch.Generator().manual_seed(3)
    shapes = ((2, heads, sq, 16), (2, heads, sk, 16), (2, heads, sk, 16))
    return tuple(torch.randn(s, generator=generator).to(device, dtype) for s in shapes)


def _math() -> BlockKernel:
    """The explicit math (dropout > 0 selects it; 1e-9 drops nothing)."""
    return BlockKernel(SCALE, 1e-9, 0)


def _window_and_documents(sq: int, sk: int, device="cpu") -> torch.Tensor:
    """Bool [2, sq, sk]: queries at positions sk.. over keys 0.. (a later chunk over an earlier
    one) in a window that hides the oldest keys from the later queries; in sample 0 a new
    document starts at the third query, so its queries from there on see no key here."""
    ids = torch.zeros(2, sk + sq, dtype=torch.long, device=device)
    ids[0, sk + 3 :] = 1
    q = torch.arange(sk, sk + sq, device=device)
    window = (sq + sk // 2 - 1, 0)
    return DocumentMask(ids, window).allowed_at(q, torch.arange(sk, device=device))


def _live(allowed: torch.Tensor) -> torch.Tensor:
    """`allowed` with the last key visible to every query (no dead rows)."""
    allowed = allowed.clone()
    allowed[:, :, -1] = True
    return allowed


def _reference(q, k, v, causal: bool, allowed) -> tuple:
    """fp32 output, log-sum-exp and autograd's input gradients of a block without dead rows,
    for the gradient `grad` of all ones times a fixed pattern."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * SCALE
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None], -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    grad = torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape)
    out.backward(grad)
    return out.detach(), lse.detach(), grad, (q.grad, k.grad, v.grad)


def _check_kernel(kernel: BlockKernel, q, k, v, causal: bool, allowed, tolerance: float) -> None:
    """Forward and backward of `kernel` against `_reference` (blocks without dead rows)."""
    out, lse, grad, expected = _reference(q, k, v, causal, allowed)
    ours, ours_lse = kernel.forward(q, k, v, causal, allowed, (0, 0))
    torch.testing.assert_close(ours.float(), out, rtol=0, atol=tolerance)
    torch.testing.assert_close(ours_lse.float(), lse, rtol=0, atol=tolerance)
    grads = kernel.backward(grad.to(q.dtype), q, k, v, out, lse, causal, allowed, (0, 0))
    for mine, theirs in zip(grads, expected, strict=True):
        torch.testing.assert_close(mine.float(), theirs, rtol=0, atol=tolerance)


@pytest.mark.parametrize("causal", [True, False])
def test_math_and_cpu_flash_are_autograds_attention(causal: bool) -> None:
    q, k, v = _qkv(4)
    assert block_kernel_name(q, 0.0, masked=False) == "cpu_flash"
    _check_kernel(BlockKernel(SCALE, 0.0, 0), q, k, v, causal, None, 1e-5)
    _check_kernel(_math(), q, k, v, causal, None, 1e-5)


def test_masked_blocks_are_autograds_attention() -> None:
    """A window and documents, every query seeing some key."""
    q, k, v = _qkv(4, sq=6, sk=8)
    allowed = _live(_window_and_documents(6, 8))
    assert not allowed.all()
    assert block_kernel_name(q, 0.0, masked=True) == "cpu_flash"
    _check_kernel(BlockKernel(SCALE, 0.0, 0), q, k, v, False, allowed, 1e-5)
    _check_kernel(_math(), q, k, v, False, allowed, 1e-5)


def test_dead_rows_weigh_nothing_in_the_merge() -> None:
    """Rows that see no key of a block: output 0, log-sum-exp -inf (CPU flash writes 0 there),
    and given the merged (finite) log-sum-exp their gradients are 0 in both kernels."""
    q, k, v = _qkv(4, sq=6, sk=8)
    allowed = _window_and_documents(6, 8)
    dead = ~allowed.any(-1)  # [2, sq]
    assert dead[0, 3:].all() and not dead[0, :3].any() and not dead[1].any()
    results = []
    for kernel in (BlockKernel(SCALE, 0.0, 0), _math()):
        out, lse = kernel.forward(q, k, v, False, allowed, (1, 0))
        assert (out[0, :, 3:] == 0).all() and torch.isneginf(lse[0, :, 3:]).all()
        merged = lse.masked_fill(torch.isneginf(lse), 0.5)  # another block's, after merging
        grad = torch.ones_like(out)
        grads = kernel.backward(grad, q, k, v, out, merged, False, allowed, (1, 0))
        assert (grads[0][0, :, 3:] == 0).all()
        results.append((out, lse, *grads))
    for fused, math in zip(*results, strict=True):
        torch.testing.assert_close(fused.float(), math.float(), rtol=0, atol=1e-5)


def test_math_kernel_dropout_gradients_are_its_forwards() -> None:
    """With dropout the backward redraws the forward's masks: its gradients are autograd's."""
    q, k, v = (t.requires_grad_() for t in _qkv(4))
    allowed = _live(_window_and_documents(8, 8))  # autograd's softmax defined everywhere
    kernel = BlockKernel(SCALE, 0.3, seed=7)
    for causal, mask in ((True, None), (False, allowed)):
        out, lse = kernel.forward(q, k, v, causal, mask, (2, 1))
        grad = torch.randn_like(out)
        expected = torch.autograd.grad(out, (q, k, v), grad)
        ours = kernel.backward(
            grad, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal,
            mask, (2, 1),
        )  # fmt: skip
        for mine, theirs in zip(ours, expected, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
        other_call, _ = kernel.forward(q, k, v, causal, mask, (2, 0))
        assert not torch.equal(other_call, out)  # each call draws its own mask


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_kernel_for_unmasked_blocks(dtype: torch.dtype, causal: bool) -> None:
    q, k, v = _qkv(4, sq=64, sk=64, dtype=dtype, device="cuda")
    assert block_kernel_name(q, 0.0, masked=False) == "cuda_flash"
    _check_kernel(BlockKernel(SCALE, 0.0, 0), q, k, v, causal, None, 2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sq, sk", [(48, 40), (64, 64)])  # rows off and on 32, columns off 16
def test_cuda_efficient_kernel_for_masked_blocks(dtype: torch.dtype, sq: int, sk: int) -> None:
    q, k, v = _qkv(4, sq=sq, sk=sk, dtype=dtype, device="cuda")
    allowed = _live(_window_and_documents(sq, sk, device="cuda"))
    assert block_kernel_name(q, 0.0, masked=True) == "cuda_efficient"
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    _check_kernel(BlockKernel(SCALE, 0.0, 0), q, k, v, False, allowed, tolerance)


@pytest.mark.gpu
@needs_cuda
def test_cuda_efficient_kernel_dead_rows() -> None:
    """Rows of a masked block that see no key: as the math gives them, forward and backward."""
    q, k, v = _qkv(4, sq=40, sk=40, dtype=torch.bfloat16, device="cuda")
    allowed = _window_and_documents(40, 40, device="cuda")
    grad = torch.ones(q.shape, device="cuda")
    results = []
    for kernel in (BlockKernel(SCALE, 0.0, 0), _math()):
        out, lse = kernel.forward(q, k, v, False, allowed, (1, 0))
        merged = lse.masked_fill(torch.isneginf(lse), 0.5)
        results.append(
            (out, lse, *kernel.backward(grad, q, k, v, out, merged, False, allowed, (1, 0)))
        )
    for efficient, math in zip(*results, strict=True):
        torch.testing.assert_close(efficient.float(), math.float(), rtol=0, atol=2e-2)
