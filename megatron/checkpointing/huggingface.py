"""Which Hugging Face model computes a checkpoint's; GPT-2 <-> `GPT2LMHeadModel` conversion.

`hf_architecture(config)` picks `GPT2LMHeadModel` (LayerNorm, GeLU, learned positions, biases,
tied output layer), `LlamaForCausalLM` (RMSNorm, SwiGLU, RoPE: see `huggingface_llama.py`) or,
for LLaMA with q/k/v biases alone, QK norm or a sliding window, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM` or `MistralForCausalLM` (`huggingface_qwen_mistral.py`)
for a dense model, `MixtralForCausalLM` for a Mixture-of-Experts one (`huggingface_mixtral.py`)
or, for Megatron-LM's MoE with DeepSeek-V3's router (sigmoid, expert bias, shared expert,
first layers dense), `Glm4MoeForCausalLM` (`huggingface_glm4_moe.py`), for it with Qwen3's
attention `Qwen3MoeForCausalLM`, with Qwen2's and a gated shared expert `Qwen2MoeForCausalLM`
(`huggingface_qwen3_moe.py`), with gpt-oss's attention sinks, sliding windows, YaRN, biases
and clamped quick-GeGLU experts `GptOssForCausalLM` (`huggingface_gpt_oss.py`); with
multi-latent attention `DeepseekV3ForCausalLM` or `DeepseekV2ForCausalLM`
(`huggingface_deepseek.py`, the former with multi-token prediction); and refuses, in one line
naming what differs, a model none computes exactly (gpt-oss's options, which only
`GptOssForCausalLM` computes, named for the others too). `hf_config_json` and `to_hf_weights`
write the chosen class's config.json and weights.

GPT-2 conversion, pure torch and plain dicts (the tools in tools/checkpoint/ import
`transformers`):

- HF's `Conv1D` stores weights [in, out], the transpose of our `Linear` [out, in];
- HF's `c_attn` output columns are [q (all heads) | k | v], [3, np, hn]; our
  `query_key_value` rows are per-head interleaved [np, 3, hn] (checkpoint version 3.0);
- the output layer is tied to the word embeddings on both sides;
- our `gelu_tanh` is HF's `gelu_new` (`gelu_pytorch_tanh` computes the same), `gelu` is
  the exact erf form on both sides.

`hf_config_json` writes config.json itself, not through the installed transformers' config
class, so that every release we declare (`transformers>=4.45`, 4.x and 5.x) reads the same
model from it whichever one ran the export: a key 5.x moved is written in both places (the
RoPE base as 4.x's `rope_theta` and 5.x's `rope_parameters`, the dtype as 4.x's `torch_dtype`
and 5.x's `dtype`), and every key the computation depends on is explicit, not left to a
release's default. The importer reads either form (`huggingface_llama.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.checkpointing.huggingface_deepseek import V2 as DEEPSEEK_V2
from megatron.checkpointing.huggingface_deepseek import V3 as DEEPSEEK_V3
from megatron.checkpointing.huggingface_deepseek import (
    deepseek_config_json,
    deepseek_differences,
    to_deepseek_state_dict,
)
from megatron.checkpointing.huggingface_glm4_moe import ARCHITECTURE as GLM4_MOE
from megatron.checkpointing.huggingface_glm4_moe import (
    glm4_moe_config_json,
    glm4_moe_differences,
    to_glm4_moe_state_dict,
)
from megatron.checkpointing.huggingface_gpt_oss import ARCHITECTURE as GPT_OSS
from megatron.checkpointing.huggingface_gpt_oss import (
    gpt_oss_config_json,
    gpt_oss_differences,
    gpt_oss_feature_differences,
    to_gpt_oss_state_dict,
)
from megatron.checkpointing.huggingface_llama import ARCHITECTURE as LLAMA
from megatron.checkpointing.huggingface_llama import (
    attention_differences,
    llama_config_json,
    llama_differences,
    to_llama_state_dict,
)
from megatron.checkpointing.huggingface_mixtral import ARCHITECTURE as MIXTRAL
from megatron.checkpointing.huggingface_mixtral import (
    mixtral_config_json,
    mixtral_differences,
    to_mixtral_state_dict,
)
from megatron.checkpointing.huggingface_qwen3_moe import ARCHITECTURE as QWEN3_MOE
from megatron.checkpointing.huggingface_qwen3_moe import (
    QWEN2_MOE,
    qwen2_moe_differences,
    qwen3_moe_config_json,
    qwen3_moe_differences,
    to_qwen3_moe_state_dict,
)
from megatron.checkpointing.huggingface_qwen_mistral import DIFFERENCES as QWEN_MISTRAL
from megatron.checkpointing.huggingface_qwen_mistral import qwen_mistral_config_json
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.checkpointing.shapes import model_config  # noqa: F401 - the tools import it here
from megatron.config import ModelConfig

GPT2 = "GPT2LMHeadModel"

TO_HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
FROM_HF_ACTIVATION = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
EOD_TOKEN_ID = 50256
"""GPT-2's `<|endoftext|>`, its bos and eos token."""

