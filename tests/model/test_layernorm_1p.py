"""`--apply-layernorm-1p` (Megatron-LM's zero-centred norms): a norm scales by 1 + weight, the
weight starts at 0, and a Hugging Face export writes the 1 + weight it scales by."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.huggingface import to_hf_weights
from megatron.model import GPTModel
from megatron.model.utils import LayerNorm, RMSNorm
from tests.model.helpers import random_batch, tiny_config


@pytest.mark.parametrize("kind, norm_class", [("layernorm", LayerNorm), ("rmsnorm", RMSNorm)])
def test_a_zero_centred_norm_scales_by_one_plus_its_weight(kind: str, norm_class) -> None:
    plain = norm_class(tiny_config(normalization=kind))
    centred = norm_class(tiny_config(normalization=kind, apply_layernorm_1p=True))
    assert torch.equal(centred.weight, torch.zeros_like(centred.weight))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(centred(x), plain(x))  # 1 + 0 = the plain norm's initial 1
    with torch.no_grad():
        plain.weight.copy_(torch.linspace(0.5, 1.5, 32))
        centred.weight.copy_(plain.weight - 1)
    torch.testing.assert_close(centred(x), plain(x))


def test_the_model_and_its_llama_export_see_the_same_scale() -> None:
    options = dict(
        activation="swiglu",
        normalization="rmsnorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
    )
    torch.manual_seed(0)
    centred = GPTModel(tiny_config(**options, apply_layernorm_1p=True)).eval()
    torch.manual_seed(0)
    plain = GPTModel(tiny_config(**options)).eval()
    with torch.no_grad():
        for name, param in centred.named_parameters():
            if name.endswith("layernorm.weight"):
                param.add_(torch.rand(param.shape) - 0.5)
        weights = {
            name: tensor + 1 if name.endswith("layernorm.weight") else tensor
            for name, tensor in centred.state_dict().items()
        }
        plain.load_state_dict(weights)
        tokens, _ = random_batch(2, 8, 64)
        positions = torch.arange(8).expand(2, 8)
        torch.testing.assert_close(centred(tokens, positions, None), plain(tokens, positions, None))
    exported = to_hf_weights(centred.state_dict(), tiny_config(**options, apply_layernorm_1p=True))
    assert torch.equal(
        exported["model.norm.weight"],
        centred.state_dict()["language_model.encoder.final_layernorm.weight"] + 1,
    )
