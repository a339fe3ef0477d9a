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

import torch

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
