"""Megatron-LM's `--use-checkpoint-args`: the model's flags from the checkpoint in `--load`.

`load_args_from_checkpoint` runs between parsing and validation (`parse_args`), where Megatron-LM's
`parse_and_validate_args` runs its function of the same name, so validation builds the model config
from the saved shape and a command line (text generation, continued training) needs no architecture
flags. Its list and rule are Megatron-LM's (megatron/training/checkpointing.py): a flag of the first
kind keeps the value the command line gave it and takes the checkpoint's only where it is unset
(None); one of the second kind always takes the checkpoint's value. Each value taken prints 'Setting
NAME to VALUE from checkpoint', each one the checkpoint lacks 'Checkpoint did not provide arguments
NAME'. Besides Megatron-LM's names, the same settings under this parser's other spellings
(`--num-key-value-heads`, `--rotary-position-embeddings-theta`, DeepSpeed-MoE's `--expert-interval`,
`--topk`, `--mlp-type`, `--moe-expert-parallel-size`), and `--qk-layernorm`, which Megatron-LM's
list lacks (its weights are in the checkpoint), come from the checkpoint too, as do the MoE family
(Megatron-LM's MoE or DeepSpeed-MoE, whatever the flags' values) and group-limited routing. The
tokenizer type and model file come from it unless `--no-use-tokenizer-model-from-checkpoint-args`;
the parallel sizes only with `--use-mp-args-from-checkpoint-args`.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError

# (name here, name in the checkpoint, force): Megatron-LM's model flags in its order.
_MODEL_ARGS: tuple[tuple[str, str, bool], ...] = (
    ("num_layers", "num_layers", False),
    ("hidden_size", "hidden_size", False),
    ("ffn_hidden_size", "ffn_hidden_size", False),
    ("seq_length", "seq_length", False),
    ("num_attention_heads", "num_attention_heads", False),
    ("num_query_groups", "num_query_groups", True),
    ("group_query_attention", "group_query_attention", True),
    ("num_key_value_heads", "num_key_value_heads", True),  # ours for num_query_groups
    ("kv_channels", "kv_channels", False),
    ("max_position_embeddings", "max_position_embeddings", False),
    ("position_embedding_type", "position_embedding_type", True),
    ("add_position_embedding", "add_position_embedding", True),
    ("use_rotary_position_embeddings", "use_rotary_position_embeddings", True),
    ("rope_theta", "rope_theta", True),  # --rotary-base
    ("rotary_percent", "rotary_percent", True),
    ("rotary_interleaved", "rotary_interleaved", True),
    ("add_bias_linear", "add_bias_linear", True),
    ("add_qkv_bias", "add_qkv_bias", True),
    ("qk_layernorm", "qk_layernorm", True),  # not in Megatron-LM's list; the weights need it
    ("window_size", "window_size", True),  # not in Megatron-LM's list; the attention needs it
    # gpt-oss's (not in Megatron-LM's list either; the model computes with them)
    ("window_attn_skip_freq", "window_attn_skip_freq", True),
    ("softmax_type", "softmax_type", True),
    ("quick_geglu", "quick_geglu", True),
    ("glu_linear_offset", "glu_linear_offset", True),
    ("activation_func_clamp_value", "activation_func_clamp_value", True),
    ("rotary_scaling_factor", "rotary_scaling_factor", True),
    ("yarn_original_max_position_embeddings", "yarn_original_max_position_embeddings", True),
    ("yarn_beta_fast", "yarn_beta_fast", True),
    ("yarn_beta_slow", "yarn_beta_slow", True),
    ("yarn_correction_range_round_to_int", "yarn_correction_range_round_to_int", True),
    ("mscale", "mscale", True),
    ("mscale_all_dim", "mscale_all_dim", True),
    ("squared_relu", "squared_relu", True),
    ("swiglu", "swiglu", True),
    ("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights", True),
    ("apply_layernorm_1p", "apply_layernorm_1p", True),
    ("normalization", "normalization", True),
    ("apply_query_key_layer_scaling", "apply_query_key_layer_scaling", True),
    ("attention_dropout", "attention_dropout", True),
    ("hidden_dropout", "hidden_dropout", True),
    ("num_experts", "num_experts", True),
    ("moe_layer_freq", "moe_layer_freq", True),
    ("expert_interval", "expert_interval", True),  # DeepSpeed-MoE's moe_layer_freq
    ("moe_ffn_hidden_size", "moe_ffn_hidden_size", True),
    ("moe_router_topk", "moe_router_topk", True),
    ("topk", "topk", True),  # DeepSpeed-MoE's moe_router_topk
    ("mlp_type", "mlp_type", True),  # DeepSpeed-MoE's residual (PR-MoE) experts
    ("moe_token_dispatcher_type", "moe_token_dispatcher_type", False),
    ("moe_router_pre_softmax", "moe_router_pre_softmax", True),
    ("moe_grouped_gemm", "moe_grouped_gemm", True),
    ("moe_shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", True),
    ("moe_shared_expert_gate", "moe_shared_expert_gate", True),
    ("moe_router_score_function", "moe_router_score_function", True),
    ("moe_router_enable_expert_bias", "moe_router_enable_expert_bias", True),
    ("moe_router_topk_scaling_factor", "moe_router_topk_scaling_factor", True),
    # Not in Megatron-LM's list; which experts a token reaches depends on them.
    ("moe_router_num_groups", "moe_router_num_groups", True),
    ("moe_router_group_topk", "moe_router_group_topk", True),
)
_DEEPSPEED_MOE_ARGS = {"expert_interval", "topk", "mlp_type", "moe_expert_parallel_size"}
"""Megatron-DeepSpeed's MoE flags: not taken from a checkpoint of Megatron-LM's MoE."""
_TOKENIZER_ARGS = (
    ("tokenizer_model", "tokenizer_model", True),
    ("tokenizer_type", "tokenizer_type", True),
)
_LATER_ARGS = (
    ("tiktoken_pattern", "tiktoken_pattern", True),
    ("ckpt_format", "ckpt_format", False),
)
_PARALLEL_ARGS = (
    ("tensor_model_parallel_size", "tensor_model_parallel_size", True),
    ("pipeline_model_parallel_size", "pipeline_model_parallel_size", True),
    ("virtual_pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", True),
    ("num_layers_per_virtual_pipeline_stage", "num_layers_per_virtual_pipeline_stage", False),
    ("expert_model_parallel_size", "expert_model_parallel_size", True),
    ("moe_expert_parallel_size", "moe_expert_parallel_size", True),  # DeepSpeed-MoE's
)
# Megatron-LM checkpoints spell these otherwise (`--rotary-base`).
_THEIR_NAMES = {"rope_theta": "rotary_base"}


def add_checkpoint_args_flags(parser: argparse.ArgumentParser) -> None:
    """`--use-checkpoint-args` and its two companions (Megatron-LM's)."""
    group = parser.add_argument_group("model flags from the checkpoint")
    group.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model's flags (layers, sizes, heads, sequence length, position "
        "embeddings, normalization, SwiGLU, MoE, tokenizer) from the checkpoint in --load, as "
        "Megatron-LM: each one taken is printed; sizes given on the command line are kept, "
        "the other flags are overridden.",
    )
    group.add_argument(
        "--use-mp-args-from-checkpoint-args",
        action="store_true",
        help="With --use-checkpoint-args, also take the tensor-, pipeline- and expert-parallel "
        "sizes from the checkpoint.",
    )
    group.add_argument(
        "--no-use-tokenizer-model-from-checkpoint-args",
        dest="use_tokenizer_model_from_checkpoint_args",
        action="store_false",
        help="With --use-checkpoint-args, keep the command line's --tokenizer-type and "
        "--tokenizer-model (e.g. when the saved path is not on this machine).",
    )


