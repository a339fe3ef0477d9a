"""Whole-model reads of torch_dist checkpoints, ours and Megatron-LM's (megatron-core's), and
writing ours in megatron-core's layout.

Both are torch.distributed.checkpoint directories (`.metadata`, `__R_0.distcp` files,
`common.pt`, `metadata.json`) under Megatron's trackers; they differ in the names:

- ours (`megatron.checkpointing.dist_checkpoint`): our GPTModel's names, one tensor per layer,
  SwiGLU's `dense_h_to_4h` as [2, F, h]; `common.pt` has our `args` and a `layout`;
- megatron-core's: its GPTModel's names with the layers stacked into one tensor each
  (`decoder.layers.self_attention.linear_qkv.weight` [L, ...]), layer norms under the linear
  layers they precede (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, as its
  Transformer Engine spec names them; its local spec's `input_layernorm` too), and Megatron-LM's
  training `args` (an argparse.Namespace) in `common.pt`.

The fused QKV rows are the same on both sides (per key/value group: its query heads, its key,
its value), as are SwiGLU's [gate; up] rows and the tied output layer (absent from both).
`read_dist_dense` returns either as our flat full-size names with the args our tools read
(`load_dense_checkpoint` does this for torch_dist directories, so `convert_to_hf.py`,
`reshard.py` and `generate_samples_gpt.py` read both); `write_megatron_core` writes a model in
megatron-core's layout, weights only, which megatron-core's `dist_checkpointing.load` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import torch

from megatron.checkpointing.dist_checkpoint import (
    COMMON_FILE,
    FORMAT_FILE,
    DistCheckpointError,
    _checked_metadata,
    _SafeReader,
)
from megatron.checkpointing.file_format import args_dict, load_file
from megatron.checkpointing.shapes import OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS

LAYERS = "language_model.encoder.layers."
FINAL_NORM = "language_model.encoder.final_layernorm."
_TOP = {
    "embedding.word_embeddings.weight": WORD_EMBEDDINGS,
    "embedding.position_embeddings.weight": POSITION_EMBEDDINGS,
    "decoder.final_layernorm.weight": FINAL_NORM + "weight",
    "decoder.final_layernorm.bias": FINAL_NORM + "bias",
    "output_layer.weight": OUTPUT_LAYER,
}
_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
    "self_attention.linear_qkv.bias": "self_attention.query_key_value.bias",
    "self_attention.q_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias": "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight": "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias": "self_attention.k_layernorm.bias",
    "self_attention.linear_proj.weight": "self_attention.dense.weight",
    "self_attention.linear_proj.bias": "self_attention.dense.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
    "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
    "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias",
}
_LINEARS = (
    "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
)  # fmt: skip
_LOCAL_SPEC_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
}
_MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
    "max_position_embeddings", "seq_length", "padded_vocab_size", "make_vocab_size_divisible_by",
    "position_embedding_type", "rotary_base", "rotary_percent", "normalization", "swiglu",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
    "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
    "apply_residual_connection_post_layernorm", "init_method_std", "consumed_train_samples",
    "consumed_valid_samples", "true_vocab_size", "bias_gelu_fusion", "openai_gelu",
)  # fmt: skip
"""Megatron-LM's training arguments that mean the same here."""


def _our_name(key: str) -> tuple[str, bool] | None:
    """(our name, stacked over layers) of a megatron-core key; None if not a weight we know."""
    if key in _TOP:
        return _TOP[key], False
    rest = key.removeprefix("decoder.layers.")
    if rest == key:
        return None
    name = _LAYER.get(rest) or _LOCAL_SPEC_NORMS.get(rest)
    return (name, True) if name is not None else None


def is_megatron_core_checkpoint(directory: str) -> bool:
    """Whether a torch_dist `directory` holds megatron-core's names (not ours)."""
    metadata = _checked_metadata(directory).state_dict_metadata
    return any(key.startswith("decoder.layers.") for key in metadata)


def _common(directory: str) -> dict:
    path = os.path.join(directory, COMMON_FILE)
    if not os.path.isfile(path):
        raise DistCheckpointError(f"{path} is missing: {directory} is not a complete checkpoint")
    return load_file(path)


