"""The pre-norm transformer: attention and MLP blocks, layers, and the layer stack.

Activations are `[s, b, h]` (sequence first, as Megatron), which lets sequence parallelism
split the first dimension. Module and parameter names are Megatron's, so state dicts load in
Megatron tools: `layers.{i}.input_layernorm`, `.self_attention.query_key_value`,
`.self_attention.dense`, `.post_attention_layernorm`, `.mlp.dense_h_to_4h`,
`.mlp.dense_4h_to_h`, and `final_layernorm` (with `--qk-layernorm` also
`.self_attention.q_layernorm` and `.k_layernorm`, megatron-core's names).

The GPT-2 block (LayerNorm, GeLU, learned positions) and the LLaMA block (RMSNorm, SwiGLU,
grouped-query attention with rotary positions, no linear biases) are options of the same
classes; see `ModelConfig`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.compiler import is_compiling

from megatron.config import ModelConfig
from megatron.core.process_groups import ModelGroups
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    get_cuda_rng_tracker,
)
from megatron.core.tensor_parallel.layers import divide
from megatron.core.tensor_parallel.mappings import this_ranks_sequence_positions
from megatron.core.tensor_parallel.output_discarding import OutputDiscardingCheckpoint
from megatron.model.attention import (
    CoreAttention,
    RotaryEmbedding,
    UlyssesAttention,
    apply_rotary_pos_emb,
)
from megatron.model.context_parallel import ContextParallelAttention
from megatron.model.document_mask import DocumentMask, layer_attention_mask
from megatron.model.fp8 import use_fp8_matmuls
from megatron.model.fused_ops import (
    bias_dropout_add,
    fuse_eagerly,
    fused,
)
from megatron.model.inference_params import InferenceParams
from megatron.model.mlp import ParallelMLP, linear_kwargs
from megatron.model.model_size import runs_in_fp8
from megatron.model.moe import build_moe_mlp
from megatron.model.moe_aux_loss import AuxLossTracker, attach_aux_loss
from megatron.model.moe_layer import RoutedMoE
from megatron.model.multi_latent_attention import MultiLatentAttention
from megatron.model.utils import (
    build_norm,
    checkpointed_pair,
    init_method_normal,
    recomputes,
    run_eagerly_when_compiled,
    scaled_init_method_normal,
    sequence_is_split,
)


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's heads; returns (output, bias).

    `query_key_value` rows are grouped per key/value head, [nkv, nq / nkv + 2, hn]: each
    group's query heads, then its key and its value (Megatron-DeepSpeed's layout; with one
    key/value head per query head it is checkpoint version 3.0's [np, 3, hn]). A column split
    gives each rank whole groups, so TP must divide `--num-key-value-heads`. Its bias
    (`add_bias_linear` or `add_qkv_bias`) is grouped and split alike.

    With `qk_layernorm` each head's queries and keys are normalized over their kv_channels
    before the rotary embedding: `q_layernorm` and `k_layernorm`, one weight shared by all heads,
    whole on every TP rank (each rank's gradient, from its own heads, is summed over the ranks,
    as megatron-core's `finalize_model_grads` does).
    """

    def __init__(self, config: ModelConfig, layer_number: int, groups: ModelGroups) -> None:
        super().__init__()
        world = groups.tensor.size
        self.heads_per_partition = divide(
            config.num_attention_heads, world, "--num-attention-heads"
        )
        self.groups_per_partition = divide(
            config.num_key_value_heads, world, "--num-key-value-heads"
        )
        self.queries_per_group = config.num_attention_heads // config.num_key_value_heads
        self.kv_channels = config.kv_channels
        self.layer_number = layer_number
        self.window = config.layer_window(layer_number)  # the layer sets its `like_layer`'s
        self.recompute_core = recomputes(config, "core_attn")
        if config.torch_compile and self.recompute_core:
            # Eager even inside a compiled layer: the recomputation runs in the backward pass,
            # outside the compiled function, so a compiled first pass would draw other dropout
            # masks than it.
            run_eagerly_when_compiled(self, "_recomputed_core")
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size,
            config.projection_size + 2 * config.kv_projection_size,
            init_method_normal(config.init_method_std),
            **dict(linear_kwargs(config), bias=config.add_bias_linear or config.add_qkv_bias),
        )
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = build_norm(config, config.kv_channels, partial_grads=True)
            self.k_layernorm = build_norm(config, config.kv_channels, partial_grads=True)
        self.core_attention = CoreAttention(config, layer_number, self.heads_per_partition)
        # Context parallelism: this rank holds 2 of 2C chunks; keys and values travel.
        self.context_parallel = None
        if groups.context.size > 1:
            comm_type = config.cp_comm_types[(layer_number - 1) % len(config.cp_comm_types)]
            self.context_parallel = ContextParallelAttention(
                self.core_attention, comm_type, self.recompute_core, groups.context
            )
        # DeepSpeed-Ulysses: this rank holds 1/S of the sequence, the core sees all of it.
        self.ulysses = None
        if groups.ulysses.size > 1:
            self.ulysses = UlyssesAttention(
                self.core_attention, groups.ulysses.group, self.recompute_core
            )
        self.rotary = None
        if config.rotary:
            self.rotary = RotaryEmbedding(
                config.kv_channels, config.rotary_percent, config.rotary_base, config.yarn
            )
        self.dense = RowParallelLinear(
            config.projection_size,
            config.hidden_size,
            scaled_init_method_normal(config.init_method_std, config.num_layers),
            input_is_parallel=True,
            skip_bias_add=True,
            **linear_kwargs(config),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_params: InferenceParams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s(/tp), b, h] -> ([s(/tp), b, h], dense bias).

        With `inference_params`, `hidden` holds the positions from its `sequence_len_offset`
        on; their keys/values join the cache and the queries attend to all cached positions.
        """
        query, key, value = self._query_key_value(hidden)
        if self.rotary is not None:
            angles = self.rotary.at(self._positions(query.size(0), query.device, inference_params))
            factor = self.rotary.factor
            query = apply_rotary_pos_emb(query, angles, factor)
            key = apply_rotary_pos_emb(key, angles, factor)
        if inference_params is not None:
            return self.dense(self._attend_with_cache(query, key, value, inference_params))
        if self.context_parallel is not None:
            return self.dense(self.context_parallel(query, key, value, attention_mask))
        if self.ulysses is not None:
            return self.dense(self.ulysses(query, key, value, attention_mask))
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
        if self.recompute_core and self.training:
            context = self._recomputed_core(query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)  # [s, b, np*hn]
        return self.dense(context)

    @staticmethod
    def _positions(
        s: int, device: torch.device, inference_params: InferenceParams | None
    ) -> torch.Tensor:
        """Global positions [s] of this rank's `s` tokens: after the cached ones in generation,
        this rank's part of the sequence under Ulysses or context parallelism."""
        if inference_params is not None:
            offset = inference_params.sequence_len_offset
            return torch.arange(offset, offset + s, device=device)
        return this_ranks_sequence_positions(s, device)

    def _query_key_value(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[s, b, h] -> query [s, b, np, hn], key and value [s, b, nkv, hn] (this rank's);
        queries and keys normalized per head with `qk_layernorm`."""
        mixed, _ = self.query_key_value(hidden)  # [s, b, nkv * (g + 2) * hn]
        s, b = mixed.shape[:2]
        g = self.queries_per_group
        mixed = mixed.view(s, b, self.groups_per_partition, g + 2, self.kv_channels)
        query, key, value = mixed.split([g, 1, 1], dim=3)
        query = query.reshape(s, b, self.heads_per_partition, self.kv_channels)
        key = key.squeeze(3)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        return query, key, value.squeeze(3)

    def _recomputed_core(self, query, key, value, attention_mask):
        # Never distributed: the query holds this rank's own heads, not a replicated input.
        return checkpoint(self.core_attention, False, query, key, value, attention_mask)

    def _attend_with_cache(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        inference_params: InferenceParams,
    ) -> torch.Tensor:
        """[s, b, np, hn] new q/k/v -> context [s, b, np * hn] over every cached position."""
        s = query.size(0)
        offset = inference_params.sequence_len_offset
        # The cache's keys/values, this step's included: [offset + s, b, np, hn] each.
        key, value = inference_params.update_key_value(self.layer_number, key, value)
        mask, causal = None, True  # an empty cache: plain causal attention over the s tokens
        if self.window is not None:  # the sliding window over the cache: [1, 1, s, offset + s]
            mask = DocumentMask(None, self.window).dense(s, offset + s, query.device, offset)
        elif s == 1:
            causal = False  # one new token sees every cached position
        elif offset > 0:
            mask = inference_params.causal_mask(s, query.device)  # [1, 1, s, offset + s]
        # [b, np, s, hn] queries, [b, np, offset + s, hn] keys and values
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return self.core_attention(query, key, value, mask, causal)


class ParallelTransformerLayer(nn.Module):
    """x + attn(LN(x)), then x + mlp(LN(x)), each branch ending in bias-dropout-add.

    With `torch_compile` the layer's training and evaluation forward runs as one compiled
    function (`compiled_layer_forward`), shared by every layer: the parameters are its inputs,
    so N layers compile once. Generation with a key/value cache stays eager.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_number: int,
        groups: ModelGroups,
        moe_losses: AuxLossTracker,
        like_layer: int | None = None,
    ) -> None:
        """`like_layer`: the decoder layer whose kind (dense, MoE, FP8) this one takes, when
        its own number lies past the decoder's (a multi-token prediction module's layer takes
        the last layer's kind, as megatron-core builds it from the last layer's spec)."""
        super().__init__()
        self.layer_number = layer_number
        kind = like_layer or layer_number
        self.window = config.layer_window(kind)  # its sliding window, or None
        self.moe_losses = moe_losses  # the model's tracker (megatron.model.moe_aux_loss)
        self.hidden_dropout = config.hidden_dropout
        self.sequence_split = sequence_is_split(config, groups)
        self.bias_dropout_fusion = config.bias_dropout_fusion
        self.torch_compile = config.torch_compile
        self.input_layernorm = build_norm(config)
        attention = MultiLatentAttention if config.mla is not None else ParallelAttention
        self.self_attention = attention(config, layer_number, groups)
        self.self_attention.window = self.window  # for generation (a MTP layer's: the last's)
        self.post_attention_layernorm = build_norm(config)
        experts = config.moe.experts_per_layer[kind - 1] if config.moe else 1
        self.is_moe = experts > 1  # DeepSpeed-MoE
        routed = config.routed_moe
        self.is_routed_moe = routed is not None and routed.moe_layers[kind - 1]
        # DeepSpeed's MoE layer (`.mlp.deepspeed_moe...`, Megatron-DeepSpeed's names),
        # Megatron-LM's (`.mlp.router`, `.mlp.experts`) or the dense MLP.
        if self.is_moe:
            self.mlp = build_moe_mlp(config, experts)
        elif self.is_routed_moe:
            self.mlp = RoutedMoE(config, layer_number, groups, moe_losses)
        else:
            self.mlp = ParallelMLP(config)
        self.moe_loss_coeff = config.moe.loss_coeff if self.is_moe else 0.0
        # --recompute-modules beyond core_attn: the norms' outputs (discarded, refilled in
        # the backward), the dense MLP, the whole MoE layer.
        self.recompute_norms = recomputes(config, "layernorm")
        self.recompute_mlp = recomputes(config, "moe" if self.is_routed_moe else "mlp")
        self.recompute_mlp = self.recompute_mlp and not self.is_moe
        if runs_in_fp8(config, kind):
            use_fp8_matmuls(self, config.fp8)

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h]; `inference_params` is the key/value cache."""
        # Sequence-split activations drop out independently on each rank. The fork stays
        # outside the compiled function: a compiled dropout draws its seed from the generator
        # that is current when the function is called.
        rng = (
            get_cuda_rng_tracker().fork()
            if self.sequence_split and self.training
            else contextlib.nullcontext()
        )
        with rng:
            # Inside the whole-model graph (TP=1) the layer is traced as part of it. An MoE
            # layer stays eager: its routing sizes the all-to-all from the data.
            compile_me = self.torch_compile and not (self.is_moe or self.is_routed_moe)
            # (Freeing the norms' outputs resizes storage, which a graph cannot replay.)
            compile_me = compile_me and not self.recompute_norms
            if compile_me and inference_params is None and not is_compiling():
                return compiled_layer_forward()(self, hidden, attention_mask)
            return self.layer_forward(hidden, attention_mask, inference_params)

    def layer_forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """The layer's arithmetic, on the RNG stream the caller chose."""
        residual_add = (
            fused(bias_dropout_add)
            if fuse_eagerly(hidden, self.bias_dropout_fusion)
            else bias_dropout_add
        )
        recompute = self.recompute_norms and self.training and torch.is_grad_enabled()
        first_norm = OutputDiscardingCheckpoint() if recompute else None
        normed = _norm(self.input_layernorm, hidden, first_norm)
        attention = self.self_attention(normed, attention_mask, inference_params)
        attention_out, attention_bias = attention
        if first_norm is not None:
            first_norm.discard_output_and_register_recompute(attention_out)
        hidden = residual_add(
            attention_out, attention_bias, hidden, self.hidden_dropout, self.training
        )
        second_norm = OutputDiscardingCheckpoint() if recompute else None
        normed = _norm(self.post_attention_layernorm, hidden, second_norm)
        if self.is_moe:
            # DeepSpeed's MoE: (output with the experts' biases in it, gate loss, counts). The
            # weighted gate loss reaches the backward through the output (moe_aux_loss.py).
            mlp_out, balancing, _ = self.mlp(normed)
            mlp_out = attach_aux_loss(mlp_out, balancing, self.moe_loss_coeff, self.moe_losses)
            mlp_bias = None
        elif self.recompute_mlp and self.training and torch.is_grad_enabled():
            mlp_out, mlp_bias = checkpointed_pair(self.mlp, normed)
        else:
            mlp_out, mlp_bias = self.mlp(normed)
        if second_norm is not None:
            second_norm.discard_output_and_register_recompute(mlp_out)
        return residual_add(mlp_out, mlp_bias, hidden, self.hidden_dropout, self.training)


