"""Attention kernels only a GPU runs (`pytest -m gpu`).

- FlexAttention's compiled kernel, the path `--reset-attention-mask` and `--window-size` take
  there (`document_mask.kernel_for`): its block masks read by torch's fused Triton kernel,
  forward and backward, against SDPA with the dense mask;
- a GPT with packed documents and Megatron's default attention dropout (0.1), which
  FlexAttention cannot drop and so must not take, trains a step;
- `--use-flash-attn` with a dense mask (context parallelism's `allgather`), which CUDA's flash
  kernel does not take.

On CPU the same masks run through eager FlexAttention and inductor's CPU template
(tests/model/test_document_mask.py); these are their GPU branches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.model.document_mask import DocumentMask, flex_attention_with, kernel_for
from tests.model.test_document_mask import KERNEL_CASES, _document_ids

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(case: str, kv_heads: int, dtype: torch.dtype) -> tuple:
    s, lengths, window = KERNEL_CASES[case]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, s, 64, generator=generator)
    k, v = (torch.randn(2, kv_heads, s, 64, generator=generator) for _ in range(2))
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, DocumentMask(_document_ids(lengths).cuda(), window)


# Every mask in bf16 (what runs train in), one in fp32: each shape is a compile of its own
# (tens of seconds), and `pytest -m gpu` has minutes in all.
CASES = [(case, torch.bfloat16) for case in sorted(KERNEL_CASES)] + [("window", torch.float32)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case, dtype", CASES)
def test_compiled_flex_kernel_gives_the_dense_masks_attention_and_gradients(case, dtype):
    q, k, v, mask = _case(case, 2, dtype)
    assert kernel_for("sdpa", q.device) == "flex"
    out = flex_attention_with(mask, q, k, v, 0.125)  # compiled: the GPU default
    grad = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    dense = ~mask.dense(q.size(2), q.size(2), q.device)
    # The reference in fp32 (math kernel), from the same inputs.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    reference = F.scaled_dot_product_attention(
        q32, k32, v32, attn_mask=dense, scale=0.125, enable_gqa=True
    )
    expected = (reference, *torch.autograd.grad(reference, (q32, k32, v32), grad.float()))
    tolerance = dict(rtol=0, atol=2e-3) if dtype == torch.float32 else dict(rtol=0, atol=6e-2)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(mine.float(), theirs, msg=name, **tolerance)


@pytest.mark.gpu
@needs_gpu
def test_packed_documents_with_attention_dropout_train_on_the_gpu():
    """Megatron's default --attention-dropout 0.1 with document masks: the varlen SDPA path
    (FlexAttention has no dropout and raised in the first forward before)."""
    from megatron.config import ModelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.model import GPTModel

    assert kernel_for("sdpa", torch.device("cuda"), dropout_p=0.1) == "varlen"
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
        max_position_embeddings=64, attention_dropout=0.1,
    )  # fmt: skip
    model = GPTModel(config).cuda()
    tokens = torch.randint(0, 128, (2, 65), device="cuda")
    documents = _document_ids([[20, 44], [64]]).cuda()
    with torch.autocast("cuda", torch.bfloat16):
        losses = model(tokens[:, :-1], labels=tokens[:, 1:], document_ids=documents)
    losses.float().mean().backward()
    assert torch.isfinite(losses).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.gpu
@needs_gpu
def test_the_flash_backend_takes_a_bool_mask_on_the_gpu():
    """`--use-flash-attn` with a dense bool mask (context parallelism's all-gathered keys:
    each rank's queries against the whole sequence): CUDA's flash kernel takes no mask, so the
    memory-efficient one runs it, giving the math kernel's attention."""
    from megatron.config import ModelConfig
    from megatron.model.attention import CoreAttention, flash_attention_status

    if not flash_attention_status()[0]:
        pytest.skip(flash_attention_status()[1])
    config = ModelConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128,
        max_position_embeddings=64, attention_dropout=0.0, kv_channels=16,
        attention_backend="flash",
    )  # fmt: skip
    core = CoreAttention(config, 1).eval()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 16, generator=generator)  # this rank's 16 of 32 queries
    k, v = (torch.randn(2, 4, 32, 16, generator=generator) for _ in range(2))
    positions = torch.cat([torch.arange(0, 8), torch.arange(24, 32)])  # chunks 0 and 3 of 4
    hidden = (torch.arange(32)[None, :] > positions[:, None])[None, None]  # [1, 1, 16, 32]
    out = core(*(t.cuda().bfloat16() for t in (q, k, v)), hidden.cuda())  # [s, b, np * hn]
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, scale=core.scale)
    reference = reference.permute(2, 0, 1, 3).reshape(16, 2, 64)
    torch.testing.assert_close(out.float().cpu(), reference, rtol=0, atol=3e-2)
