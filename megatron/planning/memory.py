"""Peak memory of one rank: model states by engine and ZeRO stage, activations, buffers.

The peak is the largest of these moments of an iteration, each a sum of what is alive then:

- `forward`: the last warm-up forward has run (every micro-batch in flight keeps its
  activations), the loss works over the logits, earlier micro-batches' gradients held;
- `backward`: the same as the backward starts and its gradient buckets are allocated;
- `boundary`: the last backward ends and gradients are reduced (flat copies);
- `step`: every gradient reduced, the optimizer updating (its temporaries alive);
- `embedding backward` (first stage): the embedding's dense gradient beside the held one,
  the other micro-batches in flight still holding their activations.

Model states per parameter element of this rank (P), Z the ZeRO group (data x Ulysses), as
DeepSpeed 0.19 allocates them (deepspeed/runtime: bf16_optimizer.py, fp16/unfused_optimizer.py,
zero/stage_1_and_2.py, zero/stage3.py; the engine picks the wrapper in engine.py):

path: persistent | held from the first backward to the step | transient
- plain (DDP) / Megatron pipeline: 4P weights + 8P Adam (+4P DDP buckets) | 4P | 4P AdamW
- DeepSpeed fp32 ZeRO-0 (no wrapper): 4P + 8P | 4P | 4P flat copy; 4P AdamW
- bf16 ZeRO-0, pipeline engine (BF16_Optimizer): 2P + 2P accumulation + 12P/Z | 2P |
  2P copy; 8P/Z step
- bf16 ZeRO-0, no pipeline (FP16_UnfusedOptimizer): 2P + 12P | 2P | 2P copy; 8P step
- bf16 ZeRO-1, fp32 accumulation (BF16_Optimizer): 2P + 4P accumulation + 12P/Z | 2P |
  4P + 2P copies; 4P/Z step
- ZeRO-2 (DeepSpeedZeroOptimizer): 2P + 12P/Z | 4P/Z fp32 partition | a 2B bucket each
  backward; the norm's fp64 copy and 4P/Z in the step
- ZeRO-3: 2P/Z + small parameters whole + 12P/Z + 4P/Z + 2B bucket | - | gathered
  layers; 16P/Z in the step

B is `reduce_bucket_size` (5e8 elements by default: a 1 GB bf16 bucket whatever the model).
"""

from __future__ import annotations

import dataclasses
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
_MEGATRON_BUCKET = 1 << 25  # megatron.core.pipeline_parallel.schedules' all-reduce bucket


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
    weights: int  # parameters (ZeRO-3: this rank's partition and the persistent small ones)
    optimizer: int  # fp32 master weights and Adam moments, from the first step on
    buffers: int  # persistent framework buffers (DDP buckets, accumulation, ZeRO-3 bucket)
    gradients: int = 0  # parameter gradients, from the first backward to the step
    accumulators: int = 0  # the same lifetime: ZeRO 1-2's fp32 partition of the gradients
    between_micro_batches: bool = True  # gradients and accumulators live across micro-batches
    backward_buckets: int = 0  # allocated at a backward's first gradient (ZeRO 1-2 buckets)
    reduction: int = 0  # at the end of the last backward: flat copies reduced
    step_temporaries: int = 0  # inside the optimizer step
    gathered: int = 0  # ZeRO-3: whole parameters gathered for the layers that ran
    offloaded: int = 0


def weight_bytes(inputs: PlanInputs) -> int:
    """Bytes per parameter element as the model holds it: half under DeepSpeed's bf16/fp16
    (and the compute dtype of the plain path's autocast), else fp32."""
    return 2 if inputs.precision in ("bf16", "fp16") else _FP32


def gradient_bytes(inputs: PlanInputs) -> int:
    """Bytes per element of a parameter's gradient: the weights' dtype under DeepSpeed,
    fp32 on the plain path (whose parameters are fp32 under autocast)."""
    return weight_bytes(inputs) if inputs.deepspeed else _FP32


def zero3_tensors(inputs: PlanInputs, sizes: tuple[int, ...]) -> tuple[list, list]:
    """ZeRO-3's (elements, padded to a multiple of the group) of each tensor: those it keeps
    whole (at most `stage3_param_persistence_threshold` elements) and those it partitions."""
    z, threshold = inputs.zero_group, inputs.zero.param_persistence_threshold
    pairs = [(n, _ceil(n, z) * z) for n in sizes]
    return [p for p in pairs if p[0] <= threshold], [p for p in pairs if p[0] > threshold]


def communication_bytes(inputs: PlanInputs) -> int:
    """Bytes per element of DeepSpeed's gradient reduction: `communication_data_type`, else
    the model's dtype (bf16 gradients are reduced in bf16 even when accumulated in fp32)."""
    return inputs.zero.communication_bytes or weight_bytes(inputs)


