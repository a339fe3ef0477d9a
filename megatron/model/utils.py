"""Weight initialisers and the normalization layers shared by the model's layers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core.process_groups import ModelGroups
from megatron.core.tensor_parallel import checkpoint, mark_sequence_parallel
from megatron.core.tensor_parallel.meta_init import initialize, new_parameter, parameter_device


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
    """LayerNorm over `width` (default h); with `partial_grads` (default: under sequence
    parallelism) its gradients are summed over TP ranks. With `apply_layernorm_1p` the weight is
    zero-centred: the norm scales by 1 + weight."""

    def __init__(
        self, config: ModelConfig, width: int | None = None, partial_grads: bool | None = None
    ) -> None:
        width = config.hidden_size if width is None else width
        super().__init__(
            width, eps=config.layernorm_epsilon, dtype=config.torch_dtype, device=parameter_device()
        )
        self.zero_centred = config.apply_layernorm_1p
        initialize((self.weight, self.bias), _norm_start(self.zero_centred))
        if config.sequence_parallel if partial_grads is None else partial_grads:
            mark_sequence_parallel(self.weight)
            mark_sequence_parallel(self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., h]."""
        weight = self.weight + 1 if self.zero_centred else self.weight
        return F.layer_norm(hidden, self.normalized_shape, weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over `width` (default h), computed in fp32 (`--normalization
    rmsnorm`, LLaMA's).

    One parameter, `weight` (Megatron-DeepSpeed's name); with `partial_grads` (default: under
    sequence parallelism) its gradient is summed over TP ranks, as the layer norm's.
    """

    def __init__(
        self, config: ModelConfig, width: int | None = None, partial_grads: bool | None = None
    ) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon
        width = config.hidden_size if width is None else width
        # Zero-centred (`apply_layernorm_1p`): the weight starts at 0 and scales by 1 + weight.
        self.zero_centred = config.apply_layernorm_1p
        self.weight = new_parameter((width,), config.torch_dtype)
        initialize(self.weight, _norm_start(self.zero_centred))
        if config.sequence_parallel if partial_grads is None else partial_grads:
            mark_sequence_parallel(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., h] in the input's dtype."""
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight + 1 if self.zero_centred else self.weight
        return x.to(hidden.dtype) * weight


def _norm_start(zero_centred: bool) -> Callable[..., None]:
    """A norm's initial weight (1, or 0 when zero-centred: it scales by 1 + weight) and bias
    (0)."""

    def fill(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        (nn.init.zeros_ if zero_centred else nn.init.ones_)(weight)
        if bias is not None:
            nn.init.zeros_(bias)

    return fill


def run_eagerly_when_compiled(module: nn.Module, method: str) -> None:
    """`module.method` runs eagerly inside a torch.compile'd caller (graph breaks around it).

    Applied per instance when the model is built, not as a decorator at import: decorating
    imports torch's compiler (torch._dynamo), seconds of start-up in every process, which a
    run that never compiles does not need.
    """
    setattr(module, method, torch.compiler.disable(getattr(module, method)))


def sequence_is_split(config: ModelConfig, groups: ModelGroups) -> bool:
    """Whether each rank holds its own part of the sequence (Megatron's sequence parallelism,
    DeepSpeed-Ulysses or context parallelism): its hidden dropout then draws from the per-rank
    model-parallel stream."""
    return config.sequence_parallel or groups.sequence_split_size > 1


def build_norm(
    config: ModelConfig, width: int | None = None, partial_grads: bool | None = None
) -> nn.Module:
    """The layer norm `config.normalization` names: `LayerNorm` or `RMSNorm`, over `width`
    (default h); `partial_grads`: each TP rank's gradient is a part, summed over the ranks
    (default: under sequence parallelism)."""
    norm = RMSNorm if config.normalization == "rmsnorm" else LayerNorm
    return norm(config, width, partial_grads)


def recomputes(config: ModelConfig, module: str) -> bool:
    """Whether selective recomputation recomputes `module` of each layer
    (`--recompute-granularity selective --recompute-modules ...`; core_attn by default)."""
    return config.recompute_granularity == "selective" and module in config.recompute_modules


def checkpointed_pair(
    module: nn.Module, hidden: torch.Tensor, distribute: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`module(hidden)` -> (output, bias or None) recomputed in the backward (a dense MLP,
    the shared expert, a whole MoE layer: `--recompute-modules mlp / shared_experts / moe`)."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output, bias = module(x)
        return (output,) if bias is None else (output, bias)

    outputs = checkpoint(run, distribute, hidden)
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    return outputs[0], (outputs[1] if len(outputs) > 1 else None)