_TOP = {
    "language_model.embedding.word_embeddings.weight": "transformer.wte.weight",
    "language_model.embedding.position_embeddings.weight": "transformer.wpe.weight",
    "language_model.encoder.final_layernorm.weight": "transformer.ln_f.weight",
    "language_model.encoder.final_layernorm.bias": "transformer.ln_f.bias",
}
_LAYER = {
    "input_layernorm.weight": "ln_1.weight",
    "input_layernorm.bias": "ln_1.bias",
    "self_attention.query_key_value.weight": "attn.c_attn.weight",
    "self_attention.query_key_value.bias": "attn.c_attn.bias",
    "self_attention.dense.weight": "attn.c_proj.weight",
    "self_attention.dense.bias": "attn.c_proj.bias",
    "post_attention_layernorm.weight": "ln_2.weight",
    "post_attention_layernorm.bias": "ln_2.bias",
    "mlp.dense_h_to_4h.weight": "mlp.c_fc.weight",
    "mlp.dense_h_to_4h.bias": "mlp.c_fc.bias",
    "mlp.dense_4h_to_h.weight": "mlp.c_proj.weight",
    "mlp.dense_4h_to_h.bias": "mlp.c_proj.bias",
}
_IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias")
"""Causal-mask buffers older transformers versions saved with the weights."""


def gpt2_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's GPT-2 cannot compute (empty: it converts exactly)."""
    differences = []
    if config.position_embedding_type != "learned_absolute":
        kind = " (rotary)" if config.position_embedding_type == "rope" else ""
        differences.append(
            f"position embeddings {config.position_embedding_type!r}{kind} (GPT-2: learned "
            "absolute)"
        )
    if config.activation not in TO_HF_ACTIVATION:
        differences.append(f"activation {config.activation!r} (GPT-2: a GeLU)")
    if config.normalization != "layernorm":
        differences.append(f"normalization {config.normalization!r} (GPT-2: layernorm)")
    if config.num_key_value_heads != config.num_attention_heads:
        differences.append(
            f"num_key_value_heads {config.num_key_value_heads} (GPT-2: one per query head)"
        )
    if config.untie_embeddings_and_output_weights:
        differences.append("an untied output layer (GPT-2: tied to the word embeddings)")
    if not config.add_bias_linear:
        differences.append("no linear biases (GPT-2: biases)")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        differences.append(
            f"kv_channels {config.kv_channels} x num_attention_heads "
            f"{config.num_attention_heads} != hidden_size {config.hidden_size} (GPT-2: head "
            "width = hidden / heads)"
        )
    return differences + attention_differences(config, "GPT-2")