def our_args(megatron_lm_args: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's training arguments -> the model arguments our tools read."""
    args = {key: megatron_lm_args[key] for key in _MODEL_ARGS if key in megatron_lm_args}
    if megatron_lm_args.get("group_query_attention"):
        args["num_key_value_heads"] = megatron_lm_args["num_query_groups"]
    # `--norm-epsilon` until core_v0.15; core_v0.16's args take TransformerConfig's name.
    epsilon = megatron_lm_args.get("norm_epsilon", megatron_lm_args.get("layernorm_epsilon"))
    if epsilon is not None:
        args["layernorm_epsilon"] = epsilon
    return args


def _read_tensors(directory: str, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    tensors = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=_SafeReader.create(directory), no_dist=True)
    return tensors


def read_dist_dense(directory: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(args, full-size weights by our flat names) of a torch_dist directory, ours or
    megatron-core's, read in this process; optimizer and random-generator state are left."""
    metadata = _checked_metadata(directory).state_dict_metadata
    common = _common(directory)
    args = args_dict(common.get("args"))
    tensors = {
        key: (tuple(item.size), item.properties.dtype)
        for key, item in metadata.items()
        if hasattr(item, "size") and not key.startswith(("optimizer.", "rng_state."))
    }
    if not any(key.startswith("decoder.layers.") for key in tensors):  # ours
        state = _read_tensors(directory, tensors)
        for name, tensor in state.items():
            if tensor.dim() == 3 and name.endswith("dense_h_to_4h.weight"):  # SwiGLU [2, F, h]
                state[name] = tensor.reshape(-1, tensor.size(-1))
            elif tensor.dim() == 2 and name.endswith("dense_h_to_4h.bias"):
                state[name] = tensor.reshape(-1)
        return args, state
    known = {key: shape for key, shape in tensors.items() if _our_name(key) is not None}
    unknown = sorted(set(tensors) - set(known))
    if unknown:
        raise DistCheckpointError(
            f"{directory}: megatron-core tensor {unknown[0]} has no counterpart in our GPT "
            "(a dense GPT or LLaMA-style model converts)"
        )
    state = {}
    for key, tensor in _read_tensors(directory, known).items():
        name, stacked = _our_name(key)
        if not stacked:
            state[name] = tensor
            continue
        for layer in range(tensor.size(0)):
            state[f"{LAYERS}{layer}.{name}"] = tensor[layer].clone()
    return our_args(args), state


def _megatron_lm_args(args: dict[str, Any]) -> argparse.Namespace:
    """Our checkpoint's model arguments under Megatron-LM's names (its checkpoints' `args`)."""
    out = {key: args[key] for key in _MODEL_ARGS if key in args}
    heads = int(args["num_attention_heads"])
    groups = int(args.get("num_key_value_heads") or heads)
    out.update(
        group_query_attention=groups != heads,
        num_query_groups=groups,
        norm_epsilon=args.get("layernorm_epsilon", 1e-5),
        layernorm_epsilon=args.get("layernorm_epsilon", 1e-5),
        ckpt_format="torch_dist",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )
    return argparse.Namespace(**out)


def write_megatron_core(
    state: dict[str, torch.Tensor], args: dict[str, Any], root: str, iteration: int
) -> str:
    """Write full-size weights (our flat names) as megatron-core's torch_dist checkpoint
    `{root}/iter_{iteration:07d}` (`release` for 0) with its tracker; returns the directory.
    One process."""
    import torch.distributed.checkpoint as dcp

    to_core = {ours: core for core, ours in _TOP.items()}
    layers = int(args["num_layers"])
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in to_core:
            tensors[to_core[name]] = tensor
    for core, ours in _LAYER.items():
        per_layer = [state.get(f"{LAYERS}{layer}.{ours}") for layer in range(layers)]
        if all(tensor is not None for tensor in per_layer):
            tensors[f"decoder.layers.{core}"] = torch.stack(per_layer)
    # Each linear layer's `_extra_state` (Transformer Engine's FP8 scaling state; none for
    # ours), one object per layer as megatron-core writes them ([state], pickled by DCP).
    for linear in _LINEARS:
        for layer in range(layers):
            tensors[f"decoder.layers.{linear}._extra_state/shard_{layer}_{layers}"] = [None]
    written = {f"{LAYERS}{layer}.{ours}" for layer in range(layers) for ours in _LAYER.values()}
    left = sorted(set(state) - written - set(to_core))
    if left:
        raise DistCheckpointError(f"our tensor {left[0]} has no megatron-core counterpart")
    # Iteration 0 (an import) is Megatron's `release` checkpoint.
    name = "release" if iteration == 0 else f"iter_{iteration:07d}"
    directory = os.path.join(root, name)
    os.makedirs(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    common = {"args": _megatron_lm_args(args), "checkpoint_version": 3.0, "iteration": iteration}
    torch.save(common, os.path.join(directory, COMMON_FILE))
    with open(os.path.join(directory, FORMAT_FILE), "w") as out:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, out)  # fmt: skip
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("release" if iteration == 0 else str(iteration))
    return directory
