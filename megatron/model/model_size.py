"""Parameter counts and training FLOPs per token, computed from the config (the parameters
from `parameter_inventory`, the one list of the model's tensors).

Logging (throughput, TFLOP/s, MFU) and benchmarks reuse these so every report agrees.
FLOPs follow Megatron's accounting (Narayanan et al. 2021): every matmul counts 2 FLOPs per
multiply-add, attention scores count the full s x s product, training = 3 x forward, and
activation recomputation is not counted (model FLOPs, as MFU requires). With MoE layers the
FLOPs are the active ones: each token passes its top-k experts (plus the gate, and PR-MoE's
dense MLP and mixing coefficient), and `num_parameters(active=True)` counts those experts only.
"""

from __future__ import annotations

import dataclasses

from megatron.config import ModelConfig
from megatron.model.parameter_inventory import (
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    ParameterSpec,
    embedding_parameters,
    experts_per_layer,
    head_parameters,
    layer_parameters,
    mla_parameters,
    mlp_parameters,
    mtp_parameters,
    parameter_inventory,
)


def _mlp_parameters(config: ModelConfig) -> int:
    return sum(spec.numel for spec in mlp_parameters(config))


def _mlp_flops(config: ModelConfig) -> int:
    h, ffn = config.hidden_size, config.ffn_hidden_size
    mlp_in = 2 * ffn if config.gated else ffn
    return 2 * h * mlp_in + 2 * ffn * h  # dense_h_to_4h, dense_4h_to_h


def mlp_forward_flops(config: ModelConfig) -> int:
    """Forward FLOPs per token of the dense MLP of `config` (its two matmuls, whole)."""
    return _mlp_flops(config)


def _routed_expert(config: ModelConfig) -> tuple[int, int]:
    """(parameters, forward FLOPs per token) of one Megatron-LM routed expert."""
    moe = config.routed_moe
    expert = dataclasses.replace(
        config, ffn_hidden_size=moe.ffn_hidden_size or config.ffn_hidden_size
    )
    return _mlp_parameters(expert), _mlp_flops(expert)


def _moe_layer(config: ModelConfig, experts: int, active: bool) -> tuple[int, int]:
    """(parameters, forward FLOPs per token) of one layer's MLP with `experts` experts."""
    if experts == 1:
        return _mlp_parameters(config), _mlp_flops(config)
    if config.routed_moe is not None:  # router, the top-k experts, the shared expert
        moe, h = config.routed_moe, config.hidden_size
        expert_params, expert_flops = _routed_expert(config)
        params = (moe.top_k if active else experts) * expert_params + h * experts
        flops = moe.top_k * expert_flops + 2 * h * experts
        if moe.shared_expert_ffn_hidden_size:
            shared = dataclasses.replace(config, ffn_hidden_size=moe.shared_expert_ffn_hidden_size)
            params += _mlp_parameters(shared)
            flops += _mlp_flops(shared)
            if moe.shared_expert_gate:  # [1, h]
                params += h
                flops += 2 * h
        return params, flops
    h, moe = config.hidden_size, config.moe
    used = min(moe.top_k, experts) if active else experts
    params = used * _mlp_parameters(config) + h * experts  # experts, gate
    flops = moe.top_k * _mlp_flops(config) + 2 * h * experts
    if moe.residual:  # PR-MoE: the dense MLP and the 2-way mixing coefficient
        params += _mlp_parameters(config) + 2 * h + 2
        flops += _mlp_flops(config) + 2 * h * 2
    return params, flops


def _experts(config: ModelConfig) -> tuple[int, ...]:
    return experts_per_layer(config)


_EMBEDDINGS = (WORD_EMBEDDINGS, POSITION_EMBEDDINGS, OUTPUT_LAYER)


def num_parameters(
    config: ModelConfig, include_embeddings: bool = True, active: bool = False
) -> int:
    """Parameters of the (unsplit) model; a tied output layer counts once. `active`: with
    MoE, only the top-k experts a token passes (the parameters one token's compute sees)."""
    top_k = config.moe.top_k if config.moe else 0
    total = sum(
        spec.numel
        for spec in parameter_inventory(config)
        if (include_embeddings or spec.name not in _EMBEDDINGS)
        and not (active and spec.expert is not None and spec.expert >= top_k)
    )
    if active and config.routed_moe is not None:  # the stacked experts a token does not use
        moe = config.routed_moe
        unused = (moe.num_experts - moe.top_k) * _routed_expert(config)[0]
        total -= unused * sum(moe.moe_layers)
    return total


