"""A simple roofline for one iteration: compute at a stated efficiency, communication at the
device table's link bandwidths, the pipeline bubble on top.

    compute  = FLOPs run by the rank (model FLOPs + recomputation) / (peak x efficiency),
               the FP8 matmuls' share (`fp8.fp8_flops`) at the device's FP8 peak
    tp comm  = Megatron's tensor-parallel bytes x 2 (T-1)/T / link (an all-reduce; (T-1)/T
               with sequence parallelism, whose all-gathers and reduce-scatters replace it)
               + DeepSpeed's tensor-parallel all-gathers (pipeline sends, MoE tokens) x (T-1)/T
    dp comm  = each data-parallel collective x 2 (D-1)/D (all-reduce) or (D-1)/D (all-gather,
               reduce-scatter) / link, then overlapped as the engines overlap it (below)
    pp comm  = pipeline bytes / link
    a2a      = Ulysses' and the experts' all-to-alls x (G-1)/G / their group's link, with
               Megatron-LM MoE's all-gather dispatcher's all-gathers and reduce-scatters,
               less what `--moe-shared-expert-overlap` hides: each MoE layer's forward
               dispatch travels while the shared expert computes (min of the two)
    cp comm  = context parallelism's exposed time (below)
    step     = (compute + tp comm) / (1 - bubble) + exposed dp comm + pp comm + a2a + cp comm
    MFU      = model FLOPs of the rank / (step x peak) (the bf16 or fp32 peak, also with FP8
               matmuls: FP8's FLOPs are the same multiply-adds)

Overlap, as the engines run it: a collective issued bucket by bucket as the backward produces
gradients (DDP's reducer; DeepSpeed's ZeRO with `overlap_comm`, ZeRO-3's reduce-scatter)
hides under that backward - the last micro-batch's when it is issued once per iteration, every
micro-batch's when issued in each - except its last bucket, which only starts when the
backward ends; ZeRO-3's prefetched parameter all-gathers hide under the whole compute the
same way. What does not fit in its window is exposed. Everything else (ZeRO-0's and
BF16_Optimizer's all-reduce after the backward, the weight all-gathers after the step,
DeepSpeed's pipeline engine, which turns `overlap_comm` off) is exposed in full.

Context parallelism (`context_parallel_seconds`): ring attention (`p2p`) starts each
key/value transfer before the attention of the block in hand, so per step only max(0,
transfer - block attention) is exposed; a block is 1/C of the rank's causal attention (the
load-balanced layout gives every step the same work), its backward twice its forward, and
the backward's gradient transfers travel beside the next step's keys and values (the last
waits in full). `allgather` and `a2a` are exposed, (C-1)/C of their payload on the link.

A group stays inside a node (NVLink) when its ranks fit in `gpus_per_node` at their stride;
otherwise it uses the network bandwidth. The efficiency (default 0.55 of the dense peak for
the matmuls, what large GPT layers reach on H100s with bf16) is a parameter, not a result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.core.pipeline_parallel.layout import bubble_fraction
from megatron.model.model_size import (
    attention_forward_flops,
    flops_per_token,
    mlp_forward_flops,
    moe_layer_forward_flops,
    routed_expert_forward_flops,
)
from megatron.planning.communication import (
    Collective,
    all_to_all_parts,
    context_parallel_layer_bytes,
    data_parallel_collectives,
    deepspeed_pipeline_gathers,
    moe_tensor_parallel_bytes,
    pipeline_bytes,
    routed_dispatch_bytes,
    tensor_parallel_bytes,
)
from megatron.planning.devices import Device
from megatron.planning.dtypes import dtypes
from megatron.planning.fp8 import fp8_flops
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole
from megatron.planning.routed_moe import is_routed_layer, routed_rows

MATMUL_EFFICIENCY = 0.55


@dataclass(frozen=True)
class StepEstimate:
    """The roofline's view of one iteration on one rank."""

    model_flops: float
    """Model FLOPs per iteration on each rank (recomputation excluded)."""
    executed_flops: float
    """FLOPs each rank runs, recomputation included."""
    compute_s: float
    communication_s: float
    """Communication time not hidden behind compute (the data-parallel part's exposed)."""
    bubble: float
    step_s: float
    mfu: float
    tokens_per_s: float
    context_parallel_s: float = 0.0
    """Context parallelism's communication time left exposed (part of `communication_s`)."""
    context_parallel_hidden: float = 0.0
    """The fraction of context parallelism's communication time hidden behind attention."""
    fp8_flops: float = 0.0
    """Of `executed_flops`, the FP8 matmuls' (at the FP8 peak, or the bf16 one without)."""
    expert_comm_hidden: float = 0.0
    """The fraction of the routed MoE dispatcher's collective time the combined 1F1B hides
    (`--overlap-moe-expert-parallel-comm`; 0 without it)."""


