"""The parameter inventory is the model: the same names, order, shapes and tensor-parallel
split dimensions as a built `GPTModel`, for every layer option."""

from __future__ import annotations

import pytest

from megatron.config import RoutedMoEConfig
from megatron.deepseek_config import MTPConfig
from megatron.model import GPTModel
from megatron.model.parameter_inventory import parameter_inventory
from tests.model.helpers import tiny_config

OPTIONS = {
    "gpt2": {},
    "llama": dict(
        activation="swiglu",
        normalization="rmsnorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        num_key_value_heads=2,
    ),
    "odd shapes": dict(ffn_hidden_size=72, kv_channels=4, num_key_value_heads=1),
    "qwen2 (qkv bias)": dict(add_bias_linear=False, add_qkv_bias=True, normalization="rmsnorm"),
    "qwen3 (qk norm)": dict(
        add_bias_linear=False, qk_layernorm=True, normalization="rmsnorm", kv_channels=16
    ),
    "qk layernorm with biases": dict(qk_layernorm=True),
    "megatron-lm moe": dict(
        activation="swiglu",
        routed_moe=RoutedMoEConfig(
            num_experts=4,
            moe_layers=(False, True),
            ffn_hidden_size=24,
            shared_expert_ffn_hidden_size=40,
        ),
    ),
    "qwen2-moe (gated shared expert, qkv bias)": dict(
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=True,
        routed_moe=RoutedMoEConfig(
            num_experts=4,
            moe_layers=(True, True),
            ffn_hidden_size=24,
            shared_expert_ffn_hidden_size=40,
            shared_expert_gate=True,
        ),
    ),
    "megatron-lm moe, no biases": dict(
        add_bias_linear=False,
        routed_moe=RoutedMoEConfig(num_experts=2, moe_layers=(True, True)),
    ),
    "multi-token prediction, tied": dict(mtp=MTPConfig(num_layers=2)),
    "multi-token prediction after an moe layer": dict(
        activation="swiglu",
        normalization="rmsnorm",
        untie_embeddings_and_output_weights=True,
        mtp=MTPConfig(num_layers=1),
        routed_moe=RoutedMoEConfig(
            num_experts=4, moe_layers=(False, True), shared_expert_ffn_hidden_size=40
        ),
    ),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_the_inventory_lists_the_models_parameters(options: dict) -> None:
    config = tiny_config(**options)
    model = GPTModel(config)
    built = [(name, tuple(param.shape)) for name, param in model.state_dict().items()]
    assert [(spec.name, spec.shape) for spec in parameter_inventory(config)] == built
    splits = {
        name: getattr(param, "partition_dim", None)
        if getattr(param, "tensor_model_parallel", False)
        else None
        for name, param in model.named_parameters()
    }
    assert {spec.name: spec.tensor_split for spec in parameter_inventory(config)} == splits
