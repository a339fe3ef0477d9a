"""Our gpt-oss-shaped models <-> Hugging Face `GptOssForCausalLM` (model_type "gpt_oss").

gpt-oss is LLaMA-style (RMSNorm, grouped-query attention, rotary positions over whole heads,
`head_dim` wide heads) with Megatron-LM's MoE in every layer, and:

- biases on every linear layer: q, k, v and o (`attention_bias`, which transformers 4 forces
  on), the router and each expert's two linears: ours without `--disable-bias-linear`;
- attention sinks: per head a learned logit `self_attn.sinks` beside every query's scores,
  in the softmax and dropped after it: our `--softmax-type learnable`;
- sliding windows on the layers `layer_types` calls "sliding_attention": a query sees itself
  and the `sliding_window` - 1 keys before it (`huggingface_qwen_mistral.py` says why), our
  `--window-size (sliding_window - 1, 0)`; which layers: `--window-attn-skip-freq N` when the
  full layers are those whose number (from 1) N divides (gpt-oss alternates: N = 2), else the
  per-layer list (1 windowed); no window flags where no layer is windowed;
- YaRN (`rope_type` "yarn"): our `--position-embedding-type yarn` with `factor`,
  `original_max_position_embeddings`, `beta_fast`, `beta_slow` and `truncate` (our
  `--yarn-correction-range-round-to-int`), cos and sin scaled by 0.1 ln(factor) + 1, what
  transformers infers without `attention_factor` (or `mscale` with `mscale_all_dim`) and ours
  at `--mscale 1 --mscale-all-dim 0`; another factor is refused both ways. Plain RoPE
  ("default") is our `--use-rotary-position-embeddings`. The base is `rope_theta` (150000
  unless given);
- the router: logits x W^T + b, the top k of them, the softmax over those k: ours without
  `--moe-router-pre-softmax`;
- the experts' activation: gate clamped to at most `swiglu_limit`, up to [-limit, limit],
  then (up + 1) * gate * sigmoid(1.702 gate): our `--quick-geglu --glu-linear-offset 1
  --activation-func-clamp-value limit`. transformers 4 fixes limit 7 and alpha 1.702 (5
  reads `swiglu_limit` and `swiglu_alpha`): an export needs limit 7.

The export writes the rotary settings where transformers 4 reads them (`rope_scaling` and the
top-level `rope_theta`) and where 5 does (`rope_parameters`); the import is
`huggingface_gpt_oss_import.py`.

Weight names, Hugging Face's under `model.layers.{i}.` (the same in transformers 4 and 5,
which loads them unconverted), ours under `language_model.encoder.layers.{i}.`:

- `self_attn.sinks` [heads] <-> `self_attention.core_attention.softmax_offset`;
- `mlp.router.weight` [E, h] and `mlp.router.bias` [E] <-> `mlp.router.weight` and `.bias`;
- `mlp.experts.gate_up_proj` [E, h, 2 ffn], its columns gate and up interleaved (gate at the
  even columns, up at the odd), and `gate_up_proj_bias` [E, 2 ffn] alike <->
  `mlp.experts.weight1` [E, h, 2 ffn] and `bias1` [E, 2 ffn], whose halves are [gate | up];
- `mlp.experts.down_proj` [E, ffn, h] and `down_proj_bias` [E, h] <-> `weight2` and `bias2`,
  as they are;
- the attention projections (with their biases), norms, embeddings and lm_head as LLaMA's
  (`huggingface_llama.py`).

Released gpt-oss checkpoints hold the experts in MXFP4: transformers dequantizes them on load
where its kernels are missing (a CPU), so they import in bf16. `router_aux_loss_coef` carries
`--moe-aux-loss-coeff` (training only: the logits do not depend on it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron.checkpointing.huggingface_llama import (
    attention_differences,
    from_llama_state_dict,
    llama_style_config_json,
    to_llama_state_dict,
)
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig
from megatron.yarn_config import yarn_mscale

ARCHITECTURE = "GptOssForCausalLM"
MODEL_TYPE = "gpt_oss"
FAMILY = "gpt-oss"
SWIGLU_ALPHA = 1.702
"""The experts' sigmoid gain: our quick-GeGLU's, and transformers 4's fixed one."""
SWIGLU_LIMIT = 7.0
"""The experts' clamp transformers 4 fixes (5 reads `swiglu_limit`)."""
_LAYER_PREFIX = "language_model.encoder.layers."
_NAMES = {
    "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
    "mlp.experts.weight1": "mlp.experts.gate_up_proj",
    "mlp.experts.bias1": "mlp.experts.gate_up_proj_bias",
    "mlp.experts.weight2": "mlp.experts.down_proj",
    "mlp.experts.bias2": "mlp.experts.down_proj_bias",
}
"""Ours -> Hugging Face's, under each layer's prefix: what LLaMA's mapping does not hold."""
_INTERLEAVED = ("mlp.experts.weight1", "mlp.experts.bias1")


def _interleaved(halves: torch.Tensor) -> torch.Tensor:
    """[..., 2 ffn] as [gate | up] -> gate and up columns interleaved (g0 u0 g1 u1 ...)."""
    gate, up = halves.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2).contiguous()


def _halves(interleaved: torch.Tensor) -> torch.Tensor:
    """[..., 2 ffn] with gate and up interleaved -> [gate | up]."""
    return torch.cat([interleaved[..., ::2], interleaved[..., 1::2]], dim=-1).contiguous()


def gpt_oss_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's gpt-oss cannot compute (empty: it converts exactly)."""
    clamp = config.activation_clamp_value
    checks = [
        (
            config.normalization != "rmsnorm",
            f"normalization {config.normalization!r} ({FAMILY}: RMSNorm; --normalization rmsnorm)",
        ),
        (
            config.activation != "quick_geglu",
            f"activation {config.activation!r} ({FAMILY}: the clamped quick-GeGLU; --quick-geglu)",
        ),
        (
            config.glu_linear_offset != 1.0,
            f"--glu-linear-offset {config.glu_linear_offset:g} ({FAMILY}: 1, up + 1)",
        ),
        (
            clamp != SWIGLU_LIMIT,
            f"--activation-func-clamp-value {clamp} ({FAMILY}: 7, the swiglu_limit "
            "transformers 4 fixes)",
        ),
        (
            config.softmax_type != "learnable",
            f"--softmax-type {config.softmax_type} ({FAMILY}: learnable attention sinks)",
        ),
        (
            not config.add_bias_linear,
            f"no linear biases (--disable-bias-linear; {FAMILY}: biases on q, k, v, o, the "
            "router and the experts)",
        ),
        (
            not config.rotary,
            f"position embeddings {config.position_embedding_type!r} ({FAMILY}: rotary; "
            "--position-embedding-type yarn or rope)",
        ),
        (
            config.rotary_percent != 1.0,
            f"--rotary-percent {config.rotary_percent:g} ({FAMILY}: RoPE over whole heads)",
        ),
        (config.mla is not None, f"multi-latent attention ({FAMILY}: grouped-query attention)"),
    ]
    differences = [text for differs, text in checks if differs]
    differences += attention_differences(config, FAMILY, allowed=("window_size",))
    if config.window_size is not None and config.window_size[1] != 0:
        left, right = config.window_size
        differences.append(
            f"--window-size {left},{right}: keys after the query ({FAMILY}: causal windows, "
            "right 0)"
        )
    return differences + _yarn_differences(config) + _moe_differences(config)


def _yarn_differences(config: ModelConfig) -> list[str]:
    """YaRN's cos/sin factor other than the one transformers infers."""
    yarn = config.yarn
    if config.position_embedding_type != "yarn" or yarn is None:
        return []
    ours, theirs = yarn.attention_factor(), yarn_mscale(yarn.scaling_factor)
    if math.isclose(ours, theirs, rel_tol=1e-9):
        return []
    return [
        f"--mscale {yarn.mscale:g} --mscale-all-dim {yarn.mscale_all_dim:g}: cos and sin "
        f"scaled by {ours:.6g} ({FAMILY}: YaRN's 0.1 ln(factor) + 1 = {theirs:.6g}; --mscale 1 "
        "--mscale-all-dim 0)"
    ]


def _moe_differences(config: ModelConfig) -> list[str]:
    """What of our Mixture-of-Experts options gpt-oss's (top-k of biased logits, softmax over
    those k, experts in every layer) lacks."""
    moe = config.routed_moe
    if moe is None:
        kind = "DeepSpeed-MoE" if config.moe is not None else "no Mixture-of-Experts layers"
        return [f"{kind} ({FAMILY}: Megatron-LM's MoE in every layer, --moe-router-topk ...)"]
    checks = [
        (not all(moe.moe_layers), f"dense layers (--moe-layer-freq; {FAMILY}: MoE everywhere)"),
        (
            bool(moe.shared_expert_ffn_hidden_size),
            f"a shared expert (--moe-shared-expert-intermediate-size; {FAMILY}: none)",
        ),
        (
            moe.score_function != "softmax",
            f"--moe-router-score-function {moe.score_function} ({FAMILY}: softmax)",
        ),
        (
            moe.pre_softmax,
            f"--moe-router-pre-softmax ({FAMILY}: the softmax over the top k logits)",
        ),
        (moe.expert_bias, f"--moe-router-enable-expert-bias ({FAMILY}: no expert bias)"),
        (
            bool(moe.topk_scaling_factor),
            f"--moe-router-topk-scaling-factor ({FAMILY}: the weights unscaled)",
        ),
        (bool(moe.group_topk), f"--moe-router-group-topk ({FAMILY}: no groups)"),
        (
            moe.capacity_factor is not None,
            f"token dropping (--moe-expert-capacity-factor; {FAMILY} computes every token)",
        ),
    ]
    return [text for differs, text in checks if differs]


def gpt_oss_feature_differences(config: ModelConfig, family: str) -> list[str]:
    """Which of gpt-oss's options, that `family` (another architecture) lacks, `config` uses."""
    used = []
    if config.softmax_type != "vanilla":
        used.append(f"--softmax-type {config.softmax_type}")
    if config.glu_linear_offset != 0.0:
        used.append(f"--glu-linear-offset {config.glu_linear_offset:g}")
    if config.activation_clamp_value is not None:
        used.append(f"--activation-func-clamp-value {config.activation_clamp_value:g}")
    if config.window_size is not None and config.window_attn_skip_freq is not None:
        used.append("--window-attn-skip-freq: windows on some layers only")
    return [f"{text} ({family}: none; {FAMILY} has it)" for text in used]


def _rope_scaling(config: ModelConfig) -> dict[str, Any]:
    """transformers 4's `rope_scaling` (5's `rope_parameters` less the base) of `config`."""
    yarn = config.yarn
    if config.position_embedding_type != "yarn" or yarn is None:
        return {"rope_type": "default"}
    return dict(
        rope_type="yarn",
        factor=float(yarn.scaling_factor),
        original_max_position_embeddings=int(yarn.original_max_position_embeddings),
        beta_fast=float(yarn.beta_fast),
        beta_slow=float(yarn.beta_slow),
        truncate=bool(yarn.round_to_int),
    )


def gpt_oss_config_json(
    config: ModelConfig,
    true_vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    moe_loss_coeff: float | None = None,
) -> dict[str, Any]:
    """config.json (less the dtype) of the `GptOssForCausalLM` computing `config`'s model,
    every key the computation reads explicit, where transformers 4 and 5 read it."""
    differences = gpt_oss_differences(config)
    if differences:
        raise CheckpointConversionError(f"{ARCHITECTURE} cannot compute {'; '.join(differences)}")
    moe, layers = config.routed_moe, config.num_layers
    windows = [config.layer_window(number) for number in range(1, layers + 1)]
    window = next((w for w in windows if w is not None), None)
    theta, scaling = float(config.rotary_base), _rope_scaling(config)
    return dict(
        llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id),
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        intermediate_size=moe.ffn_hidden_size or config.ffn_hidden_size,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=float(moe_loss_coeff or 0.0),
        output_router_logits=False,
        attention_bias=True,
        swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=SWIGLU_LIMIT,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        # Both releases build the sliding mask whatever the layers: a window none uses.
        sliding_window=config.max_position_embeddings if window is None else window[0] + 1,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_parameters={**scaling, "rope_theta": theta},
    )


def to_gpt_oss_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP=1, global expert numbers) state dict -> `GptOssForCausalLM` weights (tied
    lm_head left out)."""
    rest, out = {}, {}
    for name, tensor in state.items():
        number, _, key = name.removeprefix(_LAYER_PREFIX).partition(".")
        if not name.startswith(_LAYER_PREFIX) or key not in _NAMES:
            rest[name] = tensor
            continue
        convert = _interleaved if key in _INTERLEAVED else torch.clone
        out[f"model.layers.{number}.{_NAMES[key]}"] = convert(tensor)
    return {**to_llama_state_dict(rest, config), **out}


def from_gpt_oss_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """`GptOssForCausalLM` weights -> our full state dict (`config` from
    `megatron_args_from_gpt_oss`)."""
    remaining = dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    for number in range(config.num_layers):
        for ours, theirs in _NAMES.items():
            name = f"model.layers.{number}.{theirs}"
            if name not in remaining:
                raise CheckpointConversionError(f"the gpt-oss weights lack {name}")
            tensor = remaining.pop(name)
            convert = _halves if ours in _INTERLEAVED else torch.clone
            out[f"{_LAYER_PREFIX}{number}.{ours}"] = convert(tensor)
    return {**from_llama_state_dict(remaining, config), **out}
