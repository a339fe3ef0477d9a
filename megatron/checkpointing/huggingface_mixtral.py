"""Our LLaMA-style Mixture-of-Experts weights and flags <-> Hugging Face `MixtralForCausalLM`.

A checkpoint converts when it is LLaMA-style (RMSNorm, SwiGLU, RoPE over whole heads, grouped-
query attention or not, tied or untied output layer; see `huggingface_llama.py`, whose mapping
of everything but the MLP is reused) with no linear biases, head width hidden / heads
(transformers 4's Mixtral ignores `head_dim`), and DeepSpeed-MoE in every layer (`--expert-
interval 1`, one `--num-experts` for all), top-2 gating over SwiGLU experts, no PR-MoE; or
Megatron-LM's MoE with Mixtral's routing (see "Megatron-LM's MoE" below).

What the export computes: Mixtral sends every token to its two most probable experts. That is
our model in evaluation with `--disable-moe-token-dropping` and `--disable-moe-top2-2nd-expert-
sampling`. With DeepSpeed's defaults our evaluation forward differs: DeepSpeed's `top2gating`
draws the second expert with Gumbel noise in `eval()` too (only the flag turns it off), and
drops the tokens past `--moe-eval-capacity-factor` x 2 x tokens / experts (none when the factor
x 2 >= experts). Such a checkpoint is refused naming the flag; `convert_to_hf.py` takes the same
two flags to export it as computed with them (a training's capacity and sampling shaped its
gradients, not what its weights mean).

The gates match: DeepSpeed's `top2gating` without sampling takes softmax (fp32) over the experts,
the first expert by argmax, the second by argmax of the other logits (the same order), and
divides both gate values by their sum; Mixtral's router takes softmax (fp32), `topk(2)` (most
probable first) and divides by the sum: the same experts in the same order with bit-identical
weights. Only exact ties choose apart: DeepSpeed takes the lowest-numbered of tied experts,
`torch.topk` any of them; their weights are equal, and a tie needs equal gate logits (equal
gate rows, or an input that zeroes them).

Weight names, ours under `language_model.encoder.layers.{i}.mlp.deepspeed_moe.` (experts
numbered globally, as `load_dense_checkpoint` numbers them), Hugging Face's under
`model.layers.{i}.` (transformers 4 names, which we write; transformers 5's in memory):

- `gate.wg.weight` [E, h] <-> `block_sparse_moe.gate.weight`; 5: `mlp.gate.weight`;
- `experts.deepspeed_experts.{e}.dense_h_to_4h.weight` [gate; up] <->
  `block_sparse_moe.experts.{e}.w1.weight` (gate) and `w3` (up); 5: `mlp.experts.gate_up_proj`
  [E, 2 ffn, h], expert e's [gate; up] at [e];
- `experts.deepspeed_experts.{e}.dense_4h_to_h.weight` [h, ffn] <->
  `block_sparse_moe.experts.{e}.w2.weight`; 5: `mlp.experts.down_proj` [E, h, ffn].

transformers 5 loads the 4.x names, converting them (its `conversion_mapping` for "mixtral":
`.block_sparse_moe.` -> `.mlp.`, each layer's w1 and w3 stacked then concatenated into
`gate_up_proj`, the w2 stacked into `down_proj`), so the files we write load in both; the
import reads either in-memory form.

Megatron-LM's MoE (`--moe-router-topk` and its other flags; names in `huggingface_routed.py`)
exports when every layer is an MoE layer of softmax scores without a scaling factor, expert
bias, shared expert or capacity, and experts as wide as `--ffn-hidden-size` (the one
`intermediate_size`), without `--moe-router-pre-softmax`. Its default router (the top k
of the logits, softmax over those k) and Mixtral's (softmax over all experts, the top k,
divided by their sum) choose the same experts (softmax keeps the order) with the same weights
exp(l_i) / sum of the chosen exp(l_j), up to rounding, for any k. The import writes either
family (`moe_family`; `convert_from_hf.py --moe-family`, Megatron-LM's by default): Megatron-
LM's MoE at any k (TP 1; pipeline stages allowed), or DeepSpeed-MoE at top-2 only.

`router_aux_loss_coef` carries `--moe-loss-coeff` (Megatron-LM's `--moe-aux-loss-coeff`), but
the losses differ (DeepSpeed's per layer, over the first choices, summed over layers; Megatron-
LM's per layer, averaged; Mixtral's over the choices of all layers' tokens at once): it changes
fine-tuning, not the logits. `router_jitter_noise` (training only) has no counterpart and is
not carried.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron.checkpointing.huggingface_llama import (
    from_llama_state_dict,
    llama_style_config_json,
    llama_style_differences,
    megatron_args_from_llama,
    to_llama_state_dict,
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

ARCHITECTURE = "MixtralForCausalLM"
DEFAULTS = dict(
    num_local_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    num_key_value_heads=8,
    router_aux_loss_coef=0.001,
)
"""What transformers (4 and 5) take for a key a Mixtral config.json leaves out."""
DEFAULT_ROPE_THETA = 1e6
"""Mixtral's RoPE base where config.json sets none (LLaMA's is 10000)."""
_LINEARS = ("w1", "w3", "w2")
"""transformers 4's names of each Mixtral expert's gate, up and down projections."""
MOE_FAMILIES = ("megatron", "deepspeed")
"""What a Mixtral imports as (`--moe-family`): Megatron-LM's MoE or DeepSpeed-MoE."""
_OURS = re.compile(
    r"language_model\.encoder\.layers\.(\d+)\.mlp\.deepspeed_moe\."
    r"(gate\.wg|experts\.deepspeed_experts\.(\d+)\.(dense_h_to_4h|dense_4h_to_h))\.(\w+)"
)


