"""A simple roofline for one iteration: compute at a stated efficiency, communication at the
device table's link bandwidths, the pipeline bubble on top.

    compute  = FLOPs run by the rank (model FLOPs + recomputation) / (peak x efficiency)
    tp comm  = Megatron's tensor-parallel bytes x 2 (T-1)/T / link (an all-reduce; (T-1)/T
               with sequence parallelism, whose all-gathers and reduce-scatters replace it)
               + DeepSpeed's tensor-parallel all-gathers (pipeline sends, MoE tokens) x (T-1)/T
    dp comm  = each data-parallel collective x 2 (D-1)/D (all-reduce) or (D-1)/D (all-gather,
               reduce-scatter) / link, then overlapped as the engines overlap it (below)
    pp comm  = pipeline bytes / link
    a2a      = Ulysses' and the experts' all-to-alls x (G-1)/G / their group's link
    step     = (compute + tp comm) / (1 - bubble) + exposed dp comm + pp comm + a2a
    MFU      = model FLOPs of the rank / (step x peak)

Overlap, as the engines run it: a collective issued bucket by bucket as the backward produces
gradients (DDP's reducer; DeepSpeed's ZeRO with `overlap_comm`, ZeRO-3's reduce-scatter)
hides under that backward - the last micro-batch's when it is issued once per iteration, every
micro-batch's when issued in each - except its last bucket, which only starts when the
backward ends; ZeRO-3's prefetched parameter all-gathers hide under the whole compute the
same way. What does not fit in its window is exposed. Everything else (ZeRO-0's and
BF16_Optimizer's all-reduce after the backward, the weight all-gathers after the step,
DeepSpeed's pipeline engine, which turns `overlap_comm` off) is exposed in full.

A group stays inside a node (NVLink) when its ranks fit in `gpus_per_node` at their stride;
otherwise it uses the network bandwidth. The efficiency (default 0.55 of the dense peak for
the matmuls, what large GPT layers reach on H100s with bf16) is a parameter, not a result.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.pipeline_parallel.layout import bubble_fraction
from megatron.model.model_size import flops_per_token
from megatron.planning.communication import (
    Collective,
    all_to_all_parts,
    data_parallel_collectives,
    deepspeed_pipeline_gathers,
    moe_tensor_parallel_bytes,
    pipeline_bytes,
    tensor_parallel_bytes,
)
from megatron.planning.devices import Device
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole

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
    """The all-to-alls' time: (G-1)/G of each payload over its own group's link."""
    a2a = all_to_all_parts(inputs, role)
    # Ulysses' group: S consecutive ranks (TP 1); an expert group: EP ranks TP apart
    # (deepspeed/utils/groups.py _create_expert_and_data_parallel, TP-strided).
    seconds = a2a["ulysses"] * _ring("all_to_all", inputs.sp) / _link(device, inputs.sp, 1)
    experts = min(inputs.ep, max(inputs.model.moe.experts_per_layer)) if inputs.model.moe else 1
    if experts > 1:
        link = _link(device, experts, inputs.tp)
        seconds += a2a["experts"] * _ring("all_to_all", experts) / link
    return seconds


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
    compute = executed / (peak * efficiency)
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
    pp_comm = pipeline_bytes(inputs, role) / _link(device, inputs.pp, tp * inputs.dp * inputs.sp)
    a2a_comm = all_to_all_seconds(inputs, role, device)
    bubble = 0.0
    if inputs.pp > 1:
        bubble = bubble_fraction(inputs.pp, inputs.virtual, inputs.micro_batches)
    step = (compute + tp_comm) / (1 - bubble) + dp_comm + pp_comm + a2a_comm
    return StepEstimate(
        model_flops=model_flops,
        executed_flops=executed,
        compute_s=compute,
        communication_s=tp_comm + dp_comm + pp_comm + a2a_comm,
        bubble=bubble,
        step_s=step,
        mfu=model_flops / (step * peak),
        tokens_per_s=tokens / step,
    )