def hf_architecture(config: ModelConfig) -> str:
    """`GPT2LMHeadModel`, `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
    `MistralForCausalLM` or (Mixture-of-Experts) `MixtralForCausalLM`, `Glm4MoeForCausalLM`,
    `Qwen3MoeForCausalLM`, `Qwen2MoeForCausalLM` or `GptOssForCausalLM` or (multi-latent
    attention) `DeepseekV3ForCausalLM` or `DeepseekV2ForCausalLM`: the Hugging Face class
    computing `config`'s model.

    Raises, naming what differs from the closest, when none does exactly.
    """
    if config.mla is not None:
        candidates = {
            DEEPSEEK_V3: deepseek_differences(config, DEEPSEEK_V3),
            DEEPSEEK_V2: deepseek_differences(config, DEEPSEEK_V2),
        }
        return _closest(candidates, config)
    if config.mtp is not None:
        raise CheckpointConversionError(
            "multi-token prediction (--mtp-num-layers) without multi-latent attention has no "
            "Hugging Face export (DeepSeek-V3's format holds it, with MLA)"
        )
    if config.routed_moe is not None:
        candidates = {
            MIXTRAL: mixtral_differences(config),
            GLM4_MOE: glm4_moe_differences(config),
            QWEN3_MOE: qwen3_moe_differences(config),
            QWEN2_MOE: qwen2_moe_differences(config),
            GPT_OSS: gpt_oss_differences(config),
        }
    elif config.moe is not None:
        candidates = {MIXTRAL: mixtral_differences(config)}
    else:
        candidates = {GPT2: gpt2_differences(config), LLAMA: llama_differences(config)}
        candidates.update({name: check(config) for name, check in QWEN_MISTRAL.items()})
    return _closest(candidates, config)


def _closest(candidates: dict[str, list[str]], config: ModelConfig) -> str:
    """The first architecture with no differences, or a refusal naming the closest's; the
    options only gpt-oss has count as differences of every other."""
    for name in candidates:
        if name != GPT_OSS:
            candidates[name] = candidates[name] + gpt_oss_feature_differences(config, name)
    for name, differences in candidates.items():
        if not differences:
            return name
    name = min(candidates, key=lambda n: len(candidates[n]))
    raise CheckpointConversionError(
        f"no Hugging Face model computes this checkpoint's exactly; the closest, {name}, "
        f"differs in: {'; '.join(candidates[name])}"
    )


def gpt2_config_json(
    config: ModelConfig, true_vocab_size: int, eod_token_id: int = EOD_TOKEN_ID
) -> dict[str, Any]:
    """config.json (less the dtype) of the `GPT2LMHeadModel` computing `config`'s model."""
    differences = gpt2_differences(config)
    if differences:
        raise CheckpointConversionError(f"{GPT2} cannot compute {'; '.join(differences)}")
    return dict(
        architectures=[GPT2],
        model_type="gpt2",
        vocab_size=true_vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        activation_function=TO_HF_ACTIVATION[config.activation],
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        add_cross_attention=False,
        bos_token_id=eod_token_id,
        eos_token_id=eod_token_id,
        tie_word_embeddings=True,
    )


def hf_config_json(
    config: ModelConfig,
    true_vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    dtype: torch.dtype,
    moe_loss_coeff: float | None = None,
) -> dict[str, Any]:
    """config.json of the Hugging Face model computing `config`'s, weights of `dtype`.

    GPT-2 uses `eos_token_id` (our end of document) as its bos too, as OpenAI's GPT-2 does.
    `moe_loss_coeff`: the checkpoint's `--moe-loss-coeff`, Mixtral's `router_aux_loss_coef`.
    """
    architecture = hf_architecture(config)
    if architecture == GPT2:
        keys = gpt2_config_json(config, true_vocab_size, eos_token_id)
    elif architecture == MIXTRAL:
        keys = mixtral_config_json(
            config, true_vocab_size, bos_token_id, eos_token_id, moe_loss_coeff
        )
    elif architecture == GLM4_MOE:
        keys = glm4_moe_config_json(config, true_vocab_size, bos_token_id, eos_token_id)
    elif architecture == GPT_OSS:
        keys = gpt_oss_config_json(
            config, true_vocab_size, bos_token_id, eos_token_id, moe_loss_coeff
        )
    elif architecture in (QWEN3_MOE, QWEN2_MOE):
        keys = qwen3_moe_config_json(
            config, true_vocab_size, bos_token_id, eos_token_id, moe_loss_coeff, architecture
        )
    elif architecture in (DEEPSEEK_V3, DEEPSEEK_V2):
        keys = deepseek_config_json(
            config, architecture, true_vocab_size, bos_token_id, eos_token_id
        )
    elif architecture in QWEN_MISTRAL:
        keys = qwen_mistral_config_json(
            architecture, config, true_vocab_size, bos_token_id, eos_token_id
        )
    else:
        keys = llama_config_json(config, true_vocab_size, bos_token_id, eos_token_id)
    name = str(dtype).removeprefix("torch.")
    return {**keys, "torch_dtype": name, "dtype": name}