def attention_forward_flops(config: ModelConfig, seq_length: int) -> int:
    """Forward FLOPs per token of one layer's attention at `seq_length` (whole, causal
    masking not subtracted)."""
    h, proj = config.hidden_size, config.projection_size
    if config.mla is not None:  # its projections' matmuls, then q k^T and probs v
        mla, n = config.mla, config.num_attention_heads
        weights = sum(spec.numel for spec in mla_parameters(config) if len(spec.shape) == 2)
        head_widths = mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim
        return 2 * weights + 2 * seq_length * n * head_widths
    return (
        2 * h * (proj + 2 * config.kv_projection_size)  # query_key_value
        + 2 * 2 * seq_length * proj  # q k^T and probs v
        + 2 * proj * h  # attention dense
    )


def routed_expert_forward_flops(config: ModelConfig) -> int:
    """Forward FLOPs of one Megatron-LM routed expert on one (token, expert) row."""
    return _routed_expert(config)[1]


def moe_layer_forward_flops(config: ModelConfig) -> int:
    """Forward FLOPs per token of one Megatron-LM MoE layer's MLP: the router, the top-k
    experts, the shared expert."""
    return _moe_layer(config, config.routed_moe.num_experts, True)[1]


def flops_per_token(config: ModelConfig, seq_length: int) -> int:
    """Training (forward + backward) FLOPs per token at `seq_length`, recompute excluded."""
    h = config.hidden_size
    attention = attention_forward_flops(config, seq_length)
    experts = _experts(config)
    layers = sum(attention + _moe_layer(config, e, True)[1] for e in experts)
    forward = layers + 2 * h * config.vocab_size  # + logits
    if config.mtp is not None:  # each module: eh_proj, a layer like the last, its logits
        module = 2 * 2 * h * h + attention + _moe_layer(config, experts[-1], True)[1]
        forward += config.mtp.num_layers * (module + 2 * h * config.vocab_size)
    return 3 * forward


FP8_WEIGHT_SUFFIXES = (
    "self_attention.query_key_value.weight",
    "self_attention.dense.weight",
    "dense_h_to_4h.weight",
    "dense_4h_to_h.weight",
)
"""The weights of a transformer layer's tensor-parallel linear layers, which
`megatron.model.fp8.use_fp8_matmuls` gives the FP8 matmul: attention's, the MLP's,
DeepSpeed-MoE's experts' and PR-MoE's MLP's, a routed MoE layer's shared expert's. Not the
routers, DeepSpeed-MoE's gate and coefficient, nor Megatron-LM MoE's stacked experts."""


def runs_in_fp8(config: ModelConfig, layer_number: int) -> bool:
    """Whether transformer layer `layer_number` (1-based) multiplies in FP8 (`config.fp8`)."""
    return config.fp8 is not None and config.fp8.covers_layer(layer_number, config.num_layers)


def fp8_layer_parameters(config: ModelConfig, layer_number: int) -> list[ParameterSpec]:
    """The weights of layer `layer_number` (1-based) whose matmuls run in FP8 under
    `config.fp8`; none without FP8 or in a layer kept in the run's precision."""
    if not runs_in_fp8(config, layer_number):
        return []
    specs = layer_parameters(config, _experts(config)[layer_number - 1])
    return [spec for spec in specs if spec.name.endswith(FP8_WEIGHT_SUFFIXES)]


def fp8_weight_sizes(config: ModelConfig, tp: int, layer_number: int, ep: int = 1) -> list[int]:
    """Elements one rank holds of each FP8 weight of layer `layer_number` (its experts' only
    for the experts it holds), as `layer_tensor_sizes` counts them."""
    experts = _experts(config)[layer_number - 1]
    return _rank_sizes(fp8_layer_parameters(config, layer_number), config, tp, ep, experts)[0]


def fp8_forward_flops_per_token(config: ModelConfig) -> int:
    """Of a token's forward FLOPs (`flops_per_token` / 3), the FP8 matmuls': 2 per element of
    each FP8 weight it passes (a DeepSpeed-MoE token passes its top-k experts)."""
    top_k = config.moe.top_k if config.moe else 0
    return sum(
        2 * spec.numel
        for number in range(1, config.num_layers + 1)
        for spec in fp8_layer_parameters(config, number)
        if spec.expert is None or spec.expert < top_k
    )


def model_size_report(config: ModelConfig, seq_length: int) -> str:
    """One line for the start-up log: parameters (total and, with MoE, active) and FLOPs."""
    total = num_parameters(config)
    without_embeddings = num_parameters(config, include_embeddings=False)
    flops = flops_per_token(config, seq_length)
    active = ""
    if config.moe is not None or config.routed_moe is not None:
        active = f", {num_parameters(config, active=True):,} active per token"
    return (
        f" > model: {total:,} parameters ({without_embeddings:,} without embeddings{active}), "
        f"{flops / 1e9:.3f} GFLOPs per token for training at sequence length {seq_length}"
    )