def _plain_states(inputs: PlanInputs, w: int) -> _States:
    """No DeepSpeed: fp32 weights are the master copy (autocast computes in half)."""
    states = _States(
        weights=_FP32 * w,
        optimizer=_ADAM * w,
        buffers=0,
        gradients=_FP32 * w,
        step_temporaries=_FP32 * w,  # foreach AdamW's sqrt(exp_avg_sq) list
    )
    if inputs.engine == "plain" and inputs.dp * inputs.sp > 1:
        states.buffers = _FP32 * w  # DDP's buckets, beside the gradients
    elif inputs.engine == "megatron-pipeline" and inputs.dp > 1:
        states.reduction = _FP32 * min(w, _MEGATRON_BUCKET)  # average_gradients' flat bucket
    return states


def _zero0_states(inputs: PlanInputs, w: int) -> _States:
    half, z = weight_bytes(inputs), inputs.zero_group
    pipeline_engine = inputs.engine == "deepspeed-pipeline"  # it all-reduces even at DP 1
    flat = min(w, inputs.zero.reduce_bucket_size)
    if half == _FP32:  # the client AdamW on the parameters themselves
        return _States(
            weights=_FP32 * w,
            optimizer=_ADAM * w,
            buffers=0,
            gradients=_FP32 * w,
            reduction=_FP32 * flat if (inputs.dp > 1 or pipeline_engine) else 0,
            step_temporaries=_FP32 * w,
        )
    if pipeline_engine:  # BF16_Optimizer, accumulating in bf16
        return _States(
            weights=half * w,
            optimizer=(_FP32 + _ADAM) * _ceil(w, z),
            buffers=half * w,  # the accumulation buffer
            gradients=half * w,
            reduction=half * flat,
            step_temporaries=2 * _FP32 * _ceil(w, z),  # fp32 copy of the partition + Adam's
        )
    # FP16_UnfusedOptimizer: whole fp32 master weights and Adam state on every rank.
    return _States(
        weights=half * w,
        optimizer=(_FP32 + _ADAM) * w,
        buffers=0,
        gradients=half * w,
        reduction=half * flat if inputs.dp > 1 else 0,
        step_temporaries=2 * _FP32 * w,  # fp32 copies of the gradients, then Adam's
    )


def _zero12_states(inputs: PlanInputs, w: int, largest: int) -> _States:
    half, z, zero = weight_bytes(inputs), inputs.zero_group, inputs.zero
    partition = _ceil(w, z)
    master = _FP32 if half != _FP32 else 0
    optimizer = (master + _ADAM) * partition
    if zero.stage == 1 and half != _FP32 and inputs.grad_accum_dtype == "fp32":
        # BF16_Optimizer: fp32 gradients of the whole model, accumulated across micro-batches;
        # reduced as a concatenated copy, converted to bf16 for the all-reduce.
        copy = min(w, zero.reduce_bucket_size)
        converted = copy * communication_bytes(inputs) if communication_bytes(inputs) < 4 else 0
        return _States(
            weights=half * w,
            optimizer=optimizer,
            buffers=_FP32 * w,
            gradients=half * w,
            reduction=_FP32 * copy + converted,
            step_temporaries=_FP32 * partition,
        )
    bucket = zero.reduce_bucket_size * half  # torch.empty(reduce_bucket_size), whatever w is
    if zero.stage == 1:  # DeepSpeedZeroOptimizer stage 1 holds its bucket to the boundary
        bucket *= 2 if inputs.engine == "deepspeed-pipeline" else 1
        return _States(
            weights=half * w,
            optimizer=optimizer,
            buffers=0,
            accumulators=_FP32 * partition + bucket,
            backward_buckets=half * largest,
            reduction=half * min(w, zero.reduce_bucket_size),
            step_temporaries=_FP32 * partition,
        )
    return _States(  # ZeRO-2: each gradient moves into the bucket as it is produced
        weights=half * w,
        optimizer=optimizer,
        buffers=0,
        accumulators=_FP32 * partition,
        backward_buckets=bucket * (2 if zero.overlap_comm else 1) + half * largest,
        reduction=half * min(w, zero.reduce_bucket_size),
        # The norm's fp64 copy of the largest fragment, then Adam's temporary.
        step_temporaries=8 * min(largest, partition) + _FP32 * partition,
    )


