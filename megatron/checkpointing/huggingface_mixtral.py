"""Our LLaMA-style Mixture-of-Experts weights and flags <-> Hugging Face `MixtralForCausalLM`.

A checkpoint converts when it is LLaMA-style (RMSNorm, SwiGLU, RoPE over whole heads, grouped-
query attention or not, tied or untied output layer; see `huggingface_llama.py`, whose mapping
of everything but the MLP is reused) with no linear biases, head width hidden / heads
(transformers 4's Mixtral ignores `head_dim`), and DeepSpeed-MoE in every layer (`--expert-
interval 1`, one `--num-experts` for all), top-2 gating over SwiGLU experts, no PR-MoE.

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

`router_aux_loss_coef` carries `--moe-loss-coeff`, but the two losses differ (DeepSpeed's per
layer, over the first choices, summed over layers; Mixtral's over both choices of all layers'
tokens at once): it changes fine-tuning, not the logits. `router_jitter_noise` (training only)
has no counterpart and is not carried.
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
            moe.pre_softmax and moe.top_k > 1,
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
    """Our full (TP=1, global expert numbers) MoE state dict -> `MixtralForCausalLM` names as
    transformers 4 writes them (tied lm_head left out)."""
    out, rest = {}, {}
    if config.routed_moe is not None:
        state, out = _routed_to_mixtral(state)
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


_ROUTED = re.compile(
    r"language_model\.encoder\.layers\.(\d+)\.mlp\.(router\.weight|experts\.weight[12])"
)


def _routed_to_mixtral(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the rest, Mixtral's MoE weights) of a Megatron-LM MoE state dict: `router.weight`
    [E, h] is the gate; `experts.weight1` [E, h, 2 ffn] holds each expert's [gate | up]
    columns (w1, w3 transposed), `experts.weight2` [E, ffn, h] its w2 transposed."""
    rest, out = {}, {}
    for name, tensor in state.items():
        match = _ROUTED.fullmatch(name)
        if match is None:
            rest[name] = tensor
            continue
        layer, kind = match.groups()
        hf = f"model.layers.{layer}.block_sparse_moe."
        if kind == "router.weight":
            out[f"{hf}gate.weight"] = tensor.clone()
            continue
        for expert, weight in enumerate(tensor.unbind(0)):
            if kind == "experts.weight1":
                gate, up = weight.t().chunk(2, dim=0)  # [2 ffn, h] -> [ffn, h] each
                out[f"{hf}experts.{expert}.w1.weight"] = gate.contiguous().clone()
                out[f"{hf}experts.{expert}.w3.weight"] = up.contiguous().clone()
            else:
                out[f"{hf}experts.{expert}.w2.weight"] = weight.t().contiguous().clone()
    return rest, out


def _experts_of_layer(
    hf_state: dict[str, torch.Tensor], layer: int, experts: int
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Pop layer `layer`'s router [E, h] and each expert's ([gate; up], down) from `hf_state`,
    named as transformers 5 (fused experts) or 4 (`block_sparse_moe`) holds them."""
    fused, split = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe."
    names = [f"{fused}gate.weight", f"{fused}experts.gate_up_proj", f"{fused}experts.down_proj"]
    if names[0] not in hf_state:
        names = [f"{split}gate.weight"] + [
            f"{split}experts.{e}.{w}.weight" for e in range(experts) for w in ("w1", "w3", "w2")
        ]
    missing = [name for name in names if name not in hf_state]
    if missing:
        raise CheckpointConversionError(f"the Mixtral weights lack {missing[0]}")
    tensors = [hf_state.pop(name) for name in names]
    if len(tensors) == 3:  # [E, 2 ffn, h] and [E, h, ffn]: our experts, stacked
        return tensors[0], list(zip(tensors[1].unbind(0), tensors[2].unbind(0)))
    triples = [tensors[1 + 3 * e : 4 + 3 * e] for e in range(experts)]
    return tensors[0], [(torch.cat([w1, w3]), w2) for w1, w3, w2 in triples]


def from_mixtral_state_dict(
    hf_state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """`MixtralForCausalLM` weights (transformers 4 or 5 names) -> our full MoE state dict with
    global expert numbers (`config` from its args)."""
    remaining = dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    for layer, experts in enumerate(config.moe.experts_per_layer):
        router, weights = _experts_of_layer(remaining, layer, experts)
        ours = f"language_model.encoder.layers.{layer}.mlp.deepspeed_moe."
        out[f"{ours}gate.wg.weight"] = router.clone()
        for expert, (h_to_4h, down) in enumerate(weights):
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
) -> dict[str, Any]:
    """Checkpoint args (Megatron flag names) that rebuild the Mixtral of `hf_config` (a dict):
    experts in every layer, top-2 without token dropping or second-expert sampling."""
    hf_config = {**DEFAULTS, **hf_config}
    experts, top_k = hf_config["num_local_experts"], hf_config["num_experts_per_tok"]
    if top_k != 2:
        raise CheckpointConversionError(
            f"config.json has num_experts_per_tok={top_k!r}; only 2 converts (DeepSpeed-MoE's "
            "top-1 weighs the expert by its gate value, Mixtral's by 1)"
        )
    if not isinstance(experts, int) or experts < 2:
        raise CheckpointConversionError(f"config.json has num_local_experts={experts!r}; need 2+")
    window, positions = hf_config.get("sliding_window"), hf_config.get("max_position_embeddings")
    if window is not None and positions is not None and window < positions:
        raise CheckpointConversionError(
            f"config.json has sliding_window={window!r} < max_position_embeddings {positions}; "
            "our attention sees the whole sequence"
        )
    if pp_size != 1:
        raise CheckpointConversionError(
            f"--target-pipeline-parallel-size {pp_size}: Mixture-of-Experts models train without "
            "pipeline parallelism (DeepSpeed-MoE); use 1"
        )
    # Mixtral's linear layers have no biases whatever config.json says.
    llama_style = {**hf_config, "attention_bias": False, "mlp_bias": False}
    args = megatron_args_from_llama(
        llama_style, tp_size, pp_size, make_vocab_size_divisible_by, seq_length, DEFAULT_ROPE_THETA
    )
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
        moe_loss_coeff=float(hf_config["router_aux_loss_coef"]),
        mlp_type="standard",
        enable_expert_tensor_parallelism=False,
    )
