"""GPT batches: Megatron's left-to-right masks and position ids, and pretrain_gpt's loss."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.model.document_mask import DocumentMask
from megatron.utils import get_ltor_masks_and_position_ids

EOD = 0


def megatron_reference(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):  # noqa: ANN001, ANN201
    """Megatron-LM's `get_ltor_masks_and_position_ids` (megatron/utils.py), transcribed.

    Its attention mask is float-like with 1 = may attend, converted at the end to
    `mask < 0.5` (True = masked), exactly as Megatron returns it.
    """
    micro_batch_size, seq_length = tokens.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(
        att_mask_batch, 1, seq_length, seq_length
    )
    loss_mask = torch.ones(tokens.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(tokens)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, tokens[b] == eod]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1) :, : (i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1) :] -= i + 1 - prev_index
                    prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("reset_position_ids", [False, True])
@pytest.mark.parametrize("reset_attention_mask", [False, True])
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_masks_equal_megatron(reset_position_ids, reset_attention_mask, eod_mask_loss) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 20, (3, 24), generator=generator)
    tokens[0, [3, 10, 11]] = EOD  # adjacent documents and a one-token document
    tokens[1, 23] = EOD  # end of document at the very end
    mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids, reset_attention_mask, eod_mask_loss
    )
    ref_mask, ref_loss_mask, ref_position_ids = megatron_reference(
        tokens, EOD, reset_position_ids, reset_attention_mask, eod_mask_loss
    )
    assert torch.equal(loss_mask, ref_loss_mask)
    assert torch.equal(position_ids, ref_position_ids)
    if reset_attention_mask:
        # Document ids, whose dense form is Megatron's mask.
        assert mask.shape == tokens.shape and not mask.is_floating_point()
        assert torch.equal(DocumentMask(mask).dense(24, 24, mask.device), ref_mask)
    else:
        # None means plain causal attention: the kernels apply exactly Megatron's tril mask.
        assert mask is None
        assert torch.equal(ref_mask[0, 0], ~torch.ones(24, 24, dtype=torch.bool).tril())
    if eod_mask_loss:
        assert loss_mask[0, 3] == 0 and loss_mask[0, 4] == 1


def test_loss_func_averages_over_unmasked_tokens() -> None:
    from pretrain_gpt import loss_func

    per_token = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    loss_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, reported = loss_func(loss_mask, per_token)
    assert loss.item() == pytest.approx(2.0)
    assert reported["lm loss"].item() == pytest.approx(2.0)


def test_get_batch_shifts_labels_and_builds_masks() -> None:
    from pretrain_gpt import get_batch, get_batch_pipe

    args = argparse.Namespace(
        eod_token_id=EOD, reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True
    )
    text = torch.tensor([[5, 6, EOD, 7, 8, 9]])
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        iter([{"text": text}]), args
    )
    assert tokens.tolist() == [[5, 6, EOD, 7, 8]]
    assert labels.tolist() == [[6, EOD, 7, 8, 9]]
    assert loss_mask.tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert attention_mask is None
    (pipe_tokens, pipe_positions), (pipe_labels, pipe_mask) = get_batch_pipe({"text": text}, args)
    assert torch.equal(pipe_tokens, tokens) and torch.equal(pipe_positions, position_ids)
    assert torch.equal(pipe_labels, labels) and torch.equal(pipe_mask, loss_mask)
