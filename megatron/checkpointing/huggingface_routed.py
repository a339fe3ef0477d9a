"""Megatron-LM's MoE layers (`megatron.model.moe_layer`) as Hugging Face's per-layer expert
tensors, and the checkpoint args that build such layers, for the Mixture-of-Experts
conversions (`huggingface_mixtral.py`, `huggingface_glm4_moe.py`). Pure torch and plain dicts.

Our names under `language_model.encoder.layers.{i}.mlp.` (TP 1, experts numbered globally, as
`load_dense_checkpoint` joins the expert-parallel ranks), and their Hugging Face orientation
(`RoutedLayer`: the stacked form transformers 5 holds in memory):

- `router.weight` [E, h]: the router, HF's `gate.weight`;
- `router.expert_bias` [E] (fp32, with `--moe-router-enable-expert-bias`): added to the scores
  when choosing the experts only, HF's `gate.e_score_correction_bias`; beside it the load
  counts `router.local_tokens_per_expert` [E] of the step under way (zeros at a save's end of
  step, written as zeros by an import);
- `experts.weight1` [E, h, 2 ffn]: each expert's [gate | up] columns, so `gate_up` [E, 2 ffn, h]
  (transformers 5's `experts.gate_up_proj`; 4's per-expert gate and up rows) is weight1 with
  its last two dimensions swapped;
- `experts.weight2` [E, ffn, h]: `down` [E, h, ffn] (`experts.down_proj`) swapped alike;
- `shared_experts.dense_h_to_4h.weight` [2 s, h] ([gate; up]) and `dense_4h_to_h.weight`
  [h, s]: the shared expert, an MLP like the dense one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.config import ModelConfig, RoutedMoEConfig

_ROUTED = re.compile(
    r"language_model\.encoder\.layers\.(\d+)\.mlp\."
    r"(router\.weight|router\.expert_bias|router\.local_tokens_per_expert|experts\.\w+"
    r"|shared_experts\.dense_h_to_4h\.\w+|shared_experts\.dense_4h_to_h\.\w+"
    r"|shared_experts\.gate_weight)"
)
_OURS = "language_model.encoder.layers.{}.mlp."


@dataclass
class RoutedLayer:
    """One MoE layer's weights as Hugging Face orients them (no biases: none converts)."""

    router: torch.Tensor
    """[E, h]."""
    gate_up: torch.Tensor
    """[E, 2 ffn, h]: each expert's gate rows, then its up rows."""
    down: torch.Tensor
    """[E, h, ffn]."""
    expert_bias: torch.Tensor | None = None
    """[E] fp32, or None without aux-loss-free balancing."""
    shared_gate_up: torch.Tensor | None = None
    """[2 s, h]: the shared expert's gate rows, then its up rows; None without one."""
    shared_down: torch.Tensor | None = None
    """[h, s]."""
    shared_gate: torch.Tensor | None = None
    """[1, h]: the shared expert's output gate (`--moe-shared-expert-gate`); None without."""


def split_routed_layers(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[int, RoutedLayer]]:
    """(everything but the MoE layers' weights, each MoE layer's `RoutedLayer` by its number)
    of our full state dict; refuses expert biases (`--disable-bias-linear` exports)."""
    rest: dict[str, torch.Tensor] = {}
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _ROUTED.fullmatch(name)
        if match is None:
            rest[name] = tensor
            continue
        found.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    layers = {}
    for number, weights in found.items():
        unknown = set(weights) - {
            "router.weight",
            "router.expert_bias",
            "router.local_tokens_per_expert",
            "experts.weight1",
            "experts.weight2",
            "shared_experts.dense_h_to_4h.weight",
            "shared_experts.dense_4h_to_h.weight",
            "shared_experts.gate_weight",
        }
        if unknown:
            name = _OURS.format(number) + sorted(unknown)[0]
            raise CheckpointConversionError(f"no Hugging Face counterpart for {name!r}")
        layers[number] = RoutedLayer(
            router=weights["router.weight"].clone(),
            gate_up=weights["experts.weight1"].transpose(1, 2).contiguous(),
            down=weights["experts.weight2"].transpose(1, 2).contiguous(),
            expert_bias=_cloned(weights.get("router.expert_bias")),
            shared_gate_up=_cloned(weights.get("shared_experts.dense_h_to_4h.weight")),
            shared_down=_cloned(weights.get("shared_experts.dense_4h_to_h.weight")),
            shared_gate=_cloned(weights.get("shared_experts.gate_weight")),
        )
    return rest, layers


def _cloned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def routed_layer_state(number: int, layer: RoutedLayer) -> dict[str, torch.Tensor]:
    """Our state-dict entries of MoE layer `number` holding `layer`'s weights (the load counts
    beside an expert bias start at zero)."""
    ours = _OURS.format(number)
    out = {
        f"{ours}router.weight": layer.router.clone(),
        f"{ours}experts.weight1": layer.gate_up.transpose(1, 2).contiguous(),
        f"{ours}experts.weight2": layer.down.transpose(1, 2).contiguous(),
    }
    if layer.expert_bias is not None:
        out[f"{ours}router.expert_bias"] = layer.expert_bias.float().clone()
        out[f"{ours}router.local_tokens_per_expert"] = torch.zeros_like(
            out[f"{ours}router.expert_bias"]
        )
    if layer.shared_gate_up is not None:
        out[f"{ours}shared_experts.dense_h_to_4h.weight"] = layer.shared_gate_up.clone()
        out[f"{ours}shared_experts.dense_4h_to_h.weight"] = layer.shared_down.clone()
    if layer.shared_gate is not None:
        out[f"{ours}shared_experts.gate_weight"] = layer.shared_gate.clone()
    return out