def mixtral_differences(config: ModelConfig) -> list[str]:
    """What in `config` Hugging Face's Mixtral cannot compute (empty: it converts exactly)."""
    differences = llama_style_differences(config, "Mixtral")
    if config.kv_channels * config.num_attention_heads != config.hidden_size:
        differences.append(
            f"kv_channels {config.kv_channels} x num_attention_heads "
            f"{config.num_attention_heads} != hidden_size {config.hidden_size} (transformers 4's "
            "Mixtral: head width = hidden / heads)"
        )
    if config.add_bias_linear:
        differences.append("linear biases (Mixtral has none: --disable-bias-linear)")
    if config.routed_moe is not None:
        return differences + _routed_differences(config)
    moe = config.moe
    if moe is None:
        return [*differences, "no Mixture-of-Experts layers (Mixtral: experts in every layer)"]
    dense = sum(count == 1 for count in moe.experts_per_layer)
    if dense:
        differences.append(
            f"{dense} of {config.num_layers} layers without experts (--expert-interval above 1; "
            "Mixtral: experts in every layer)"
        )
    counts = sorted({count for count in moe.experts_per_layer if count > 1})
    if len(counts) > 1:
        differences.append(
            f"expert counts {', '.join(map(str, counts))} differ between layers (--num-experts; "
            "Mixtral: one num_local_experts)"
        )
    if moe.top_k != 2:
        differences.append(
            f"--topk {moe.top_k} (DeepSpeed's top-1 weighs its expert by the gate probability, "
            "Mixtral renormalizes its choices to sum to 1: only top-2 computes alike)"
        )
    if moe.residual:
        differences.append("PR-MoE (--mlp-type residual: a dense MLP beside the experts)")
    if moe.drop_tokens and moe.eval_capacity_factor * moe.top_k < counts[-1]:
        differences.append(
            f"token dropping in evaluation (--moe-eval-capacity-factor {moe.eval_capacity_factor:g}"
            f" x top-{moe.top_k} < {counts[-1]} experts; Mixtral computes every token: "
            "--disable-moe-token-dropping exports the model without capacity)"
        )
    if moe.top_k == 2 and moe.top2_2nd_expert_sampling:
        differences.append(
            "the second expert sampled (DeepSpeed adds Gumbel noise in evaluation too; Mixtral "
            "takes the second most probable: --disable-moe-top2-2nd-expert-sampling exports that)"
        )
    return differences


def _routed_differences(config: ModelConfig) -> list[str]:
    """What in Megatron-LM's MoE settings Mixtral's router does not compute. Mixtral takes
    softmax over all experts, the top k, renormalized to sum to 1: Megatron-LM's default
    (top k of the logits, softmax over those k) gives the same experts and weights."""
    moe = config.routed_moe
    checks = [
        (
            not all(moe.moe_layers),
            "layers without experts (--moe-layer-freq; Mixtral: every layer)",
        ),
        (moe.score_function != "softmax", f"--moe-router-score-function {moe.score_function}"),
        (
            moe.pre_softmax,
            "--moe-router-pre-softmax (its top-k weights are not renormalized; Mixtral's are)",
        ),
        (moe.topk_scaling_factor not in (None, 1.0), "--moe-router-topk-scaling-factor"),
        (moe.expert_bias, "--moe-router-enable-expert-bias (the biases choose the experts)"),
        (
            moe.shared_expert_ffn_hidden_size is not None,
            "a shared expert (--moe-shared-expert-intermediate-size)",
        ),
        (
            moe.capacity_factor is not None,
            "token dropping (--moe-expert-capacity-factor; Mixtral computes every token)",
        ),
        (
            moe.ffn_hidden_size not in (None, config.ffn_hidden_size),
            "--moe-ffn-hidden-size "
            "other than --ffn-hidden-size (Mixtral's intermediate_size is both)",
        ),
    ]
    return [text for differs, text in checks if differs]


def num_experts_and_top_k(config: ModelConfig) -> tuple[int, int]:
    """(experts per layer, experts per token) of either MoE."""
    if config.routed_moe is not None:
        return config.routed_moe.num_experts, config.routed_moe.top_k
    return config.moe.experts_per_layer[0], config.moe.top_k


def mixtral_config_json(
    config: ModelConfig,
    true_vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    moe_loss_coeff: float | None = None,
) -> dict[str, Any]:
    """config.json (less the dtype) of the `MixtralForCausalLM` computing `config`'s model; read
    alike by transformers 4.45+ and 5.x (the RoPE base in both releases' places).

    `moe_loss_coeff` (the checkpoint's `--moe-loss-coeff`) becomes `router_aux_loss_coef`;
    None: Mixtral's default."""
    differences = mixtral_differences(config)
    if differences:
        raise CheckpointConversionError(f"{ARCHITECTURE} cannot compute {'; '.join(differences)}")
    keys = llama_style_config_json(config, true_vocab_size, bos_token_id, eos_token_id)
    return dict(
        keys,
        architectures=[ARCHITECTURE],
        model_type="mixtral",
        num_local_experts=num_experts_and_top_k(config)[0],
        num_experts_per_tok=num_experts_and_top_k(config)[1],
        router_aux_loss_coef=(
            DEFAULTS["router_aux_loss_coef"] if moe_loss_coeff is None else float(moe_loss_coeff)
        ),
        output_router_logits=False,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


def to_mixtral_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP=1, global expert numbers) MoE state dict, either family -> the weights of
    `MixtralForCausalLM` as transformers 4 names them (tied lm_head left out)."""
    out, rest = {}, {}
    if config.routed_moe is not None:
        state, layers = split_routed_layers(state)
        for number, layer in layers.items():
            hf = f"model.layers.{number}.block_sparse_moe."
            out[f"{hf}gate.weight"] = layer.router
            out.update(hf_expert_tensors(f"{hf}experts.", layer, _LINEARS))
    for name, tensor in state.items():
        match = _OURS.fullmatch(name)
        if match is None:
            rest[name] = tensor
            continue
        layer, module, expert, linear, param = match.groups()
        if param != "weight":
            raise CheckpointConversionError(f"no Hugging Face Mixtral counterpart for {name!r}")
        hf = f"model.layers.{layer}.block_sparse_moe."
        if module == "gate.wg":
            out[f"{hf}gate.weight"] = tensor.clone()
        elif linear == "dense_h_to_4h":  # [gate; up]
            gate, up = tensor.chunk(2, dim=0)
            out[f"{hf}experts.{expert}.w1.weight"] = gate.clone()
            out[f"{hf}experts.{expert}.w3.weight"] = up.clone()
        else:
            out[f"{hf}experts.{expert}.w2.weight"] = tensor.clone()
    return {**to_llama_state_dict(rest, config), **out}


def _mixtral_layer(hf_state: dict[str, torch.Tensor], layer: int, experts: int) -> RoutedLayer:
    """Pop layer `layer`'s router and experts from `hf_state`, named as transformers 5 (fused
    experts under `mlp.`) or 4 (`block_sparse_moe.experts.{e}.w1/w3/w2`) holds them."""
    fused, split = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe."
    prefix = fused if f"{fused}gate.weight" in hf_state else split
    if f"{prefix}gate.weight" not in hf_state:
        raise CheckpointConversionError(f"the Mixtral weights lack {split}gate.weight")
    router = hf_state.pop(f"{prefix}gate.weight")
    gate_up, down = pop_hf_experts(
        hf_state, f"{fused}experts.", f"{split}experts.", experts, _LINEARS
    )
    return RoutedLayer(router=router, gate_up=gate_up, down=down)


def from_mixtral_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """`MixtralForCausalLM` weights (transformers 4 or 5 names) -> our full state dict of the
    MoE family `config` has (from `megatron_args_from_mixtral`): Megatron-LM's stacked experts,
    or DeepSpeed-MoE's with global expert numbers."""
    remaining = dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    experts = num_experts_and_top_k(config)[0]
    for number in range(config.num_layers):
        layer = _mixtral_layer(remaining, number, experts)
        if config.routed_moe is not None:
            out.update(routed_layer_state(number, layer))
            continue
        ours = f"language_model.encoder.layers.{number}.mlp.deepspeed_moe."
        out[f"{ours}gate.wg.weight"] = layer.router.clone()
        for expert, (h_to_4h, down) in enumerate(zip(layer.gate_up, layer.down)):
            prefix = f"{ours}experts.deepspeed_experts.{expert}."
            out[f"{prefix}dense_h_to_4h.weight"] = h_to_4h.contiguous().clone()
            out[f"{prefix}dense_4h_to_h.weight"] = down.contiguous().clone()
    return {**from_llama_state_dict(remaining, config), **out}


def megatron_args_from_mixtral(
    hf_config: dict[str, Any],
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int,
    seq_length: int | None = None,
    moe_family: str = "megatron",
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the Mixtral of `hf_config` (a dict):
    experts in every layer, as Megatron-LM's MoE (`moe_family` "megatron": top-k of the logits,
    softmax over those k, dropless; any k; TP 1) or DeepSpeed-MoE ("deepspeed": top-2 without
    token dropping or second-expert sampling; no pipeline stages)."""
    hf_config = {**DEFAULTS, **hf_config}
    experts, top_k = hf_config["num_local_experts"], hf_config["num_experts_per_tok"]
    if moe_family not in MOE_FAMILIES:
        raise CheckpointConversionError(
            f"--moe-family {moe_family}: choose {' or '.join(MOE_FAMILIES)}"
        )
    if not isinstance(experts, int) or experts < 2:
        raise CheckpointConversionError(f"config.json has num_local_experts={experts!r}; need 2+")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise CheckpointConversionError(
            f"config.json has num_experts_per_tok={top_k!r}; need 1 to num_local_experts {experts}"
        )
    window, positions = hf_config.get("sliding_window"), hf_config.get("max_position_embeddings")
    if window is not None and positions is not None and window < positions:
        raise CheckpointConversionError(
            f"config.json has sliding_window={window!r} < max_position_embeddings {positions}; "
            "our attention sees the whole sequence"
        )
    if moe_family == "megatron":
        check_routed_import(tp_size)
    else:
        _check_deepspeed_import(top_k, pp_size)
    # Mixtral's linear layers have no biases whatever config.json says.
    llama_style = {**hf_config, "attention_bias": False, "mlp_bias": False}
    args = megatron_args_from_llama(
        llama_style, tp_size, pp_size, make_vocab_size_divisible_by, seq_length, DEFAULT_ROPE_THETA
    )
    coeff = float(hf_config["router_aux_loss_coef"])
    if moe_family == "megatron":
        return dict(args, **routed_moe_args(experts, top_k, moe_aux_loss_coeff=[coeff]))
    return dict(
        args,
        num_experts=[experts],
        expert_interval=1,
        topk=top_k,
        moe_expert_parallel_size=1,
        moe_train_capacity_factor=1.0,
        moe_eval_capacity_factor=1.0,
        moe_min_capacity=4,
        moe_token_dropping=False,
        moe_top2_2nd_expert_sampling=False,
        moe_loss_coeff=coeff,
        mlp_type="standard",
        enable_expert_tensor_parallelism=False,
    )


def _check_deepspeed_import(top_k: int, pp_size: int) -> None:
    """Refuse what DeepSpeed-MoE cannot hold: other than top-2, pipeline stages."""
    if top_k != 2:
        raise CheckpointConversionError(
            f"config.json has num_experts_per_tok={top_k!r}; only 2 converts to DeepSpeed-MoE "
            "(its top-1 weighs the expert by its gate value, Mixtral's by 1): --moe-family "
            "megatron imports any top-k"
        )
    if pp_size != 1:
        raise CheckpointConversionError(
            f"--target-pipeline-parallel-size {pp_size}: DeepSpeed-MoE models train without "
            "pipeline parallelism; use 1 (or --moe-family megatron)"
        )
