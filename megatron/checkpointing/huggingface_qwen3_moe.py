"""Megatron-LM's MoE with Qwen's attention <-> Hugging Face `Qwen3MoeForCausalLM` and
`Qwen2MoeForCausalLM` (issue 58).

Qwen3-MoE is Qwen3 (LLaMA-style, each head's queries and keys normalized: `--qk-layernorm`,
`huggingface_qwen_mistral.py`) with Mixture-of-Experts layers; Qwen2-MoE is Qwen2 (biases on
q, k and v: `--add-qkv-bias`, heads hidden / heads wide) with the same MoE layers plus a shared
expert whose output is scaled by sigmoid(x . w) (`--moe-shared-expert-intermediate-size`,
`--moe-shared-expert-gate`). Either converts exactly when our model is that attention, no
other linear biases, and Megatron-LM's MoE with a softmax router:

- Qwen3-MoE's router takes the softmax over all experts (fp32), the top k, and divides them by
  their sum when `norm_topk_prob`: ours without `--moe-router-pre-softmax` (the top k of the
  logits, the softmax over those: the same experts and weights up to rounding), and with it
  when `norm_topk_prob` is false (the softmax's top k, unnormalized). No expert bias, scaling,
  groups or capacity; a shared expert (gated) in Qwen2-MoE only;
- the MoE layers: layer i is one unless it is in `mlp_only_layers` or (i + 1) is not a
  multiple of `decoder_sparse_step`; the others are dense MLPs of `intermediate_size` (our
  `--ffn-hidden-size`), the experts `moe_intermediate_size` wide (`--moe-ffn-hidden-size`).
  The export writes `decoder_sparse_step` 1 and the dense layers in `mlp_only_layers`; the
  import reads any pattern as `--moe-layer-freq`.

Weight names (ours in `huggingface_routed.py`), Hugging Face's under `model.layers.{i}.mlp.`
as transformers 4 writes them (transformers 5 stacks the experts on load: its conversion
mapping for "qwen3_moe" is qwen2_moe's): `gate.weight`, `experts.{e}.gate_proj / up_proj /
down_proj.weight`, Qwen2-MoE's `shared_expert.gate_proj / up_proj / down_proj.weight` and
`shared_expert_gate.weight` [1, h]; attention and dense layers as LLaMA's
(`huggingface_llama.py`).
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
from megatron.checkpointing.huggingface_qwen_mistral import (
    megatron_args_from_qwen2,
    megatron_args_from_qwen3,
    qwen2_differences,
)
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
QWEN2_MOE = "Qwen2MoeForCausalLM"
MODEL_TYPES = {ARCHITECTURE: "qwen3_moe", QWEN2_MOE: "qwen2_moe"}
FAMILIES = {ARCHITECTURE: "Qwen3-MoE", QWEN2_MOE: "Qwen2-MoE"}
DEFAULTS = {
    "qwen3_moe": dict(
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
    ),
    "qwen2_moe": dict(
        num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.001, qkv_bias=True,
    ),
}  # fmt: skip
"""What transformers (Qwen3-MoE: 4.51+ and 5; Qwen2-MoE: 4.40+ and 5) take for a key
config.json leaves out."""
_LINEARS = ("gate_proj", "up_proj", "down_proj")
_MOE_KEYS = (
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
    "output_router_logits", "shared_expert_intermediate_size", "qkv_bias",
)  # fmt: skip


def qwen3_moe_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's Qwen3-MoE cannot compute (empty: it converts exactly)."""
    family = FAMILIES[ARCHITECTURE]
    differences = llama_style_differences(config, family, ("qk_layernorm",))
    if not config.qk_layernorm:
        differences.append(f"no QK norm (--qk-layernorm; {family}: q_norm and k_norm)")
    if config.routed_moe is not None and config.routed_moe.shared_expert_ffn_hidden_size:
        differences.append(
            f"a shared expert (--moe-shared-expert-intermediate-size; {family}: none)"
        )
    return differences + _routed_differences(config, family)


def qwen2_moe_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's Qwen2-MoE cannot compute (empty: it converts exactly)."""
    family = FAMILIES[QWEN2_MOE]
    # Qwen2's attention (q/k/v biases, heads hidden / heads wide), less its dense-MLP check.
    differences = [
        text.replace("Qwen2", family)
        for text in qwen2_differences(config)
        if not text.startswith(("Mixture-of-Experts", "biases on every linear layer"))
    ]
    moe = config.routed_moe
    if moe is not None and not moe.shared_expert_ffn_hidden_size:
        differences.append(
            f"no shared expert ({family}: a gated one; --moe-shared-expert-intermediate-size "
            "with --moe-shared-expert-gate)"
        )
    elif moe is not None and not moe.shared_expert_gate:
        differences.append(
            f"an ungated shared expert ({family} gates it: --moe-shared-expert-gate)"
        )
    return differences + _routed_differences(config, family)


def _routed_differences(config: ModelConfig, family: str) -> list[str]:
    """What both Qwen MoE families lack: MLA, biases, and the routers they do not have."""
    differences = []
    if config.mla is not None:
        differences.append(f"multi-latent attention ({family}: grouped-query attention)")
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
    architecture: str = ARCHITECTURE,
) -> dict[str, Any]:
    """config.json (less the dtype) of the `Qwen3MoeForCausalLM` (or `architecture`
    `Qwen2MoeForCausalLM`) computing `config`'s model, every key the computation reads
    explicit, in transformers 4's and 5's places."""
    differences = DIFFERENCES[architecture](config)
    if differences:
        raise CheckpointConversionError(f"{architecture} cannot compute {'; '.join(differences)}")
    moe = config.routed_moe
    layers = config.num_layers
    keys = dict(
        llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id),
        architectures=[architecture],
        model_type=MODEL_TYPES[architecture],
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
    if architecture == QWEN2_MOE:
        return dict(
            keys,
            qkv_bias=True,
            shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        )
    return dict(keys, attention_bias=False)


