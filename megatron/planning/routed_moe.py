"""Megatron-LM's routed MoE layers (`megatron/model/moe_layer.py`) in the plan: what one
layer keeps for backward and what its token dispatcher sends, per micro-batch on one rank.

A rank routes the T tokens of its own part of the micro-batch: T = s x b / (C x TP), C the sequence
split (context parallelism) and TP the tensor-parallel size under sequence parallelism (required
with TP > 1; the experts are whole, the expert-parallel group folded over the tensor x context x
data-parallel ranks). Rows: the (token, expert) copies a rank's experts process, R = T x k when the
load is balanced (T x k / EP from each of the EP ranks), or with a capacity factor at most E x
ceil(T x k / E x factor) (`drop_over_capacity`; exact when every expert overflows). At EP = 1
without a capacity factor R = T x k exactly; at EP > 1 each rank's R depends on the routing, and the
plan (its activations and dispatch bytes alike) is for a balanced load.

Activations (checked against saved-tensor hooks in tests/planning/test_routed_moe_plan.py),
with c the compute dtype's bytes, L the router logits' (the compute dtype, or
`--moe-router-dtype`):
- the router's input (the post-attention norm output, or autocast's copy of it) and its
  logits [T, E] (kept by the gather of the chosen ones), the top-k indices [T, k] (int64) and
  the softmax over the chosen [T, k] (fp32); with `--moe-router-pre-softmax` or sigmoid scores
  the scores [T, E] (fp32) instead of the logits; the z-loss's fp32 logits and log-sum-exp;
  the load-balancing loss's own fp32 scores [T, E] and per-expert counts; with
  a capacity factor the kept map [T, E] (bool);
- the dispatch: the (expert, token) indices [R, 2] (int64), the all-to-all dispatcher's row
  order and its inverse [R] each (int64);
- the experts: their input [R, h], the first product [R, W] (W = 2 F' with SwiGLU, whose
  silu(gate) [R, F'] is kept too) and the activation [R, F'] (F' = `--moe-ffn-hidden-size`),
  all in c; each bias's row-to-expert index [R] (int64); under autocast the experts'
  half-precision weight copies (`weight.to(dtype)`, made in every forward, so kept per
  micro-batch); the int32 group offsets of each matmul that runs torch's grouped_mm (the
  runtime's own rule, `moe_experts.grouped_mm_runs`, asked with the plan's device, compute
  dtype and GPU);
- the combine: the experts' output and the weighted output [R, h] and the weights [R], in c;
- the shared expert: a tensor-parallel MLP of `--moe-shared-expert-intermediate-size` over
  the gathered sequence (s x b / C tokens, widths / TP), as a dense layer's; with
  `--moe-shared-expert-gate` its output [T, h] and gate [T, 1] for their product, and under
  autocast the gate's half copy of the input [T, h].
"""

from __future__ import annotations

import torch

from megatron.config import ModelConfig
from megatron.model.moe_experts import grouped_mm_runs
from megatron.model.moe_router import expert_capacity
from megatron.model.utils import recomputes
from megatron.planning.dtypes import Dtypes
from megatron.planning.inputs import PlanInputs

_FP32, _INDEX = 4, 8
_ROUTER_BYTES = {"fp32": 4, "fp64": 8}
# The experts' compute dtype (autocast's, or the parameters') by the job's precision.
_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNKNOWN_GPU_CAPABILITY = (9, 0)
"""The compute capability planned for a GPU the plan does not know (`PlanInputs`'s
`compute_capability` None on CUDA): Hopper's."""
BALANCED_LOAD_NOTE = (
    "Megatron-LM MoE at EP > 1 without a capacity factor: each rank's expert rows (their "
    "activations, and the all-to-all dispatcher's bytes) are planned for a balanced load, "
    "T x k per micro-batch and layer; a skewed router sends more to some ranks"
)
"""The plan's note where the routed experts' load depends on the routing."""


def is_routed_layer(config: ModelConfig, layer_number: int | None) -> bool:
    """Whether layer `layer_number` (1-based; None: the first) is a routed MoE layer."""
    moe = config.routed_moe
    return moe is not None and moe.moe_layers[(layer_number or 1) - 1]


