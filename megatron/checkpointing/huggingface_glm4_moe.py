"""Megatron-LM's DeepSeek-style MoE with standard attention <-> Hugging Face
`Glm4MoeForCausalLM` (GLM-4.5's architecture: DeepSeek-V3's MoE, grouped-query attention).

DeepSeek-V3 itself, with multi-latent attention, is `huggingface_deepseek.py`'s; GLM-4-MoE
computes DeepSeek-V3's MoE beside ordinary attention, and converts exactly when our model is:

- LLaMA-style attention (RMSNorm, SwiGLU, RoPE, grouped-query or not; `huggingface_llama.py`
  maps all but the MLPs) with no linear biases (GLM's `attention_bias` puts biases on q, k and
  v only, which our `--add-bias-linear` cannot: refused on import) and no QK norm
  (`use_qk_norm`); RoPE may rotate part of each head (`--rotary-percent`, GLM's
  `partial_rotary_factor`: both rotate the first channels by halves, `rotate_half`);
- Megatron-LM's MoE (`megatron.model.moe_router`, `moe_layer`) with sigmoid scores
  (`--moe-router-score-function sigmoid`), the chosen experts' scores divided by their sum
  when k > 1 (GLM's `norm_topk_prob`; ours normalizes exactly then) and multiplied by
  `--moe-router-topk-scaling-factor` (`routed_scaling_factor`), the experts chosen by score
  plus expert bias (`--moe-router-enable-expert-bias`, `e_score_correction_bias`; zeros
  without it), a shared expert (`--moe-shared-expert-intermediate-size`, a multiple s of
  `--moe-ffn-hidden-size`: `n_shared_experts` = s / moe ffn) and the first k layers dense
  (`--moe-layer-freq "([0]*k+[1]*(L-k))"`, `first_k_dense_replace`), dropless;
- GLM's group-limited routing (`n_group` groups, each token's experts within its
  `topk_group` best, a group worth the sum of its two best scores) is ours
  (`--moe-router-num-groups`, `--moe-router-group-topk`, a group worth its best top k /
  group-topk scores) where top k / group-topk is 2, or with every group kept.

Both routers compute the logits in fp32 (GLM always; ours with `--moe-router-dtype fp32`, which
the import sets), the sigmoid, the top k of score + bias, the unbiased scores of those,
normalized with the same + 1e-20, then scaled. The experts and their sum run in other orders:
the logits agree up to the rounding of fp32 sums.

Weight names (ours in `huggingface_routed.py`), Hugging Face's under `model.layers.{i}.mlp.`
as transformers 4 (4.54 and later: GLM-4-MoE's first release) writes them, which we write and
transformers 5 loads (its `conversion_mapping` for "glm4_moe", qwen2_moe's, stacks each
layer's experts into `experts.gate_up_proj` [E, 2 ffn, h] and `experts.down_proj`):
`gate.weight`, `gate.e_score_correction_bias`, `experts.{e}.gate_proj / up_proj / down_proj
.weight`, `shared_experts.gate_proj / up_proj / down_proj.weight`; a dense layer's MLP is
LLaMA's (`gate_proj`, `up_proj`, `down_proj`). GLM's multi-token-prediction layers
(`num_nextn_predict_layers`, past the last layer) are not read by transformers' causal LM and
are not imported; the export writes none.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.checkpointing.huggingface_llama import (
    attention_differences,
    from_llama_state_dict,
    llama_style_config_json,
    megatron_args_from_llama,
    to_llama_state_dict,
)
from megatron.checkpointing.huggingface_routed import (
    RoutedLayer,
    check_routed_import,
    first_moe_layer,
    group_ranking_differences,
    hf_expert_tensors,
    pop_hf_experts,
    routed_layer_state,
    routed_moe_args,
    split_routed_layers,
)
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig

ARCHITECTURE = "Glm4MoeForCausalLM"
DEFAULTS = dict(
    n_routed_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=1408,
    n_shared_experts=1,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    use_qk_norm=False,
    attention_bias=False,
    rms_norm_eps=1e-5,
    num_key_value_heads=8,
    tie_word_embeddings=False,
    hidden_act="silu",
)
"""What transformers (4.54+ and 5) take for a key a GLM-4-MoE config.json leaves out."""
DEFAULT_PARTIAL_ROTARY = 0.5
"""GLM-4-MoE's `partial_rotary_factor` where config.json sets none: half of each head."""
_LINEARS = ("gate_proj", "up_proj", "down_proj")


def glm4_moe_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's GLM-4-MoE cannot compute (empty: it converts exactly)."""
    family = "GLM-4-MoE"
    wanted = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding_type": "rope"}
    differences = [
        f"{name} {getattr(config, name)!r} ({family}: {value!r})"
        for name, value in wanted.items()
        if getattr(config, name) != value
    ]
    if config.add_bias_linear:
        differences.append(
            f"linear biases ({family}: none on the output projection and MLPs; "
            "--disable-bias-linear)"
        )
    differences += attention_differences(config, family)
    moe = config.routed_moe
    if moe is None:
        kind = "DeepSpeed-MoE" if config.moe is not None else "no Mixture-of-Experts layers"
        return [*differences, f"{kind} ({family}: Megatron-LM's MoE, --moe-router-topk ...)"]
    ffn = moe.ffn_hidden_size or config.ffn_hidden_size
    dense = first_moe_layer(config)
    shared = moe.shared_expert_ffn_hidden_size
    checks = [
        (
            moe.score_function != "sigmoid",
            f"--moe-router-score-function {moe.score_function} ({family}: sigmoid)",
        ),
        (
            not all(moe.moe_layers[dense:]),
            f"--moe-layer-freq: dense layers after MoE ones ({family}: the first "
            "first_k_dense_replace layers dense, then experts in every layer)",
        ),
        (
            not shared,
            f"no shared expert (--moe-shared-expert-intermediate-size; {family}: "
            f"n_shared_experts x the routed experts' width {ffn})",
        ),
        (
            bool(shared) and shared % ffn != 0,
            f"--moe-shared-expert-intermediate-size {shared} not a multiple of the routed "
            f"experts' {ffn} ({family}: n_shared_experts x moe_intermediate_size)",
        ),
        (
            moe.shared_expert_gate,
            f"--moe-shared-expert-gate ({family}: the shared expert ungated)",
        ),
        (
            moe.capacity_factor is not None,
            f"token dropping (--moe-expert-capacity-factor; {family} computes every token)",
        ),
    ]
    differences += [text for differs, text in checks if differs]
    return differences + group_ranking_differences(moe, family, 2)


def glm4_moe_config_json(
    config: ModelConfig, true_vocab_size: int, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, Any]:
    """config.json (less the dtype) of the `Glm4MoeForCausalLM` computing `config`'s model,
    every key the computation reads explicit, in transformers 4's and 5's places (the RoPE base
    and rotated fraction top-level and in `rope_parameters`)."""
    differences = glm4_moe_differences(config)
    if differences:
        raise CheckpointConversionError(f"{ARCHITECTURE} cannot compute {'; '.join(differences)}")
    moe = config.routed_moe
    ffn = moe.ffn_hidden_size or config.ffn_hidden_size
    keys = llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id)
    partial = float(config.rotary_percent)
    return dict(
        keys,
        architectures=[ARCHITECTURE],
        model_type="glm4_moe",
        partial_rotary_factor=partial,
        rope_parameters=dict(keys["rope_parameters"], partial_rotary_factor=partial),
        attention_bias=False,
        use_qk_norm=False,
        moe_intermediate_size=ffn,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        n_shared_experts=moe.shared_expert_ffn_hidden_size // ffn,
        routed_scaling_factor=float(moe.topk_scaling_factor or 1.0),
        norm_topk_prob=moe.top_k > 1,
        n_group=moe.num_groups or 1,
        topk_group=moe.group_topk or moe.num_groups or 1,
        first_k_dense_replace=first_moe_layer(config),
        num_nextn_predict_layers=0,
        output_router_logits=False,
    )


def to_glm4_moe_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP=1, global expert numbers) state dict -> `Glm4MoeForCausalLM` weights as
    transformers 4 names them (tied lm_head left out); zero expert biases without
    `--moe-router-enable-expert-bias`."""
    rest, layers = split_routed_layers(state)
    out = {}
    for number, layer in layers.items():
        hf = f"model.layers.{number}.mlp."
        bias = layer.expert_bias
        out[f"{hf}gate.weight"] = layer.router
        out[f"{hf}gate.e_score_correction_bias"] = (
            torch.zeros(layer.router.size(0)) if bias is None else bias.float()
        )
        out.update(hf_expert_tensors(f"{hf}experts.", layer, _LINEARS))
        for name, part in zip(_LINEARS, layer.shared_gate_up.chunk(2, dim=0)):
            out[f"{hf}shared_experts.{name}.weight"] = part.contiguous()
        out[f"{hf}shared_experts.down_proj.weight"] = layer.shared_down
    return {**to_llama_state_dict(rest, config), **out}


def _glm4_moe_layer(hf_state: dict[str, torch.Tensor], number: int, experts: int) -> RoutedLayer:
    """Pop MoE layer `number`'s router, expert bias, experts (transformers 5's fused or 4's
    per-expert names) and shared expert from `hf_state`."""
    hf = f"model.layers.{number}.mlp."
    names = [
        f"{hf}gate.weight",
        f"{hf}gate.e_score_correction_bias",
        *(f"{hf}shared_experts.{name}.weight" for name in _LINEARS),
    ]
    missing = [name for name in names if name not in hf_state]
    if missing:
        raise CheckpointConversionError(f"the GLM-4-MoE weights lack {missing[0]}")
    router, bias, gate, up, down = (hf_state.pop(name) for name in names)
    gate_up, experts_down = pop_hf_experts(
        hf_state, f"{hf}experts.", f"{hf}experts.", experts, _LINEARS
    )
    return RoutedLayer(
        router=router,
        gate_up=gate_up,
        down=experts_down,
        expert_bias=bias.float(),
        shared_gate_up=torch.cat([gate, up]),
        shared_down=down,
    )


def from_glm4_moe_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """`Glm4MoeForCausalLM` weights (transformers 4 or 5 names) -> our full state dict of
    Megatron-LM's MoE (`config` from `megatron_args_from_glm4_moe`)."""
    remaining = dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    moe = config.routed_moe
    for number, is_moe in enumerate(moe.moe_layers):
        if is_moe:
            out.update(
                routed_layer_state(number, _glm4_moe_layer(remaining, number, moe.num_experts))
            )
    return {**from_llama_state_dict(remaining, config), **out}


def _check_glm4_moe(hf_config: dict[str, Any]) -> None:
    """Refuse, naming the config.json key, what our model does not compute."""
    experts, groups, kept = (hf_config[k] for k in ("n_routed_experts", "n_group", "topk_group"))
    if hf_config["use_qk_norm"]:
        raise CheckpointConversionError(
            "config.json has use_qk_norm=true; our attention has no QK norm"
        )
    if hf_config["attention_bias"]:
        raise CheckpointConversionError(
            "config.json has attention_bias=true (biases on q, k and v only); our "
            "--add-bias-linear puts biases on every linear layer"
        )
    top_k = hf_config["num_experts_per_tok"]
    if not isinstance(groups, int) or groups < 1 or not isinstance(kept, int) or kept < 1:
        raise CheckpointConversionError(
            f"config.json has n_group={groups!r}, topk_group={kept!r}; need whole numbers >= 1"
        )
    if kept < groups and (experts % groups or top_k // kept != 2):
        raise CheckpointConversionError(
            f"config.json has n_group={groups}, topk_group={kept} with num_experts_per_tok="
            f"{top_k}: ours ranks groups by their best top k / topk_group scores, GLM by its "
            "best 2; group-limited routing converts where that is 2"
        )
    shared = hf_config["n_shared_experts"]
    if not isinstance(shared, int) or shared < 1:
        raise CheckpointConversionError(
            f"config.json has n_shared_experts={shared!r}; need 1 or more"
        )
    normalized = bool(hf_config["norm_topk_prob"])
    if isinstance(top_k, int) and normalized != (top_k > 1):
        raise CheckpointConversionError(
            f"config.json has norm_topk_prob={normalized} with num_experts_per_tok={top_k}: "
            "Megatron-LM's sigmoid router normalizes the chosen scores exactly when k > 1"
        )
    first = hf_config["first_k_dense_replace"]
    layers = hf_config["num_hidden_layers"]
    if not isinstance(first, int) or not 0 <= first <= layers:
        raise CheckpointConversionError(
            f"config.json has first_k_dense_replace={first!r}; need 0 to num_hidden_layers {layers}"
        )
    if not isinstance(experts, int) or experts < 2:
        raise CheckpointConversionError(f"config.json has n_routed_experts={experts!r}; need 2+")
    scale = hf_config["routed_scaling_factor"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise CheckpointConversionError(
            f"config.json has routed_scaling_factor={scale!r}; need a number above 0"
        )


def megatron_args_from_glm4_moe(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
    moe_family: str = "megatron",
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the GLM-4-MoE of `hf_config` (a
    dict) as Megatron-LM's MoE: sigmoid router in fp32 with expert bias, shared expert, the
    first layers dense; refuses what differs in one line naming the key."""
    if moe_family != "megatron":
        raise CheckpointConversionError(
            f"--moe-family {moe_family}: DeepSpeed-MoE has no sigmoid router, expert bias or "
            "shared expert; GLM-4-MoE imports as Megatron-LM's MoE (--moe-family megatron)"
        )
    hf_config = {**DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
    _check_glm4_moe(hf_config)
    check_routed_import(tp_size)
    layers, first = hf_config["num_hidden_layers"], hf_config["first_k_dense_replace"]
    args = megatron_args_from_llama(
        {**hf_config, "mlp_bias": False},
        tp_size,
        pp_size,
        make_vocab_size_divisible_by,
        seq_length,
        default_partial_rotary=DEFAULT_PARTIAL_ROTARY,
    )
    ffn, scale = hf_config["moe_intermediate_size"], float(hf_config["routed_scaling_factor"])
    routed = routed_moe_args(
        hf_config["n_routed_experts"],
        hf_config["num_experts_per_tok"],
        moe_layer_freq=[0] * first + [1] * (layers - first) if first else 1,
        moe_ffn_hidden_size=ffn,
        moe_shared_expert_intermediate_size=ffn * hf_config["n_shared_experts"],
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        **_group_args(hf_config),
    )
    return dict(args, **routed)


def _group_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """`--moe-router-num-groups` / `--moe-router-group-topk` where some groups are left out."""
    groups, kept = hf_config["n_group"], hf_config["topk_group"]
    if kept >= groups:
        return {}
    return dict(moe_router_num_groups=groups, moe_router_group_topk=kept)