DIFFERENCES = {ARCHITECTURE: qwen3_moe_differences, QWEN2_MOE: qwen2_moe_differences}
"""Each Qwen MoE architecture's check of a model."""


def to_qwen3_moe_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP=1, global expert numbers) state dict -> `Qwen3MoeForCausalLM` (or, with a
    gated shared expert, `Qwen2MoeForCausalLM`) weights as transformers 4 names them (tied
    lm_head left out)."""
    rest, layers = split_routed_layers(state)
    out = {}
    for number, layer in layers.items():
        hf = f"model.layers.{number}.mlp."
        out[f"{hf}gate.weight"] = layer.router
        out.update(hf_expert_tensors(f"{hf}experts.", layer, _LINEARS))
        if layer.shared_gate_up is not None:
            gate, up = layer.shared_gate_up.chunk(2, dim=0)
            out[f"{hf}shared_expert.gate_proj.weight"] = gate.contiguous().clone()
            out[f"{hf}shared_expert.up_proj.weight"] = up.contiguous().clone()
            out[f"{hf}shared_expert.down_proj.weight"] = layer.shared_down.clone()
            out[f"{hf}shared_expert_gate.weight"] = layer.shared_gate.clone()
    return {**to_llama_state_dict(rest, config), **out}


def from_qwen3_moe_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """`Qwen3MoeForCausalLM` or `Qwen2MoeForCausalLM` weights (transformers 4 or 5 names) ->
    our full state dict (`config` from `megatron_args_from_qwen3_moe`)."""
    remaining = dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    moe = config.routed_moe
    for number, is_moe in enumerate(moe.moe_layers):
        if not is_moe:
            continue
        hf = f"model.layers.{number}.mlp."
        shared = [f"{hf}shared_expert.{name}.weight" for name in _LINEARS]
        shared.append(f"{hf}shared_expert_gate.weight")
        needed = [f"{hf}gate.weight"] + (shared if moe.shared_expert_ffn_hidden_size else [])
        missing = [name for name in needed if name not in remaining]
        if missing:
            raise CheckpointConversionError(f"the Qwen MoE weights lack {missing[0]}")
        router = remaining.pop(f"{hf}gate.weight")
        gate_up, down = pop_hf_experts(
            remaining, f"{hf}experts.", f"{hf}experts.", moe.num_experts, _LINEARS
        )
        layer = RoutedLayer(router, gate_up, down)
        if moe.shared_expert_ffn_hidden_size:
            gate, up, down_proj, gate_weight = (remaining.pop(name) for name in shared)
            layer.shared_gate_up = torch.cat([gate, up])
            layer.shared_down, layer.shared_gate = down_proj, gate_weight
        out.update(routed_layer_state(number, layer))
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
    """Checkpoint args (Megatron flag names) that rebuild the Qwen3-MoE or Qwen2-MoE of
    `hf_config` (a dict, by its `model_type`) as Qwen3 or Qwen2 with Megatron-LM's MoE;
    refuses what differs in one line naming the key."""
    model_type = hf_config.get("model_type", "qwen3_moe")
    family = "Qwen2-MoE" if model_type == "qwen2_moe" else "Qwen3-MoE"
    if moe_family != "megatron":
        raise CheckpointConversionError(
            f"--moe-family {moe_family}: DeepSpeed-MoE's top-2 gating cannot take {family}'s "
            "top-k; it imports as Megatron-LM's MoE (--moe-family megatron)"
        )
    hf_config = {k: v for k, v in hf_config.items() if v is not None}
    if "num_experts" not in hf_config and "num_local_experts" in hf_config:
        hf_config["num_experts"] = hf_config["num_local_experts"]  # transformers 5's name
    hf_config = {**DEFAULTS[model_type], **hf_config}
    pattern = _moe_layers(hf_config)
    if not any(pattern):
        raise CheckpointConversionError(
            "config.json's decoder_sparse_step and mlp_only_layers leave no MoE layer; "
            f"import it as model_type {model_type.removesuffix('_moe')!r}"
        )
    check_routed_import(tp_size)
    attention = {k: v for k, v in hf_config.items() if k not in _MOE_KEYS}
    shared = {}
    if model_type == "qwen2_moe":
        if hf_config["qkv_bias"] is not True:
            raise CheckpointConversionError(
                f"config.json has qkv_bias={hf_config['qkv_bias']!r}: Qwen2-MoE without biases "
                "on q, k and v is not built here"
            )
        width = hf_config["shared_expert_intermediate_size"]
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise CheckpointConversionError(
                f"config.json has shared_expert_intermediate_size={width!r}; need a width >= 1"
            )
        args = megatron_args_from_qwen2(
            attention, tp_size, pp_size, make_vocab_size_divisible_by, seq_length
        )
        shared = dict(moe_shared_expert_intermediate_size=width, moe_shared_expert_gate=True)
    else:
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
        **shared,
    )
    return dict(args, **routed)
