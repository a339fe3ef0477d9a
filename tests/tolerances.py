"""How far apart two computations of the same value may be when their sums run in other orders.

Another parallel layout, another code path, another thread count or another CPU's kernels
(AVX-512 vs AVX2, 1 vs 2 OpenMP threads) sums the same terms in another order. A sum of n
terms rounded at unit roundoff u has an error of at most (n - 1) u sum|x_i| in any order
(Higham, "Accuracy and Stability of Numerical Algorithms", 4.2), so two orders differ by up
to 2 (n - 1) u sum|x_i|: a bound set by the dtype, the reduction length and the size of the
terms, not by one machine's rounding.

An element whose terms cancel (a small result from large terms) keeps the absolute error of
its large terms, so the bound is normwise: every element within `2 * terms * u * scale`,
with `scale` the largest magnitude in the expected tensor standing in for the terms' size.
`terms` is the number of terms summed along the longest path into the values (a matmul's
contraction length; through several layers, forward and backward, the sum of those).

Where the claim is that two runs do *exactly* the same arithmetic (a resume, the same layout
twice, a copy of weights), compare bitwise (`torch.equal`) instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.config import ModelConfig

# Unit roundoff (half the machine epsilon) per dtype.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def reordering_atol(expected: torch.Tensor, terms: int, dtype: torch.dtype | None = None) -> float:
    """The absolute tolerance for `expected` computed with `terms`-term sums in another order.

    `dtype` is the precision the sums ran in (default: `expected`'s own).
    """
    if terms < 1:
        raise ValueError(f"terms must be at least 1, got {terms}")
    unit = UNIT_ROUNDOFF[dtype or expected.dtype]
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    return 2.0 * terms * unit * max(scale, torch.finfo(torch.float32).tiny)


def assert_close_reordered(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    terms: int,
    dtype: torch.dtype | None = None,
    msg: str | None = None,
) -> None:
    """Assert `actual` equals `expected` up to summing `terms` terms in another order.

    Elementwise within `reordering_atol(expected, terms, dtype)`; shapes and dtypes must match.
    """
    atol = reordering_atol(expected, terms, dtype)
    torch.testing.assert_close(
        actual,
        expected,
        rtol=0.0,
        atol=atol,
        msg=lambda default: (
            f"{msg + ': ' if msg else ''}{default}\n(reordering bound: {terms} terms at "
            f"{dtype or expected.dtype}, scale {expected.detach().abs().max().item():.3g})"
        ),
    )


# --- terms of a GPT's computations ---------------------------------------------------------


def forward_terms(config: ModelConfig, tokens: int) -> int:
    """The terms summed along the longest path from the ids into one logit of `config`'s model
    run on `tokens` tokens (all sequences together: generous for attention), for
    `tests.tolerances` where another implementation (transformers, another tensor-parallel
    size, another MoE dispatch) computes the same logits in fp32. Per layer: its two norms
    (hidden each), QKV (hidden), scores (kv_channels), softmax and context (tokens each),
    attention output (heads x kv_channels), the MLP (hidden, then ffn); with `qk_layernorm`
    the query's norm (kv_channels) before the scores; multi-latent attention: its latent norm
    and up-projection (the latent's width each), scores over its query/key channels, output
    over heads x its value channels; with experts also the
    gate (hidden), its softmax (experts), the dispatch (tokens), the combine (experts x tokens)
    and PR-MoE's mixing coefficient (hidden). Then the final norm and the output layer."""
    hidden = config.hidden_size
    experts = config.moe.experts_per_layer if config.moe else (1,) * config.num_layers
    terms = 2 * hidden
    for count in experts:
        terms += 3 * hidden + 2 * tokens + hidden + config.ffn_hidden_size
        if config.mla is not None:  # latent norm and up-projection, wider scores and output
            mla = config.mla
            latent = max(mla.kv_lora_rank, mla.q_lora_rank or 0)
            terms += 2 * latent + mla.qk_head_dim + mla.qk_pos_emb_head_dim
            terms += config.num_attention_heads * mla.v_head_dim
        else:
            terms += config.kv_channels + config.projection_size
            if config.qk_layernorm:
                terms += config.kv_channels
        if count > 1:
            terms += 2 * hidden + count + tokens + count * tokens
    return terms


def training_loss_terms(config: ModelConfig, micro_tokens: int, tokens: int, steps: int) -> int:
    """The terms summed along the longest path into a loss logged `steps` optimizer steps
    after the state two runs share (0: the first step's loss): the forward into the logits
    (`forward_terms` of a micro-batch of `micro_tokens`), the mean over the step's `tokens`,
    and every earlier step's forward and backward (the same contractions transposed, plus the
    weight gradients' sums over `tokens`): errors compound over steps. The cross-entropy's sum
    over the vocabulary is counted by `assert_losses_reordered`."""
    forward = forward_terms(config, micro_tokens)
    return forward + tokens + steps * (2 * forward + tokens)


def assert_losses_reordered(
    actual: Sequence[float],
    expected: Sequence[float],
    *,
    terms: Sequence[int],
    vocab: int,
    digits: int | None = 7,
    what: str = "",
) -> None:
    """Each fp32 loss of `actual` equals `expected`'s up to sums in other orders.

    Loss i may differ by `reordering_atol(expected[i], terms[i])` (see `training_loss_terms`), plus
    2 x `vocab` x u for the cross-entropy's softmax sum over `vocab` positive terms (in any
    order its relative error is at most vocab x u, an absolute error of its log), plus one
    unit of the last of the `digits` significant digits a log line keeps (None: exact floats).
    """
    assert len(actual) == len(expected) == len(terms), (what, actual, expected)
    unit = UNIT_ROUNDOFF[torch.float32]
    for index, (got, want, count) in enumerate(zip(actual, expected, terms)):
        atol = reordering_atol(torch.tensor(want), count) + 2 * vocab * unit
        if digits is not None and want != 0:
            atol += 10.0 ** (math.floor(math.log10(abs(want))) - digits + 1)
        assert abs(got - want) <= atol, (
            f"{what}: loss {index}: {got} vs {want} differ by {abs(got - want):.3g} > {atol:.3g} "
            f"({count} terms, vocabulary {vocab})\n{list(actual)}\n{list(expected)}"
        )


def loss_terms(config: ModelConfig, tokens: int) -> int:
    """`forward_terms` and the cross entropy's log-sum-exp over the (padded) vocabulary."""
    return forward_terms(config, tokens) + config.vocab_size


def grad_terms(config: ModelConfig, batch: int, seq: int) -> int:
    """Terms along the longest path into a gradient of a mean token loss.

    The backward pass runs the forward's contractions again (2 x `loss_terms`), and every
    weight gradient sums over the batch x seq tokens, as the mean does.
    """
    return 2 * loss_terms(config, seq) + 2 * batch * seq
