"""Rotary position embeddings: no learned position table, the rotate-half form equals a
complex rotation of channel pairs, scores depend only on relative position, odd widths are
refused."""

from __future__ import annotations

import pytest
import torch

from megatron.model import GPTModel, num_parameters
from megatron.model.attention import RotaryEmbedding, apply_rotary_pos_emb
from tests.model.helpers import complex_rotary, tiny_config
from tests.tolerances import assert_close_reordered, reordering_atol


@pytest.mark.parametrize("percent", [0.5, 1.0])
def test_rope_model_has_no_position_table(percent):
    """With rope there is no learned position table, in the module or the state dict."""
    config = tiny_config(position_embedding_type="rope", rotary_percent=percent)
    model = GPTModel(config)
    assert model.language_model.embedding.position_embeddings is None
    assert not any("position_embeddings" in key for key in model.state_dict())
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    assert num_parameters(config) == num_parameters(tiny_config()) - 16 * 32


@pytest.mark.parametrize("percent", [0.5, 1.0])
def test_apply_rotary_pos_emb_equals_complex_rotation(percent):
    """Rotate-half rotary equals multiplying channel pairs (j, j + d/2) by e^(i pos theta_j)."""
    hn = 16
    tensor = torch.randn(11, 2, 3, hn, generator=torch.Generator().manual_seed(0))
    rotary = RotaryEmbedding(hn, percent)
    angles = rotary(11)
    assert angles.shape == (11, 1, 1, int(hn * percent))
    rotated = apply_rotary_pos_emb(tensor, angles)
    # Against a float64 rotation: fp32 angles position x inv_freq are off by up to position
    # x u radians (11 positions), then cos, sin and the two-term sum round (4 more).
    rotation_terms = 11 + 4
    assert_close_reordered(rotated, complex_rotary(tensor, int(hn * percent)), terms=rotation_terms)
    # Bitwise: these channels are copied, and position 0 is x * cos 0 + y * sin 0 = x exactly.
    if percent < 1.0:  # the unrotated channels pass through untouched
        assert torch.equal(rotated[..., int(hn * percent) :], tensor[..., int(hn * percent) :])
    assert torch.equal(rotated[0], tensor[0])  # position 0 is not rotated
    # Rotations preserve each complex pair's modulus, hence the norm (a sum over hn squares).
    assert_close_reordered(rotated.norm(dim=-1), tensor.norm(dim=-1), terms=hn + rotation_terms)


def test_rotary_scores_depend_only_on_relative_position():
    """q_m . k_n after rotation depends on m - n alone (the scores matrix is Toeplitz)."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 1, 8, generator=generator).expand(9, 1, 1, 8)
    k = torch.randn(1, 1, 1, 8, generator=generator).expand(9, 1, 1, 8)
    angles = RotaryEmbedding(8, 1.0)(9)
    rq, rk = apply_rotary_pos_emb(q, angles)[:, 0, 0], apply_rotary_pos_emb(k, angles)[:, 0, 0]
    scores = rq @ rk.T
    # Normwise over the whole matrix (a diagonal may cancel to a small value): 8-term dot
    # products of vectors rotated by fp32 angles off by up to position x u (9 positions).
    atol = reordering_atol(scores, terms=8 + 9 + 4)
    for offset in range(-8, 9):
        diagonal = torch.diagonal(scores, offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), atol=atol, rtol=0)
    assert scores.std() > 1e-2  # not trivially constant


def test_rotary_rejects_an_odd_number_of_channels():
    """A rotary width that is odd (or zero) is refused with the flags named."""
    with pytest.raises(ValueError, match="--rotary-percent"):
        RotaryEmbedding(10, 0.5)