def load_args_from_checkpoint(
    args: argparse.Namespace, parser: argparse.ArgumentParser, typed: set[str] | None
) -> list[str]:
    """Set the model's flags in `args` from the checkpoint in `--load` (before validation).

    A value set that differs from `parser`'s default joins `typed`: it counts as given (what
    the command line would have to say to build that model). Returns the lines to print.
    Raises `ArgumentError` naming --load and --use-checkpoint-args without a checkpoint.
    """
    from megatron.checkpointing.checks import CheckpointError
    from megatron.checkpointing.saved_args import read_saved_args

    if not args.load:
        raise ArgumentError(
            "--use-checkpoint-args needs --load, the checkpoint directory to read the model's "
            "flags from"
        )
    try:
        saved = read_saved_args(args.load, getattr(args, "universal_checkpoint", False))
    except CheckpointError as error:
        raise ArgumentError(f"--use-checkpoint-args with --load {args.load}: {error}") from None
    if saved is None:
        raise ArgumentError(
            f"--use-checkpoint-args: no checkpoint in --load {args.load} to read the model's "
            "flags from"
        )
    lines = [f" > --use-checkpoint-args: model flags from {saved.path}"]
    checkpoint = dict(saved.args)
    for ours, theirs in _THEIR_NAMES.items():
        if checkpoint.get(ours) is None and checkpoint.get(theirs) is not None:
            checkpoint[ours] = checkpoint[theirs]
    if checkpoint.get("disable_bias_linear") is not None:  # Megatron-LM's one-off conversion
        checkpoint["add_bias_linear"] = not checkpoint["disable_bias_linear"]
    if checkpoint.get("num_experts") is None:
        args.moe_ffn_hidden_size = None  # as theirs: no experts, no expert width
    entries = list(_MODEL_ARGS)
    if args.use_tokenizer_model_from_checkpoint_args:
        entries += _TOKENIZER_ARGS
    entries += _LATER_ARGS
    if args.use_mp_args_from_checkpoint_args:
        if saved.version < 3.0:
            entries.append(("tensor_model_parallel_size", "model_parallel_size", False))
        else:
            entries += _PARALLEL_ARGS
    # The MoE family is the checkpoint's (`routed_moe`), even where its flags are the parser's
    # defaults (top-2): validation reads the family off the flags given.
    routed = bool(checkpoint.get("routed_moe"))
    if routed and typed is not None:
        typed.add("moe_router_topk")
    for name, key, force in entries:
        if not hasattr(args, name):  # a Megatron-LM flag this parser does not have
            continue
        if routed and name in _DEEPSPEED_MOE_ARGS:
            continue
        if key == "moe_ffn_hidden_size" and checkpoint.get("num_experts") is None:
            continue
        if not force and getattr(args, name) is not None:
            continue
        value = checkpoint.get(key)
        if value is None:
            lines.append(f"Checkpoint did not provide arguments {name}")
            continue
        lines.append(f"Setting {name} to {value} from checkpoint")
        setattr(args, name, value)
        if typed is not None and value != parser.get_default(name):
            typed.add(name)
    return lines
