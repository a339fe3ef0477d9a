"""Weight initialisers and small tensor helpers shared by the model's layers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.tensor_parallel import mark_sequence_parallel


def init_method_normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Initialiser drawing N(0, std^2) (Megatron's default for every weight)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(
    std: float, num_layers: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (std / sqrt(2 L))^2) for the layers that write into the residual stream."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


class LayerNorm(nn.LayerNorm):
    """LayerNorm over h; under sequence parallelism its gradients are summed over TP ranks."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon, dtype=config.torch_dtype)
        if config.sequence_parallel:
            mark_sequence_parallel(self.weight)
            mark_sequence_parallel(self.bias)