def _norm(
    norm: nn.Module, hidden: torch.Tensor, recompute: OutputDiscardingCheckpoint | None
) -> torch.Tensor:
    """`norm(hidden)`, or (`--recompute-modules layernorm`) the same, its output freed once
    the next matmul has saved it and recomputed when the backward gets there."""
    return norm(hidden) if recompute is None else recompute.checkpoint(norm, hidden)


@functools.cache
def compiled_layer_forward():
    """`ParallelTransformerLayer.layer_forward` under `torch.compile`, created on first use."""
    return torch.compile(ParallelTransformerLayer.layer_forward)


def moe_metrics_of(config: ModelConfig) -> tuple[int, bool]:
    """How Megatron-LM's named MoE losses are logged (`AuxLossTracker.forward`): as means over
    the whole model's MoE layers, multi-token prediction's included (megatron-core's count),
    and whether per layer too."""
    routed = config.routed_moe
    if routed is None:
        return 1, False
    layers = sum(routed.moe_layers)
    if config.mtp is not None and routed.moe_layers[-1]:  # MTP layers are like the last
        layers += config.mtp.num_layers
    return layers, routed.per_layer_logging


def recompute_chunks(config: ModelConfig, layers: int) -> list[tuple[int, int, bool]]:
    """Under `--recompute-granularity full`, how a stack of `layers` layers runs: (start,
    stop, recomputed) runs of its layers, each recomputed run one checkpoint (the planner
    counts what each keeps from this too).

    uniform: every group of `--recompute-num-layers` N layers is one recomputed chunk; block:
    each of the first N layers is recomputed on its own and the rest keep their activations
    (as Megatron-LM).
    """
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(start, min(start + n, layers), True) for start in range(0, layers, n)]
    return [(i, i + 1, i < n) for i in range(layers)]


class ParallelTransformer(nn.Module):
    """`num_layers` layers then the final layer norm, with optional full recomputation."""

    def __init__(
        self,
        config: ModelConfig,
        groups: ModelGroups,
        moe_losses: AuxLossTracker,
        layer_numbers: range | None = None,
        post_layer_norm: bool = True,
    ) -> None:
        """`groups`: the model's process groups; `moe_losses`: its MoE loss tracker."""
        super().__init__()
        self.config = config
        self.moe_losses = moe_losses
        numbers = layer_numbers or range(1, config.num_layers + 1)
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(config, n, groups, moe_losses) for n in numbers
        )
        if post_layer_norm:
            self.final_layernorm = build_norm(config)
        self.has_moe = any(layer.is_moe or layer.is_routed_moe for layer in self.layers)
        self.windows = {layer.window for layer in self.layers}
        # DeepSpeed-MoE layers record their raw losses, Megatron-LM's their weighted ones.
        self.moe_loss_coeff = config.moe.loss_coeff if config.moe else 1.0
        self.moe_metrics = moe_metrics_of(config)

    def _layer_masks(self, attention_mask, inference_params) -> dict:
        """Each layer window's mask (`layer_attention_mask`) by window: one or, with
        `--window-attn-skip-freq`, two, made once per forward. Generation applies the window
        itself (`ParallelAttention._attend_with_cache`)."""
        if inference_params is not None:
            return dict.fromkeys(self.windows, attention_mask)
        return {window: layer_attention_mask(attention_mask, window) for window in self.windows}

    def _recomputed_layers(self, hidden, masks):
        config = self.config
        for start, stop, recompute in recompute_chunks(config, len(self.layers)):
            run = _run_layers(self.layers[start:stop], masks)
            if recompute:
                hidden = checkpoint(run, config.distribute_saved_activations, hidden)
            else:
                hidden = run(hidden)
        return hidden

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h], final layer norm applied when present.

        `attention_mask`: None (causal), bool [b|1, 1, s, s] (True = masked), or the document
        ids [b, s] of packed documents (`document_mask.py`); `inference_params` (the key/value
        cache of generation) is passed to every layer.
        """
        # The MoE layers' losses of this forward join the step's 'moe loss' (not those of a
        # recomputation in the backward, which runs outside this scope).
        scope = None
        if self.has_moe:
            scope = self.moe_losses.forward(self.moe_loss_coeff, *self.moe_metrics)
        masks = self._layer_masks(attention_mask, inference_params)
        with scope or contextlib.nullcontext():
            if self.config.recompute_granularity == "full" and self.training:
                hidden = self._recomputed_layers(hidden, masks)
            else:
                for layer in self.layers:
                    hidden = layer(hidden, masks[layer.window], inference_params)
        if hasattr(self, "final_layernorm"):
            hidden = self.final_layernorm(hidden)
        return hidden


def _run_layers(layers: nn.ModuleList, masks: dict):
    """A function running `layers`, each with its window's mask of `masks` (what a
    recomputed chunk replays)."""

    def run(hidden: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            hidden = layer(hidden, masks[layer.window])
        return hidden

    return run
