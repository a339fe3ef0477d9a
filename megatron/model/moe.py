"""Mixture-of-Experts layers: DeepSpeed-MoE (its gating, capacity, token dropping and
all-to-all) around our MLP class, as Megatron-DeepSpeed builds them.

A layer whose `ModelConfig.moe.experts_per_layer` entry is above 1 gets `build_moe_mlp`'s
`deepspeed.moe.layer.MoE` as its `mlp`, so its parameters carry Megatron-DeepSpeed's names
(`mlp.deepspeed_moe.gate.wg.weight`, `mlp.deepspeed_moe.experts.deepspeed_experts.{e}.
dense_h_to_4h.weight`, with PR-MoE also `mlp.mlp.*` and `mlp.coefficient.*`). The expert
parallel groups are DeepSpeed's, made from our `mpu`: by `deepspeed.initialize` under DeepSpeed's
engine, by `set_up_expert_groups` without it. Each layer's load-balancing loss reaches the
backward through the layer's output (`megatron.model.moe_aux_loss`).

This is one of the few modules that import DeepSpeed.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.tensor_parallel.layers import (
    mark_sequence_parallel,
    set_tensor_model_parallel_attributes,
)
from megatron.model.mlp import ParallelMLP


class ExpertMLP(ParallelMLP):
    """One expert: our MLP, returning its output with the bias added (DeepSpeed's `Experts`
    keep only the first element of a returned tuple, which would drop the bias)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """[tokens, h] -> [tokens, h]."""
        output, bias = super().forward(hidden)
        return output if bias is None else output + bias


def build_moe_mlp(config: ModelConfig, num_experts: int) -> nn.Module:
    """DeepSpeed's MoE layer with `num_experts` of our MLP, set up as `config.moe` says."""
    from deepspeed.moe.layer import MoE

    moe = config.moe
    expert = ExpertMLP(config, tensor_parallel=moe.expert_tensor_parallel)
    layer = MoE(
        config.hidden_size,
        expert,
        num_experts=num_experts,
        # A layer with fewer experts than EP ranks spreads over as many ranks as it has.
        ep_size=min(moe.expert_parallel_size, num_experts),
        k=moe.top_k,
        capacity_factor=moe.train_capacity_factor,
        eval_capacity_factor=moe.eval_capacity_factor,
        min_capacity=moe.min_capacity,
        use_residual=moe.residual,
        drop_tokens=moe.drop_tokens,
        enable_expert_tensor_parallelism=moe.expert_tensor_parallel,
        top2_2nd_expert_sampling=moe.top2_2nd_expert_sampling,
    )
    # DeepSpeed deep-copies `expert` once per expert, and a Parameter's deepcopy keeps neither
    # the split our layers declared on it nor its sequence-parallel gradient hook: declare
    # them again on every copy (else a split expert counts once in the gradient norm).
    declared = dict(expert.named_parameters())
    for copy in layer.deepspeed_moe.experts.deepspeed_experts:
        for name, param in copy.named_parameters():
            _declare_like(declared[name], param)
    return layer


def _declare_like(template: nn.Parameter, param: nn.Parameter) -> None:
    """Give `param` the split and sequence-parallel marks its layer declared on `template`."""
    if getattr(template, "tensor_model_parallel", False):
        set_tensor_model_parallel_attributes(
            param, template.partition_dim, template.partition_stride
        )
    if getattr(template, "sequence_parallel", False):
        mark_sequence_parallel(param)
    if getattr(template, "swiglu_halves", False):
        param.swiglu_halves = True


def set_up_expert_groups(model: nn.Module, mpu: object) -> None:
    """Give `model`'s MoE layers DeepSpeed's expert-parallel groups, built from `mpu`
    (the run's `deepspeed_mpu()`), as `deepspeed.initialize` does, for the engines that
    are not DeepSpeed's; nothing for a dense model.

    DeepSpeed builds the groups from our `mpu` (its pipeline stages are ours) over
    `deepspeed.comm`, which `megatron.initialize` starts for MoE runs. Every rank must call
    this: each group is made by all ranks together.
    """
    layers = [module for module in model.modules() if hasattr(module, "set_deepspeed_parallelism")]
    if not layers:
        return
    import deepspeed
    from deepspeed.utils import groups

    if not deepspeed.comm.is_initialized():
        raise RuntimeError(
            "DeepSpeed-MoE needs deepspeed.comm: call deepspeed.init_distributed() over the "
            "process group first (megatron.initialize does for --num-experts runs)"
        )
    groups.mpu = mpu
    for layer in layers:
        layer.set_deepspeed_parallelism()