def routed_tokens(inputs: PlanInputs) -> int:
    """T: the tokens one rank routes per micro-batch: its part of s x b under a sequence
    split and under sequence parallelism (see the module docstring)."""
    tokens = inputs.local_seq_length * inputs.micro_batch
    return tokens // inputs.tp if inputs.model.sequence_parallel else tokens


def routed_rows(inputs: PlanInputs) -> int:
    """R: the (token, expert) rows one rank's experts process per micro-batch and layer, for a
    balanced load (see the module docstring); also the rows a rank sends."""
    moe, tokens = inputs.model.routed_moe, routed_tokens(inputs)
    rows = tokens * moe.top_k
    kept = expert_capacity(moe, tokens)
    return rows if kept is None else min(rows, moe.num_experts * kept)


def _logits_bytes(inputs: PlanInputs, size: Dtypes) -> int:
    """Bytes per element of the router's logits: `--moe-router-dtype`, else the compute
    dtype (autocast's, or the parameters')."""
    return _ROUTER_BYTES.get(inputs.model.routed_moe.router_dtype, size.compute)


def _router_bytes(inputs: PlanInputs, size: Dtypes) -> int:
    """What the router (and its losses) keep for backward, but for its input."""
    moe, tokens = inputs.model.routed_moe, routed_tokens(inputs)
    e, k, logits = moe.num_experts, moe.top_k, _logits_bytes(inputs, size)
    total = tokens * k * _INDEX  # the chosen experts
    keeps_logits = moe.score_function == "softmax" and not moe.pre_softmax  # by the gather
    if keeps_logits:
        total += tokens * k * _FP32  # softmax over the chosen logits
    else:
        total += tokens * e * _FP32  # the scores, gathered from
        if moe.score_function == "sigmoid" and k > 1:  # normalized over the chosen k
            total += tokens * k * _FP32 + tokens * _FP32
    if moe.z_loss_coeff:
        # logsumexp keeps its fp32 input (the logits themselves when they are fp32) and result.
        keeps_logits = keeps_logits or logits == _FP32
        total += (0 if logits == _FP32 else tokens * e * _FP32) + tokens * _FP32 + _FP32
    if keeps_logits:
        total += tokens * e * logits
    if moe.router_dtype is not None and _ROUTER_BYTES[moe.router_dtype] != size.residual:
        total += e * inputs.model.hidden_size * logits  # weight.to(dtype), every forward
    if expert_capacity(moe, tokens) is not None:
        total += tokens * e  # the kept map (bool) the weights are multiplied by
    if moe.load_balancing != "none" and moe.aux_loss_coeff > 0:
        # Its scores and the loss (its top-k's node is freed with the unused values).
        total += tokens * e * _FP32 + _FP32
        if moe.score_function == "sigmoid":
            total += tokens * _FP32  # the scores' normalizer
        per_expert = e * (inputs.micro_batch if moe.load_balancing == "seq_aux_loss" else 1)
        total += per_expert * _FP32
    return total


def _router_input_bytes(inputs: PlanInputs, size: Dtypes) -> int:
    """The post-attention norm output [T, h] as the router and the shared expert keep it:
    the output itself, or a copy each (autocast's half one per matmul, the router's dtype)."""
    moe, h = inputs.model.routed_moe, inputs.model.hidden_size
    autocast = size.compute < size.residual
    kept_itself, copies = False, []
    if moe.router_dtype is not None:
        router = _ROUTER_BYTES[moe.router_dtype]
        kept_itself = router == size.residual
        copies += [] if kept_itself else [router]
    elif autocast:
        copies.append(size.compute)
    else:
        kept_itself = True
    if moe.shared_expert_ffn_hidden_size:
        # Recomputed (`shared_experts`), it keeps its input itself: no cast without a graph.
        if autocast and not recomputes(inputs.model, "shared_experts"):
            copies.append(size.compute)
        else:
            kept_itself = True
    # `--recompute-modules layernorm` frees the norm's output (the copies stay).
    kept_itself = kept_itself and not recomputes(inputs.model, "layernorm")
    per_token = (size.residual if kept_itself else 0) + sum(copies)
    return routed_tokens(inputs) * h * per_token


