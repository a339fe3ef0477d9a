"""The routed experts of one MoE layer on this rank: their MLP weights stacked, run over
tokens grouped by expert, with one grouped matmul (`--moe-grouped-gemm`: torch's
`grouped_mm`) or a loop over the experts.

`weight1` is [local experts, h, ffn] ([.., 2 x ffn] with SwiGLU: [gate | up]), `weight2`
[local experts, ffn, h], and `bias1` / `bias2` beside them unless `--disable-bias-linear`.
Every rank draws all E experts' initial weights in expert order and keeps its own, so an
expert starts the same whatever the expert-parallel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core.tensor_parallel.meta_init import initialize, new_parameter
from megatron.core.tensor_parallel.output_discarding import OutputDiscardingCheckpoint
from megatron.model.fused_ops import bias_swiglu
from megatron.model.gated_activation import activation_of
from megatron.model.utils import init_method_normal, recomputes, scaled_init_method_normal


def _zeros(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        nn.init.zeros_(tensor)


class GroupedExperts(nn.Module):
    """tokens [N, h] grouped by local expert, counts [local experts] -> [N, h]."""

    def __init__(self, config: ModelConfig, num_local_experts: int, first_expert: int) -> None:
        super().__init__()
        moe = config.routed_moe
        assert moe is not None
        ffn = moe.ffn_hidden_size or config.ffn_hidden_size
        self.swiglu = config.gated  # [gate | up] halves
        self.gated_activation = activation_of(config)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        self.grouped_gemm = moe.grouped_gemm
        # Its output freed after the second matmul saved it, recomputed in the backward.
        self.recompute_activation = recomputes(config, "moe_act")
        width = ffn * (2 if self.swiglu else 1)
        hidden, dtype = config.hidden_size, config.torch_dtype
        self.weight1 = new_parameter((num_local_experts, hidden, width), dtype)
        self.weight2 = new_parameter((num_local_experts, ffn, hidden), dtype)
        init_in = init_method_normal(config.init_method_std)
        init_out = scaled_init_method_normal(config.init_method_std, config.num_layers)

        def fill(weight1: torch.Tensor, weight2: torch.Tensor) -> None:
            for expert in range(moe.num_experts):  # everyone draws all, in order
                w1, w2 = init_in(torch.empty(width, hidden)), init_out(torch.empty(hidden, ffn))
                local = expert - first_expert
                if 0 <= local < num_local_experts:
                    weight1[local].copy_(w1.t())
                    weight2[local].copy_(w2.t())

        initialize((self.weight1, self.weight2), fill)
        if config.add_bias_linear:
            self.bias1 = new_parameter((num_local_experts, width), dtype)
            self.bias2 = new_parameter((num_local_experts, hidden), dtype)
            initialize((self.bias1, self.bias2), _zeros)
        else:
            self.bias1 = self.bias2 = None
        for param in self.parameters():  # dim 0 counts experts: split over the EP ranks
            param.expert_partition_dim = 0

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """[N, h] tokens, `counts[e]` of them for local expert e in turn -> [N, h]."""
        dtype = _compute_dtype(tokens)
        tokens = tokens.to(dtype)
        intermediate = self._matmul(tokens, self.weight1.to(dtype), counts)  # [N, (2 x) ffn]
        intermediate = _add_bias(intermediate, self.bias1, counts)
        recompute = None
        if self.recompute_activation and self.training and torch.is_grad_enabled():
            recompute = OutputDiscardingCheckpoint()  # --recompute-modules moe_act
            activated = recompute.checkpoint(self._activation, intermediate)
        else:
            activated = self._activation(intermediate)
        output = self._matmul(activated, self.weight2.to(dtype), counts)  # [N, h]
        if recompute is not None:
            recompute.discard_output_and_register_recompute(output)
        return _add_bias(output, self.bias2, counts)

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        """The gated activation or GeLU of the first matmul's output."""
        if self.gated_activation is not None:
            return self.gated_activation(intermediate, None)
        if self.swiglu:
            return bias_swiglu(intermediate, None)
        return F.gelu(intermediate, approximate=self.approximate)

    def _matmul(
        self, tokens: torch.Tensor, weight: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """Each expert's rows times its [in, out] weight."""
        if self.grouped_gemm and _grouped_mm_fits(tokens, weight):
            offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
            product = F.grouped_mm(tokens, weight, offs=offsets)
            if product.requires_grad:
                # grouped_mm's backward needs a dense gradient; a broadcast one (the gradient
                # of a sum) has zero strides.
                product.register_hook(lambda grad: grad.contiguous())
            return product
        parts = tokens.split(counts)
        return torch.cat([part @ weight[e] for e, part in enumerate(parts)])


def _compute_dtype(tokens: torch.Tensor) -> torch.dtype:
    """Autocast's half precision where it is on (grouped_mm is not on its lists), else the
    tokens' own."""
    device = tokens.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tokens.dtype


def _grouped_mm_fits(tokens: torch.Tensor, weight: torch.Tensor) -> bool:
    """`grouped_mm_runs` for [N, in] `tokens` times [experts, in, out] `weight` on their device."""
    capability = torch.cuda.get_device_capability(tokens.device) if tokens.is_cuda else None
    return grouped_mm_runs(
        tokens.device.type, tokens.dtype, capability, tokens.shape[-1], weight.shape[-1]
    )


def grouped_mm_runs(
    device_type: str,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    in_features: int,
    out_features: int,
) -> bool:
    """Whether `--moe-grouped-gemm` runs torch's grouped matmul for [N, in_features] tokens of
    `dtype` times [experts, in_features, out_features] weights on a `device_type` device of
    compute `capability` (major, minor; None off CUDA), else the loop over the experts.

    torch's grouped matmul needs rows of 16-byte multiples, and on CUDA GPUs bf16 on sm_90
    (Hopper) or later. The planner asks this too (megatron/planning/routed_moe.py).
    """
    if not hasattr(F, "grouped_mm"):
        return False
    if device_type == "cuda" and not (dtype == torch.bfloat16 and capability[0] >= 9):
        return False
    size = dtype.itemsize
    return all(dim * size % 16 == 0 for dim in (in_features, out_features))


def grouped_gemm_fallback_note(
    config: ModelConfig,
    dtype: torch.dtype,
    device_type: str,
    capability: tuple[int, int] | None,
) -> str | None:
    """The start-up note of a run asking `--moe-grouped-gemm` whose experts' matmuls will
    not run torch's grouped matmul (`grouped_mm_runs`) at the compute `dtype` on this device,
    but the loop over the experts; None when they all run it, or when none was asked for."""
    moe = config.routed_moe
    if moe is None or not moe.grouped_gemm:
        return None
    ffn = moe.ffn_hidden_size or config.ffn_hidden_size
    width = ffn * (2 if config.gated else 1)
    shapes = ((config.hidden_size, width), (ffn, config.hidden_size))
    looping = [
        f"[{rows} x {cols}]"
        for rows, cols in shapes
        if not grouped_mm_runs(device_type, dtype, capability, rows, cols)
    ]
    if not looping:
        return None
    dtype_name = str(dtype).removeprefix("torch.")
    where = f"{dtype_name} on {device_type}" + (
        f" sm_{capability[0]}{capability[1]}" if capability else ""
    )
    return (
        f" > note: --moe-grouped-gemm: the experts' {' and '.join(looping)} matmuls loop over "
        f"the experts here ({where}): torch's grouped matmul needs rows of 16-byte multiples, "
        "and on GPUs bf16 on sm_90 (Hopper) or later"
    )


def _add_bias(tensor: torch.Tensor, bias: torch.Tensor | None, counts: list[int]) -> torch.Tensor:
    """Each row plus its expert's bias."""
    if bias is None:
        return tensor
    per_row = bias.to(tensor.dtype).repeat_interleave(
        torch.tensor(counts, device=tensor.device), dim=0, output_size=tensor.shape[0]
    )
    return tensor + per_row
