"""Multi-latent attention models <-> Hugging Face `DeepseekV3ForCausalLM` and
`DeepseekV2ForCausalLM` (transformers 4.x releases that have them, and 5.x).

Both hold MLA in every layer, LLaMA's norms and SwiGLU MLPs, the first `first_k_dense_replace`
layers dense and the rest DeepSeek's MoE (routed experts plus a shared expert of
`n_shared_experts` x an expert's width). They differ in the router:

- DeepSeek-V3: sigmoid scores, the experts chosen by score + `e_score_correction_bias` (ours:
  `--moe-router-score-function sigmoid --moe-router-enable-expert-bias`) within each token's
  `topk_group` best of `n_group` groups, a group worth the sum of its two best scores (ours:
  `--moe-router-num-groups` / `--moe-router-group-topk`, worth the top k / group-topk: equal
  when that is 2), the chosen scores normalized when k > 1 (`norm_topk_prob`), times
  `routed_scaling_factor` (`--moe-router-topk-scaling-factor`);
- DeepSeek-V2: a softmax over all experts (ours: `--moe-router-pre-softmax`), greedy top k
  or, under `group_limited_greedy`, within the best groups by their best score (ours at
  top k / group-topk = 1), unnormalized, times `routed_scaling_factor`.

transformers 4.x's DeepSeek-V3 (4.57) masks the groups left out with 0 where DeepSeek's code,
megatron-core, transformers 5 and ours mask with -inf: it chooses alike wherever a kept
expert's score + bias is positive, and otherwise may pick an expert of a group left out.

Attention (`megatron/model/multi_latent_attention.py`; ours under `self_attention.`, theirs
under `self_attn.`): `linear_q_down_proj` / `q_layernorm` / `linear_q_up_proj` are `q_a_proj` /
`q_a_layernorm` / `q_b_proj` (or `linear_q_proj` is `q_proj` without a query latent),
`linear_kv_down_proj` / `kv_layernorm` / `linear_kv_up_proj` are `kv_a_proj_with_mqa` /
`kv_a_layernorm` / `kv_b_proj`, `linear_proj` is `o_proj`; the same row layouts (per head
[nope | rope] queries, [nope | v] up-projected keys and values, [latent | rope] down-projection).
Their latents are always normalized: ours must have `--qk-layernorm`. Rotary channels: our MLA
rotates each rotary part's even channels with its odd ones, DeepSeek-V3's `rope_interleave`
(true, written; false is refused) and DeepSeek-V2's complex pairs alike, so the rows need no
permutation. YaRN (`--rotary-scaling-factor` > 1) is `rope_parameters` {"rope_type": "yarn",
factor, mscale, mscale_all_dim, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1}
plus `attention_factor` where transformers would infer another cos/sin factor than ours.

Multi-token prediction (`--mtp-num-layers D`, V3 only) uses DeepSeek's layout: module k is
`model.layers.{L + k}.` (L = num_hidden_layers) with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` (our `final_layernorm`), a copy of the word embeddings (`embed_tokens`) and
of the output layer (`shared_head.head`), and its transformer layer's weights by the decoder
layers' names; `num_nextn_predict_layers` = D. transformers' causal LM does not read them
(its `MtpModel` drafts from them).

This module writes them (`to_deepseek_state_dict`, `deepseek_config_json`);
`huggingface_deepseek_import.py` reads them back.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from megatron.checkpointing.huggingface_glm4_moe import to_glm4_moe_state_dict
from megatron.checkpointing.huggingface_llama import (
    attention_differences,
    llama_style_config_json,
)
from megatron.checkpointing.huggingface_routed import first_moe_layer, group_ranking_differences
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig
from megatron.yarn_config import yarn_mscale

V3 = "DeepseekV3ForCausalLM"
V2 = "DeepseekV2ForCausalLM"
MODEL_TYPES = {"deepseek_v3": V3, "deepseek_v2": V2}
ATTENTION_NAMES = {
    "linear_q_proj.weight": "q_proj.weight",
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}
"""Ours under `...layers.{i}.self_attention.` -> theirs under `model.layers.{i}.self_attn.`."""
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
"""Ours under `mtp.layers.{k}.` -> theirs under `model.layers.{L + k}.`."""
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
"""DeepSeek's per-module copies of the word embeddings and the output layer."""
_LAYER = re.compile(r"language_model\.encoder\.layers\.(\d+)\.self_attention\.(.+)")
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")
YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
"""YaRN's settings our MLA fixes (megatron-core's MLATransformerConfig defaults)."""


def _router_differences(config: ModelConfig, architecture: str) -> list[str]:
    """What in `config`'s Megatron-LM MoE `architecture`'s router cannot compute."""
    moe, family = config.routed_moe, architecture.removesuffix("ForCausalLM")
    if moe is None:
        return [] if config.moe is None else [f"DeepSpeed-MoE ({family}: Megatron-LM's MoE)"]
    ffn = moe.ffn_hidden_size or config.ffn_hidden_size
    shared = moe.shared_expert_ffn_hidden_size
    sigmoid = architecture == V3
    worth = 2 if sigmoid else 1  # a group's worth: the sum of its best 2 (V3) or its best (V2)
    checks = [
        (
            moe.score_function != ("sigmoid" if sigmoid else "softmax"),
            f"--moe-router-score-function {moe.score_function} ({family}: "
            f"{'sigmoid' if sigmoid else 'softmax'})",
        ),
        (
            not sigmoid and not moe.pre_softmax,
            f"softmax over the chosen experts only ({family}: over all of them, "
            "--moe-router-pre-softmax)",
        ),
        (
            not sigmoid and moe.expert_bias,
            f"--moe-router-enable-expert-bias ({family}: no expert bias)",
        ),
        (
            not all(moe.moe_layers[first_moe_layer(config) :]),
            f"--moe-layer-freq: dense layers after MoE ones ({family}: the first "
            "first_k_dense_replace layers dense, then experts in every layer)",
        ),
        (
            not shared or shared % ffn != 0,
            f"shared expert width {shared} (--moe-shared-expert-intermediate-size; {family}: "
            f"n_shared_experts >= 1 x the routed experts' width {ffn})",
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
    differences = [text for differs, text in checks if differs]
    return differences + group_ranking_differences(moe, family, worth)


def _rope_differences(config: ModelConfig, family: str) -> list[str]:
    """What in `config`'s MLA rotary positions transformers computes otherwise."""
    mla = config.mla
    fixed = {name: getattr(mla, name) for name in YARN_FIXED}
    differences = [
        f"YaRN {name} {value:g} ({family} here: {YARN_FIXED[name]:g})"
        for name, value in fixed.items()
        if value != YARN_FIXED[name]
    ]
    if mla.rope_type != "yarn" and mla.rotary_scaling_factor > 1 and mla.mscale_all_dim:
        differences.append(
            f"--rope-type rope with --mscale-all-dim {mla.mscale_all_dim:g} scaling the softmax "
            f"({family}: only under YaRN)"
        )
    return differences


def deepseek_differences(config: ModelConfig, architecture: str) -> list[str]:
    """What in `config` `architecture` (`V3` or `V2`) cannot compute (empty: converts exactly)."""
    family = architecture.removesuffix("ForCausalLM")
    if config.mla is None:
        return [f"standard attention ({family}: multi-latent attention, --multi-latent-attention)"]
    wanted = {"normalization": "rmsnorm", "activation": "swiglu"}
    differences = [
        f"{name} {getattr(config, name)!r} ({family}: {value!r})"
        for name, value in wanted.items()
        if getattr(config, name) != value
    ]
    if config.add_bias_linear:
        differences.append(f"linear biases ({family}: none; --disable-bias-linear)")
    if not config.qk_layernorm:
        differences.append(f"unnormalized latents ({family} normalizes them: --qk-layernorm)")
    differences += [
        text
        for text in attention_differences(config, family, ("qk_layernorm",))
        if "query/key/value" not in text
    ]
    if config.mtp is not None and architecture == V2:
        differences.append(f"multi-token prediction (--mtp-num-layers; {family}: none)")
    return (
        differences + _rope_differences(config, family) + _router_differences(config, architecture)
    )


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """transformers 5's `rope_parameters` (4's `rope_scaling` without the base) for our MLA."""
    mla, theta = config.mla, float(config.rotary_base)
    if mla.rope_type != "yarn" or mla.rotary_scaling_factor <= 1:
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(mla.rotary_scaling_factor)
    ours = yarn_mscale(factor, mla.mscale) / yarn_mscale(factor, mla.mscale_all_dim)
    inferred = ours if mla.mscale and mla.mscale_all_dim else yarn_mscale(factor)
    rope = dict(
        rope_type="yarn", rope_theta=theta, factor=factor, mscale=float(mla.mscale),
        mscale_all_dim=float(mla.mscale_all_dim), truncate=True, **YARN_FIXED,
    )  # fmt: skip
    if not math.isclose(inferred, ours, rel_tol=1e-12):
        rope["attention_factor"] = ours
    return rope


def deepseek_config_json(
    config: ModelConfig,
    architecture: str,
    true_vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
) -> dict[str, Any]:
    """config.json (less the dtype) of the `architecture` computing `config`'s model, every
    key the computation reads explicit, where transformers 4 and 5 read it."""
    differences = deepseek_differences(config, architecture)
    if differences:
        raise CheckpointConversionError(f"{architecture} cannot compute {'; '.join(differences)}")
    mla, moe = config.mla, config.routed_moe
    keys = llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id)
    rope = _rope_parameters(config)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    ffn = (moe.ffn_hidden_size or config.ffn_hidden_size) if moe else config.ffn_hidden_size
    groups = (moe.num_groups or 1) if moe else 1
    out = dict(
        keys,
        architectures=[architecture],
        model_type="deepseek_v3" if architecture == V3 else "deepseek_v2",
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_head_dim,
        qk_rope_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        head_dim=mla.qk_pos_emb_head_dim,  # what both releases set it to
        num_key_value_heads=config.num_attention_heads,
        rope_parameters=rope,
        rope_scaling=None if scaling["rope_type"] == "default" else scaling,
        attention_bias=False,
        moe_intermediate_size=ffn,
        n_routed_experts=moe.num_experts if moe else 2,
        num_experts_per_tok=moe.top_k if moe else 1,
        n_shared_experts=moe.shared_expert_ffn_hidden_size // ffn if moe else 1,
        routed_scaling_factor=float((moe.topk_scaling_factor if moe else None) or 1.0),
        n_group=groups,
        topk_group=(moe.group_topk or groups) if moe else 1,
        first_k_dense_replace=first_moe_layer(config),
        output_router_logits=False,
    )
    if architecture == V3:
        out.update(
            norm_topk_prob=bool(moe) and moe.top_k > 1,
            rope_interleave=True,
            num_nextn_predict_layers=config.mtp.num_layers if config.mtp else 0,
        )
    else:
        grouped = groups > 1
        out.update(
            norm_topk_prob=False,
            topk_method="group_limited_greedy" if grouped else "greedy",
            mlp_bias=False,
        )
    return out


def _attention_to_hf(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(our state less the MLA weights, the MLA weights by DeepSeek's names)."""
    rest, out = {}, {}
    for name, tensor in state.items():
        match = _LAYER.fullmatch(name)
        if match is None:
            rest[name] = tensor
        elif match.group(2) in ATTENTION_NAMES:
            hf_name = ATTENTION_NAMES[match.group(2)]
            out[f"model.layers.{match.group(1)}.self_attn.{hf_name}"] = tensor
        else:
            raise CheckpointConversionError(f"no Hugging Face DeepSeek counterpart for {name!r}")
    return rest, out


def _mtp_as_layers(state: dict[str, torch.Tensor], num_layers: int) -> tuple[dict, dict]:
    """(our state with each MTP module's transformer layer renamed as decoder layer
    num_layers + k, the modules' own weights by DeepSeek's names)."""
    rest, own = {}, {}
    for name, tensor in state.items():
        if not name.startswith("mtp.layers."):
            rest[name] = tensor
            continue
        number, _, key = name.removeprefix("mtp.layers.").partition(".")
        layer = num_layers + int(number)
        if key.startswith("transformer_layer."):
            inner = key.removeprefix("transformer_layer.")
            rest[f"language_model.encoder.layers.{layer}.{inner}"] = tensor
        elif key in MTP_NAMES:
            own[f"model.layers.{layer}.{MTP_NAMES[key]}"] = tensor
        else:
            raise CheckpointConversionError(f"no DeepSeek multi-token prediction name for {name!r}")
    return rest, own


def to_deepseek_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig, architecture: str
) -> dict[str, torch.Tensor]:
    """Our full (TP=1, global expert numbers) state dict -> `architecture`'s weights as
    transformers 4 names them (tied lm_head left out; MTP modules as layers L + k)."""
    rest, mtp_own = _mtp_as_layers(state, config.num_layers)
    rest, out = _attention_to_hf(rest)
    moe_state = to_glm4_moe_state_dict(rest, config)
    if architecture == V2:
        moe_state = {k: v for k, v in moe_state.items() if "e_score_correction_bias" not in k}
    out.update(moe_state)
    embeddings = out["model.embed_tokens.weight"]
    head = out.get("lm_head.weight", embeddings)
    for number in range(config.mtp.num_layers if config.mtp else 0):
        hf = f"model.layers.{config.num_layers + number}."
        out[hf + "embed_tokens.weight"] = embeddings.clone()
        out[hf + "shared_head.head.weight"] = head.clone()
    return {**out, **mtp_own}