def _recompute_factor(inputs: PlanInputs) -> float:
    granularity = inputs.model.recompute_granularity
    if granularity == "full":
        return 4.0 / 3.0  # one more forward
    if granularity == "selective":
        # The attention core's forward again: 4 b s^2 h of a layer's 72 b s h^2 + 12 b s^2 h.
        s, h = inputs.seq_length, inputs.model.hidden_size
        return 1.0 + s / (18 * h + 3 * s)
    return 1.0


def _link(device: Device, group: int, stride: int) -> float:
    return (
        device.intra_node_bytes_per_s
        if group * stride <= device.gpus_per_node
        else device.inter_node_bytes_per_s
    )


def _ring(op: str, group: int) -> float:
    """Bytes over each rank's link per payload byte: 2 (G-1)/G for an all-reduce, (G-1)/G for
    an all-gather, a reduce-scatter or an all-to-all."""
    return (2.0 if op == "all_reduce" else 1.0) * (group - 1) / group


def data_parallel_seconds(
    inputs: PlanInputs,
    collectives: list[Collective],
    device: Device,
    backward_s: float,
    compute_s: float,
) -> float:
    """The data-parallel collectives' time not hidden behind compute (see the module's
    docstring): per window, max(their time - the window, the last bucket's time)."""
    exposed = 0.0
    windows: dict[tuple[str, bool], list[float]] = {}
    for collective in collectives:
        if collective.group == 1:
            continue
        link = _link(device, collective.group, collective.stride)
        per_byte = _ring(collective.op, collective.group) / link
        seconds = collective.bytes * per_byte
        if collective.overlap == "none":
            exposed += seconds
            continue
        tail = min(collective.bytes, collective.bucket_bytes) * per_byte
        key = (collective.overlap, collective.per_micro_batch)
        total, last = windows.get(key, [0.0, 0.0])
        windows[key] = [total + seconds, max(last, tail)]
    for (overlap, per_micro_batch), (seconds, tail) in windows.items():
        window = compute_s if overlap == "compute" else backward_s
        if overlap == "backward" and not per_micro_batch:
            window /= inputs.micro_batches  # under the last micro-batch's backward only
        exposed += max(seconds - window, tail)
    return exposed


def all_to_all_seconds(inputs: PlanInputs, role: RankRole, device: Device) -> float:
    """The all-to-alls' time (and Megatron-LM MoE's all-gather dispatcher's): (G-1)/G of
    each payload over its own group's link."""
    a2a = all_to_all_parts(inputs, role)
    # Ulysses' group: S consecutive ranks (TP 1); an expert group: EP ranks TP apart
    # (deepspeed/utils/groups.py _create_expert_and_data_parallel, TP-strided).
    seconds = a2a["ulysses"] * _ring("all_to_all", inputs.sp) / _link(device, inputs.sp, 1)
    experts = min(inputs.ep, max(inputs.model.moe.experts_per_layer)) if inputs.model.moe else 1
    stride = inputs.tp
    if inputs.model.routed_moe is not None:  # EP consecutive ranks (folded over TP x CP x DP)
        experts, stride = inputs.ep, 1
    if experts > 1:
        link = _link(device, experts, stride)
        seconds += a2a["experts"] * _ring("all_to_all", experts) / link
        for op, count in routed_dispatch_bytes(inputs, role).items():
            if op != "all_to_all":
                seconds += count * _ring(op, experts) / link
    return seconds


def shared_expert_overlap_seconds(
    inputs: PlanInputs, role: RankRole, device: Device, efficiency: float = MATMUL_EFFICIENCY
) -> float:
    """The all-to-all time `--moe-shared-expert-overlap` hides per iteration: in each MoE
    layer's forward (again under full recomputation) the tokens' dispatch travels while the
    shared expert computes, so min(dispatch, shared expert forward) of it is hidden."""
    moe = inputs.model.routed_moe
    if moe is None or not moe.shared_expert_overlap or moe.dispatcher != "alltoall":
        return 0.0
    if inputs.ep == 1 or not moe.shared_expert_ffn_hidden_size:
        return 0.0
    config = inputs.model
    tokens = inputs.local_seq_length * inputs.micro_batch  # the shared expert's, gathered
    dispatch = routed_rows(inputs) * config.hidden_size * dtypes(inputs).residual
    dispatch_s = dispatch * _ring("all_to_all", inputs.ep) / _link(device, inputs.ep, 1)
    shared = dataclasses.replace(config, ffn_hidden_size=moe.shared_expert_ffn_hidden_size)
    peak = device.fp32_flops if inputs.precision == "fp32" else device.bf16_flops
    shared_s = tokens * mlp_forward_flops(shared) / inputs.tp / (peak * efficiency)
    passes = 2 if config.recompute_granularity == "full" else 1
    layers = sum(is_routed_layer(config, n) for chunk in role.layers for n in chunk)
    return layers * passes * min(dispatch_s, shared_s) * inputs.micro_batches


