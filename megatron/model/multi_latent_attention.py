"""Multi-latent attention (DeepSeek-V2/V3's MLA), as megatron-core computes it.

Queries come through a low-rank latent (`--q-lora-rank`: hidden -> q_lora_rank -> heads), or
straight from the hidden states when it is unset (DeepSeek-V2-Lite). Keys and values share one
latent of `--kv-lora-rank` channels; each head's key is its up-projected `--qk-head-dim`
channels plus `--qk-pos-emb-head-dim` rotary channels shared by all heads, taken from the
down-projection beside the latent (the "decoupled" rotary part); values have `--v-head-dim`
channels. With `--qk-layernorm` the two latents are normalized (megatron-core's q_layernorm and
kv_layernorm). Rotary positions are `--rope-type rope` or `yarn` (MLA's default:
`--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim`; at factor 1 it is plain rope), applied
as megatron-core applies them for MLA: each rotary part's even channels, then its odd ones,
rotated by halves. The softmax scale is mscale(all-dim)^2 / sqrt(qk + pos channels).

Parameter names are megatron-core's (`linear_q_proj` or `linear_q_down_proj` and
`linear_q_up_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`, `linear_proj`, `q_layernorm`,
`kv_layernorm`). Tensor parallelism as megatron-core's local layers: the up-projections split
the heads (column-parallel), the output projection is row-parallel, and the down-projections
are column-parallel with their outputs gathered (every rank needs the whole latent), scattered
back over the sequence under `--sequence-parallel`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from megatron.config import MLAConfig, ModelConfig
from megatron.core.process_groups import ModelGroups
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megatron.core.tensor_parallel.layers import divide
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
    this_ranks_sequence_positions,
)
from megatron.core.tensor_parallel.output_discarding import OutputDiscardingCheckpoint
from megatron.model.attention import CoreAttention, UlyssesAttention
from megatron.model.context_parallel import ContextParallelAttention
from megatron.model.inference_params import InferenceParams
from megatron.model.mlp import linear_kwargs
from megatron.model.utils import (
    build_norm,
    init_method_normal,
    recomputes,
    scaled_init_method_normal,
)
from megatron.yarn_config import YarnConfig, yarn_mscale


def mla_yarn(mla: MLAConfig) -> YarnConfig:
    """Multi-latent attention's YaRN settings (`--rope-type yarn`; its ramp rounded)."""
    return YarnConfig(
        scaling_factor=mla.rotary_scaling_factor,
        original_max_position_embeddings=mla.original_max_position_embeddings,
        beta_fast=mla.beta_fast,
        beta_slow=mla.beta_slow,
        mscale=mla.mscale,
        mscale_all_dim=mla.mscale_all_dim,
    )


class MLARotary(nn.Module):
    """MLA's rotary angles and the factor its cos and sin are scaled by."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla = config.mla
        dim = mla.qk_pos_emb_head_dim
        if mla.rope_type == "yarn":
            yarn = mla_yarn(mla)
            inv_freq = yarn.inverse_frequencies(dim, config.rotary_base)
            self.factor = yarn.attention_factor()
        else:
            inv_freq = 1.0 / config.rotary_base ** (
                torch.arange(0, dim, 2, dtype=torch.float32) / dim
            )
            self.factor = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """Angles [s, 1, 1, dim] for the positions [s]."""
        freqs = torch.outer(positions.to(self.inv_freq.device, torch.float32), self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def rotate(self, tensor: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Rotate [s, b, n, dim]: its even channels then its odd ones, by halves (MLA's order)."""
        tensor = torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)
        first, second = tensor.chunk(2, dim=-1)
        half_turned = torch.cat((-second, first), dim=-1)
        cos = (angles.cos() * self.factor).to(tensor.dtype)
        sin = (angles.sin() * self.factor).to(tensor.dtype)
        return tensor * cos + half_turned * sin


