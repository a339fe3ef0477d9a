"""Hugging Face `DeepseekV3ForCausalLM` / `DeepseekV2ForCausalLM` folders -> our checkpoint args
and weights: multi-latent attention (`--multi-latent-attention` and its shapes, YaRN), Megatron-LM's
MoE with DeepSeek's routers, DeepSeek-V3's multi-token prediction modules (layers L and on).

The names, layouts and what each router computes are `huggingface_deepseek.py`'s; a config.json
key our model cannot compute is refused in one line naming it. YaRN: our cos/sin factor is
mscale(factor, mscale) / mscale(factor, mscale_all_dim); transformers' is that when both keys
are set, else plain YaRN's mscale(factor), or an explicit `attention_factor`: the import picks
the `--mscale` that gives theirs.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace
from typing import Any

import torch

from megatron.checkpointing.huggingface_deepseek import (
    ATTENTION_NAMES,
    EXPERT_LINEARS,
    MTP_COPIES,
    MTP_NAMES,
    YARN_FIXED,
)
from megatron.checkpointing.huggingface_llama import from_llama_state_dict, megatron_args_from_llama
from megatron.checkpointing.huggingface_routed import (
    RoutedLayer,
    check_routed_import,
    pop_hf_experts,
    routed_layer_state,
    routed_moe_args,
)
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig
from megatron.yarn_config import yarn_mscale

DEFAULTS = dict(
    q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1,
    routed_scaling_factor=1.0, norm_topk_prob=False, topk_method="greedy",
    rope_interleave=True, attention_bias=False, rms_norm_eps=1e-6, hidden_act="silu",
    tie_word_embeddings=False, num_nextn_predict_layers=0,
)  # fmt: skip
"""What this import takes for a key a DeepSeek config.json leaves out (transformers' defaults
where both releases agree; a missing shape key is refused)."""


def _number(hf_config: dict[str, Any], key: str, low: float = 0.0) -> float:
    """config.json's `key`, a number above `low`, or a one-line refusal naming it."""
    value = hf_config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= low:
        raise CheckpointConversionError(f"config.json has {key}={value!r}; need a number > {low:g}")
    return float(value)


def _mla_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our MLA flags (dest names) for a DeepSeek config.json's attention and rotary settings."""
    if hf_config["attention_bias"]:
        raise CheckpointConversionError(
            "config.json has attention_bias=true; our multi-latent attention has no biases"
        )
    if hf_config["model_type"] == "deepseek_v3" and hf_config["rope_interleave"] is False:
        raise CheckpointConversionError(
            "config.json has rope_interleave=false; our MLA rotates interleaved channel pairs, "
            "DeepSeek's layout (true)"
        )
    heads = hf_config["num_attention_heads"]
    if hf_config.get("num_key_value_heads") not in (None, heads):
        raise CheckpointConversionError(
            f"config.json has num_key_value_heads={hf_config['num_key_value_heads']} of "
            f"{heads} heads; multi-latent attention has a key and value per head"
        )
    rope = {}
    for key in ("rope_parameters", "rope_scaling"):
        found = hf_config.get(key) or {}
        if not isinstance(found, dict):
            raise CheckpointConversionError(f"config.json has {key}={found!r}; expected an object")
        rope.update(found)
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    args = dict(
        multi_latent_attention=True, q_lora_rank=hf_config["q_lora_rank"],
        kv_lora_rank=hf_config["kv_lora_rank"], qk_head_dim=hf_config["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf_config["qk_rope_head_dim"], v_head_dim=hf_config["v_head_dim"],
        qk_layernorm=True, rope_theta=float(theta), rope_type="rope", rotary_scaling_factor=1.0,
        mscale=1.0, mscale_all_dim=0.0,
    )  # fmt: skip
    if kind == "default":
        return args
    if kind != "yarn":
        raise CheckpointConversionError(
            f"config.json has rope type {kind!r}; only 'default' and 'yarn' convert"
        )
    for name, value in YARN_FIXED.items():
        given = rope.get(name)
        if given is not None and float(given) != value:
            raise CheckpointConversionError(
                f"config.json has {name}={given!r} under YaRN; our MLA computes {value:g}"
            )
    if rope.get("truncate") is False:
        raise CheckpointConversionError("config.json has YaRN truncate=false; ours truncates")
    factor = rope.get("factor")
    if factor is None:  # transformers' rule for DeepSeek: the context's growth
        factor = (
            hf_config["max_position_embeddings"] / YARN_FIXED["original_max_position_embeddings"]
        )
    factor = _number({"rope factor": factor}, "rope factor")
    if factor < 1:
        raise CheckpointConversionError(f"config.json has YaRN factor {factor:g}; need 1 or more")
    if factor == 1:  # YaRN at factor 1 is plain rotary positions
        return args
    given, all_dim = rope.get("mscale"), float(rope.get("mscale_all_dim") or 0.0)
    theirs = rope.get("attention_factor")
    if theirs is None:  # transformers' inference of the cos/sin factor
        theirs = (
            yarn_mscale(factor, given) / yarn_mscale(factor, all_dim)
            if given and all_dim
            else yarn_mscale(factor)
        )
    # Ours scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim): the
    # mscale giving their factor (theirs when it does).
    mscale = (float(theirs) * yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))
    if given and math.isclose(mscale, float(given), rel_tol=1e-9, abs_tol=1e-12):
        mscale = float(given)
    return dict(
        args, rope_type="yarn", rotary_scaling_factor=factor, mscale=mscale, mscale_all_dim=all_dim
    )


def _router_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our Megatron-LM MoE flags (dest names) for a DeepSeek config.json's MoE; {} if dense."""
    layers, first = hf_config["num_hidden_layers"], hf_config["first_k_dense_replace"]
    if not isinstance(first, int) or not 0 <= first <= layers:
        raise CheckpointConversionError(
            f"config.json has first_k_dense_replace={first!r}; need 0 to num_hidden_layers {layers}"
        )
    if first == layers:
        return {}
    v3 = hf_config["model_type"] == "deepseek_v3"
    experts, top_k = hf_config["n_routed_experts"], hf_config["num_experts_per_tok"]
    groups, kept = hf_config["n_group"] or 1, hf_config["topk_group"] or 1
    shared = hf_config["n_shared_experts"]
    if not isinstance(shared, int) or shared < 1:
        raise CheckpointConversionError(f"config.json has n_shared_experts={shared!r}; need 1+")
    grouped = groups > 1 and (v3 or hf_config["topk_method"] == "group_limited_greedy")
    if not v3 and hf_config["topk_method"] not in ("greedy", "group_limited_greedy"):
        raise CheckpointConversionError(
            f"config.json has topk_method={hf_config['topk_method']!r}; 'greedy' and "
            "'group_limited_greedy' convert"
        )
    worth = 2 if v3 else 1
    if grouped and (experts % groups or not 1 <= kept <= groups or top_k // kept != worth):
        raise CheckpointConversionError(
            f"config.json has n_group={groups}, topk_group={kept} with num_experts_per_tok="
            f"{top_k}: ours ranks groups by their best top k / topk_group scores, "
            f"{'DeepSeek-V3 by its best 2' if v3 else 'DeepSeek-V2 by its best one'}"
        )
    normalized = bool(hf_config["norm_topk_prob"])
    if v3 and normalized != (top_k > 1):
        raise CheckpointConversionError(
            f"config.json has norm_topk_prob={normalized} with num_experts_per_tok={top_k}: "
            "Megatron-LM's sigmoid router normalizes the chosen scores exactly when k > 1"
        )
    if not v3 and normalized and top_k > 1:
        raise CheckpointConversionError(
            "config.json has norm_topk_prob=true; DeepSeek-V2's softmax router is converted "
            "unnormalized (transformers 5 ignores the key)"
        )
    ffn = hf_config["moe_intermediate_size"]
    scale = _number(hf_config, "routed_scaling_factor")
    return routed_moe_args(
        experts,
        top_k,
        moe_layer_freq=[0] * first + [1] * (layers - first) if first else 1,
        moe_ffn_hidden_size=ffn,
        moe_shared_expert_intermediate_size=ffn * shared,
        moe_router_score_function="sigmoid" if v3 else "softmax",
        moe_router_pre_softmax=not v3,
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        moe_router_enable_expert_bias=v3,
        moe_router_dtype="fp32",
        moe_router_num_groups=groups if grouped else None,
        moe_router_group_topk=kept if grouped else None,
    )


def megatron_args_from_deepseek(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
    moe_family: str = "megatron",
    mtp_layers: int = 0,
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the DeepSeek-V3 or -V2 of
    `hf_config` (a dict) with MLA and Megatron-LM's MoE, `mtp_layers` multi-token prediction
    modules; refuses what differs in one line naming the key."""
    if moe_family != "megatron":
        raise CheckpointConversionError(
            f"--moe-family {moe_family}: DeepSpeed-MoE has no shared expert or DeepSeek router; "
            "DeepSeek imports as Megatron-LM's MoE (--moe-family megatron)"
        )
    hf_config = {**DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
    mla = _mla_args(hf_config)
    routed = _router_args(hf_config)
    if routed:
        check_routed_import(tp_size)
    llama = {k: v for k, v in hf_config.items() if k not in ("rope_parameters", "rope_scaling")}
    args = megatron_args_from_llama(
        {**llama, "mlp_bias": False, "rope_theta": mla["rope_theta"], "head_dim": None},
        tp_size,
        pp_size,
        make_vocab_size_divisible_by,
        seq_length,
    )
    args = dict(args, **mla, **routed)
    if mtp_layers:
        args.update(mtp_num_layers=mtp_layers, mtp_loss_scaling_factor=0.1)
    return args


def mtp_layers_in(names: list[str], num_layers: int) -> int:
    """How many of DeepSeek's multi-token prediction modules (layers L, L + 1, ... with an
    `eh_proj`) the weight names hold."""
    count = 0
    while f"model.layers.{num_layers + count}.eh_proj.weight" in names:
        count += 1
    return count


def _routed_layer(hf_state: dict[str, torch.Tensor], number: int, experts: int, v3: bool):
    """Pop MoE layer `number`'s router, expert bias (V3), experts and shared expert."""
    hf = f"model.layers.{number}.mlp."
    names = [f"{hf}gate.weight", *(f"{hf}shared_experts.{name}.weight" for name in EXPERT_LINEARS)]
    if v3:
        names.insert(1, f"{hf}gate.e_score_correction_bias")
    missing = [name for name in names if name not in hf_state]
    if missing:
        raise CheckpointConversionError(f"the DeepSeek weights lack {missing[0]}")
    popped = [hf_state.pop(name) for name in names]
    bias = popped.pop(1).float() if v3 else None
    router, gate, up, down = popped
    gate_up, experts_down = pop_hf_experts(
        hf_state, f"{hf}experts.", f"{hf}experts.", experts, EXPERT_LINEARS
    )
    return RoutedLayer(
        router=router, gate_up=gate_up, down=experts_down, expert_bias=bias,
        shared_gate_up=torch.cat([gate, up]), shared_down=down,
    )  # fmt: skip


def from_deepseek_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig, v3: bool = True
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 (`v3`) or -V2 weights (transformers 4 or 5 names; MTP modules as layers
    L + k) -> our full state dict (`config` from `megatron_args_from_deepseek`)."""
    remaining = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    out: dict[str, torch.Tensor] = {}
    depth = config.mtp.num_layers if config.mtp else 0
    moe_layers = config.routed_moe.moe_layers if config.routed_moe else ()
    layer_kinds = list(moe_layers) or [False] * config.num_layers
    layer_kinds += [layer_kinds[-1]] * depth  # each MTP layer is the last layer's kind
    for number, is_moe in enumerate(layer_kinds):
        hf, ours = f"model.layers.{number}.", f"language_model.encoder.layers.{number}."
        for key, hf_key in ATTENTION_NAMES.items():
            if f"{hf}self_attn.{hf_key}" in remaining:
                out[f"{ours}self_attention.{key}"] = remaining.pop(f"{hf}self_attn.{hf_key}")
        if is_moe:
            experts = config.routed_moe.num_experts
            out.update(routed_layer_state(number, _routed_layer(remaining, number, experts, v3)))
    mtp_own = {}
    for number in range(depth):
        hf = f"model.layers.{config.num_layers + number}."
        for key, hf_key in MTP_NAMES.items():
            if hf + hf_key not in remaining:
                raise CheckpointConversionError(f"the DeepSeek weights lack {hf}{hf_key}")
            mtp_own[f"mtp.layers.{number}.{key}"] = remaining.pop(hf + hf_key)
        for copy in MTP_COPIES:
            remaining.pop(hf + copy, None)
    # from_llama_state_dict reads these two fields; the MTP layers count as decoder layers.
    shape = SimpleNamespace(
        num_layers=config.num_layers + depth,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
    )
    state = {**from_llama_state_dict(remaining, shape), **out}
    return {_mtp_name(name, config.num_layers): tensor for name, tensor in state.items()} | mtp_own


def _mtp_name(name: str, num_layers: int) -> str:
    """Decoder layer num_layers + k's names back under MTP module k's transformer layer."""
    match = re.fullmatch(r"language_model\.encoder\.layers\.(\d+)\.(.+)", name)
    if match is None or int(match.group(1)) < num_layers:
        return name
    return f"mtp.layers.{int(match.group(1)) - num_layers}.transformer_layer.{match.group(2)}"