def combined_1f1b_seconds(
    inputs: PlanInputs, role: RankRole, device: Device, efficiency: float = MATMUL_EFFICIENCY
) -> tuple[float, float]:
    """(hidden, total) seconds of the routed MoE layers' dispatcher collectives per iteration
    under `--overlap-moe-expert-parallel-comm` (Megatron-LM's combined 1F1B,
    `megatron.core.pipeline_parallel.combined_1f1b`); (0, 0) without it.

    Each layer's four collectives per micro-batch (dispatch and combine, forward and
    backward) take c each. The backward of micro-batch i runs beside the forward of i+1, and
    each collective travels while the other pass computes its next piece: the forward's
    dispatch behind the experts' backward (2 X, X the experts' forward), its combine behind
    the attention's backward (2 A, A the layer's forward but for the experts), the backward's
    combine behind the forward's attention (A), its dispatch behind the forward's experts
    (X; with `--delay-wgrad-compute` the experts' weight gradient too, moved there from the
    dispatch's side). Hidden per layer and pair: min(c, A) + min(c, 2A) + min(c, X) + min(c,
    2X), M - 1 pairs of micro-batches (the first forward and the last backward run alone)."""
    moe = inputs.model.routed_moe
    if moe is None or not moe.overlap_expert_comm or inputs.ep == 1:
        return 0.0, 0.0
    layers = sum(is_routed_layer(inputs.model, n) for chunk in role.layers for n in chunk)
    total = all_to_all_seconds(inputs, role, device)
    if not layers or total == 0.0:
        return 0.0, 0.0
    config, m = inputs.model, inputs.micro_batches
    c = total / (4 * layers * m)
    rate = (device.fp32_flops if inputs.precision == "fp32" else device.bf16_flops) * efficiency
    tokens = inputs.local_seq_length * inputs.micro_batch
    experts_s = routed_rows(inputs) * routed_expert_forward_flops(config) / rate
    rest = attention_forward_flops(config, inputs.seq_length) + moe_layer_forward_flops(config)
    rest -= moe.top_k * routed_expert_forward_flops(config)
    attention_s = tokens * rest / inputs.tp / rate
    per_pair = sum(min(c, piece) for piece in (attention_s, 2 * attention_s))
    per_pair += sum(min(c, piece) for piece in (experts_s, 2 * experts_s))
    return layers * (m - 1) * per_pair, total


def ring_exposed_seconds(
    size: int, key_values_s: float, gradients_s: float, block_s: float
) -> tuple[float, float]:
    """(exposed, total) transfer seconds of one ring attention forward and backward over
    `size` ranks: `key_values_s` per key/value transfer, `gradients_s` per gradient transfer,
    `block_s` one block's forward attention (its backward: twice that).

    Forward: C-1 steps, each transfer hidden behind the block in hand. Backward, as
    `RingAttention.backward` runs it: step 0 hides the keys and values; steps 1 to C-2 the
    keys and values with the previous step's gradients beside them; step C-1 that gradient
    alone; the last gradient is waited for after the last block.
    """
    if size == 1:
        return 0.0, 0.0
    forward = (size - 1) * max(0.0, key_values_s - block_s)
    backward_block = 2 * block_s
    backward = max(0.0, key_values_s - backward_block)
    backward += (size - 2) * max(0.0, key_values_s + gradients_s - backward_block)
    backward += max(0.0, gradients_s - backward_block) + gradients_s
    total = 2 * (size - 1) * key_values_s + size * gradients_s
    return forward + backward, total


