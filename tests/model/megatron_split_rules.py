"""Megatron's tensor-parallel split of each GPTModel parameter, stated by name: the test
oracle the layers' own declarations (`megatron.model.sharding`) are checked against
(tests/model/test_sharding.py). The code reads the declarations, never these names.
"""

from __future__ import annotations

import torch

from megatron.checkpointing.pipeline_stages import HEAD_WEIGHT
from megatron.checkpointing.shapes import OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS

VOCAB_PARALLEL = (WORD_EMBEDDINGS, HEAD_WEIGHT, OUTPUT_LAYER)
COLUMN_PARALLEL = (
    ".self_attention.query_key_value.weight",
    ".self_attention.query_key_value.bias",
    ".dense_h_to_4h.weight",
    ".dense_h_to_4h.bias",
)
ROW_PARALLEL = (".self_attention.dense.weight", ".dense_4h_to_h.weight")
REPLICATED = (
    "layernorm.weight",
    "layernorm.bias",
    POSITION_EMBEDDINGS,
    ".self_attention.dense.bias",
    ".dense_4h_to_h.bias",
    ".mlp.deepspeed_moe.gate.wg.weight",
    ".mlp.coefficient.weight",
    ".mlp.coefficient.bias",
    # Megatron-LM's MoE (TP 1 here): the router (and its expert-bias buffers) and the
    # stacked experts.
    ".mlp.router.weight",
    ".mlp.router.expert_bias",
    ".mlp.router.local_tokens_per_expert",
    ".mlp.experts.weight1",
    ".mlp.experts.weight2",
    ".mlp.experts.bias1",
    ".mlp.experts.bias2",
)
ROUTED_EXPERTS = (
    ".mlp.experts.weight1",
    ".mlp.experts.weight2",
    ".mlp.experts.bias1",
    ".mlp.experts.bias2",
)
"""Megatron-LM's stacked experts: dim 0 counts this rank's experts, a slice of all of them
under expert parallelism (`megatron.model.moe_experts`)."""
EXPERT_MLPS = (".mlp.deepspeed_moe.experts.deepspeed_experts.", ".mlp.mlp.")
"""The MLPs of an MoE layer (its experts; PR-MoE's dense MLP), split over tensor-parallel
ranks only with `--enable-expert-tensor-parallelism`."""


def partition_dim(name: str, expert_tensor_parallel: bool = False) -> int | None:
    """The dimension tensor parallelism splits parameter `name` along; None if replicated.

    `expert_tensor_parallel`: the model splits its MoE experts too (`EXPERT_MLPS`).
    """
    if not expert_tensor_parallel and any(part in name for part in EXPERT_MLPS):
        return None
    if name in VOCAB_PARALLEL or name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    if name.endswith(REPLICATED):
        return None
    raise KeyError(f"no tensor-parallel rule for parameter {name!r}")


def swiglu_tensors(state: dict[str, torch.Tensor]) -> set[str]:
    """The `dense_h_to_4h` weights and biases of `state` (whole or one rank's) that are SwiGLU's.

    SwiGLU's `dense_h_to_4h` has twice as many rows as `dense_4h_to_h` has columns (gate and
    up); a GeLU MLP's are equal. MoE experts are MLPs too.
    """
    found = set()
    for name, tensor in state.items():
        if name.endswith(".dense_h_to_4h.weight"):
            prefix = name.removesuffix("dense_h_to_4h.weight")
            down = state.get(prefix + "dense_4h_to_h.weight")
            if down is not None and tensor.size(0) == 2 * down.size(1):
                found.update((name, prefix + "dense_h_to_4h.bias"))
    return found
