"""Megatron-LM's MoE with Qwen3's attention <-> Hugging Face `Qwen3MoeForCausalLM` (issue 58).

Qwen3-MoE is Qwen3 (LLaMA-style, each head's queries and keys normalized: `--qk-layernorm`,
`huggingface_qwen_mistral.py`) with Mixture-of-Experts layers. It converts exactly when our
model is that attention, no linear biases, and Megatron-LM's MoE with a softmax router:

- Qwen3-MoE's router takes the softmax over all experts (fp32), the top k, and divides them by
  their sum when `norm_topk_prob`: ours without `--moe-router-pre-softmax` (the top k of the
  logits, the softmax over those: the same experts and weights up to rounding), and with it
  when `norm_topk_prob` is false (the softmax's top k, unnormalized). No expert bias, scaling,
  groups, shared expert or capacity;
- the MoE layers: layer i is one unless it is in `mlp_only_layers` or (i + 1) is not a
  multiple of `decoder_sparse_step`; the others are dense MLPs of `intermediate_size` (our
  `--ffn-hidden-size`), the experts `moe_intermediate_size` wide (`--moe-ffn-hidden-size`).
  The export writes `decoder_sparse_step` 1 and the dense layers in `mlp_only_layers`; the
  import reads any pattern as `--moe-layer-freq`.

Weight names (ours in `huggingface_routed.py`), Hugging Face's under `model.layers.{i}.mlp.`
as transformers 4 writes them (transformers 5 stacks the experts on load: its conversion
mapping for "qwen3_moe" is qwen2_moe's): `gate.weight`, `experts.{e}.gate_proj / up_proj /
down_proj.weight`; attention and dense layers as LLaMA's (`huggingface_llama.py`).
`router_aux_loss_coef` carries `--moe-aux-loss-coeff` (a training setting: the logits do not
depend on it).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.checkpointing.huggingface_llama import (
    from_llama_state_dict,
    llama_style_config_json,
    llama_style_differences,
    to_llama_state_dict,
)
from megatron.checkpointing.huggingface_qwen_mistral import megatron_args_from_qwen3
from megatron.checkpointing.huggingface_routed import (
    RoutedLayer,
    check_routed_import,
    hf_expert_tensors,
    pop_hf_experts,
    routed_layer_state,
    routed_moe_args,
    split_routed_layers,
)
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"
DEFAULTS = dict(
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
)  # fmt: skip
"""What transformers (4.51+ and 5) take for a Qwen3-MoE key config.json leaves out."""
_LINEARS = ("gate_proj", "up_proj", "down_proj")
_MOE_KEYS = (
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
    "output_router_logits",
)  # fmt: skip


def qwen3_moe_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's Qwen3-MoE cannot compute (empty: it converts exactly)."""
    family = "Qwen3-MoE"
    differences = llama_style_differences(config, family, ("qk_layernorm",))
    if config.mla is not None:
        differences.append(f"multi-latent attention ({family}: grouped-query attention)")
    if not config.qk_layernorm:
        differences.append(f"no QK norm (--qk-layernorm; {family}: q_norm and k_norm)")
    if config.add_bias_linear:
        differences.append(f"linear biases ({family}: none; --disable-bias-linear)")
    moe = config.routed_moe
    if moe is None:
        kind = "DeepSpeed-MoE" if config.moe is not None else "no Mixture-of-Experts layers"
        return [*differences, f"{kind} ({family}: Megatron-LM's MoE, --moe-router-topk ...)"]
    checks = [
        (
            moe.score_function != "softmax",
            f"--moe-router-score-function {moe.score_function} ({family}: softmax)",
        ),
        (moe.expert_bias, f"--moe-router-enable-expert-bias ({family}: no expert bias)"),
        (
            bool(moe.topk_scaling_factor),
            f"--moe-router-topk-scaling-factor ({family}: the weights unscaled)",
        ),
        (bool(moe.group_topk), f"--moe-router-group-topk ({family}: no groups)"),
        (
            bool(moe.shared_expert_ffn_hidden_size),
            f"a shared expert (--moe-shared-expert-intermediate-size; {family}: none)",
        ),
        (
            moe.capacity_factor is not None,
            f"token dropping (--moe-expert-capacity-factor; {family} computes every token)",
        ),
    ]
    return differences + [text for differs, text in checks if differs]