def context_parallel_seconds(
    inputs: PlanInputs, role: RankRole, device: Device, efficiency: float
) -> tuple[float, float]:
    """(exposed, total) seconds of context parallelism's communication per iteration (the
    module's docstring); the loss gather is left out (b s fp32 per micro-batch)."""
    c = inputs.cp
    if c == 1:
        return 0.0, 0.0
    link = _link(device, c, inputs.tp)  # the CP group's ranks are TP apart
    peak = device.fp32_flops if inputs.precision == "fp32" else device.bf16_flops
    # One block's forward: 4 np hn flops per query-key pair, over b s^2 / (2 C^2) pairs.
    s, b = inputs.seq_length, inputs.micro_batch
    block_flops = 2 * b * s * s * inputs.model.projection_size / (inputs.tp * c * c)
    block_s = block_flops / (peak * efficiency)
    recomputed = inputs.model.recompute_granularity == "full"
    exposed = total = 0.0
    for number in (n for chunk in role.layers for n in chunk):
        comm_type = inputs.cp_comm_type(number)
        layer = context_parallel_layer_bytes(inputs, comm_type)
        if comm_type != "p2p":
            passes = layer["backward"] + layer["forward"] * (2 if recomputed else 1)
            seconds = passes * _ring("all_to_all", c) / link
            exposed, total = exposed + seconds, total + seconds
            continue
        key_values_s = layer["forward"] / (c - 1) / link
        gradients_s = (layer["backward"] - layer["forward"]) / c / link
        ring = ring_exposed_seconds(c, key_values_s, gradients_s, block_s)
        forward = (c - 1) * max(0.0, key_values_s - block_s)  # the recomputed forward's
        exposed += ring[0] + (forward if recomputed else 0.0)
        total += ring[1] + ((c - 1) * key_values_s if recomputed else 0.0)
    return exposed * inputs.micro_batches, total * inputs.micro_batches


def estimate_step(
    inputs: PlanInputs,
    role: RankRole,
    device: Device,
    efficiency: float = MATMUL_EFFICIENCY,
) -> StepEstimate:
    """Step time and MFU of a rank of `role` (the plan passes its busiest)."""
    tokens = inputs.micro_batch * inputs.micro_batches * inputs.dp * inputs.seq_length
    model_flops = flops_per_token(inputs.model, inputs.seq_length) * tokens / (inputs.world_size)
    executed = model_flops * _recompute_factor(inputs)
    peak = device.fp32_flops if inputs.precision == "fp32" else device.bf16_flops
    fp8 = fp8_flops(inputs)
    fp8_peak = device.fp8_flops or peak
    compute = (executed - fp8) / (peak * efficiency) + fp8 / (fp8_peak * efficiency)
    # The backward: what runs after each forward (recomputed forwards included).
    backward = compute * (executed - model_flops / 3) / executed if executed else 0.0
    tp = inputs.tp
    tp_link = _link(device, tp, 1)
    megatron_op = "all_gather" if inputs.model.sequence_parallel else "all_reduce"
    gathers = deepspeed_pipeline_gathers(inputs, role) + moe_tensor_parallel_bytes(inputs, role)
    tp_comm = (
        (
            tensor_parallel_bytes(inputs, role) * _ring(megatron_op, tp)
            + gathers * _ring("all_gather", tp)
        )
        / tp_link
        if tp > 1
        else 0.0
    )
    dp_comm = data_parallel_seconds(
        inputs, data_parallel_collectives(inputs, role), device, backward, compute
    )
    pp_stride = tp * inputs.dp * inputs.split
    pp_comm = pipeline_bytes(inputs, role) / _link(device, inputs.pp, pp_stride)
    a2a_comm = all_to_all_seconds(inputs, role, device)
    a2a_comm -= shared_expert_overlap_seconds(inputs, role, device, efficiency)
    hidden_a2a, total_a2a = combined_1f1b_seconds(inputs, role, device, efficiency)
    a2a_comm -= hidden_a2a
    cp_comm, cp_total = context_parallel_seconds(inputs, role, device, efficiency)
    bubble = 0.0
    if inputs.pp > 1:
        bubble = bubble_fraction(inputs.pp, inputs.virtual, inputs.micro_batches)
    step = (compute + tp_comm) / (1 - bubble) + dp_comm + pp_comm + a2a_comm + cp_comm
    return StepEstimate(
        model_flops=model_flops,
        executed_flops=executed,
        compute_s=compute,
        communication_s=tp_comm + dp_comm + pp_comm + a2a_comm + cp_comm,
        bubble=bubble,
        step_s=step,
        mfu=model_flops / (step * peak),
        tokens_per_s=tokens / step,
        context_parallel_s=cp_comm,
        context_parallel_hidden=1.0 - cp_comm / cp_total if cp_total else 0.0,
        fp8_flops=fp8,
        expert_comm_hidden=hidden_a2a / total_a2a if total_a2a else 0.0,
    )
