"""Peak memory of one rank: model states by engine and ZeRO stage, activations, buffers.

The peak is the largest of three moments of an iteration, each a sum of what is alive then:

- `forward`: the last warm-up forward has run (every micro-batch in flight keeps its
  activations) and the loss is being computed over the logits;
- `backward`: the first backward starts (activations still held, the logits' gradient and
  the first gradients arrive);
- `step`: every gradient reduced, the optimizer updating (its temporaries alive).

Model states per parameter element W of this rank, Z the ZeRO group (data x Ulysses):

| path | weights | gradients | optimizer |
|---|---|---|---|
| plain / Megatron pipeline (fp32 weights; autocast under bf16/fp16) | 4 | 4 (+4 DDP buckets) | 8 |
| DeepSpeed fp32, ZeRO-0 | 4 | 4 | 8 |
| DeepSpeed bf16/fp16 ZeRO-0 | 2 | 2 (+4 fp32 copy for the step) | 12 (fp32 master + Adam) |
| DeepSpeed bf16 ZeRO-1 (BF16_Optimizer) | 2 | 2 + 4 (fp32 accumulation) | 12 / Z |
| DeepSpeed ZeRO-1/2 (DeepSpeedZeroOptimizer) | 2 | 2 + 4 / Z (+ buckets) | 12 / Z |
| DeepSpeed ZeRO-3 | 2 / Z (+ gathered layers) | 4 / Z (+ buckets) | 12 / Z |

(fp32 DeepSpeed under ZeRO 1-3 has 4-byte weights and gradients and no separate master.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.planning.activations import (
    autocast_copy_bytes,
    logits_bytes,
    logits_working_bytes,
    stage_activation_bytes,
)
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole, micro_batches_in_flight

_FP32 = 4
_ADAM = 8  # exp_avg and exp_avg_sq, fp32


@dataclass
class RankMemory:
    """Bytes one rank holds, by kind, and its predicted peak."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    peak_bytes: int
    peak_at: str
    """`forward`, `backward` or `step`: the moment of the peak."""
    moments: dict[str, int] = field(default_factory=dict)
    offloaded: int = 0
    """Optimizer bytes held in host memory (ZeRO offload), not on the device."""

    def as_json(self) -> dict:
        """The `memory` object of `--dry-run-json`."""
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "buffers": self.buffers,
            "peak_bytes": self.peak_bytes,
            "peak_at": self.peak_at,
            "moments": dict(self.moments),
            "offloaded_to_host": self.offloaded,
        }


@dataclass
class _States:
    weights: int
    gradients: int  # alive from the first backward to the step
    optimizer: int  # alive from the first step on
    buffers: int  # persistent framework buffers (DDP buckets, flat fp32 gradients)
    reduction: int  # transient while gradients are reduced (flat copies, buckets)
    step_temporaries: int  # transient inside the optimizer step
    gradients_between_micro_batches: bool  # held during later micro-batches' forward
    gathered: int = 0  # ZeRO-3: parameters gathered for the layers running now
    offloaded: int = 0


def _half(inputs: PlanInputs) -> int:
    return 2 if inputs.precision in ("bf16", "fp16") else _FP32


def model_states(inputs: PlanInputs, parameters: int) -> _States:
    """Weights, gradients, optimizer state and buffers of `parameters` elements on a rank."""
    w, z, zero = parameters, inputs.zero_group, inputs.zero
    if not inputs.deepspeed:
        ddp = _FP32 * w if inputs.dp * inputs.sp > 1 and inputs.engine == "plain" else 0
        return _States(
            weights=_FP32 * w,
            gradients=_FP32 * w,
            optimizer=_ADAM * w,
            buffers=ddp,
            reduction=0,
            step_temporaries=_FP32 * w,  # foreach AdamW's sqrt(exp_avg_sq) list
            gradients_between_micro_batches=True,
        )
    half = _half(inputs)
    master = 0 if half == _FP32 else _FP32  # fp32 master copy beside half weights
    states = master + _ADAM
    if zero.stage == 0:
        flat = min(w, zero.reduce_bucket_size) * half if inputs.dp > 1 else 0
        return _States(
            weights=half * w,
            gradients=half * w,
            optimizer=states * w,
            buffers=0,
            reduction=flat,
            step_temporaries=_FP32 * w + (_FP32 * w if master else 0),
            gradients_between_micro_batches=True,
        )
    partition = -(-w // z)
    optimizer = states * partition
    offloaded = optimizer if zero.offload_optimizer else 0
    if zero.offload_optimizer:
        optimizer = 0
    if zero.stage == 1 and half != _FP32 and inputs.grad_accum_dtype == "fp32":
        # BF16_Optimizer: fp32 gradients of the whole model, accumulated across micro-batches.
        return _States(
            weights=half * w,
            gradients=half * w,
            optimizer=optimizer,
            buffers=_FP32 * w,
            reduction=0,
            step_temporaries=_FP32 * partition,
            gradients_between_micro_batches=False,
            offloaded=offloaded,
        )
    if zero.stage in (1, 2):
        bucket = min(w, zero.reduce_bucket_size) * half
        return _States(
            weights=half * w,
            gradients=half * w,
            optimizer=optimizer,
            buffers=_FP32 * partition,
            reduction=bucket * (2 if zero.overlap_comm else 1),
            step_temporaries=_FP32 * partition,
            gradients_between_micro_batches=False,
            offloaded=offloaded,
        )
    gathered = min(w, zero.max_live_parameters, 2 * zero.prefetch_bucket_size) * half
    return _States(
        weights=half * partition,
        gradients=_FP32 * partition,
        optimizer=optimizer,
        buffers=0,
        reduction=min(w, zero.reduce_bucket_size) * half,
        step_temporaries=_FP32 * partition,
        gradients_between_micro_batches=False,
        gathered=gathered,
        offloaded=offloaded,
    )


def rank_memory(inputs: PlanInputs, role: RankRole) -> RankMemory:
    """The predicted peak of a rank of `role`, and what it is made of."""
    states = model_states(inputs, role.num_parameters)
    in_flight = micro_batches_in_flight(inputs, role.pp_rank)
    per_micro_batch = stage_activation_bytes(inputs, role.num_layers, role.first, role.last)
    activations = int(in_flight * per_micro_batch)
    activations += autocast_copy_bytes(inputs, role.num_layers, role.last)
    logits = logits_bytes(inputs) + logits_working_bytes(inputs) if role.last else 0
    fixed = states.weights + states.optimizer + states.buffers + states.gathered
    accumulating = inputs.micro_batches > 1 and states.gradients_between_micro_batches
    forward = fixed + activations + logits + (states.gradients if accumulating else 0)
    backward = fixed + activations + logits + states.gradients
    step = fixed + states.gradients + max(states.reduction, states.step_temporaries)
    moments = {"forward": forward, "backward": backward, "step": step}
    peak_at = max(moments, key=moments.__getitem__)
    return RankMemory(
        weights=states.weights + states.gathered,
        gradients=states.gradients,
        optimizer=states.optimizer,
        activations=activations,
        logits=logits,
        buffers=states.buffers + max(states.reduction, states.step_temporaries),
        peak_bytes=moments[peak_at],
        peak_at=peak_at,
        moments=moments,
        offloaded=states.offloaded,
    )
