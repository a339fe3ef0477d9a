"""Parameter counts and training FLOPs per token, computed from the config.

Logging (throughput, TFLOP/s, MFU) and benchmarks reuse these so every report agrees.
FLOPs follow Megatron's accounting (Narayanan et al. 2021): every matmul counts 2 FLOPs per
multiply-add, attention scores count the full s x s product, training = 3 x forward, and
activation recomputation is not counted (model FLOPs, as MFU requires).
"""

from __future__ import annotations

from megatron.config import ModelConfig


def num_parameters(config: ModelConfig, include_embeddings: bool = True) -> int:
    """Total parameters of the (unsplit) model; a tied output layer counts once."""
    h, ffn, proj = config.hidden_size, config.ffn_hidden_size, config.projection_size
    qkv = proj + 2 * config.kv_projection_size
    mlp_in = 2 * ffn if config.activation == "swiglu" else ffn
    norm = h if config.normalization == "rmsnorm" else 2 * h  # weight (and bias)
    weights = h * qkv + proj * h + h * mlp_in + ffn * h
    biases = qkv + h + mlp_in + h if config.add_bias_linear else 0
    total = config.num_layers * (2 * norm + weights + biases) + norm  # + final norm
    if include_embeddings:
        total += config.vocab_size * h
        if config.untie_embeddings_and_output_weights:
            total += config.vocab_size * h
        if config.position_embedding_type == "learned_absolute":
            total += config.max_position_embeddings * h
    return total


def flops_per_token(config: ModelConfig, seq_length: int) -> int:
    """Training (forward + backward) FLOPs per token at `seq_length`, recompute excluded."""
    h, ffn, proj = config.hidden_size, config.ffn_hidden_size, config.projection_size
    mlp_in = 2 * ffn if config.activation == "swiglu" else ffn
    per_layer = (
        2 * h * (proj + 2 * config.kv_projection_size)  # query_key_value
        + 2 * 2 * seq_length * proj  # q k^T and probs v
        + 2 * proj * h  # attention dense
        + 2 * h * mlp_in  # dense_h_to_4h
        + 2 * ffn * h  # dense_4h_to_h
    )
    forward = config.num_layers * per_layer + 2 * h * config.vocab_size  # + logits
    return 3 * forward


def model_size_report(config: ModelConfig, seq_length: int) -> str:
    """One line for the start-up log: parameters and FLOPs per token."""
    total = num_parameters(config)
    without_embeddings = num_parameters(config, include_embeddings=False)
    flops = flops_per_token(config, seq_length)
    return (
        f" > model: {total:,} parameters ({without_embeddings:,} without embeddings), "
        f"{flops / 1e9:.3f} GFLOPs per token for training at sequence length {seq_length}"
    )