class MultiLatentAttention(nn.Module):
    """[s(/tp), b, h] -> ([s(/tp), b, h], output bias): MLA self-attention, causal."""

    def __init__(self, config: ModelConfig, layer_number: int, groups: ModelGroups) -> None:
        super().__init__()
        mla = config.mla
        self.mla = mla
        self.sequence_parallel = config.sequence_parallel
        self.tensor_parallel_size = groups.tensor.size
        self.heads = divide(config.num_attention_heads, groups.tensor.size, "--num-attention-heads")
        self.q_head_dim = mla.qk_head_dim + mla.qk_pos_emb_head_dim
        self.layer_number = layer_number
        init = init_method_normal(config.init_method_std)
        plain = dict(linear_kwargs(config), bias=False)
        n = config.num_attention_heads
        if mla.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(
                config.hidden_size, n * self.q_head_dim, init, **plain
            )
        else:
            self.linear_q_down_proj = ColumnParallelLinear(
                config.hidden_size, mla.q_lora_rank, init, **plain
            )
            self.linear_q_up_proj = ColumnParallelLinear(
                mla.q_lora_rank, n * self.q_head_dim, init, **plain
            )
        self.linear_kv_down_proj = ColumnParallelLinear(
            config.hidden_size, mla.kv_lora_rank + mla.qk_pos_emb_head_dim, init, **plain
        )
        self.linear_kv_up_proj = ColumnParallelLinear(
            mla.kv_lora_rank, n * (mla.qk_head_dim + mla.v_head_dim), init, **plain
        )
        self.q_layernorm = self.kv_layernorm = None
        if config.qk_layernorm:
            if mla.q_lora_rank is not None:
                self.q_layernorm = build_norm(config, mla.q_lora_rank)
            self.kv_layernorm = build_norm(config, mla.kv_lora_rank)
        self.rotary = MLARotary(config)
        # flash_attn wants one head width for queries, keys and values; SDPA picks a fused
        # kernel that takes MLA's wider queries and keys (flash or memory-efficient).
        core_config = config
        if config.attention_backend == "flash":
            core_config = dataclasses.replace(config, attention_backend="sdpa")
        self.core_attention = CoreAttention(core_config, layer_number)
        # As megatron-core, whatever the rope type (1 unless --rotary-scaling-factor > 1).
        factor = yarn_mscale(mla.rotary_scaling_factor, mla.mscale_all_dim)
        self.core_attention.scale = factor * factor / math.sqrt(self.q_head_dim)
        self.recompute_core = recomputes(config, "core_attn")
        self.recompute_up = recomputes(config, "mla_up_proj")
        # A sequence split across ranks: as standard attention's (its values narrower than its
        # queries and keys: ContextParallelAttention pads them for the ring's kernels).
        self.context_parallel = self.ulysses = None
        if groups.context.size > 1:
            comm_type = config.cp_comm_types[(layer_number - 1) % len(config.cp_comm_types)]
            self.context_parallel = ContextParallelAttention(
                self.core_attention, comm_type, self.recompute_core, groups.context
            )
        if groups.ulysses.size > 1:
            self.ulysses = UlyssesAttention(
                self.core_attention, groups.ulysses.group, self.recompute_core
            )
        self.linear_proj = RowParallelLinear(
            n * mla.v_head_dim,
            config.hidden_size,
            scaled_init_method_normal(config.init_method_std, config.num_layers),
            input_is_parallel=True,
            skip_bias_add=True,
            **linear_kwargs(config),
        )

    def _down(self, layer: ColumnParallelLinear, hidden: torch.Tensor) -> torch.Tensor:
        """A down-projection's whole output [s, b, r] (gathered over the TP ranks)."""
        out, _ = layer(hidden)
        return gather_from_tensor_model_parallel_region(out) if layer.split else out

    def _to_sequence_part(self, latent: torch.Tensor) -> torch.Tensor:
        """[s, b, r] -> this rank's [s / tp, b, r] under sequence parallelism."""
        return scatter_to_sequence_parallel_region(latent) if self.sequence_parallel else latent

    def query_key_value(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple:
        """[s(/tp), b, h] -> query, key [s, b, n/tp, qk + pos] and value [s, b, n/tp, v]."""
        return self.up_projections(*self.latents(hidden), self.rotary.at(positions))

    def latents(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[s(/tp), b, h] -> the query latent (normalized; without one the projected query),
        the key/value latent (normalized) and the shared rotary key [s, b, pos]."""
        mla = self.mla
        if mla.q_lora_rank is None:
            q_in, _ = self.linear_q_proj(hidden)
        else:
            q_in = self._to_sequence_part(self._down(self.linear_q_down_proj, hidden))
            if self.q_layernorm is not None:
                q_in = self.q_layernorm(q_in)
        kv_combined = self._down(self.linear_kv_down_proj, hidden)  # [s, b, kv_lora + pos]
        kv_latent, k_pos = kv_combined.split([mla.kv_lora_rank, mla.qk_pos_emb_head_dim], -1)
        if self.tensor_parallel_size > 1:
            # Every rank's heads read the shared rotary key: its gradient is their sum.
            k_pos = copy_to_tensor_model_parallel_region(k_pos)
        kv_latent = self._to_sequence_part(kv_latent)
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        return q_in, kv_latent, k_pos

    def up_projections(
        self, q_in: torch.Tensor, kv_latent: torch.Tensor, k_pos: torch.Tensor, angles: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`latents` -> query, key, value: the up-projections and the rotary part
        (`--recompute-modules mla_up_proj` recomputes this)."""
        query = self.query_heads(q_in, angles)
        key, value = self.key_value_heads(kv_latent, self.rotary.rotate(k_pos.unsqueeze(2), angles))
        return query, key, value

    def query_heads(self, q_in: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The query latent (or projected query) [s, b, *] -> queries [s, b, n/tp, qk + pos],
        their rotary channels rotated by `angles`."""
        mla = self.mla
        q = q_in if mla.q_lora_rank is None else self.linear_q_up_proj(q_in)[0]
        q = q.view(*q.shape[:2], self.heads, self.q_head_dim)
        q_content, q_pos = q.split([mla.qk_head_dim, mla.qk_pos_emb_head_dim], -1)
        return torch.cat((q_content, self.rotary.rotate(q_pos, angles)), dim=-1)

    def key_value_heads(
        self, kv_latent: torch.Tensor, k_rotated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key/value latent [s, b, r] and the rotated shared key [s, b, 1, pos] -> keys
        [s, b, n/tp, qk + pos] and values [s, b, n/tp, v]."""
        mla = self.mla
        kv, _ = self.linear_kv_up_proj(kv_latent)
        kv = kv.view(*kv.shape[:2], self.heads, mla.qk_head_dim + mla.v_head_dim)
        k_content, value = kv.split([mla.qk_head_dim, mla.v_head_dim], -1)
        k_pos = k_rotated.expand(-1, -1, self.heads, -1)
        return torch.cat((k_content, k_pos), dim=-1), value

    def _cached_query_key_value(
        self, hidden: torch.Tensor, positions: torch.Tensor, cache: InferenceParams
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generation: the new tokens' compressed latent and rotated shared key join the cache
        (what DeepSeek's MLA caches); the queries of the new tokens, the keys and values of
        every cached position, up-projected from it."""
        q_in, kv_latent, k_pos = self.latents(hidden)
        angles = self.rotary.at(positions)
        k_rotated = self.rotary.rotate(k_pos.unsqueeze(2), angles)
        (latent,) = cache.update(
            self.layer_number, torch.cat((kv_latent.unsqueeze(2), k_rotated), dim=-1)
        )
        kv_latent, k_rotated = latent.split([self.mla.kv_lora_rank, k_rotated.size(-1)], -1)
        key, value = self.key_value_heads(kv_latent.squeeze(2), k_rotated)
        return self.query_heads(q_in, angles), key, value

    def _contiguous_up_projections(self, *latents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`up_projections` as tensors of their own storage (the value is a slice of the
        key/value projection otherwise), what a recomputation refills."""
        return tuple(t.contiguous() for t in self.up_projections(*latents))

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_params: InferenceParams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s(/tp), b, h] -> ([s(/tp), b, h], output bias).

        With `inference_params`, `hidden` holds the positions from its `sequence_len_offset`
        on; their compressed latents join the cache."""
        s = hidden.size(0) * (self.tensor_parallel_size if self.sequence_parallel else 1)
        if inference_params is None:
            positions = this_ranks_sequence_positions(s, hidden.device)
        else:
            offset = inference_params.sequence_len_offset
            positions = torch.arange(offset, offset + s, device=hidden.device)
        up = None
        if inference_params is not None:
            query, key, value = self._cached_query_key_value(hidden, positions, inference_params)
        elif self.recompute_up and self.training and torch.is_grad_enabled():
            up = OutputDiscardingCheckpoint()
            latents = (*self.latents(hidden), self.rotary.at(positions))
            query, key, value = up.checkpoint(self._contiguous_up_projections, *latents)
        else:
            query, key, value = self.query_key_value(hidden, positions)
        split = self.context_parallel or self.ulysses
        if split is not None and inference_params is None:
            # [s/C, b, n/tp, d] in, context [s/C, b, n/tp * v] out
            context = split(query, key, value, attention_mask)
            if up is not None:  # the split attention has saved what it needs of them
                up.discard_output_and_register_recompute(context)
            return self.linear_proj(context)
        causal = True
        if inference_params is not None:
            attention_mask = None  # an empty cache: causal attention over the s tokens
            if s == 1:
                causal = False  # one new token sees every cached position
            elif inference_params.sequence_len_offset > 0:
                attention_mask = inference_params.causal_mask(s, hidden.device)
        # [b, n/tp, s, qk + pos] queries and keys, [b, n/tp, s, v] values
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.recompute_core and self.training:
            context = checkpoint(self.core_attention, False, query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask, causal)
        if up is not None:  # the core attention has saved them: free, refill in the backward
            up.discard_output_and_register_recompute(context)
        return self.linear_proj(context)  # context [s, b, n/tp * v]
