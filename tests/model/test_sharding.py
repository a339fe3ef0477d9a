"""The layers' own declarations of how their tensors are split (`megatron.model.sharding`).

For models of every family (GPT-2, LLaMA with SwiGLU and GQA, Qwen's q/k norms and QKV bias,
DeepSpeed-MoE with PR-MoE and with expert tensor parallelism, Megatron-LM's routed MoE with a
shared expert and expert biases), built on the meta device, every state-dict entry's declared
split is the one Megatron's rules give that name (`tests/model/megatron_split_rules.py`:
the tensor-parallel dimension, SwiGLU's two halves, the vocabulary's rows, the stacked
experts), so the writers read the layers instead of a table of names. DeepSpeed-MoE's copies of
the expert keep the split their template declared.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig, MoEConfig, RoutedMoEConfig
from megatron.core.process_groups import ModelGroups
from megatron.model import GPTModel
from megatron.model.sharding import Split, declared_splits, model_splits
from megatron.training.optimizer import counted_once
from tests.model.megatron_split_rules import (
    ROUTED_EXPERTS,
    VOCAB_PARALLEL,
    partition_dim,
    swiglu_tensors,
)

GPT2 = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
    max_position_embeddings=16, ffn_hidden_size=64,
)  # fmt: skip
LLAMA = dataclasses.replace(
    GPT2, activation="swiglu", normalization="rmsnorm", num_key_value_heads=2,
    untie_embeddings_and_output_weights=True, add_bias_linear=False,
    position_embedding_type="rope",
)  # fmt: skip
QWEN = dataclasses.replace(LLAMA, qk_layernorm=True, add_qkv_bias=True)
DEEPSPEED_MOE = dataclasses.replace(
    GPT2, moe=MoEConfig(experts_per_layer=(4, 4), top_k=2, residual=True)
)
EXPERT_TP = dataclasses.replace(
    GPT2, moe=MoEConfig(experts_per_layer=(1, 4), expert_tensor_parallel=True)
)
SWIGLU_MOE = dataclasses.replace(
    LLAMA, moe=MoEConfig(experts_per_layer=(2, 2), top_k=1)
)  # experts whole on every tensor-parallel rank: SwiGLU's halves, no split
ROUTED = dataclasses.replace(
    LLAMA,
    routed_moe=RoutedMoEConfig(
        num_experts=4, moe_layers=(False, True), top_k=2, shared_expert_ffn_hidden_size=32,
        expert_bias=True,
    ),
)  # fmt: skip
CONFIGS = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "qwen": QWEN,
    "deepspeed-moe": DEEPSPEED_MOE,
    "expert-tp": EXPERT_TP,
    "swiglu-moe": SWIGLU_MOE,
    "routed": ROUTED,
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_declarations_are_the_checkpoint_rules(family: str) -> None:
    config = CONFIGS[family]
    splits = model_splits(config)
    with torch.device("meta"):
        state = GPTModel(config, ModelGroups()).state_dict()
    assert sorted(splits) == sorted(state)  # every entry, buffers too
    expert_tp = bool(config.moe and config.moe.expert_tensor_parallel)
    swiglu = swiglu_tensors(state)
    for name, split in splits.items():
        assert split.tensor_dim == partition_dim(name, expert_tp), name
        assert split.swiglu == (name in swiglu), name
        assert split.stride == (2 if split.swiglu and split.tensor_dim is not None else 1), name
        assert split.vocab == (name in VOCAB_PARALLEL), name
        assert (split.expert_dim == 0) == name.endswith(ROUTED_EXPERTS), name
    assert any(split.tensor_dim == 1 for split in splits.values())  # row-parallel layers
    if family == "routed":
        assert sum(split.expert_dim == 0 for split in splits.values()) == 2  # weight1, weight2
    if family == "llama":
        assert sum(split.swiglu for split in splits.values()) == 2  # SwiGLU, 2 layers


def test_deepspeed_moe_experts_keep_their_split_through_deepspeeds_copies() -> None:
    """DeepSpeed deep-copies the expert per expert (a Parameter's deepcopy drops our marks):
    with expert tensor parallelism every copy is still a tensor-parallel shard, so the
    gradient norm counts it on every tensor-parallel rank, not on rank 0 only."""
    with torch.device("meta"):
        model = GPTModel(EXPERT_TP, ModelGroups())
    experts = [(name, param) for name, param in model.named_parameters()
               if ".deepspeed_experts." in name and name.endswith(".weight")]  # fmt: skip
    assert len(experts) == 8  # 4 experts x (dense_h_to_4h, dense_4h_to_h)
    for name, param in experts:
        assert counted_once(param, tp_rank_0=False), name


def test_a_live_model_declares_the_same_as_the_meta_one() -> None:
    """The torch_dist writer reads a rank's live chunks: the same splits as `model_splits`."""
    assert declared_splits(GPTModel(LLAMA, ModelGroups())) == model_splits(LLAMA)
    assert model_splits(GPT2)["language_model.encoder.layers.0.input_layernorm.weight"] == Split()