def _grouped_gemm_runs(inputs: PlanInputs, in_features: int, out_features: int) -> bool:
    """Whether the experts' [rows, in_features] x [in_features, out_features] matmul runs
    torch's grouped_mm under `--moe-grouped-gemm`: the runtime's rule
    (`moe_experts.grouped_mm_runs`) for the plan's device, compute dtype and GPU."""
    if not inputs.model.routed_moe.grouped_gemm:
        return False
    capability = inputs.compute_capability
    if inputs.device_type == "cuda" and capability is None:
        capability = UNKNOWN_GPU_CAPABILITY
    dtype = _COMPUTE_DTYPES[inputs.precision]
    return grouped_mm_runs(inputs.device_type, dtype, capability, in_features, out_features)


def _experts_bytes(inputs: PlanInputs, size: Dtypes, rows: int) -> int:
    """What a rank's local experts keep for `rows` token rows."""
    config = inputs.model
    moe, h, c = config.routed_moe, config.hidden_size, size.compute
    ffn = moe.ffn_hidden_size or config.ffn_hidden_size
    width = 2 * ffn if config.gated else ffn
    local = moe.num_experts // inputs.ep
    total = rows * h * c + rows * width * c  # input, first product
    if not recomputes(config, "moe_act"):  # else run without a graph, its output freed
        total += rows * ffn * c  # the activation's output
        if config.activation == "swiglu" and not config.glu_keeps_input_only:
            total += rows * ffn * c  # silu(gate)
    if config.add_bias_linear:
        total += 2 * rows * _INDEX  # each bias's row-to-expert index
    if c != size.residual:  # weight.to(dtype): copies made in every forward
        total += local * (h * width + ffn * h) * c
    for in_features, out_features in ((h, width), (ffn, h)):  # each matmul decides alone
        if _grouped_gemm_runs(inputs, in_features, out_features):
            total += local * 4  # its grouped_mm's int32 group offsets
    return total


def _shared_expert_bytes(inputs: PlanInputs, size: Dtypes) -> int:
    """The shared expert's dense MLP, but for its input (`_router_input_bytes`)."""
    config = inputs.model
    ffn = config.routed_moe.shared_expert_ffn_hidden_size
    if not ffn or recomputes(config, "shared_experts"):  # recomputed: its input alone
        return 0
    tokens = inputs.local_seq_length * inputs.micro_batch  # gathered under sequence parallel
    ffn //= inputs.tp
    mlp_in = 2 * ffn if config.gated else ffn
    total = tokens * mlp_in * size.activation_input + tokens * ffn * size.compute
    if config.activation == "swiglu" and not config.glu_keeps_input_only:
        total += tokens * ffn * size.activation_input
    return total


def _shared_gate_bytes(inputs: PlanInputs, size: Dtypes) -> int:
    """`--moe-shared-expert-gate`: the product keeps the shared expert's output [T, h] (with
    its bias, in the residual dtype under autocast) and the gate sigmoid(x . w) [T, 1]; under
    autocast the gate's matmul keeps its own half copy of x."""
    config = inputs.model
    if not config.routed_moe.shared_expert_gate:
        return 0
    tokens, h = routed_tokens(inputs), config.hidden_size
    autocast = size.compute < size.residual
    output = size.residual if config.add_bias_linear and autocast else size.compute
    return (
        tokens * h * output + tokens * size.compute + (tokens * h * size.compute if autocast else 0)
    )


def routed_mlp_bytes(inputs: PlanInputs, size: Dtypes) -> int:
    """What a routed MoE layer's MLP part keeps for backward per micro-batch on one rank, its
    input (the post-attention norm output, or copies of it) included (module docstring)."""
    moe, h, c = inputs.model.routed_moe, inputs.model.hidden_size, size.compute
    rows = routed_rows(inputs)
    dispatch = rows * 2 * _INDEX  # the (expert, token) indices
    if moe.dispatcher == "alltoall":
        dispatch += 2 * rows * _INDEX  # the (source, expert) -> (expert, source) order, inverse
    combine = rows * c + 2 * rows * h * c  # the weights, the outputs and the weighted outputs
    return (
        _router_input_bytes(inputs, size)
        + _router_bytes(inputs, size)
        + dispatch
        + _experts_bytes(inputs, size, rows)
        + combine
        + _shared_expert_bytes(inputs, size)
        + _shared_gate_bytes(inputs, size)
    )