def to_hf_weights(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full (TP=1) state dict -> the weights of `hf_architecture(config)`, by its names.

    Zero-centred norms (`--apply-layernorm-1p`) are exported as the 1 + weight they scale by."""
    architecture = hf_architecture(config)
    if config.apply_layernorm_1p:
        state = {
            name: tensor + 1 if name.endswith("norm.weight") else tensor
            for name, tensor in state.items()
        }
    if architecture == GPT2:
        return to_hf_state_dict(state, config.num_attention_heads)
    if architecture in (DEEPSEEK_V3, DEEPSEEK_V2):
        return to_deepseek_state_dict(state, config, architecture)
    convert = {
        MIXTRAL: to_mixtral_state_dict,
        GLM4_MOE: to_glm4_moe_state_dict,
        QWEN3_MOE: to_qwen3_moe_state_dict,
        QWEN2_MOE: to_qwen3_moe_state_dict,
        GPT_OSS: to_gpt_oss_state_dict,
    }
    return convert.get(architecture, to_llama_state_dict)(state, config)


def _qkv_to_hf(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Our rows [np, 3, hn](, h) -> HF's [3, np, hn] order (weights also transposed)."""
    grouped = tensor.reshape(heads, 3, -1, *tensor.shape[1:]).transpose(0, 1)
    flat = grouped.reshape(tensor.shape)  # [3h(, h)] in q|k|v order
    return flat.t().contiguous() if flat.dim() == 2 else flat.contiguous()


def _qkv_from_hf(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's [h, 3h] weight ([3h] bias), columns q|k|v -> our [np, 3, hn] rows."""
    rows = tensor.t() if tensor.dim() == 2 else tensor  # [3h(, h)]
    grouped = rows.reshape(3, heads, -1, *rows.shape[1:]).transpose(0, 1)
    return grouped.reshape(rows.shape).contiguous()


def _convert(name: str, tensor: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    if "query_key_value" in name or "c_attn" in name:
        return _qkv_to_hf(tensor, heads) if to_hf else _qkv_from_hf(tensor, heads)
    if tensor.dim() == 2 and ("layers." in name or ".h." in name):  # Linear <-> Conv1D
        return tensor.t().contiguous()
    return tensor.clone()


def to_hf_state_dict(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """Our full (TP=1) GPTModel state dict -> `GPT2LMHeadModel` names (lm_head left tied)."""
    out = {}
    for name, tensor in state.items():
        if name in _TOP:
            out[_TOP[name]] = _convert(name, tensor, heads, True)
            continue
        prefix, _, rest = name.partition(".layers.")
        number, _, key = rest.partition(".")
        if prefix != "language_model.encoder" or key not in _LAYER:
            raise CheckpointConversionError(f"no Hugging Face GPT-2 counterpart for {name!r}")
        out[f"transformer.h.{number}.{_LAYER[key]}"] = _convert(name, tensor, heads, True)
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """`GPT2LMHeadModel` (or `GPT2Model`) weights -> our full GPTModel state dict.

    `lm_head.weight` must equal the word embeddings: our output layer is tied to them.
    """
    top = {hf: ours for ours, hf in _TOP.items()}
    layer = {hf: ours for ours, hf in _LAYER.items()}
    out: dict[str, torch.Tensor] = {}
    head = None
    for name, tensor in hf_state.items():
        if name == "lm_head.weight":
            head = tensor
            continue
        if name.endswith(_IGNORED_HF_SUFFIXES):
            continue
        full = name if name.startswith("transformer.") else "transformer." + name
        if full in top:
            out[top[full]] = _convert(full, tensor, heads, False)
            continue
        number, _, key = full.removeprefix("transformer.h.").partition(".")
        if not full.startswith("transformer.h.") or key not in layer:
            raise CheckpointConversionError(f"unknown GPT-2 parameter {name!r}")
        ours = f"language_model.encoder.layers.{number}.{layer[key]}"
        out[ours] = _convert(full, tensor, heads, False)
    embeddings = out.get("language_model.embedding.word_embeddings.weight")
    if head is not None and embeddings is not None and not torch.equal(head, embeddings):
        raise CheckpointConversionError(
            "lm_head.weight differs from transformer.wte.weight: our GPT ties the output layer "
            "to the word embeddings (tie_word_embeddings must be true)"
        )
    return out


def megatron_args_from_hf(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the GPT-2 of `hf_config` (a dict)."""
    activation = FROM_HF_ACTIVATION.get(hf_config.get("activation_function", "gelu_new"))
    if hf_config.get("model_type") != "gpt2":
        raise CheckpointConversionError(
            f"config.json has model_type={hf_config.get('model_type')!r}; only 'gpt2', "
            "'llama', 'qwen2', 'qwen3', 'mistral', 'mixtral', 'glm4_moe', 'qwen3_moe', "
            "'qwen2_moe', 'gpt_oss', 'deepseek_v2' and 'deepseek_v3' convert"
        )
    problems = {
        "scale_attn_weights": (hf_config.get("scale_attn_weights", True), True),
        "scale_attn_by_inverse_layer_idx": (
            hf_config.get("scale_attn_by_inverse_layer_idx", False),
            False,
        ),
        "add_cross_attention": (hf_config.get("add_cross_attention", False), False),
        "tie_word_embeddings": (hf_config.get("tie_word_embeddings", True), True),
    }
    for key, (value, supported) in problems.items():
        if value != supported:
            raise CheckpointConversionError(f"config.json has {key}={value!r}; only {supported!r}")
    if activation is None:
        raise CheckpointConversionError(
            f"config.json has activation_function={hf_config.get('activation_function')!r}; "
            f"supported: {', '.join(FROM_HF_ACTIVATION)}"
        )
    hidden, heads = hf_config["n_embd"], hf_config["n_head"]
    if hidden % heads != 0:
        raise CheckpointConversionError(f"config.json: n_embd {hidden} % n_head {heads} != 0")
    positions = hf_config["n_positions"]
    if seq_length is not None and seq_length > positions:
        raise CheckpointConversionError(
            f"--seq-length {seq_length} exceeds the model's n_positions {positions}"
        )
    return dict(
        num_layers=hf_config["n_layer"],
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=hf_config.get("n_inner") or 4 * hidden,
        kv_channels=hidden // heads,
        max_position_embeddings=positions,
        seq_length=seq_length or positions,
        layernorm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5),
        init_method_std=hf_config.get("initializer_range", 0.02),
        hidden_dropout=hf_config.get("resid_pdrop", 0.1),
        attention_dropout=hf_config.get("attn_pdrop", 0.1),
        openai_gelu=activation == "gelu_tanh",
        bias_gelu_fusion=activation == "gelu_tanh",
        use_rotary_position_embeddings=False,
        position_embedding_type="learned_absolute",
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        true_vocab_size=hf_config["vocab_size"],
        tokenizer_type="GPT2BPETokenizer",
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )
