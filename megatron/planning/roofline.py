"""A simple roofline for one iteration: compute at a stated efficiency, communication at the
device table's link bandwidths, the pipeline bubble on top.

    compute  = FLOPs run by the rank (model FLOPs + recomputation) / (peak x efficiency)
    comm     = tensor-parallel bytes x 2 (T-1)/T / link       (not overlapped with compute;
                                                                (T-1)/T with sequence parallelism)
             + data-parallel bytes x (D-1)/D x 2 / link        (not overlapped: an upper bound)
             + pipeline bytes / link
    step     = (compute + tensor-parallel comm) / (1 - bubble) + data-parallel + pipeline comm
    MFU      = model FLOPs of the rank / (step x peak)

A group stays inside a node (NVLink) when its ranks fit in `gpus_per_node` at their stride;
otherwise it uses the network bandwidth. The efficiency (default 0.55 of the dense peak for
the matmuls, what large GPT layers reach on H100s with bf16) is a parameter, not a result.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.pipeline_parallel.layout import bubble_fraction
from megatron.model.model_size import flops_per_token
from megatron.planning.devices import Device
from megatron.planning.inputs import PlanInputs

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
        else (device.inter_node_bytes_per_s)
    )


def estimate_step(
    inputs: PlanInputs,
    communication: dict[str, int],
    device: Device,
    efficiency: float = MATMUL_EFFICIENCY,
) -> StepEstimate:
    """Step time and MFU of the busiest rank (`communication`: its bytes by kind)."""
    tokens = inputs.micro_batch * inputs.micro_batches * inputs.dp * inputs.seq_length
    model_flops = flops_per_token(inputs.model, inputs.seq_length) * tokens / (inputs.world_size)
    executed = model_flops * _recompute_factor(inputs)
    peak = device.fp32_flops if inputs.precision == "fp32" else device.bf16_flops
    compute = executed / (peak * efficiency)
    tp = inputs.tp
    # An all-reduce moves 2 (T-1)/T of its payload over each link, an all-gather or a
    # reduce-scatter (T-1)/T: sequence parallelism trades each all-reduce for one of each.
    ring = (1 if inputs.model.sequence_parallel else 2) * (tp - 1) / tp
    tp_comm = communication["tensor_parallel"] * ring / _link(device, tp, 1)
    group = inputs.dp * inputs.sp
    dp_stride = inputs.tp
    dp_comm = (
        communication["data_parallel"] * 2 * (group - 1) / group / _link(device, group, dp_stride)
        if group > 1
        else 0.0
    )
    pp_comm = communication["pipeline"] / _link(device, inputs.pp, inputs.tp * group)
    pp_comm += communication.get("all_to_all", 0) / _link(device, group, dp_stride)
    bubble = (
        bubble_fraction(inputs.pp, inputs.virtual, inputs.micro_batches) if (inputs.pp > 1) else 0.0
    )
    step = (compute + tp_comm) / (1 - bubble) + dp_comm + pp_comm
    return StepEstimate(
        model_flops=model_flops,
        executed_flops=executed,
        compute_s=compute,
        communication_s=tp_comm + dp_comm + pp_comm,
        bubble=bubble,
        step_s=step,
        mfu=model_flops / (step * peak),
        tokens_per_s=tokens / step,
    )