def routed_output_mask_bytes(inputs: PlanInputs, size: Dtypes) -> int:
    """Bytes per element of the dropout mask on a routed MoE layer's output: bool on GPUs,
    else the output's dtype, the compute dtype's (or the dense MLP's output's when a shared
    expert adds to it)."""
    if inputs.model.routed_moe.shared_expert_ffn_hidden_size:
        return size.branch_mask
    return min(size.mask, size.compute)


def routed_expert_parameters(config: ModelConfig) -> int:
    """Parameters of all E routed experts of one MoE layer (weights and biases)."""
    moe, h = config.routed_moe, config.hidden_size
    ffn = moe.ffn_hidden_size or config.ffn_hidden_size
    width = 2 * ffn if config.gated else ffn
    biases = width + h if config.add_bias_linear else 0
    return moe.num_experts * (h * width + ffn * h + biases)


def routed_weight_copy_elements(
    config: ModelConfig, fp8: bool = False, tp: int = 1, gathered: bool = False
) -> int:
    """Weights of a routed MoE layer's MLP part that torch.autocast casts once per region
    (the router's, unless `--moe-router-dtype` computes it outside autocast; this rank's
    `tp`-th of the shared expert's, unless `fp8`: its matmuls cast to FP8 themselves, and but
    for its first linear's where that casts inside its sequence-parallel gather, `gathered`);
    the experts' own copies are per forward (`routed_mlp_bytes`)."""
    moe, h = config.routed_moe, config.hidden_size
    total = 0 if moe.router_dtype is not None else moe.num_experts * h
    ffn = moe.shared_expert_ffn_hidden_size
    if ffn and not fp8 and not recomputes(config, "shared_experts"):
        mlp_in = 2 * ffn if config.gated else ffn
        total += ((0 if gathered else h * mlp_in) + ffn * h) // tp
    if ffn and moe.shared_expert_gate:  # [1, h], outside the shared expert's recomputation
        total += h
    return total


def dispatch_bytes(inputs: PlanInputs, size: Dtypes) -> dict[str, int]:
    """One routed MoE layer's dispatcher collectives per micro-batch on one rank, by op, as the
    plan counts payloads (an all-to-all's or a reduce-scatter's input, an all-gather's
    output); nothing at EP 1. Forward, run again by full recomputation, then backward.

    With N = R rows sent and received (balanced), tokens in the post-attention norm output's
    dtype r (fp32 under autocast: the experts cast after the dispatch) and expert outputs in
    the compute dtype c:
    - `alltoall`: forward the count exchange (E int64), the tokens out (N h r) and the
      outputs back (R h c); backward the outputs' gradient out (N h c) and the tokens'
      gradient back (R h r);
    - `allgather` over the EP x T tokens of the group: forward all-gathers of the tokens
      (EP T h r), the routing weights (EP T E, the logits' dtype) and the routing map (EP T E
      bytes), and a reduce-scatter of the combined outputs (EP T h c); backward the
      reduce-scatter's transpose, an all-gather (EP T h c), and reduce-scatters of the tokens'
      and weights' gradients.
    """
    ep = inputs.ep
    if ep == 1:
        return {}
    moe, h = inputs.model.routed_moe, inputs.model.hidden_size
    r, c, e = size.residual, size.compute, moe.num_experts
    passes = 2 if inputs.model.recompute_granularity == "full" else 1
    if moe.dispatcher == "alltoall":
        rows = routed_rows(inputs)
        forward = e * _INDEX + rows * h * r + rows * h * c
        return {"all_to_all": passes * forward + rows * h * (c + r)}
    gathered = ep * routed_tokens(inputs)
    weights = gathered * e * _logits_bytes(inputs, size)
    tokens, outputs, routing_map = gathered * h * r, gathered * h * c, gathered * e
    return {
        "all_gather": passes * (tokens + weights + routing_map) + outputs,
        "reduce_scatter": passes * outputs + tokens + weights,
    }
