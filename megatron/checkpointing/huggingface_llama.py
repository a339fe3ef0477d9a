"""Our LLaMA-style weights and flags <-> Hugging Face `LlamaForCausalLM` names, layouts, config.

A checkpoint converts when it is RMSNorm + SwiGLU + RoPE over whole heads (`rotary_percent`
1), with or without grouped-query attention, an untied output layer and linear biases (HF's
`attention_bias` / `mlp_bias`, both on or both off like our `add_bias_linear`). Pure torch and
plain dicts (the tools in tools/checkpoint/ import `transformers`):

- our `query_key_value` rows are grouped per key/value head, [nkv, nq/nkv + 2, hn]: each
  group's query heads, then its key head, then its value head. HF's `q_proj` holds the query
  heads in order (head i uses key/value head i // (nq/nkv), the same grouping), `k_proj` and
  `v_proj` the key/value heads;
- our `dense_h_to_4h` (TP=1) is [gate; up]: `gate_proj` then `up_proj`;
- both sides rotate the two halves of each head's channels (HF's `rotate_half`, our
  `apply_rotary_pos_emb`) with the same angles, so q/k rows need no permutation;
- Linear weights are [out, in] on both sides;
- the QK norms (`--qk-layernorm`: `self_attention.q_layernorm` / `k_layernorm`) are Qwen3's
  `self_attn.q_norm` / `k_norm`, and q/k/v biases alone (`--add-qkv-bias`) Qwen2's: those
  families, and Mistral's sliding window, are `huggingface_qwen_mistral.py`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.checkpointing.shapes import OUTPUT_LAYER, WORD_EMBEDDINGS
from megatron.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
_TOP = {
    WORD_EMBEDDINGS: "model.embed_tokens.weight",
    "language_model.encoder.final_layernorm.weight": "model.norm.weight",
    OUTPUT_LAYER: "lm_head.weight",
}
_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3's
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "self_attention.dense.bias": "self_attn.o_proj.bias",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
    "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias",
}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
_LAYER_PREFIX = "language_model.encoder.layers."


def attention_differences(
    config: ModelConfig, family: str, allowed: tuple[str, ...] = ()
) -> list[str]:
    """Which of the attention options a plain LLaMA lacks `config` uses, but those `family`
    computes (`allowed`: "qkv_bias", "qk_layernorm", "window_size")."""
    used = {
        "qkv_bias": config.add_qkv_bias and not config.add_bias_linear,
        "qk_layernorm": config.qk_layernorm,
        "window_size": config.window_size is not None,
    }
    texts = {
        "qkv_bias": f"biases on the query/key/value projection alone (--add-qkv-bias; {family}: "
        "none, or on every linear layer)",
        "qk_layernorm": f"a norm of each head's queries and keys (--qk-layernorm; {family}: none)",
        "window_size": f"sliding-window attention (--window-size; {family}: whole-sequence "
        "attention)",
    }
    return [texts[name] for name, on in used.items() if on and name not in allowed]


def llama_style_differences(
    config: ModelConfig, family: str, allowed: tuple[str, ...] = ()
) -> list[str]:
    """What in `config` differs from every LLaMA-style model (`family` names it in the text):
    RMSNorm, SwiGLU, RoPE over whole heads; and the attention options of
    `attention_differences` but those `allowed`."""
    wanted = {
        "normalization": "rmsnorm",
        "activation": "swiglu",
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
    }
    return [
        f"{name} {getattr(config, name)!r} ({family}: {value!r})"
        for name, value in wanted.items()
        if getattr(config, name) != value
    ] + attention_differences(config, family, allowed)


def llama_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's LLaMA cannot compute (empty: it converts exactly)."""
    differences = llama_style_differences(config, "LLaMA")
    if config.hidden_size % config.num_attention_heads:
        differences.append(
            f"hidden_size {config.hidden_size} not a multiple of num_attention_heads "
            f"{config.num_attention_heads} (transformers 5's LLaMA config requires it)"
        )
    if config.moe is not None:
        differences.append("Mixture-of-Experts layers (LLaMA: a dense MLP; see Mixtral)")
    return differences


def llama_config_json(
    config: ModelConfig, true_vocab_size: int, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, Any]:
    """config.json (less the dtype) of the `LlamaForCausalLM` computing `config`'s model.

    Read alike by transformers 4.45+ and 5.x (see `huggingface.py`): the RoPE base is both
    4.x's top-level `rope_theta` and 5.x's `rope_parameters`. 4.45 is our floor because
    `head_dim` is read from it on and `mlp_bias` from 4.41 (earlier releases would take hidden //
    heads and drop MLP biases without an error).
    """
    differences = llama_differences(config)
    if differences:
        raise CheckpointConversionError(f"{ARCHITECTURE} cannot compute {', '.join(differences)}")
    return dict(
        llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id),
        attention_bias=config.add_bias_linear,
        mlp_bias=config.add_bias_linear,
    )


