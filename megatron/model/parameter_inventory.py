"""Every parameter of the GPT a `ModelConfig` describes: its name, its whole shape, and which
parallel dimension splits it. The one inventory the parameter counts and FLOPs
(`model_size.py`), the checkpoint shape checks (`checkpointing/shapes.py`) and the planner's
per-rank tensors read, so a new layer option is described once.

Names are Megatron's `GPTModel` state-dict keys (an MoE layer's experts under their global
numbers, DeepSpeed-MoE's names); shapes are TP = 1 shapes. `tensor_split` is the dimension
tensor parallelism splits (0: column-parallel weights and biases and the vocabulary, 1:
row-parallel weights), None where every tensor-parallel rank holds it whole (norms,
row-parallel biases, the MoE gate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.config import ModelConfig

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "language_model.embedding.position_embeddings.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"
"""The untied output layer (`--untie-embeddings-and-output-weights`), vocab-parallel."""
LAYER_PREFIX = "language_model.encoder.layers."
MTP_PREFIX = "mtp.layers."
"""Multi-token prediction's modules (`--mtp-num-layers`), megatron-core's names."""


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter tensor of the model."""

    name: str
    """Within a layer (`layer_parameters`): relative to the layer, e.g. `mlp.dense_4h_to_h.bias`."""
    shape: tuple[int, ...]
    tensor_split: int | None
    expert: int | None = None
    """The global expert number of an MoE expert's tensor (spread over expert-parallel ranks)."""
    expert_split: int | None = None
    """The dimension split over expert-parallel ranks: Megatron-LM's MoE stacks a layer's
    experts in one tensor (dimension 0, the global expert number)."""

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        count = 1
        for size in self.shape:
            count *= size
        return count

    def numel_per_rank(self, tp: int) -> int:
        """Elements one of `tp` tensor-parallel ranks holds (a padded shard rounds up)."""
        if self.tensor_split is None or tp == 1:
            return self.numel
        shape = list(self.shape)
        shape[self.tensor_split] = -(-shape[self.tensor_split] // tp)
        count = 1
        for size in shape:
            count *= size
        return count


def _norm(name: str, config: ModelConfig, width: int | None = None) -> list[ParameterSpec]:
    h = config.hidden_size if width is None else width
    specs = [ParameterSpec(f"{name}.weight", (h,), None)]
    if config.normalization == "layernorm":
        specs.append(ParameterSpec(f"{name}.bias", (h,), None))
    return specs


def mlp_parameters(
    config: ModelConfig, prefix: str = "mlp.", expert: int | None = None
) -> list[ParameterSpec]:
    """One MLP under `prefix` (the dense `mlp.`, an expert's, PR-MoE's `mlp.mlp.`): with SwiGLU
    `dense_h_to_4h` holds the gate rows, then the up rows ([2 ffn, h])."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    h_to_4h = 2 * ffn if config.gated else ffn
    specs = [
        ParameterSpec(f"{prefix}dense_h_to_4h.weight", (h_to_4h, h), 0, expert),
        ParameterSpec(f"{prefix}dense_4h_to_h.weight", (h, ffn), 1, expert),
    ]
    if config.add_bias_linear:
        specs.insert(1, ParameterSpec(f"{prefix}dense_h_to_4h.bias", (h_to_4h,), 0, expert))
        specs.append(ParameterSpec(f"{prefix}dense_4h_to_h.bias", (h,), None, expert))
    return specs


def layer_parameters(config: ModelConfig, experts: int = 1) -> list[ParameterSpec]:
    """One transformer layer with `experts` experts (1: a dense MLP), names relative to it.

    QKV rows are grouped per key/value head ([nkv, nq/nkv + 2, hn]); the QK norms
    (`qk_layernorm`) are [hn], whole on every tensor-parallel rank.
    """
    h = config.hidden_size
    specs = _norm("input_layernorm", config)
    if config.mla is not None:
        specs += mla_parameters(config)
        specs += _norm("post_attention_layernorm", config)
        return specs + _mlp_or_experts(config, experts)
    qkv = config.projection_size + 2 * config.kv_projection_size
    specs.append(ParameterSpec("self_attention.query_key_value.weight", (qkv, h), 0))
    if config.add_bias_linear or config.add_qkv_bias:
        specs.append(ParameterSpec("self_attention.query_key_value.bias", (qkv,), 0))
    if config.qk_layernorm:
        specs += _norm("self_attention.q_layernorm", config, config.kv_channels)
        specs += _norm("self_attention.k_layernorm", config, config.kv_channels)
    if config.softmax_type == "learnable":  # attention sinks: a logit per head
        heads = (config.num_attention_heads,)
        specs.append(ParameterSpec("self_attention.core_attention.softmax_offset", heads, 0))
    specs.append(ParameterSpec("self_attention.dense.weight", (h, config.projection_size), 1))
    if config.add_bias_linear:
        specs.append(ParameterSpec("self_attention.dense.bias", (h,), None))
    specs += _norm("post_attention_layernorm", config)
    return specs + _mlp_or_experts(config, experts)


def mla_parameters(config: ModelConfig) -> list[ParameterSpec]:
    """Multi-latent attention's (megatron/model/multi_latent_attention.py): the projections
    split over tensor-parallel ranks by rows, the output projection by columns."""
    mla, h, n = config.mla, config.hidden_size, config.num_attention_heads
    q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    prefix = "self_attention."
    if mla.q_lora_rank is None:
        specs = [ParameterSpec(f"{prefix}linear_q_proj.weight", (n * q_head, h), 0)]
    else:
        specs = [
            ParameterSpec(f"{prefix}linear_q_down_proj.weight", (mla.q_lora_rank, h), 0),
            ParameterSpec(f"{prefix}linear_q_up_proj.weight", (n * q_head, mla.q_lora_rank), 0),
        ]
    down = mla.kv_lora_rank + mla.qk_pos_emb_head_dim
    up = n * (mla.qk_head_dim + mla.v_head_dim)
    specs += [
        ParameterSpec(f"{prefix}linear_kv_down_proj.weight", (down, h), 0),
        ParameterSpec(f"{prefix}linear_kv_up_proj.weight", (up, mla.kv_lora_rank), 0),
    ]
    if config.qk_layernorm:
        if mla.q_lora_rank is not None:
            specs += _norm(f"{prefix}q_layernorm", config, mla.q_lora_rank)
        specs += _norm(f"{prefix}kv_layernorm", config, mla.kv_lora_rank)
    specs.append(ParameterSpec(f"{prefix}linear_proj.weight", (h, n * mla.v_head_dim), 1))
    if config.add_bias_linear:
        specs.append(ParameterSpec(f"{prefix}linear_proj.bias", (h,), None))
    return specs


def _mlp_or_experts(config: ModelConfig, experts: int) -> list[ParameterSpec]:
    """A layer's MLP: dense, Megatron-LM's routed MoE or DeepSpeed-MoE's experts."""
    h = config.hidden_size
    if experts == 1:
        return mlp_parameters(config)
    if config.routed_moe is not None:
        return routed_moe_parameters(config)
    specs = []
    specs.append(ParameterSpec("mlp.deepspeed_moe.gate.wg.weight", (experts, h), None))
    for number in range(experts):
        prefix = f"mlp.deepspeed_moe.experts.deepspeed_experts.{number}."
        specs += mlp_parameters(config, prefix, expert=number)
    if config.moe.residual:  # PR-MoE: the dense MLP and the coefficient mixing the two
        specs += mlp_parameters(config, "mlp.mlp.")
        specs.append(ParameterSpec("mlp.coefficient.weight", (2, h), None))
        specs.append(ParameterSpec("mlp.coefficient.bias", (2,), None))
    return specs


def routed_moe_parameters(config: ModelConfig) -> list[ParameterSpec]:
    """A Megatron-LM MoE layer's MLP (`megatron.model.moe_layer`): the router, the stacked
    experts (weights [E, in, out], biases [E, out]), the shared expert (and its gate)."""
    moe = config.routed_moe
    h, experts = config.hidden_size, moe.num_experts
    ffn = moe.ffn_hidden_size or config.ffn_hidden_size
    width = 2 * ffn if config.gated else ffn
    specs = [
        ParameterSpec("mlp.router.weight", (experts, h), None),
        ParameterSpec("mlp.experts.weight1", (experts, h, width), None, expert_split=0),
        ParameterSpec("mlp.experts.weight2", (experts, ffn, h), None, expert_split=0),
    ]
    if config.add_bias_linear:  # the router's (megatron-core's), then the experts'
        specs.insert(1, ParameterSpec("mlp.router.bias", (experts,), None))
        specs.append(ParameterSpec("mlp.experts.bias1", (experts, width), None, expert_split=0))
        specs.append(ParameterSpec("mlp.experts.bias2", (experts, h), None, expert_split=0))
    if moe.shared_expert_ffn_hidden_size:
        shared = dataclasses.replace(config, ffn_hidden_size=moe.shared_expert_ffn_hidden_size)
        if moe.shared_expert_gate:  # the module's own parameter: before its linear layers'
            specs.append(ParameterSpec("mlp.shared_experts.gate_weight", (1, h), None))
        specs += mlp_parameters(shared, "mlp.shared_experts.")
    return specs


def experts_per_layer(config: ModelConfig) -> tuple[int, ...]:
    """Experts of each layer (1 for a dense layer)."""
    if config.routed_moe is not None:
        moe = config.routed_moe
        return tuple(moe.num_experts if on else 1 for on in moe.moe_layers)
    return config.moe.experts_per_layer if config.moe else (1,) * config.num_layers


def embedding_parameters(config: ModelConfig, vocab_rows: int | None = None) -> list[ParameterSpec]:
    """The word embeddings (`vocab_rows`, default the padded vocabulary) and, with learned
    absolute positions, the position table (whole on every tensor-parallel rank)."""
    h = config.hidden_size
    rows = config.vocab_size if vocab_rows is None else vocab_rows
    specs = [ParameterSpec(WORD_EMBEDDINGS, (rows, h), 0)]
    if config.position_embedding_type == "learned_absolute":
        specs.append(ParameterSpec(POSITION_EMBEDDINGS, (config.max_position_embeddings, h), None))
    return specs


def head_parameters(config: ModelConfig, vocab_rows: int | None = None) -> list[ParameterSpec]:
    """The final norm and, untied, the output layer."""
    specs = _norm("language_model.encoder.final_layernorm", config)
    if config.untie_embeddings_and_output_weights:
        rows = config.vocab_size if vocab_rows is None else vocab_rows
        specs.append(ParameterSpec(OUTPUT_LAYER, (rows, config.hidden_size), 0))
    return specs


def mtp_parameters(config: ModelConfig) -> list[ParameterSpec]:
    """Multi-token prediction's modules (megatron/model/multi_token_prediction.py), full
    names: two norms, the column-parallel projection [h, 2h], a transformer layer of the last
    layer's kind, the final norm; none without `config.mtp`."""
    if config.mtp is None:
        return []
    h, experts = config.hidden_size, experts_per_layer(config)[-1]
    specs = []
    for index in range(config.mtp.num_layers):
        prefix = f"{MTP_PREFIX}{index}."
        module = _norm("enorm", config) + _norm("hnorm", config)
        module.append(ParameterSpec("eh_proj.weight", (h, 2 * h), 0))
        module += [
            dataclasses.replace(spec, name=f"transformer_layer.{spec.name}")
            for spec in layer_parameters(config, experts)
        ]
        module += _norm("final_layernorm", config)
        specs += [dataclasses.replace(spec, name=prefix + spec.name) for spec in module]
    return specs


def parameter_inventory(config: ModelConfig, vocab_rows: int | None = None) -> list[ParameterSpec]:
    """Every parameter of the whole model under its full name, in state-dict order; a tied
    output layer is the word embedding (listed once)."""
    specs = embedding_parameters(config, vocab_rows)
    for number, experts in enumerate(experts_per_layer(config)):
        for spec in layer_parameters(config, experts):
            specs.append(dataclasses.replace(spec, name=f"{LAYER_PREFIX}{number}.{spec.name}"))
    return specs + head_parameters(config, vocab_rows) + mtp_parameters(config)