def qwen3_moe_config_json(
    config: ModelConfig,
    true_vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    moe_loss_coeff: float | None = None,
) -> dict[str, Any]:
    """config.json (less the dtype) of the `Qwen3MoeForCausalLM` computing `config`'s model,
    every key the computation reads explicit, in transformers 4's and 5's places."""
    differences = qwen3_moe_differences(config)
    if differences:
        raise CheckpointConversionError(f"{ARCHITECTURE} cannot compute {'; '.join(differences)}")
    moe = config.routed_moe
    layers = config.num_layers
    return dict(
        llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id),
        architectures=[ARCHITECTURE],
        model_type="qwen3_moe",
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=layers,
        layer_types=["full_attention"] * layers,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.ffn_hidden_size or config.ffn_hidden_size,
        norm_topk_prob=not moe.pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[number for number, is_moe in enumerate(moe.moe_layers) if not is_moe],
        router_aux_loss_coef=float(moe_loss_coeff or 0.0),
        output_router_logits=False,
    )


def to_qwen3_moe_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP=1, global expert numbers) state dict -> `Qwen3MoeForCausalLM` weights as
    transformers 4 names them (tied lm_head left out)."""
    rest, layers = split_routed_layers(state)
    out = {}
    for number, layer in layers.items():
        hf = f"model.layers.{number}.mlp."
        out[f"{hf}gate.weight"] = layer.router
        out.update(hf_expert_tensors(f"{hf}experts.", layer, _LINEARS))
    return {**to_llama_state_dict(rest, config), **out}


def from_qwen3_moe_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """`Qwen3MoeForCausalLM` weights (transformers 4 or 5 names) -> our full state dict
    (`config` from `megatron_args_from_qwen3_moe`)."""
    remaining = dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    moe = config.routed_moe
    for number, is_moe in enumerate(moe.moe_layers):
        if not is_moe:
            continue
        hf = f"model.layers.{number}.mlp."
        if f"{hf}gate.weight" not in remaining:
            raise CheckpointConversionError(f"the Qwen3-MoE weights lack {hf}gate.weight")
        router = remaining.pop(f"{hf}gate.weight")
        gate_up, down = pop_hf_experts(
            remaining, f"{hf}experts.", f"{hf}experts.", moe.num_experts, _LINEARS
        )
        out.update(routed_layer_state(number, RoutedLayer(router, gate_up, down)))
    return {**from_llama_state_dict(remaining, config), **out}


def _moe_layers(hf_config: dict[str, Any]) -> list[int]:
    """Which layers are MoE layers (1) or dense (0), as transformers builds them."""
    layers, step = hf_config["num_hidden_layers"], hf_config["decoder_sparse_step"]
    dense = hf_config["mlp_only_layers"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise CheckpointConversionError(
            f"config.json has decoder_sparse_step={step!r}; need a whole number >= 1"
        )
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise CheckpointConversionError(
            f"config.json has mlp_only_layers={dense!r}; need a list of layer numbers"
        )
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def megatron_args_from_qwen3_moe(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
    moe_family: str = "megatron",
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the Qwen3-MoE of `hf_config` (a
    dict) as Qwen3 with Megatron-LM's MoE; refuses what differs in one line naming the key."""
    if moe_family != "megatron":
        raise CheckpointConversionError(
            f"--moe-family {moe_family}: DeepSpeed-MoE's top-2 gating cannot take Qwen3-MoE's "
            "top-k; it imports as Megatron-LM's MoE (--moe-family megatron)"
        )
    hf_config = {k: v for k, v in hf_config.items() if v is not None}
    if "num_experts" not in hf_config and "num_local_experts" in hf_config:
        hf_config["num_experts"] = hf_config["num_local_experts"]  # transformers 5's name
    hf_config = {**DEFAULTS, **hf_config}
    pattern = _moe_layers(hf_config)
    if not any(pattern):
        raise CheckpointConversionError(
            "config.json's decoder_sparse_step and mlp_only_layers leave no MoE layer; "
            "import it as model_type 'qwen3'"
        )
    check_routed_import(tp_size)
    attention = {k: v for k, v in hf_config.items() if k not in _MOE_KEYS}
    args = megatron_args_from_qwen3(
        attention, tp_size, pp_size, make_vocab_size_divisible_by, seq_length
    )
    coeff = float(hf_config["router_aux_loss_coef"] or 0.0)
    routed = routed_moe_args(
        hf_config["num_experts"],
        hf_config["num_experts_per_tok"],
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
        moe_router_pre_softmax=not hf_config["norm_topk_prob"],
        moe_aux_loss_coeff=[coeff],
    )
    return dict(args, **routed)
