"""Hugging Face `GptOssForCausalLM` config.json -> our checkpoint args (Megatron's dest names):
what `huggingface_gpt_oss.py` says each of gpt-oss's settings is in our flags, read as
transformers reads config.json, a key our model cannot compute refused in one line naming it.

Where config.json says the rotary settings: transformers 4 reads `rope_scaling` (and the
top-level `rope_theta`), 5 reads `rope_scaling` when it is set and `rope_parameters` when not;
with neither, both take gpt-oss's YaRN (factor 32, original context 4096, betas 32 and 1, not
truncated). The import reads them so: a `rope_parameters` alone, as 5 saves it, is what 5
computes (4 would take the default YaRN; a `rope_scaling` of null with no `rope_parameters`,
plain RoPE to 4 and YaRN to 5, is refused). YaRN's cos/sin factor must be 0.1 ln(factor) + 1
(no other `attention_factor`, or `mscale` with `mscale_all_dim`), ours at `--mscale 1
--mscale-all-dim 0`.

transformers 4 fixes the experts' clamp at 7 and their sigmoid gain at 1.702; 5 reads
`swiglu_limit` and `swiglu_alpha`: the import takes the `swiglu_limit` written (what 5
computes) and refuses another `swiglu_alpha` (our `--quick-geglu`'s is 1.702).
"""

from __future__ import annotations

import math
from typing import Any

from megatron.checkpointing.huggingface_gpt_oss import FAMILY, SWIGLU_ALPHA, SWIGLU_LIMIT
from megatron.checkpointing.huggingface_llama import megatron_args_from_llama
from megatron.checkpointing.huggingface_routed import check_routed_import, routed_moe_args
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.yarn_config import yarn_mscale

DEFAULT_THETA = 150000.0
DEFAULT_YARN = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
    original_max_position_embeddings=4096,
)  # fmt: skip
"""The rotary settings transformers (4 and 5) takes where config.json gives none."""
DEFAULTS = dict(
    num_local_experts=128, num_experts_per_tok=4, head_dim=64, num_key_value_heads=8,
    sliding_window=128, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
    swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT, router_aux_loss_coef=0.0,
)  # fmt: skip
"""What transformers takes for a key config.json leaves out (its aux-loss weight, 0.9 in 4
and 0.001 in 5, is a training setting: none here)."""
_ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor")


def _number(value: Any, key: str, low: float | None = None) -> float:
    """`value` (config.json's `key`) as a float, or a one-line refusal naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointConversionError(f"config.json has {key}={value!r}; not a number")
    if low is not None and value <= low:
        raise CheckpointConversionError(f"config.json has {key}={value!r}; need above {low:g}")
    return float(value)


def _rope_source(hf_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(where, the rotary settings) transformers reads from `hf_config` (see the module's
    docstring); refuses a config.json the two releases read apart."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf_config.get(key)
        if value is not None and not isinstance(value, dict):
            raise CheckpointConversionError(f"config.json has {key}={value!r}; expected an object")
        if value:
            return key, value
    if "rope_scaling" in hf_config:
        raise CheckpointConversionError(
            "config.json has rope_scaling=null and no rope_parameters: transformers 4 reads "
            f"plain RoPE, 5 {FAMILY}'s YaRN (factor 32): write the settings meant there"
        )
    return "rope_scaling", dict(DEFAULT_YARN)


def _rope_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our rotary flags (dest names) for a gpt-oss config.json's RoPE or YaRN."""
    where, rope = _rope_source(hf_config)
    places = {
        "rope_theta": hf_config.get("rope_theta"),
        f"{where}.rope_theta": rope.get("rope_theta"),
    }
    found = {key: value for key, value in places.items() if value is not None}
    if len({_number(value, key) for key, value in found.items()}) > 1:
        raise CheckpointConversionError(
            f"config.json has {' but '.join(f'{k}={v:g}' for k, v in found.items())}: "
            "transformers 4 and 5 would read different RoPE bases"
        )
    theta = _number(next(iter(found.values()), DEFAULT_THETA), "rope_theta", 0.0)
    partial = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise CheckpointConversionError(
            f"config.json has partial_rotary_factor={partial!r}; only 1 (RoPE over whole heads) "
            "converts"
        )
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return dict(
            position_embedding_type="rope", use_rotary_position_embeddings=True, rope_theta=theta
        )
    if kind != "yarn":
        raise CheckpointConversionError(
            f"config.json has {where}.rope_type={kind!r}; only 'yarn' and 'default' convert"
        )
    return dict(
        _yarn_args(hf_config, where, rope),
        position_embedding_type="yarn",
        use_rotary_position_embeddings=False,
        rope_theta=theta,
    )


def _yarn_args(hf_config: dict[str, Any], where: str, rope: dict[str, Any]) -> dict[str, Any]:
    """Our YaRN flags (dest names) for the settings `rope` (config.json's `where`), read as
    transformers reads them (its defaults where a key is missing or null)."""
    original = rope.get("original_max_position_embeddings")
    if original is None:
        original = hf_config["max_position_embeddings"]
    original = int(_number(original, f"{where}.original_max_position_embeddings", 0.0))
    factor = rope.get("factor")
    if factor is None:  # transformers 5's rule; 4 needs the key
        factor = hf_config["max_position_embeddings"] / original
    factor = _number(factor, f"{where}.factor", 0.0)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointConversionError(f"config.json has {where}.truncate={truncate!r}")
    ours = yarn_mscale(factor)
    theirs, named = rope.get("attention_factor"), "attention_factor"
    if theirs is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        # transformers' inference from both (one alone: YaRN's own, ours)
        named = "mscale and mscale_all_dim"
        scales = [_number(rope[key], f"{where}.{key}") for key in ("mscale", "mscale_all_dim")]
        theirs = yarn_mscale(factor, scales[0]) / yarn_mscale(factor, scales[1])
    if theirs is not None and not math.isclose(
        _number(theirs, f"{where}.{named}"), ours, rel_tol=1e-9
    ):
        raise CheckpointConversionError(
            f"config.json's {where}.{named} scale cos and sin by {theirs:.6g}; ours by YaRN's "
            f"0.1 ln(factor) + 1 = {ours:.6g} (--mscale 1 --mscale-all-dim 0)"
        )
    return dict(
        rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=_number(rope.get("beta_fast") or 32.0, f"{where}.beta_fast"),
        yarn_beta_slow=_number(rope.get("beta_slow") or 1.0, f"{where}.beta_slow"),
        yarn_correction_range_round_to_int=truncate,
        mscale=1.0,
        mscale_all_dim=0.0,
    )


def window_attn_skip_freq(windowed: list[bool]) -> int | list[int] | None:
    """`--window-attn-skip-freq` for layers windowed or not (from layer 1): N when the full
    layers are those whose number N divides, None when all are windowed, else the list
    (1 windowed)."""
    if all(windowed):
        return None
    for every in range(2, len(windowed) + 1):
        if all(w == bool(number % every) for number, w in enumerate(windowed, 1)):
            return every
    return [int(w) for w in windowed]


def _window_args(hf_config: dict[str, Any], layers: int) -> dict[str, Any]:
    """Our sliding-window flags (dest names) for a gpt-oss config.json's `layer_types` and
    `sliding_window`: none where no layer is windowed."""
    kinds = hf_config.get("layer_types")
    if kinds is None:  # transformers' default: windowed, full, windowed, ...
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    allowed = ("sliding_attention", "full_attention")
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - set(allowed):
        raise CheckpointConversionError(
            f"config.json has layer_types={kinds!r}; need {layers} of {allowed}"
        )
    windowed = [kind == "sliding_attention" for kind in kinds]
    if not any(windowed):
        return dict(window_size=None, window_attn_skip_freq=None)
    window = hf_config["sliding_window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointConversionError(
            f"config.json has sliding_window={window!r} with sliding_attention layers; need a "
            "whole number >= 1"
        )
    return dict(window_size=(window - 1, 0), window_attn_skip_freq=window_attn_skip_freq(windowed))


def megatron_args_from_gpt_oss(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
    moe_family: str = "megatron",
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the gpt-oss of `hf_config` (a dict)
    as our GPT with Megatron-LM's MoE; refuses what differs in one line naming the key."""
    if moe_family != "megatron":
        raise CheckpointConversionError(
            f"--moe-family {moe_family}: DeepSpeed-MoE's top-2 gating cannot take {FAMILY}'s "
            "top-k; it imports as Megatron-LM's MoE (--moe-family megatron)"
        )
    check_routed_import(tp_size)
    hf_config = {**DEFAULTS, **hf_config}  # a null head_dim or num_key_value_heads: LLaMA's
    alpha = _number(hf_config["swiglu_alpha"], "swiglu_alpha")
    if alpha != SWIGLU_ALPHA:
        raise CheckpointConversionError(
            f"config.json has swiglu_alpha={alpha:g}; our --quick-geglu computes "
            f"gate * sigmoid({SWIGLU_ALPHA} gate)"
        )
    limit = _number(hf_config["swiglu_limit"], "swiglu_limit", 0.0)
    if hf_config["attention_bias"] is not True:
        raise CheckpointConversionError(
            f"config.json has attention_bias={hf_config['attention_bias']!r}: {FAMILY} without "
            "attention biases is not built here (transformers 4 puts them back)"
        )
    layers = hf_config["num_hidden_layers"]
    # LLaMA's args less its rotary settings (ours below) and checks (gpt-oss's `hidden_act`
    # is unused; its biases are on the attention, the router and the experts).
    llama = {k: v for k, v in hf_config.items() if k not in _ROPE_KEYS}
    llama.update(attention_bias=True, mlp_bias=True, hidden_act="silu")
    args = megatron_args_from_llama(
        llama, tp_size, pp_size, make_vocab_size_divisible_by, seq_length
    )
    coeff = hf_config["router_aux_loss_coef"] or 0.0
    routed = routed_moe_args(
        hf_config["num_local_experts"],
        hf_config["num_experts_per_tok"],
        moe_ffn_hidden_size=hf_config["intermediate_size"],
        moe_aux_loss_coeff=[_number(coeff, "router_aux_loss_coef")],
    )
    return dict(
        args,
        **_rope_args(hf_config),
        **_window_args(hf_config, layers),
        **routed,
        swiglu=False,
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=limit,
        softmax_type="learnable",
    )
