"""The pretrain_gpt.py flags that build a model `convert_from_hf.py` imported, from its
checkpoint args (Megatron's dest names): what the tool prints after writing the checkpoint.
"""

from __future__ import annotations

import shlex


def model_flags(args: dict) -> str:
    """The pretrain_gpt.py flags that build the imported model."""
    flags = [
        f"--num-layers {args['num_layers']}",
        f"--hidden-size {args['hidden_size']}",
        f"--num-attention-heads {args['num_attention_heads']}",
        f"--ffn-hidden-size {args['ffn_hidden_size']}",
        f"--max-position-embeddings {args['max_position_embeddings']}",
        f"--seq-length {args['seq_length']}",
        f"--layernorm-epsilon {args['layernorm_epsilon']}",
        f"--make-vocab-size-divisible-by {args['make_vocab_size_divisible_by']}",
        f"--tensor-model-parallel-size {args['tensor_model_parallel_size']}",
        f"--pipeline-model-parallel-size {args['pipeline_model_parallel_size']}",
    ]
    if args.get("swiglu") or args.get("quick_geglu"):
        flags += [
            f"--kv-channels {args['kv_channels']}",
            f"--num-key-value-heads {args['num_key_value_heads']}",
            "--normalization rmsnorm",
            *(gpt_oss_flags(args) if args.get("quick_geglu") else ["--swiglu"]),
            *rotary_flags(args),
            f"--rotary-position-embeddings-theta {args['rope_theta']:g}",
            "--no-position-embedding",
        ]
        if args.get("rotary_percent", 1.0) != 1.0:
            flags.append(f"--rotary-percent {args['rotary_percent']:g}")
        if args["untie_embeddings_and_output_weights"]:
            flags.append("--untie-embeddings-and-output-weights")
        if not args["add_bias_linear"]:
            flags.append("--disable-bias-linear")
        if args.get("add_qkv_bias"):
            flags.append("--add-qkv-bias")
        if args.get("qk_layernorm"):
            flags.append("--qk-layernorm")
        if args.get("window_size") is not None:
            flags.append(f"--window-size {args['window_size'][0]},{args['window_size'][1]}")
        skip = args.get("window_attn_skip_freq")
        if skip is not None:
            text = str(skip) if isinstance(skip, int) else f"[{','.join(map(str, skip))}]"
            flags.append(f"--window-attn-skip-freq {shlex.quote(text)}")
    elif not args["bias_gelu_fusion"]:
        flags.append("--no-bias-gelu-fusion")
    if args.get("multi_latent_attention"):
        flags += mla_flags(args)
    if args.get("routed_moe"):
        flags += routed_moe_flags(args)
    elif args.get("num_experts"):
        flags += [
            f"--num-experts {' '.join(map(str, args['num_experts']))}",
            f"--expert-interval {args['expert_interval']} --topk {args['topk']}",
            "--disable-moe-token-dropping --disable-moe-top2-2nd-expert-sampling",
            f"--moe-loss-coeff {args['moe_loss_coeff']:g}",
            "--deepspeed --deepspeed_config FILE --no-pipeline-parallel",
        ]
    if args.get("tokenizer_model"):
        flags.append(f"--tokenizer-type {args['tokenizer_type']}")
        flags.append(f"--tokenizer-model {args['tokenizer_model']}")
    return " ".join(flags)


def gpt_oss_flags(args: dict) -> list[str]:
    """gpt-oss's activation and attention sinks, of imported args."""
    return [
        f"--quick-geglu --glu-linear-offset {float(args['glu_linear_offset'])!r}",
        f"--activation-func-clamp-value {float(args['activation_func_clamp_value'])!r}",
        f"--softmax-type {args['softmax_type']}",
    ]


def rotary_flags(args: dict) -> list[str]:
    """RoPE, or `--position-embedding-type yarn` with its settings, of imported args."""
    if args.get("position_embedding_type") != "yarn":
        return ["--use-rotary-position-embeddings"]
    rounding = "" if args["yarn_correction_range_round_to_int"] else "no-"
    return [
        f"--position-embedding-type yarn --rotary-scaling-factor "
        f"{float(args['rotary_scaling_factor'])!r}",
        f"--yarn-original-max-position-embeddings {args['yarn_original_max_position_embeddings']}",
        f"--yarn-beta-fast {float(args['yarn_beta_fast'])!r}",
        f"--yarn-beta-slow {float(args['yarn_beta_slow'])!r}",
        f"--{rounding}yarn-correction-range-round-to-int",
        f"--mscale {float(args['mscale'])!r} --mscale-all-dim {float(args['mscale_all_dim'])!r}",
    ]


def mla_flags(args: dict) -> list[str]:
    """The multi-latent attention and multi-token prediction flags of imported args."""
    flags = ["--multi-latent-attention"]
    if args["q_lora_rank"] is not None:
        flags.append(f"--q-lora-rank {args['q_lora_rank']}")
    flags += [
        f"--kv-lora-rank {args['kv_lora_rank']} --qk-head-dim {args['qk_head_dim']}",
        f"--qk-pos-emb-head-dim {args['qk_pos_emb_head_dim']} --v-head-dim {args['v_head_dim']}",
        f"--rope-type {args['rope_type']}",
    ]
    if args["rope_type"] == "yarn":
        flags.append(
            f"--rotary-scaling-factor {args['rotary_scaling_factor']!r} --mscale "
            f"{args['mscale']!r} --mscale-all-dim {args['mscale_all_dim']!r}"
        )
    if args.get("mtp_num_layers"):
        flags.append(f"--mtp-num-layers {args['mtp_num_layers']}")
    return flags


def layer_pattern(pattern: list[int]) -> str:
    """`--moe-layer-freq`'s list form, as Megatron-LM's recipes write it: "([0]*1+[1]*3)"."""
    runs: list[list[int]] = []
    for value in pattern:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return "(" + "+".join(f"[{value}]*{count}" for value, count in runs) + ")"


def routed_moe_flags(args: dict) -> list[str]:
    """The Megatron-LM MoE flags (`--moe-router-topk` picks that family) of imported args."""
    flags = [f"--num-experts {args['num_experts'][0]} --moe-router-topk {args['moe_router_topk']}"]
    freq = args["moe_layer_freq"]
    if freq != 1:
        text = str(freq) if isinstance(freq, int) else layer_pattern(freq)
        flags.append(f"--moe-layer-freq {shlex.quote(text)}")
    valued = {
        "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
        "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
        "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
        "moe_router_dtype": "--moe-router-dtype",
    }
    flags += [
        f"{flag} {args[name]:g}" if isinstance(args[name], float) else f"{flag} {args[name]}"
        for name, flag in valued.items()
        if args.get(name) is not None
    ]
    if args["moe_router_score_function"] != "softmax":
        flags.append(f"--moe-router-score-function {args['moe_router_score_function']}")
    if args["moe_router_enable_expert_bias"]:
        flags.append("--moe-router-enable-expert-bias")
    if args.get("moe_router_pre_softmax"):
        flags.append("--moe-router-pre-softmax")
    if args.get("moe_shared_expert_gate"):
        flags.append("--moe-shared-expert-gate")
    if args.get("moe_router_num_groups"):
        flags.append(
            f"--moe-router-num-groups {args['moe_router_num_groups']} "
            f"--moe-router-group-topk {args['moe_router_group_topk']}"
        )
    if args["moe_aux_loss_coeff"][0]:
        flags.append(f"--moe-aux-loss-coeff {args['moe_aux_loss_coeff'][0]:g}")
    return flags
