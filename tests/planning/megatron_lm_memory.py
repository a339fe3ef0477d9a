"""Megatron-LM's own per-rank memory estimate for a dense GPT, the reference the planner's
GPT-3 175B figure is compared with.

Transcribed (the dense-GPT branch only: no MoE, MTP, MLA or hybrid models) from Megatron-LM's
`megatron/training/theoretical_memory_usage.py` at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
(2026-08-22): `compute_weight_and_optimizer_memory` (18 bytes per parameter of the most loaded
shard without the distributed optimizer: fp16 weights, fp32 gradients, fp32 master weights
and Adam moments), `compute_activation_memory` (Korthikanti et al. 2022, Table 2, with
--sequence-parallel and selective recomputation) and `compute_activation_memory_without_sp`
(sbh (10 + 24 / tp) bytes per layer, 5% overhead). Megatron-LM prints the sum at start-up
("Theoretical memory footprints: weight and optimizer=..., activation=..., total=...").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DenseGPT:
    """The flags the estimate reads."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    padded_vocab_size: int
    seq_length: int
    micro_batch_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    num_microbatches: int
    sequence_parallel_selective: bool = False
    """--sequence-parallel with --recompute-granularity selective (the Table 2 formula)."""


def weight_and_optimizer_bytes(args: DenseGPT) -> float:
    """`compute_weight_and_optimizer_memory` for a dense GPT, LayerNorm, tied embeddings."""
    h, tp, pp = args.hidden_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    attention = 2 * h * h * 2  # query/key/value + dense, kv_channels x heads = h, no GQA
    mlp = 2 * h * args.ffn_hidden_size
    layernorms = 2 * h * 2
    embedding = h * args.padded_vocab_size
    tp_sharded = (attention + mlp) * args.num_layers
    replicated = layernorms * args.num_layers + 2 * h  # + the final LayerNorm
    most_loaded = (tp_sharded / pp + embedding) / tp + replicated / pp
    return most_loaded * 18


def activation_bytes(args: DenseGPT) -> float:
    """The first pipeline stage's activations (`compute_activation_memory[_without_sp]`)."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.sequence_parallel_selective:
        memory = s * b * h * (18 + 4 * args.ffn_hidden_size / h) * args.num_layers
    else:
        memory = s * b * h * (10 + 24 / tp) * args.num_layers
    memory += 8 * s * b * pp + s * b * h * pp  # embedding input and dropout, pp in flight
    if pp > 1:
        memory *= min(1, args.num_microbatches / pp)
    elif args.sequence_parallel_selective:
        memory += s * b * h * 4 * (1 + args.padded_vocab_size / h)
    else:
        memory += (s * b * args.padded_vocab_size / tp + s * b * h) * 2
    if args.sequence_parallel_selective:
        return memory / tp
    return memory * 1.05


def total_bytes(args: DenseGPT) -> float:
    """Weights and optimizer plus activations: Megatron-LM's "total" per rank."""
    return weight_and_optimizer_bytes(args) + activation_bytes(args)
