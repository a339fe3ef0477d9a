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
from megatron.model.parameter_inventory import (  # noqa: F401 - the tools import them here
    LAYER_PREFIX,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    parameter_inventory,
)


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


def expected_shapes(args: dict[str, Any], vocab_rows: int) -> dict[str, tuple[int, ...]]:
    """The full (TP=1) shape of every GPTModel parameter the args describe
    (`megatron.model.parameter_inventory`, with `vocab_rows` embedding rows), and of the
    buffers saved beside them (Megatron-LM's MoE routers' expert biases and load counts).

    An MoE layer holds all its experts, numbered globally (Megatron's layout; any
    expert-parallel size).
    """
    model_dims(args)  # names a missing shape flag before the config is built
    config = model_config(args)
    shapes = {spec.name: spec.shape for spec in parameter_inventory(config, vocab_rows)}
    moe = config.routed_moe
    if moe is not None and moe.expert_bias:  # the routers' fp32 buffers, saved with the model
        routers = [f"{LAYER_PREFIX}{n}.mlp" for n, is_moe in enumerate(moe.moe_layers) if is_moe]
        if config.mtp is not None and moe.moe_layers[-1]:  # each MTP layer is the last's kind
            routers += [
                f"mtp.layers.{k}.transformer_layer.mlp" for k in range(config.mtp.num_layers)
            ]
        for router in routers:
            for buffer in ("expert_bias", "local_tokens_per_expert"):
                shapes[f"{router}.router.{buffer}"] = (moe.num_experts,)
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
