"""Parameter counts and training FLOPs per token, computed from the config.

Logging (throughput, TFLOP/s, MFU) and benchmarks reuse these so every report agrees.
FLOPs follow Megatron's accounting (Narayanan et al. 2021): every matmul counts 2 FLOPs per
multiply-add, attention scores count the full s x s product, training = 3 x forward, and
activation recomputation is not counted (model FLOPs, as MFU requires). With MoE layers the
FLOPs are the active ones: each token passes its top-k experts (plus the gate, and PR-MoE's
dense MLP and mixing coefficient), and `num_parameters(active=True)` counts those experts only.
"""

from __future__ import annotations

from megatron.config import ModelConfig


def _mlp_tensor_sizes(config: ModelConfig, parts: int = 1) -> list[int]:
    """Elements of each tensor of one MLP split over `parts` tensor-parallel ranks:
    dense_h_to_4h's weight (and SwiGLU's second half) and dense_4h_to_h's, then their biases
    (the row-parallel one whole)."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    mlp_in = 2 * ffn if config.activation == "swiglu" else ffn
    weights = [h * _split(mlp_in, parts), _split(ffn, parts) * h]
    return weights + ([_split(mlp_in, parts), h] if config.add_bias_linear else [])


def _mlp_parameters(config: ModelConfig) -> int:
    return sum(_mlp_tensor_sizes(config))


def _mlp_flops(config: ModelConfig) -> int:
    h, ffn = config.hidden_size, config.ffn_hidden_size
    mlp_in = 2 * ffn if config.activation == "swiglu" else ffn
    return 2 * h * mlp_in + 2 * ffn * h  # dense_h_to_4h, dense_4h_to_h


def _moe_layer(config: ModelConfig, experts: int, active: bool) -> tuple[int, int]:
    """(parameters, forward FLOPs per token) of one layer's MLP with `experts` experts."""
    if experts == 1:
        return _mlp_parameters(config), _mlp_flops(config)
    h, moe = config.hidden_size, config.moe
    used = min(moe.top_k, experts) if active else experts
    params = used * _mlp_parameters(config) + h * experts  # experts, gate
    flops = moe.top_k * _mlp_flops(config) + 2 * h * experts
    if moe.residual:  # PR-MoE: the dense MLP and the 2-way mixing coefficient
        params += _mlp_parameters(config) + 2 * h + 2
        flops += _mlp_flops(config) + 2 * h * 2
    return params, flops


def _experts(config: ModelConfig) -> tuple[int, ...]:
    return config.moe.experts_per_layer if config.moe else (1,) * config.num_layers


def num_parameters(
    config: ModelConfig, include_embeddings: bool = True, active: bool = False
) -> int:
    """Parameters of the (unsplit) model; a tied output layer counts once. `active`: with
    MoE, only the top-k experts a token passes (the parameters one token's compute sees)."""
    h, proj = config.hidden_size, config.projection_size
    qkv = proj + 2 * config.kv_projection_size
    norm = h if config.normalization == "rmsnorm" else 2 * h  # weight (and bias)
    attention = h * qkv + proj * h + (qkv + h if config.add_bias_linear else 0)
    total = norm  # the final norm
    for experts in _experts(config):
        total += 2 * norm + attention + _moe_layer(config, experts, active)[0]
    if include_embeddings:
        total += config.vocab_size * h
        if config.untie_embeddings_and_output_weights:
            total += config.vocab_size * h
        if config.position_embedding_type == "learned_absolute":
            total += config.max_position_embeddings * h
    return total


def flops_per_token(config: ModelConfig, seq_length: int) -> int:
    """Training (forward + backward) FLOPs per token at `seq_length`, recompute excluded."""
    h, proj = config.hidden_size, config.projection_size
    attention = (
        2 * h * (proj + 2 * config.kv_projection_size)  # query_key_value
        + 2 * 2 * seq_length * proj  # q k^T and probs v
        + 2 * proj * h  # attention dense
    )
    layers = sum(attention + _moe_layer(config, e, True)[1] for e in _experts(config))
    forward = layers + 2 * h * config.vocab_size  # + logits
    return 3 * forward


def model_size_report(config: ModelConfig, seq_length: int) -> str:
    """One line for the start-up log: parameters (total and, with MoE, active) and FLOPs."""
    total = num_parameters(config)
    without_embeddings = num_parameters(config, include_embeddings=False)
    flops = flops_per_token(config, seq_length)
    active = ""
    if config.moe is not None:
        active = f", {num_parameters(config, active=True):,} active per token"
    return (
        f" > model: {total:,} parameters ({without_embeddings:,} without embeddings{active}), "
        f"{flops / 1e9:.3f} GFLOPs per token for training at sequence length {seq_length}"
    )


def _split(width: int, parts: int) -> int:
    return -(-width // parts)  # a shard's width; padded vocabularies divide exactly


def layer_tensor_sizes(config: ModelConfig, tp: int, experts: int = 1, ep: int = 1) -> list[int]:
    """Elements of each parameter tensor one tensor-parallel rank holds of one layer.

    Column-parallel weights and biases (query_key_value, dense_h_to_4h) and row-parallel
    weights (dense, dense_4h_to_h) are split over `tp`; row-parallel biases and norms are
    whole on every rank. An MoE layer's rank holds experts / `ep` experts (each split over
    `tp` only with expert tensor parallelism) and the whole gate.
    """
    h, proj = config.hidden_size, config.projection_size
    qkv = proj + 2 * config.kv_projection_size
    bias = config.add_bias_linear
    norm = [h] if config.normalization == "rmsnorm" else [h, h]
    sizes = norm * 2 + [h * _split(qkv, tp), _split(proj, tp) * h]
    sizes += [_split(qkv, tp), h] if bias else []
    if experts == 1:
        return sizes + _mlp_tensor_sizes(config, tp)
    sizes += _expert_tensor_sizes(config, tp, experts, ep) + [h * experts]
    if config.moe.residual:
        sizes += _mlp_tensor_sizes(config, tp) + [2 * h, 2]
    return sizes


def _expert_tensor_sizes(config: ModelConfig, tp: int, experts: int, ep: int) -> list[int]:
    """The tensors of this rank's experts / `ep` experts (split over `tp` only with expert
    tensor parallelism)."""
    expert_tp = tp if config.moe.expert_tensor_parallel else 1
    return _mlp_tensor_sizes(config, expert_tp) * _split(experts, min(ep, experts))


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
    h = config.hidden_size
    experts = _experts(config)
    parts: dict[str, list[int]] = {"embedding": [], "layers": [], "head": []}
    word = _split(config.vocab_size, tp) * h
    if first:
        parts["embedding"].append(word)
        if config.position_embedding_type == "learned_absolute":
            parts["embedding"].append(config.max_position_embeddings * h)
    for n in layers:
        parts["layers"] += layer_tensor_sizes(config, tp, experts[n - 1], ep)
    if last:
        parts["head"] += [h] if config.normalization == "rmsnorm" else [h, h]
        if config.untie_embeddings_and_output_weights or not first:
            parts["head"].append(word)
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
        sum(_expert_tensor_sizes(config, tp, experts[n - 1], ep))
        for n in layers
        if experts[n - 1] > 1
    )
