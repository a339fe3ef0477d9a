"""Multi-token prediction (DeepSeek-V3's MTP, megatron-core's `MultiTokenPredictionBlock`).

After the decoder (and its final norm), module k of D (`--mtp-num-layers`) takes the hidden
states of module k - 1 (the decoder's for k = 1) and the embeddings of the tokens shifted k
places left, and predicts the token k + 1 places ahead:

    h'_k = eh_proj([enorm(embed(ids << k)); hnorm(h_{k-1})])    # [s, b, 2h] -> [s, b, h]
    h_k  = final_layernorm(transformer_layer(h'_k))
    loss_k = cross-entropy(output_layer(h_k), labels << k)      # the model's output layer

`<< k` shifts along the sequence, zero-filling the last k positions, whose losses are masked
out (the loss mask shifted alike). The model's training loss is unchanged in value (the
per-token losses are the next token's); `MTPLossAutoScaler`-style, each module's mean loss
times `--mtp-loss-scaling-factor` / D reaches the backward through those losses
(`moe_aux_loss.MoEAuxLossAutoScaler`, with the main loss's backward scale), and its value is
logged as 'mtp_k loss' (megatron-core's names). Parameter names are megatron-core's
(`mtp.layers.{k-1}.enorm.weight`, `.hnorm`, `.eh_proj`, `.transformer_layer.*`,
`.final_layernorm`); the transformer layer is numbered after the decoder's (`num_layers + k`)
and is of the last decoder layer's kind (dense or MoE), as megatron-core builds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.process_groups import ModelGroups
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.model.document_mask import layer_attention_mask
from megatron.model.moe_aux_loss import AuxLossTracker, MoEAuxLossAutoScaler
from megatron.model.transformer import ParallelTransformerLayer, moe_metrics_of
from megatron.model.utils import build_norm, init_method_normal

Embed = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""The model's embedding: ([b, s] ids, [b|1, s] positions) -> [s(/tp), b, h]."""
Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""The model's output layer and loss: ([s(/tp), b, h] hidden, [b, s] labels) -> [b, s]."""


def mtp_loss_name(depth: int) -> str:
    """The logged name of module `depth`'s loss (from 1), megatron-core's."""
    return f"mtp_{depth} loss"


def shift_left(tensor: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s]: each row one place left, the last position zero (megatron-core's
    `roll_tensor` at CP = 1)."""
    shifted = torch.roll(tensor, shifts=-1, dims=-1)
    shifted[..., -1] = 0
    return shifted


class MultiTokenPredictionLayer(nn.Module):
    """One prediction module: two norms, the projection of their concatenation, one
    transformer layer and a final norm."""

    def __init__(
        self, config: ModelConfig, depth: int, groups: ModelGroups, moe_losses: AuxLossTracker
    ) -> None:
        """Module `depth` (from 1) of `config.mtp.num_layers`."""
        super().__init__()
        self.sequence_parallel = config.sequence_parallel and groups.tensor.size > 1
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        # Column-parallel, gathered: megatron-core's eh_proj (gather_output=False, then
        # gather_from_tensor_model_parallel_region, whose backward splits the gradient).
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size,
            config.hidden_size,
            init_method_normal(config.init_method_std),
            bias=False,
            sequence_parallel=config.sequence_parallel,
            use_cpu_initialization=config.use_cpu_initialization,
            params_dtype=config.torch_dtype,
        )
        self.transformer_layer = ParallelTransformerLayer(
            config,
            config.num_layers + depth,
            groups,
            moe_losses,
            like_layer=config.num_layers,
        )
        self.final_layernorm = build_norm(config)

    def forward(
        self,
        hidden: torch.Tensor,
        embeddings: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Module k - 1's hidden states and the embeddings of the tokens k places ahead, both
        [s(/tp), b, h] -> module k's normalized hidden states [s(/tp), b, h]."""
        joined = torch.cat((self.enorm(embeddings), self.hnorm(hidden)), dim=-1)
        projected, _ = self.eh_proj(joined)  # [s, b, h / tp]
        projected = gather_from_tensor_model_parallel_region(projected)  # [s, b, h]
        if self.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected)
        return self.final_layernorm(self.transformer_layer(projected, attention_mask))


class MultiTokenPredictionBlock(nn.Module):
    """The D prediction modules of the last pipeline stage (`mtp.layers`)."""

    def __init__(
        self, config: ModelConfig, groups: ModelGroups, moe_losses: AuxLossTracker
    ) -> None:
        super().__init__()
        self.config = config
        self.moe_losses = moe_losses
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, depth, groups, moe_losses)
            for depth in range(1, config.mtp.num_layers + 1)
        )
        self.has_moe = any(
            layer.transformer_layer.is_moe or layer.transformer_layer.is_routed_moe
            for layer in self.layers
        )

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        embed: Embed,
        head: Head,
    ) -> list[torch.Tensor]:
        """The decoder's final hidden states [s(/tp), b, h], its [b, s] ids, positions,
        labels and loss mask (None: every position counts) -> each module's weighted loss,
        a scalar to add to the training loss (`attach_mtp_losses`); while training, each
        module's mean loss is also recorded for the log line as 'mtp_k loss'."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None]
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float32)
        loss_mask = loss_mask.float()
        # Its layers are the last decoder layer's kind, window included.
        window = self.config.layer_window(self.config.num_layers)
        attention_mask = layer_attention_mask(attention_mask, window)
        mtp = self.config.mtp
        weight = mtp.loss_scaling_factor / mtp.num_layers
        weighted = []
        scope = contextlib.nullcontext()
        if self.has_moe:
            scope = self.moe_losses.forward(1.0, *moe_metrics_of(self.config))
        with scope:
            for depth, layer in enumerate(self.layers, start=1):
                input_ids, position_ids = shift_left(input_ids), shift_left(position_ids)
                labels, loss_mask = shift_left(labels), shift_left(loss_mask)
                hidden = layer(hidden, embed(input_ids, position_ids), attention_mask)
                losses = head(hidden, labels)  # [b, s]
                total = (losses.float() * loss_mask).sum()
                mean = total / loss_mask.sum().clamp(min=1)
                if self.training:
                    self.moe_losses.record_loss(mtp_loss_name(depth), mean)
                # Per-token loss: the sum, over the micro-batch's positions, which the step's
                # backward scale multiplies back (`token_loss.aux_loss_factor`).
                weighted.append(weight * (total / labels.numel() if mtp.per_token_loss else mean))
        return weighted


def attach_mtp_losses(
    losses: torch.Tensor, weighted: list[torch.Tensor], tracker: AuxLossTracker
) -> torch.Tensor:
    """The model's per-token `losses`, unchanged, carrying the modules' `weighted` losses into
    the backward with the main loss's gradient (`tracker.backward_scale`, as the MoE losses)."""
    for loss in weighted:
        losses = MoEAuxLossAutoScaler.apply(losses, loss, tracker)
    return losses
