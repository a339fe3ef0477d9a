"""The element sizes of the tensors a layer keeps for backward, by role, on a job's
precision path (plain fp32, fp32 parameters under autocast, or half-precision parameters)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.planning.inputs import PlanInputs

_FP32 = 4


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of the tensors a layer saves, by role."""

    residual: int
    """The residual stream, norm inputs and dropout masks (the parameters' dtype)."""
    compute: int
    """Matmul inputs and outputs (half precision under --bf16/--fp16)."""
    activation_input: int
    """The MLP activation's input: fp32 under autocast unless the bias-GeLU kernel is fused
    (eager CPU adds the fp32 bias first and keeps the sum) or there is no bias."""
    mask: int
    """A dropout mask: bool on GPUs (torch's fused dropout), the input's dtype on CPUs (the
    embedding's output: the residual dtype)."""
    branch_mask: int
    """The dropout mask after attention and after the MLP: on CPUs their output's dtype, the
    parameters' once the linear bias is added, else the compute dtype's."""


def dtypes(inputs: PlanInputs) -> Dtypes:
    """The saved tensors' element sizes on this job's path."""
    gpu = inputs.device_type == "cuda"
    if inputs.precision == "fp32":
        mask = 1 if gpu else _FP32
        return Dtypes(_FP32, _FP32, _FP32, mask, mask)
    if inputs.deepspeed or inputs.fsdp:
        # Half-precision parameters (DeepSpeed's, or FSDP2's gathered in `param_dtype`):
        # everything half, autocast or not (tests/planning/test_fsdp_plan.py measures it).
        mask = 1 if gpu else 2
        return Dtypes(2, 2, 2, mask, mask)
    # fp32 parameters under torch.autocast: adding an fp32 bias makes an fp32 tensor.
    bias = inputs.model.add_bias_linear
    fused_gelu = gpu and inputs.model.bias_gelu_fusion and not inputs.model.gated
    activation_input = _FP32 if bias and not fused_gelu else 2
    mask = 1 if gpu else _FP32
    return Dtypes(_FP32, 2, activation_input, mask, mask if bias or gpu else 2)