def _zero3_states(inputs: PlanInputs, tensor_sizes: tuple[int, ...]) -> _States:
    half, z, zero = weight_bytes(inputs), inputs.zero_group, inputs.zero
    whole, split = zero3_tensors(inputs, tensor_sizes)
    persistent = sum(n for n, _ in whole)
    partitioned = sum(n for n, _ in split)
    partition = sum(padded for _, padded in whole + split) // z
    master = _FP32 if half != _FP32 else 0
    return _States(
        weights=half * partition + half * persistent,
        optimizer=(master + _ADAM) * partition,
        # The fp32 gradient partition and the reduce bucket, both allocated at start-up.
        buffers=_FP32 * partition + half * zero.reduce_bucket_size,
        step_temporaries=_FP32 * partition + 8 * partition + _FP32 * partition,
        # A gathered parameter stays until its backward when it is used again within
        # max_reuse_distance elements: the layers after it, forward and backward.
        gathered=half * min(partitioned, zero.max_reuse_distance // 2),
    )


def _ceil(count: int, parts: int) -> int:
    return -(-count // parts)


def model_states(inputs: PlanInputs, role: RankRole) -> _States:
    """Weights, gradients, optimizer state and buffers of a rank of `role`, by engine.

    Under DeepSpeed ZeRO 0-2, MoE experts are partitioned over the expert-data-parallel
    group (data-parallel ranks / EP), the rest over the ZeRO group: two shares, added up
    (ZeRO-3 is planned as one share).
    """
    if inputs.deepspeed and role.expert_parameters and inputs.zero.stage < 3:
        dense = _states_of(inputs, role, role.num_parameters - role.expert_parameters)
        expert_inputs = dataclasses.replace(inputs, dp=max(1, inputs.dp // inputs.ep), sp=1)
        experts = _states_of(expert_inputs, role, role.expert_parameters)
        experts.backward_buckets = 0  # one gradient bucket serves both groups
        added = {
            field.name: getattr(dense, field.name) + getattr(experts, field.name)
            for field in dataclasses.fields(_States)
            if field.name != "between_micro_batches"
        }
        return _States(**added, between_micro_batches=dense.between_micro_batches)
    return _states_of(inputs, role, role.num_parameters)


def _states_of(inputs: PlanInputs, role: RankRole, w: int) -> _States:
    if not inputs.deepspeed:
        states = _plain_states(inputs, w)
    elif inputs.zero.stage == 0:
        states = _zero0_states(inputs, w)
    elif inputs.zero.stage in (1, 2):
        states = _zero12_states(inputs, w, max(role.tensor_sizes, default=0))
    else:
        states = _zero3_states(inputs, role.tensor_sizes)
    if inputs.zero.offload_optimizer:
        states.offloaded, states.optimizer = states.optimizer, 0
    return states


def rank_memory(inputs: PlanInputs, role: RankRole) -> RankMemory:
    """The predicted peak of a rank of `role`, and what it is made of."""
    states = model_states(inputs, role)
    in_flight = micro_batches_in_flight(inputs, role.pp_rank)
    per_micro_batch = stage_activation_bytes(inputs, role.num_layers, role.first, role.last)
    activations = int(in_flight * per_micro_batch)
    activations += autocast_copy_bytes(inputs, role.num_layers, role.last)
    logits = logits_bytes(inputs) + logits_working_bytes(inputs) if role.last else 0
    if role.last and inputs.engine == "deepspeed-pipeline":
        # DeepSpeed's pipe buffers keep each micro-batch's outputs (the logits, last) until
        # the buffer is reused: two buffers at least, so the previous logits stay alive.
        logits += (min(2, inputs.micro_batches) - 1) * logits_bytes(inputs)
    fixed = states.weights + states.optimizer + states.buffers
    held = states.gradients + states.accumulators  # from the first backward to the step
    carried = held if inputs.micro_batches > 1 and states.between_micro_batches else 0
    forward = fixed + states.gathered + activations + logits + carried
    # Gradient buckets are allocated at a backward's first parameter gradient: after the
    # loss and the output layer (their logits freed), beside the output weight's gradient.
    head_gradient = gradient_bytes(inputs) * role.parameters["head"] if role.last else 0
    backward = fixed + states.gathered + activations + (carried or states.accumulators)
    backward += states.backward_buckets + head_gradient
    boundary = fixed + held + states.backward_buckets + states.reduction
    step = fixed + held + states.step_temporaries
    moments = {"forward": forward, "backward": backward, "boundary": boundary, "step": step}
    if role.first:
        # The embedding's backward ends each micro-batch's backward on the first stage: a
        # dense gradient of the whole word-embedding shard, added to the held one after.
        # By then that micro-batch's activations are gone, the others' in flight are not.
        rows = inputs.model.vocab_size // inputs.tp
        embedding = gradient_bytes(inputs) * rows * inputs.model.hidden_size
        remaining = activations - int(per_micro_batch / inputs.virtual)
        moments["embedding backward"] = fixed + held + embedding + max(0, remaining)
    peak_at = max(moments, key=moments.__getitem__)
    return RankMemory(
        weights=states.weights + states.gathered,
        gradients=held,
        optimizer=states.optimizer,
        activations=activations,
        logits=logits,
        buffers=states.buffers
        + max(states.backward_buckets, states.reduction, states.step_temporaries),
        peak_bytes=moments[peak_at],
        peak_at=peak_at,
        moments=moments,
        offloaded=states.offloaded,
    )
