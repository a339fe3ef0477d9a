"""`tests/tolerances.py`: the reordering bound holds for any summation order and catches a
wrong term.

With non-negative terms sum|x_i| is the sum itself, so the bound 2 n u sum|x_i| is a theorem
(Higham 4.2) for every order: these checks cannot fail on any machine or thread count.
"""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import assert_close_reordered, reordering_atol


def _positive(*shape: int, seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def test_two_summation_orders_are_within_the_bound():
    terms = _positive(100_000, seed=0)
    sequential = terms.cumsum(0)[-1]  # left to right
    pairwise = terms.sum()  # ATen's blocked, vectorised order
    backwards = terms.flip(0).cumsum(0)[-1]
    for order in (pairwise, backwards):
        assert_close_reordered(order, sequential, terms=terms.numel())


def test_a_matmul_in_float32_is_within_the_bound_of_float64():
    a, b = _positive(64, 512, seed=1), _positive(512, 32, seed=2)
    exact = (a.double() @ b.double()).float()
    assert_close_reordered(a @ b, exact, terms=512)
    assert_close_reordered(
        (a.bfloat16() @ b.bfloat16()).float(), exact, terms=512 + 8, dtype=torch.bfloat16
    )


def test_a_missing_term_is_caught():
    a, b = _positive(64, 512, seed=1), _positive(512, 32, seed=2)
    wrong = a[:, 1:] @ b[1:]  # one of 512 terms dropped: off by about 1/512 of the value
    with pytest.raises(AssertionError, match="reordering bound: 512 terms"):
        assert_close_reordered(wrong, a @ b, terms=512)


def test_the_bound_scales_with_terms_dtype_and_magnitude():
    x = torch.tensor([0.5, -4.0])
    assert reordering_atol(x, 10) == 2 * 10 * 2.0**-24 * 4.0
    assert reordering_atol(x, 10, torch.bfloat16) == 2 * 10 * 2.0**-8 * 4.0
    with pytest.raises(ValueError, match="terms must be at least 1"):
        reordering_atol(x, 0)
