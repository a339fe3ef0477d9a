"""Multi-token prediction (`--mtp-num-layers`, megatron/model/multi_token_prediction.py).

The model's per-token losses stay the next token's; the MTP module's loss, computed by hand
here from the model's own weights (module k: the decoder's hidden states through `hnorm`, the
embedding of the tokens k places ahead through `enorm`, `eh_proj` of their concatenation, one
transformer layer, the final norm, the shared output layer, cross-entropy against the token
k + 1 places ahead, the last k positions masked), is logged as 'mtp_k loss', and the gradient
is that of `lm loss + factor / D x sum_k mtp_k loss`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.deepseek_config import MTPConfig
from megatron.model.moe_aux_loss import moe_losses_of, scale_aux_losses_like
from megatron.model.multi_token_prediction import mtp_loss_name, shift_left
from tests.model.helpers import build_model, random_batch, tiny_config


def _hand_mtp_losses(model, tokens, labels, loss_mask) -> list[torch.Tensor]:  # noqa: ANN001
    """Each module's masked mean loss, written out from the weights."""
    hidden = model.language_model(tokens, None, None)  # [s, b, h], final norm applied
    ids, targets, mask = tokens, labels, loss_mask.float()
    positions = torch.arange(tokens.size(1))[None]
    means = []
    for layer in model.mtp.layers:
        ids, targets, mask = shift_left(ids), shift_left(targets), shift_left(mask)
        positions = shift_left(positions)
        embedded = model.language_model.embedding(ids, positions)
        joined = torch.cat((layer.enorm(embedded), layer.hnorm(hidden)), dim=-1)
        hidden = layer.final_layernorm(
            layer.transformer_layer(F.linear(joined, layer.eh_proj.weight), None)
        )
        logits = F.linear(hidden, model.output_weight()).transpose(0, 1)  # [b, s, v]
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        means.append((losses * mask.flatten()).sum() / mask.sum())
    return means


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("per_token", [False, True])
def test_mtp_losses_are_logged_and_join_the_gradient(depth: int, per_token: bool) -> None:
    factor = 0.3
    config = tiny_config(
        mtp=MTPConfig(num_layers=depth, loss_scaling_factor=factor, per_token_loss=per_token),
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
    )
    model = build_model(config)
    tokens, labels = random_batch(3, 12, config.vocab_size)
    loss_mask = torch.ones_like(labels)
    loss_mask[1, 4:7] = 0  # a masked stretch: shifted with the labels
    tracker = moe_losses_of(model)
    tracker.start()
    losses = model(tokens, labels=labels, loss_mask=loss_mask)
    mask = loss_mask.float()
    lm_loss = (losses * mask).sum() / (1 if per_token else mask.sum())
    scale_aux_losses_like(lm_loss, tracker, labels.numel() if per_token else 1.0)
    lm_loss.backward()
    reported = tracker.pop()
    got = {name: param.grad.clone() for name, param in model.named_parameters()}

    with torch.no_grad():
        expected_lm = F.cross_entropy(
            F.linear(model.language_model(tokens, None, None), model.output_weight())
            .transpose(0, 1)
            .flatten(0, 1),
            labels.flatten(),
            reduction="none",
        ).view_as(losses)
    torch.testing.assert_close(losses.detach(), expected_lm, rtol=1e-5, atol=1e-6)

    model.zero_grad()
    hand = _hand_mtp_losses(model, tokens, labels, loss_mask)
    assert sorted(reported) == [mtp_loss_name(k) for k in range(1, depth + 1)]
    for k, value in enumerate(hand, start=1):
        torch.testing.assert_close(reported[mtp_loss_name(k)], value.detach(), rtol=1e-5, atol=0)
    # The gradient of lm loss + factor / D x sum of the modules' losses (per-token: sums).
    lm = model.model_forward(tokens, None, None, labels)  # the next token's losses alone
    total = (lm * mask).sum() / (1 if per_token else mask.sum())
    for k, mean in enumerate(hand, start=1):
        shifted = mask
        for _ in range(k):
            shifted = shift_left(shifted)
        term = mean * shifted.sum() if per_token else mean
        total = total + factor / depth * term
    model.zero_grad()
    total.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert got["mtp.layers.0.eh_proj.weight"].abs().sum() > 0


def test_mtp_parameter_names_are_megatron_cores() -> None:
    config = tiny_config(mtp=MTPConfig(num_layers=1), position_embedding_type="rope")
    names = [name for name, _ in build_model(config).named_parameters() if name.startswith("mtp")]
    assert "mtp.layers.0.enorm.weight" in names
    assert "mtp.layers.0.hnorm.weight" in names
    assert "mtp.layers.0.eh_proj.weight" in names
    assert "mtp.layers.0.final_layernorm.weight" in names
    assert "mtp.layers.0.transformer_layer.self_attention.query_key_value.weight" in names


def test_evaluation_and_generation_log_no_mtp_loss() -> None:
    config = tiny_config(mtp=MTPConfig(num_layers=1), position_embedding_type="rope")
    model = build_model(config).eval()
    tokens, labels = random_batch(2, 8, config.vocab_size)
    tracker = moe_losses_of(model)
    tracker.start()
    with torch.no_grad():
        model(tokens, labels=labels)
        logits = model(tokens)
    assert tracker.pop() == {}
    assert logits.shape == (2, 8, config.vocab_size)