def _split(width: int, parts: int) -> int:
    return -(-width // parts)  # a shard's width; padded vocabularies divide exactly


def _held_experts(experts: int, ep: int) -> int:
    """Experts one rank holds of an `experts`-expert layer: a layer with fewer experts than
    EP ranks spreads over as many ranks as it has."""
    return _split(experts, min(ep, experts))


def _rank_sizes(specs: list[ParameterSpec], config: ModelConfig, tp: int, ep: int, experts: int):  # noqa: ANN202
    """(elements per rank of each held tensor, of which the experts') of one layer's specs."""
    held = _held_experts(experts, ep)
    expert_tp = tp if config.moe is not None and config.moe.expert_tensor_parallel else 1
    sizes, expert_sizes = [], []
    for spec in specs:
        if spec.expert_split is not None:  # Megatron-LM's stacked experts: E / EP of them
            expert_sizes.append(spec.numel // ep)
        elif spec.expert is None:
            sizes.append(spec.numel_per_rank(tp))
        elif spec.expert < held:
            expert_sizes.append(spec.numel_per_rank(expert_tp))
    return sizes + expert_sizes, expert_sizes


def layer_tensor_sizes(config: ModelConfig, tp: int, experts: int = 1, ep: int = 1) -> list[int]:
    """Elements of each parameter tensor one tensor-parallel rank holds of one layer.

    Column-parallel weights and biases (query_key_value, dense_h_to_4h) and row-parallel
    weights (dense, dense_4h_to_h) are split over `tp`; row-parallel biases and norms are
    whole on every rank (`parameter_inventory.ParameterSpec.tensor_split`). An MoE layer's
    rank holds experts / `ep` experts (each split over `tp` only with expert tensor
    parallelism) and the whole gate.
    """
    return _rank_sizes(layer_parameters(config, experts), config, tp, ep, experts)[0]


def layer_parameters_per_rank(config: ModelConfig, tp: int, experts: int = 1, ep: int = 1) -> int:
    """Parameters one tensor-parallel rank holds of one transformer layer."""
    return sum(layer_tensor_sizes(config, tp, experts, ep))


def stage_tensor_sizes(
    config: ModelConfig, tp: int, layers: range, first: bool, last: bool, ep: int = 1
) -> dict[str, list[int]]:
    """Each parameter tensor's elements on one rank of a pipeline stage, by part: `embedding`
    (first stage: word embeddings split over `tp`, the whole position table), `layers` (the
    global 1-based layer numbers in `layers`), `head` (last stage: the final norm and the
    untied output layer, or with tied embeddings on a stage without them, Megatron's copy)."""
    experts = _experts(config)
    parts: dict[str, list[int]] = {"embedding": [], "layers": [], "head": []}
    embedding = embedding_parameters(config)
    if first:
        parts["embedding"] = [spec.numel_per_rank(tp) for spec in embedding]
    for n in layers:
        parts["layers"] += layer_tensor_sizes(config, tp, experts[n - 1], ep)
    if last:
        parts["head"] = [spec.numel_per_rank(tp) for spec in head_parameters(config)]
        tied = not config.untie_embeddings_and_output_weights
        if (tied or config.mtp is not None) and not first:
            parts["head"].append(embedding[0].numel_per_rank(tp))  # the embeddings' copy
        if config.mtp is not None:  # multi-token prediction's modules (a layer like the last)
            parts["head"] += _rank_sizes(mtp_parameters(config), config, tp, ep, experts[-1])[0]
    return parts


def stage_parameters_per_rank(
    config: ModelConfig, tp: int, layers: range, first: bool, last: bool, ep: int = 1
) -> dict[str, int]:
    """Parameters one rank of a pipeline stage holds, by part (see `stage_tensor_sizes`)."""
    sizes = stage_tensor_sizes(config, tp, layers, first, last, ep)
    return {part: sum(tensors) for part, tensors in sizes.items()}


def expert_parameters_per_rank(config: ModelConfig, tp: int, layers: range, ep: int = 1) -> int:
    """Of `stage_parameters_per_rank`, the experts' (MoE layers' expert MLPs): DeepSpeed
    reduces and partitions them over the expert-data-parallel group, not the data one."""
    experts = _experts(config)
    return sum(
        sum(
            _rank_sizes(layer_parameters(config, experts[n - 1]), config, tp, ep, experts[n - 1])[1]
        )
        for n in layers
        if experts[n - 1] > 1
    )
