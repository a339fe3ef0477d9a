"""The transformer block's MLP: h -> ffn -> GeLU or a gated activation (SwiGLU, quick-GeGLU)
-> h, split over tensor-parallel ranks.

Also the expert of DeepSpeed-MoE layers (`megatron.model.moe`), whole on every TP rank unless
experts are tensor-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.model.fused_ops import bias_gelu, bias_swiglu, fuse_eagerly, fused
from megatron.model.gated_activation import activation_of
from megatron.model.utils import init_method_normal, scaled_init_method_normal


def linear_kwargs(config: ModelConfig) -> dict:
    """The keyword arguments every linear layer of a block takes from the config."""
    return dict(
        bias=config.add_bias_linear,
        sequence_parallel=config.sequence_parallel,
        use_cpu_initialization=config.use_cpu_initialization,
        params_dtype=config.torch_dtype,
    )


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU or SwiGLU -> h (row-parallel); (output, bias).

    With `--swiglu` `dense_h_to_4h` is twice as wide and each TP rank's output is
    [gate | up] of its ffn / tp channels (Megatron-DeepSpeed's layout, so its checkpoints
    load): the TP=1 weight is [gate; up], and a rank's shard is [gate_r; up_r].
    """

    def __init__(self, config: ModelConfig, tensor_parallel: bool = True) -> None:
        super().__init__()
        # An MoE expert without expert tensor parallelism is whole on every TP rank.
        kwargs = linear_kwargs(config)
        if not tensor_parallel:
            kwargs.update(sequence_parallel=False, tensor_parallel=False)
        self.swiglu = config.gated  # [gate | up] halves, as SwiGLU's
        self.activation = activation_of(config)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        self.bias_gelu_fusion = config.bias_gelu_fusion
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size * (2 if self.swiglu else 1),
            init_method_normal(config.init_method_std),
            skip_bias_add=True,
            # Stride 2: rank r holds blocks r and tp + r of the full [gate; up], its gate and up.
            stride=2 if self.swiglu else 1,
            **kwargs,
        )
        if self.swiglu:  # its rows are [gate; up] (a rank's: [gate_r; up_r]), split or whole
            for param in self.dense_h_to_4h.parameters():
                param.swiglu_halves = True
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            scaled_init_method_normal(config.init_method_std, config.num_layers),
            input_is_parallel=True,
            skip_bias_add=True,
            **kwargs,
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, h] -> ([s, b, h], bias to add after dropout's input)."""
        intermediate, bias = self.dense_h_to_4h(hidden)  # [s, b, (2 x) ffn / tp]
        fuse = fuse_eagerly(hidden, self.bias_gelu_fusion)
        if self.activation is not None:
            activated = self.activation(intermediate, bias)
        elif self.swiglu:
            activated = (fused(bias_swiglu) if fuse else bias_swiglu)(intermediate, bias)
        else:
            activated = (fused(bias_gelu) if fuse else bias_gelu)(
                intermediate, bias, self.approximate
            )
        return self.dense_4h_to_h(activated)