def pop_hf_experts(
    hf_state: dict[str, torch.Tensor],
    fused: str,
    split: str,
    experts: int,
    linears: tuple[str, str, str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pop one layer's experts from `hf_state` as (gate_up [E, 2 ffn, h], down [E, h, ffn]):
    transformers 5's fused `{fused}gate_up_proj` and `{fused}down_proj`, or else transformers
    4's `{split}{e}.{gate}.weight`, `{up}` and `{down}` of each expert (`linears`' names)."""
    names = [f"{fused}gate_up_proj", f"{fused}down_proj"]
    if names[0] not in hf_state:
        names = [f"{split}{e}.{linear}.weight" for e in range(experts) for linear in linears]
    missing = [name for name in names if name not in hf_state]
    if missing:
        raise CheckpointConversionError(f"the Hugging Face weights lack {missing[0]}")
    tensors = [hf_state.pop(name) for name in names]
    if len(tensors) == 2:
        return tensors[0].contiguous(), tensors[1].contiguous()
    triples = [tensors[3 * e : 3 * e + 3] for e in range(experts)]
    gate_up = torch.stack([torch.cat([gate, up]) for gate, up, _ in triples])
    return gate_up, torch.stack([down for _, _, down in triples])


def hf_expert_tensors(
    prefix: str, layer: RoutedLayer, linears: tuple[str, str, str]
) -> dict[str, torch.Tensor]:
    """`layer`'s experts under transformers 4's per-expert names `{prefix}{e}.{linear}.weight`
    (the names we write: transformers 5 stacks them into its fused tensors on load)."""
    gate_name, up_name, down_name = linears
    out = {}
    for expert, (gate_up, down) in enumerate(zip(layer.gate_up, layer.down)):
        gate, up = gate_up.chunk(2, dim=0)
        out[f"{prefix}{expert}.{gate_name}.weight"] = gate.contiguous().clone()
        out[f"{prefix}{expert}.{up_name}.weight"] = up.contiguous().clone()
        out[f"{prefix}{expert}.{down_name}.weight"] = down.contiguous().clone()
    return out


def routed_moe_args(num_experts: int, top_k: int, **settings: Any) -> dict[str, Any]:
    """The checkpoint args of Megatron-LM's MoE (what a run with its flags saves): `settings`
    (flag dest names) over Megatron-LM's defaults, at expert-parallel size 1."""
    if not isinstance(num_experts, int) or num_experts < 2:
        raise CheckpointConversionError(f"{num_experts!r} experts per layer; need 2 or more")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise CheckpointConversionError(
            f"{top_k!r} experts per token; need 1 to the {num_experts} experts"
        )
    defaults = dict(
        moe_layer_freq=1,
        moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
        moe_router_load_balancing_type=["aux_loss"],
        moe_aux_loss_coeff=[0.0],
        moe_z_loss_coeff=None,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False,
        moe_router_bias_update_rate=1e-3,
        moe_router_dtype=None,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_token_dispatcher_type="allgather",
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_token_drop_policy="probs",
        moe_grouped_gemm=False,
        moe_per_layer_logging=False,
        expert_tensor_parallel_size=None,
    )
    unknown = set(settings) - set(defaults)
    if unknown:
        raise TypeError(f"routed_moe_args: unknown settings {sorted(unknown)}")
    return dict(
        defaults,
        **settings,
        routed_moe=True,
        num_experts=[num_experts],
        moe_router_topk=top_k,
        expert_model_parallel_size=1,
    )


def check_routed_import(tp_size: int) -> None:
    """Refuse tensor parallelism for an import as Megatron-LM's MoE (written at TP 1; its
    experts are whole on every tensor-parallel rank, so reshard.py splits the rest)."""
    if tp_size != 1:
        raise CheckpointConversionError(
            f"--target-tensor-parallel-size {tp_size}: Megatron-LM's MoE imports at 1; then "
            f"tools/checkpoint/reshard.py --target-tensor-parallel-size {tp_size} (it trains "
            "there with --sequence-parallel --expert-tensor-parallel-size 1)"
        )


def first_moe_layer(config: ModelConfig) -> int:
    """How many layers come before the first Megatron-LM MoE layer (all of them without one):
    DeepSeek's and GLM's `first_k_dense_replace`."""
    layers = config.routed_moe.moe_layers if config.routed_moe else ()
    return layers.index(True) if True in layers else config.num_layers


def group_ranking_differences(moe: RoutedMoEConfig, family: str, worth: int) -> list[str]:
    """Under group-limited routing, the one-line difference where ours ranks the groups by
    their best top k / group-topk scores and `family` by their best `worth`; else none."""
    if not moe.group_topk or moe.top_k // moe.group_topk == worth:
        return []
    return [
        f"--moe-router-topk {moe.top_k} over --moe-router-group-topk {moe.group_topk}: groups "
        f"ranked by their best {moe.top_k // moe.group_topk} scores ({family}: by their best "
        f"{worth})"
    ]