def llama_style_config_json(
    config: ModelConfig, true_vocab_size: int, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, Any]:
    """The config.json keys LLaMA and Mixtral share (`architectures` says LLaMA), unchecked."""
    theta = float(config.rotary_base)
    return dict(
        architectures=[ARCHITECTURE],
        model_type="llama",
        vocab_size=true_vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.kv_channels,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std,
        rms_norm_eps=config.layernorm_epsilon,
        rope_theta=theta,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attention_dropout=config.attention_dropout,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def _qkv_to_hf(tensor: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """Our grouped rows [nkv, g + 2, hn](, h) -> HF's q [nq hn], k and v [nkv hn] (, h)."""
    nkv = config.num_key_value_heads
    group = config.num_attention_heads // nkv
    grouped = tensor.reshape(nkv, group + 2, config.kv_channels, *tensor.shape[1:])
    parts = (grouped[:, :group], grouped[:, group], grouped[:, group + 1])
    return [part.reshape(-1, *tensor.shape[1:]).contiguous() for part in parts]


def _qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig):
    """HF's q, k, v projections -> our rows grouped per key/value head."""
    nkv, hn = config.num_key_value_heads, config.kv_channels
    rest = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(nkv, -1, hn, *rest),
            k.reshape(nkv, 1, hn, *rest),
            v.reshape(nkv, 1, hn, *rest),
        ],
        dim=1,
    )  # [nkv, g + 2, hn(, h)]
    return grouped.reshape(-1, *rest).contiguous()


def to_llama_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP=1) GPTModel state dict -> `LlamaForCausalLM` names (tied lm_head left out)."""
    out = {}
    for name, tensor in state.items():
        if name in _TOP:
            out[_TOP[name]] = tensor.clone()
            continue
        number, _, key = name.removeprefix(_LAYER_PREFIX).partition(".")
        module, _, param = key.rpartition(".")
        hf = f"model.layers.{number}."
        if not name.startswith(_LAYER_PREFIX):
            raise CheckpointConversionError(f"no Hugging Face LLaMA counterpart for {name!r}")
        if module == "self_attention.query_key_value":
            for hf_module, part in zip(_QKV, _qkv_to_hf(tensor, config)):
                out[f"{hf}{hf_module}.{param}"] = part
        elif module == "mlp.dense_h_to_4h":  # [gate; up]
            for hf_module, part in zip(_GATE_UP, tensor.chunk(2, dim=0)):
                out[f"{hf}{hf_module}.{param}"] = part.clone()
        elif key in _LAYER:
            out[hf + _LAYER[key]] = tensor.clone()
        else:
            raise CheckpointConversionError(f"no Hugging Face LLaMA counterpart for {name!r}")
    return out


def _pop(hf_state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf_state:
        raise CheckpointConversionError(f"the LLaMA weights lack {name}")
    return hf_state.pop(name)


def from_llama_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` weights -> our full GPTModel state dict (`config` from its args).

    With tied embeddings (`untie_embeddings_and_output_weights` False) `lm_head.weight`, when
    present, must equal the embeddings.
    """
    remaining = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    out: dict[str, torch.Tensor] = {}
    for number in range(config.num_layers):
        hf, ours = f"model.layers.{number}.", f"{_LAYER_PREFIX}{number}."
        for param in ("weight", "bias"):
            if f"{hf}{_QKV[0]}.{param}" in remaining:
                q, k, v = (_pop(remaining, f"{hf}{name}.{param}") for name in _QKV)
                out[f"{ours}self_attention.query_key_value.{param}"] = _qkv_from_hf(q, k, v, config)
            if f"{hf}{_GATE_UP[0]}.{param}" in remaining:
                gate, up = (_pop(remaining, f"{hf}{name}.{param}") for name in _GATE_UP)
                out[f"{ours}mlp.dense_h_to_4h.{param}"] = torch.cat([gate, up])
        for key, hf_key in _LAYER.items():
            if hf + hf_key in remaining:
                out[ours + key] = remaining.pop(hf + hf_key).clone()
    for ours, hf in _TOP.items():
        if hf in remaining:
            out[ours] = remaining.pop(hf).clone()
    if remaining:
        raise CheckpointConversionError(f"unknown LLaMA parameter {sorted(remaining)[0]!r}")
    if not config.untie_embeddings_and_output_weights:
        head = out.pop(OUTPUT_LAYER, None)
        if head is not None and not torch.equal(head, out.get(WORD_EMBEDDINGS, head)):
            raise CheckpointConversionError(
                "lm_head.weight differs from model.embed_tokens.weight, but config.json has "
                "tie_word_embeddings true"
            )
    return out


def rope_settings(
    hf_config: dict[str, Any], default_theta: float, default_partial: float | None = None
) -> tuple[float, float]:
    """(RoPE base, fraction of each head rotated) of a config.json by transformers 4 (top-level
    `rope_theta`, `partial_rotary_factor`, `rope_scaling`) or 5 (`rope_parameters`), the
    defaults where it sets none; refuses scaled RoPE and values the two would read apart.
    `default_partial` None: the family rotates whole heads, and any other fraction is refused."""
    places = {"": hf_config}  # key prefix -> where transformers 4 or 5 may look
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf_config.get(key) or {}
        if not isinstance(rope, dict):
            raise CheckpointConversionError(f"config.json has {key}={rope!r}; expected an object")
        field = "type" if "type" in rope and "rope_type" not in rope else "rope_type"
        if rope.get(field, "default") != "default":
            raise CheckpointConversionError(
                f"config.json has {key}.{field}={rope[field]!r}; only plain RoPE ('default') "
                "converts"
            )
        places[f"{key}."] = rope

    def given(name: str, default: float) -> float:
        """`name`'s one value where config.json sets it (a number), else `default`."""
        found = {p + name: d[name] for p, d in places.items() if d.get(name) is not None}
        for key, value in found.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CheckpointConversionError(f"config.json has {key}={value!r}; not a number")
        if len({float(value) for value in found.values()}) > 1:
            raise CheckpointConversionError(
                f"config.json has {' but '.join(f'{k}={v:g}' for k, v in found.items())}: "
                f"transformers 4 and 5 would read different values of {name}"
            )
        return float(next(iter(found.values()), default))

    partial = given("partial_rotary_factor", 1.0 if default_partial is None else default_partial)
    if default_partial is None and partial != 1.0:
        raise CheckpointConversionError(
            f"config.json has partial_rotary_factor={partial:g}; only 1 (RoPE over whole heads) "
            "converts"
        )
    if not 0.0 < partial <= 1.0:
        raise CheckpointConversionError(
            f"config.json has partial_rotary_factor={partial:g}; need above 0, at most 1"
        )
    return given("rope_theta", default_theta), partial


def megatron_args_from_llama(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
    default_rope_theta: float = 10000.0,
    default_partial_rotary: float | None = None,
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the LLaMA of `hf_config` (a dict);
    `default_rope_theta`: the family's RoPE base where config.json gives none;
    `default_partial_rotary`: the fraction of each head a family that may rotate part of it
    rotates where config.json gives none (None: whole heads only, as LLaMA)."""
    act = hf_config.get("hidden_act", "silu")
    bias = bool(hf_config.get("attention_bias", False))
    if act != "silu":
        raise CheckpointConversionError(f"config.json has hidden_act={act!r}; only 'silu'")
    if bool(hf_config.get("mlp_bias", False)) != bias:
        raise CheckpointConversionError(
            "config.json has attention_bias != mlp_bias; our --disable-bias-linear sets both"
        )
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    positions = hf_config["max_position_embeddings"]
    if seq_length is not None and seq_length > positions:
        raise CheckpointConversionError(
            f"--seq-length {seq_length} exceeds the model's max_position_embeddings {positions}"
        )
    theta, partial = rope_settings(hf_config, default_rope_theta, default_partial_rotary)
    rotated = int(head_dim * partial)
    if rotated < 2 or rotated % 2:
        raise CheckpointConversionError(
            f"config.json has partial_rotary_factor={partial:g} of head_dim {head_dim}: "
            f"{rotated} rotated channels; our RoPE needs a positive even number"
        )
    return dict(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=hf_config.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf_config["intermediate_size"],
        kv_channels=head_dim,
        max_position_embeddings=positions,
        seq_length=seq_length or positions,
        layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        init_method_std=hf_config.get("initializer_range", 0.02),
        hidden_dropout=0.0,
        attention_dropout=float(hf_config.get("attention_dropout") or 0.0),
        normalization="rmsnorm",
        swiglu=True,
        openai_gelu=False,
        bias_gelu_fusion=False,
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False),
        add_bias_linear=bias,
        use_rotary_position_embeddings=True,
        add_position_embedding=False,
        position_embedding_type="rope",
        rope_theta=theta,
        rotary_percent=partial,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        true_vocab_size=hf_config["vocab_size"],
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )
