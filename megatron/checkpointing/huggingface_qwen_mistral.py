"""Our LLaMA-style models with Qwen2's q/k/v biases, Qwen3's QK norm or Mistral's sliding window
<-> Hugging Face `Qwen2ForCausalLM`, `Qwen3ForCausalLM` and `MistralForCausalLM`.

Each is LLaMA (RMSNorm, SwiGLU, RoPE over whole heads, grouped-query attention or not, tied or
untied output layer, no biases elsewhere; weights named as LLaMA's, which
`huggingface_llama.py` maps, `self_attn.q_norm` / `k_norm` included) with one attention option:

- Qwen2 (and Qwen2.5, the same model_type "qwen2"): a bias on q_proj, k_proj and v_proj only,
  `--disable-bias-linear --add-qkv-bias` (grouped per key/value head as the weight rows).
  transformers 4's Qwen2 takes the head width as hidden / heads whatever `head_dim` says, so
  only such a model exports. Its sliding window (`use_sliding_window`, on the layers from
  `max_window_layers` on, `layer_types`) is not built here: refused on import.
- Qwen3: `q_norm` and `k_norm`, RMSNorm over each head's head_dim with the model's epsilon,
  after the projections and before RoPE: `--qk-layernorm` (megatron-core's `q_layernorm`,
  `k_layernorm`). Its `attention_bias` puts biases on the four attention projections and on
  no MLP, which our flags cannot (refused), and so is its sliding window. Qwen3 needs
  transformers 4.51 or later.
- Mistral: sliding-window attention. transformers' masks (5.x's `sliding_window_overlay` in
  masking_utils.py, 4.x's `_prepare_4d_causal_attention_mask_with_cache_position`) let a
  query at position q see the keys k with q - sliding_window < k <= q: sliding_window keys,
  its own included. Megatron-LM's `--window-size (left, right)` sees q - left <= k <= q +
  right: sliding_window = left + 1, right 0. (4.x's flash-attention path hands flash_attn
  (W, W), one key more than its own masks; 5.x's hands it (W - 1, W - 1).) A window at least
  max_position_embeddings wide masks nothing and imports as no window.

The config.json written carries the keys of transformers 4 and 5 (see `huggingface.py`) and
states the window keys explicitly (`use_sliding_window` false, `layer_types` all full
attention for the Qwens).
"""

from __future__ import annotations

from typing import Any

from megatron.checkpointing.huggingface_llama import (
    llama_style_config_json,
    llama_style_differences,
    megatron_args_from_llama,
)
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig

QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
MISTRAL = "MistralForCausalLM"
MODEL_TYPES = {QWEN2: "qwen2", QWEN3: "qwen3", MISTRAL: "mistral"}
DEFAULTS = {
    "qwen2": dict(num_key_value_heads=32, tie_word_embeddings=False),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, tie_word_embeddings=False),
    "mistral": dict(num_key_value_heads=8, tie_word_embeddings=False, sliding_window=4096),
}
"""What transformers (4 and 5) take for a key config.json leaves out, where it differs from
what `megatron_args_from_llama` assumes (the RoPE base is 10000 and rms_norm_eps 1e-6 for all)."""


def _dense_differences(config: ModelConfig, family: str) -> list[str]:
    """What every dense family here lacks: MoE layers, biases beyond q/k/v."""
    differences = []
    if config.moe is not None or config.routed_moe is not None:
        differences.append(f"Mixture-of-Experts layers ({family}: a dense MLP)")
    if config.add_bias_linear:
        differences.append(
            f"biases on every linear layer ({family}: none on the output projection and the "
            "MLP; --disable-bias-linear)"
        )
    return differences


def qwen2_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's Qwen2 cannot compute (empty: it converts exactly)."""
    differences = llama_style_differences(config, "Qwen2", allowed=("qkv_bias",))
    differences += _dense_differences(config, "Qwen2")
    if not config.add_qkv_bias:
        differences.append("no query/key/value biases (Qwen2: on q, k and v; --add-qkv-bias)")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        differences.append(
            f"kv_channels {config.kv_channels} x num_attention_heads "
            f"{config.num_attention_heads} != hidden_size {config.hidden_size} (transformers 4's "
            "Qwen2: head width = hidden / heads)"
        )
    return differences


def qwen3_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's Qwen3 cannot compute (empty: it converts exactly)."""
    differences = llama_style_differences(config, "Qwen3", allowed=("qk_layernorm",))
    differences += _dense_differences(config, "Qwen3")
    if not config.qk_layernorm:
        differences.append("no QK norm (Qwen3: q_norm and k_norm; --qk-layernorm)")
    return differences


def mistral_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's Mistral cannot compute (empty: it converts exactly)."""
    differences = llama_style_differences(config, "Mistral", allowed=("window_size",))
    differences += _dense_differences(config, "Mistral")
    if config.window_size is None:
        differences.append("no sliding window (Mistral: sliding_window; --window-size)")
    return differences


DIFFERENCES = {QWEN2: qwen2_differences, QWEN3: qwen3_differences, MISTRAL: mistral_differences}
"""Each architecture's check of a model (used to pick the one that computes it)."""


def qwen_mistral_config_json(
    architecture: str,
    config: ModelConfig,
    true_vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
) -> dict[str, Any]:
    """config.json (less the dtype) of the `architecture` (Qwen2, Qwen3 or Mistral) computing
    `config`'s model, every key the computation reads explicit, in transformers 4's and 5's
    places."""
    differences = DIFFERENCES[architecture](config)
    if differences:
        raise CheckpointConversionError(f"{architecture} cannot compute {'; '.join(differences)}")
    keys = dict(
        llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id),
        architectures=[architecture],
        model_type=MODEL_TYPES[architecture],
    )
    if architecture == MISTRAL:
        return dict(keys, sliding_window=config.window_size[0] + 1)
    full = dict(
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=config.num_layers,
        layer_types=["full_attention"] * config.num_layers,
    )
    if architecture == QWEN3:
        full["attention_bias"] = False
    return dict(keys, **full)


def _refuse_qwen_sliding_window(hf_config: dict[str, Any]) -> None:
    """Refuse the Qwens' sliding window (named by the key that turns it on)."""
    if hf_config.get("use_sliding_window"):
        raise CheckpointConversionError(
            "config.json has use_sliding_window=true: the Qwen sliding window (on the layers "
            "from max_window_layers on) is not built here"
        )
    kinds = hf_config.get("layer_types") or []
    if any(kind != "full_attention" for kind in kinds):
        other = next(kind for kind in kinds if kind != "full_attention")
        raise CheckpointConversionError(
            f"config.json has layer_types with {other!r}: only 'full_attention' layers convert"
        )


def _llama_args(hf_config: dict[str, Any], *sizes: Any) -> dict[str, Any]:
    """LLaMA's checkpoint args for a family whose biases config.json does not set: Qwen2's q/k/v
    biases are fixed, Qwen3 (after its refusal) and Mistral have none."""
    return megatron_args_from_llama(
        {**hf_config, "attention_bias": False, "mlp_bias": False}, *sizes
    )


def megatron_args_from_qwen2(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the Qwen2 of `hf_config` (a dict):
    LLaMA's with biases on q, k and v (`--add-qkv-bias`)."""
    hf_config = {**DEFAULTS["qwen2"], **hf_config}
    _refuse_qwen_sliding_window(hf_config)
    heads, hidden = hf_config["num_attention_heads"], hf_config["hidden_size"]
    if hf_config.get("head_dim") not in (None, hidden // heads):
        raise CheckpointConversionError(
            f"config.json has head_dim={hf_config['head_dim']!r}, but transformers 4's Qwen2 "
            f"takes hidden_size / num_attention_heads = {hidden // heads}"
        )
    args = _llama_args(hf_config, tp_size, pp_size, make_vocab_size_divisible_by, seq_length)
    return dict(args, add_qkv_bias=True)


def megatron_args_from_qwen3(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the Qwen3 of `hf_config` (a dict):
    LLaMA's with each head's queries and keys normalized (`--qk-layernorm`)."""
    hf_config = {**DEFAULTS["qwen3"], **hf_config}
    _refuse_qwen_sliding_window(hf_config)
    if hf_config.get("attention_bias"):
        raise CheckpointConversionError(
            "config.json has attention_bias=true: Qwen3's biases on the four attention "
            "projections alone are not built here (--add-qkv-bias covers q, k and v only)"
        )
    args = _llama_args(hf_config, tp_size, pp_size, make_vocab_size_divisible_by, seq_length)
    return dict(args, qk_layernorm=True)


def megatron_args_from_mistral(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the Mistral of `hf_config` (a dict):
    LLaMA's with `--window-size (sliding_window - 1, 0)` (none if the window spans every
    position)."""
    hf_config = {**DEFAULTS["mistral"], **hf_config}
    window = hf_config.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise CheckpointConversionError(f"config.json has sliding_window={window!r}; not a number")
    if window is not None and window < 1:
        raise CheckpointConversionError(
            f"config.json has sliding_window={window}; need at least 1 (or null: no window)"
        )
    args = _llama_args(hf_config, tp_size, pp_size, make_vocab_size_divisible_by, seq_length)
    if window is not None and window < args["max_position_embeddings"]:
        args["window_size"] = (window - 1, 0)
    return args
