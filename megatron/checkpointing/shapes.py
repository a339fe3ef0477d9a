"""The parameters and shapes a checkpoint's args describe, and its tokenizer's size.

Used to validate what was read from disk before it is converted, so a checkpoint that does not
match its own args fails with the parameter and the flags named instead of deep in a reshape.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig

WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "language_model.embedding.position_embeddings.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"
"""The untied output layer (`--untie-embeddings-and-output-weights`), vocab-parallel."""


def model_config(args: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` a checkpoint's args build (the same rule `pretrain_gpt.py` uses)."""
    defaults = {"padded_vocab_size": 1, "max_position_embeddings": args.get("seq_length")}
    namespace = argparse.Namespace(**{**defaults, **args})
    try:
        return ModelConfig.from_args(namespace)
    except (AttributeError, TypeError, ValueError) as error:
        raise CheckpointConversionError(
            f"the checkpoint's args do not describe a model: {error}"
        ) from None


def model_dims(args: dict[str, Any]) -> dict[str, int]:
    """num_layers, hidden, heads, kv_heads, kv_channels, ffn and max_positions from args."""
    try:
        hidden, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
        dims = {"num_layers": int(args["num_layers"]), "hidden": hidden, "heads": heads}
    except (KeyError, TypeError) as error:
        raise CheckpointConversionError(f"the checkpoint's args lack {error}") from None
    dims["kv_heads"] = int(args.get("num_key_value_heads") or heads)
    dims["kv_channels"] = int(args.get("kv_channels") or hidden // heads)
    dims["ffn"] = int(args.get("ffn_hidden_size") or 4 * hidden)
    dims["max_positions"] = int(args.get("max_position_embeddings") or args.get("seq_length") or 0)
    return dims


def _mlp_shapes(prefix: str, config: ModelConfig, h: int, ffn: int) -> dict[str, tuple]:
    """One MLP's parameters under `prefix` (`mlp.`, an expert's, PR-MoE's dense `mlp.mlp.`)."""
    h_to_4h = 2 * ffn if config.activation == "swiglu" else ffn
    shapes = {
        f"{prefix}dense_h_to_4h.weight": (h_to_4h, h),
        f"{prefix}dense_4h_to_h.weight": (h, ffn),
    }
    if config.add_bias_linear:
        shapes.update(
            {f"{prefix}dense_h_to_4h.bias": (h_to_4h,), f"{prefix}dense_4h_to_h.bias": (h,)}
        )
    return shapes


def _moe_shapes(experts: int, config: ModelConfig, h: int, ffn: int) -> dict[str, tuple]:
    """An MoE layer's parameters: DeepSpeed's gate, every expert by its global number, and with
    PR-MoE the dense MLP and the coefficient mixing the two."""
    shapes = {"mlp.deepspeed_moe.gate.wg.weight": (experts, h)}
    for expert in range(experts):
        prefix = f"mlp.deepspeed_moe.experts.deepspeed_experts.{expert}."
        shapes.update(_mlp_shapes(prefix, config, h, ffn))
    if config.moe.residual:
        shapes.update(_mlp_shapes("mlp.mlp.", config, h, ffn))
        shapes.update({"mlp.coefficient.weight": (2, h), "mlp.coefficient.bias": (2,)})
    return shapes


def expected_shapes(args: dict[str, Any], vocab_rows: int) -> dict[str, tuple[int, ...]]:
    """The full (TP=1) shape of every GPTModel parameter the args describe.

    QKV rows are grouped per key/value head ([nkv, nq/nkv + 2, hn]); with SwiGLU
    `dense_h_to_4h` holds the gate rows, then the up rows ([2 ffn, h]). An MoE layer holds
    all its experts, numbered globally (Megatron's layout; any expert-parallel size).
    """
    d, config = model_dims(args), model_config(args)
    h, hn = d["hidden"], d["kv_channels"]
    qkv, ffn = (d["heads"] + 2 * d["kv_heads"]) * hn, d["ffn"]
    shapes: dict[str, tuple[int, ...]] = {WORD_EMBEDDINGS: (vocab_rows, h)}
    if config.position_embedding_type == "learned_absolute":
        shapes[POSITION_EMBEDDINGS] = (d["max_positions"], h)
    layer = {
        "input_layernorm.weight": (h,),
        "self_attention.query_key_value.weight": (qkv, h),
        "self_attention.dense.weight": (h, d["heads"] * hn),
        "post_attention_layernorm.weight": (h,),
    }
    if config.normalization == "layernorm":
        layer.update({"input_layernorm.bias": (h,), "post_attention_layernorm.bias": (h,)})
    if config.add_bias_linear:
        layer.update(
            {"self_attention.query_key_value.bias": (qkv,), "self_attention.dense.bias": (h,)}
        )
    experts = config.moe.experts_per_layer if config.moe else (1,) * d["num_layers"]
    for number in range(d["num_layers"]):
        mlp = (
            _moe_shapes(experts[number], config, h, ffn)
            if experts[number] > 1
            else _mlp_shapes("mlp.", config, h, ffn)
        )
        for key, shape in {**layer, **mlp}.items():
            shapes[f"language_model.encoder.layers.{number}.{key}"] = shape
    shapes["language_model.encoder.final_layernorm.weight"] = (h,)
    if config.normalization == "layernorm":
        shapes["language_model.encoder.final_layernorm.bias"] = (h,)
    if config.untie_embeddings_and_output_weights:
        shapes[OUTPUT_LAYER] = (vocab_rows, h)
    return shapes


def check_shapes(state: dict[str, torch.Tensor], args: dict[str, Any], source: str) -> None:
    """Raise unless `state` has exactly the parameters and shapes `args` describe."""
    vocab_rows = state[WORD_EMBEDDINGS].size(0) if WORD_EMBEDDINGS in state else 0
    expected = expected_shapes(args, vocab_rows)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointConversionError(
            f"{source} does not match its args (num_layers, position embeddings, normalization, "
            f"add_bias_linear, untie_embeddings_and_output_weights, num_experts, "
            f"expert_interval, mlp_type): missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointConversionError(
                f"{source}: {name} has shape {tuple(state[name].shape)}, but the checkpoint's "
                f"args (hidden_size, num_attention_heads, num_key_value_heads, kv_channels, "
                f"ffn_hidden_size, swiglu, max_position_embeddings, num_experts) give {shape}"
            )


def resolve_true_vocab_size(args: dict[str, Any], override: int | None, source: str) -> int:
    """The tokenizer's vocabulary size: `override`, else args, else from the tokenizer files."""
    if override is not None:
        return int(override)
    if args.get("true_vocab_size"):
        return int(args["true_vocab_size"])
    vocab_file, merge_file = args.get("vocab_file"), args.get("merge_file")
    try:
        from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(vocab_file, merge_file).vocab_size
    except Exception as error:  # noqa: BLE001 - any failure means: ask for the flag
        raise CheckpointConversionError(
            f"cannot tell the tokenizer's vocabulary size of {source}: its args have no "
            f"true_vocab_size and its tokenizer files (vocab_file {vocab_file}, merge_file "
            f"{merge_file}) cannot be read ({error}); pass --true-vocab-size"
        ) from None
