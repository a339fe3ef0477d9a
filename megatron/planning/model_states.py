"""Model states of one rank: weights, gradients, optimizer state and framework buffers, by
engine and, under DeepSpeed, by the optimizer wrapper it runs (`megatron.deepspeed_facts`).

Bytes per parameter element of this rank (P), Z the ZeRO group (data x Ulysses), h the
weights' half dtype (2), a the gradient accumulation dtype's bytes, B `reduce_bucket_size`
(5e8 elements: a 1 GB bucket in half precision whatever the model), E the engine's fixed
5e8-element all-reduce bucket. As DeepSpeed 0.19.8 allocates them (each term below cites the
function and line it follows):

wrapper: persistent | held from the first backward to the step | transient
- plain (DDP) / Megatron pipeline: 4P weights + 8P Adam (+4P DDP buckets) | 4P | 4P AdamW
- fp32 ZeRO-0, the client AdamW: 4P + 8P | 4P | a flat copy of E; 4P AdamW
- FP16_UnfusedOptimizer (fp16 ZeRO-0 on either engine, bf16 ZeRO-0 on the plain one):
  hP + 12P whole on every rank | hP | a flat copy of E; 4P fp32 gradients + 4P AdamW
- BF16_Optimizer (bf16 ZeRO-0 on the pipeline engine, bf16 ZeRO-1 accumulating in fp32):
  hP + aP accumulation buffer + 12P/Z | hP | the buffer's conversion; 4P/Z (+4P/Z if a < 4)
- DeepSpeedZeroOptimizer stage 1 (fp16 ZeRO-1; bf16 ZeRO-1 accumulating in bf16):
  hP + 12P/Z | the whole gradient hP (aP with a separate accumulation dtype) + hB bucket
  (two on the pipeline engine or with overlap_comm) | hB at the boundary; 4P/Z in the step
- stage 2: hP + 12P/Z | the gradient partition (4P/Z with fp32 accumulation, else hP/Z) |
  hB bucket each backward (two with overlap_comm); the norm's fp64 copy and 4P/Z in the step
- ZeRO-3: hP/Z + small parameters whole + 12P/Z + 4P/Z + hB | - | gathered layers; 16P/Z

torch FSDP2 on the plain engine (`fsdp_states`; torch 2.13's _fully_shard/), c the compute
dtype's bytes (`param_dtype`: 2 under --bf16/--fp16, else 4), r the reduce dtype's (4, or 2
with --grad-reduce-in-bf16), Z the data x context ranks, units: each layer and the root
(embeddings, final norm, output layer):
- both strategies: 4P/Z fp32 weights + 8P/Z Adam | 4P/Z gradient shard, from the
  reduce-scatter to the step | cP gathered weights of the units alive (optim_grads: every
  unit, kept to its backward; optim_grads_params: the root and one layer, two in the
  backward's prefetch; 1 byte an element for the FP8 layers' linear weights under
  `--fp8-param-gather`); rP whole gradients summed across micro-batches before the last
  one's reduce-scatter; a unit's rP reduce-scatter input; a unit's second cP copy as it is
  gathered; 4P/Z AdamW
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.deepspeed_facts import (
    ENGINE_ALLREDUCE_BUCKET,
    OptimizerWrapper,
    effective_overlap_comm,
)
from megatron.model.model_size import fp8_weight_sizes
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole

_FP32 = 4
_ADAM = 8  # exp_avg and exp_avg_sq, fp32
_MEGATRON_BUCKET = 1 << 25  # megatron.core.pipeline_parallel.schedules' all-reduce bucket
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class States:
    """What one rank's model states occupy, by lifetime (bytes)."""

    weights: int
    """Parameters (ZeRO-3: this rank's partition and the persistent small ones)."""
    optimizer: int
    """fp32 master weights and Adam moments."""
    buffers: int = 0
    """Persistent framework buffers that are not gradients (DDP's buckets, ZeRO-3's bucket)."""
    gradient_buffers: int = 0
    """Persistent gradient storage (BF16_Optimizer's accumulation buffer, ZeRO-3's fp32
    gradient partition): allocated at start-up."""
    gradients: int = 0
    """Gradients from the first backward to the step (summed across micro-batches)."""
    accumulators: int = 0
    """Gradient storage allocated at a backward's first gradient, held to the step (ZeRO-2's
    partition)."""
    held_buckets: int = 0
    """Reduction buckets allocated at a backward's first gradient, held to the step."""
    backward_buckets: int = 0
    """Allocated as a backward's gradients arrive, freed at its end."""
    reduction: int = 0
    """At the end of the last backward: flat copies reduced."""
    step_temporaries: int = 0
    """Inside the optimizer step."""
    gathered: int = 0
    """ZeRO-3: whole parameters gathered for the layers that ran."""
    offloaded: int = 0
    """Optimizer bytes held in host memory (ZeRO offload)."""
    prefetched: int = 0
    """FSDP2 optim_grads_params: the next layer's weights, gathered ahead in the backward."""
    unsharded_gradients: int = 0
    """FSDP2: whole gradients summed across micro-batches without a reduce-scatter, carried
    into the later micro-batches when there are several."""
    sharded_gradients: int = 0
    """FSDP2: this rank's reduce-scattered gradient shard, from the last backward to the step."""
    root_gathered: int = 0
    """FSDP2: the root unit's gathered weights (embeddings, final norm, output layer): alive
    through its forward and its backward, which ends with the embedding's."""
    gather_copy: int = 0
    """FSDP2: the root's all-gather output beside the per-parameter copies made of it."""


def weight_bytes(inputs: PlanInputs) -> int:
    """Bytes per parameter element as the model holds it: half under DeepSpeed's bf16/fp16
    (and the compute dtype of the plain path's autocast, and FSDP2's gathered weights),
    else fp32."""
    return 2 if inputs.precision in ("bf16", "fp16") else _FP32


def gradient_bytes(inputs: PlanInputs) -> int:
    """Bytes per element of a parameter's gradient: the weights' dtype under DeepSpeed (and
    of FSDP2's gathered weights), fp32 on the plain path (fp32 parameters under autocast)."""
    return weight_bytes(inputs) if inputs.deepspeed or inputs.fsdp else _FP32


def reduce_bytes(inputs: PlanInputs) -> int:
    """Bytes per element FSDP2 reduce-scatters gradients in (`reduce_dtype`)."""
    return _BYTES[inputs.grad_reduce_dtype]


def accumulation_bytes(inputs: PlanInputs) -> int:
    """Bytes per element of the dtype DeepSpeed sums micro-batch gradients in."""
    return _BYTES[inputs.grad_accum_dtype]


def communication_bytes(inputs: PlanInputs) -> int:
    """Bytes per element of DeepSpeed's gradient reduction: `communication_data_type`, else
    the model's dtype (engine.py communication_data_type, L1719-1730: fp16, bf16 or fp32)."""
    return inputs.zero.communication_bytes or weight_bytes(inputs)


def zero3_tensors(inputs: PlanInputs, sizes: tuple[int, ...]) -> tuple[list, list]:
    """ZeRO-3's (elements, padded to a multiple of the group) of each tensor: those it keeps
    whole (at most `stage3_param_persistence_threshold` elements) and those it partitions."""
    z, threshold = inputs.zero_group, inputs.zero.param_persistence_threshold
    pairs = [(n, _ceil(n, z) * z) for n in sizes]
    return [p for p in pairs if p[0] <= threshold], [p for p in pairs if p[0] > threshold]


def engine_allreduce_transient(
    sizes: Sequence[int] | None, total: int, element: int, communicated: int
) -> int:
    """The largest transient of DeepSpeed's engine all-reduce of gradients of `sizes`
    elements in order (None: many tensors, each far below a bucket; `total` elements in all).

    engine.py allreduce_no_retain (L3828-3839) closes a bucket once it holds more than E
    (MEMORY_OPT_ALLREDUCE_SIZE, L151) elements; allreduce_bucket (L3795-3801) flattens it (a
    copy, unless it is one tensor: torch's flatten of one tensor is a view) and converts it
    to the communication dtype when that differs (a second copy).
    """
    if sizes is None:
        bucket = min(total, ENGINE_ALLREDUCE_BUCKET)
        return bucket * element + (bucket * communicated if communicated != element else 0)
    largest, bucket = 0, []
    for size in list(sizes) + [None]:
        if size is not None:
            bucket.append(size)
            if sum(bucket) <= ENGINE_ALLREDUCE_BUCKET:
                continue
        if bucket:
            n = sum(bucket)
            flat = n * element if len(bucket) > 1 else 0
            largest = max(largest, flat + (n * communicated if communicated != element else 0))
        bucket = []
    return largest


def _ceil(count: int, parts: int) -> int:
    return -(-count // parts)


def _plain_states(inputs: PlanInputs, w: int) -> States:
    """No DeepSpeed: fp32 weights are the master copy (autocast computes in half)."""
    states = States(
        weights=_FP32 * w,
        optimizer=_ADAM * w,
        gradients=_FP32 * w,
        step_temporaries=_FP32 * w,  # foreach AdamW's sqrt(exp_avg_sq) list
    )
    if inputs.engine == "plain" and inputs.zero_group > 1:
        states.buffers = _FP32 * w  # DDP's buckets, beside the gradients
    elif inputs.engine == "megatron-pipeline" and inputs.zero_group > 1:
        states.reduction = _FP32 * min(w, _MEGATRON_BUCKET)  # average_gradients' flat bucket
    return states


def _engine_reduces(inputs: PlanInputs) -> bool:
    """Whether DeepSpeed's engine all-reduces (and flattens) gradients: over data-parallel
    (x sequence-split) ranks, and on the pipeline engine always (pipe/engine.py
    _exec_reduce_grads, L287-298)."""
    return inputs.zero_group > 1 or inputs.engine == "deepspeed-pipeline"


def _client_states(inputs: PlanInputs, w: int, sizes: Sequence[int] | None) -> States:
    """fp32 ZeRO-0: the client AdamW steps the parameters themselves (engine.py
    _configure_optimizer, L2365-2366: no wrapper)."""
    copy = engine_allreduce_transient(sizes, w, _FP32, communication_bytes(inputs))
    return States(
        weights=_FP32 * w,
        optimizer=_ADAM * w,
        gradients=_FP32 * w,
        reduction=copy if _engine_reduces(inputs) else 0,
        step_temporaries=_FP32 * w,
    )


def _fp16_wrapper_states(inputs: PlanInputs, w: int, sizes: Sequence[int] | None) -> States:
    """FP16_UnfusedOptimizer (fp16/unfused_optimizer.py), DeepSpeed's wrapper for fp16 at
    ZeRO-0 on either engine and for bf16 at ZeRO-0 on the plain engine."""
    half = weight_bytes(inputs)
    copy = engine_allreduce_transient(sizes, w, half, communication_bytes(inputs))
    return States(
        weights=half * w,
        # __init__ L78: "fp32_group = [p.clone().float().detach() ...]", whole on every rank;
        # initialize_optimizer_states (L412-433) steps once, so Adam's moments exist from
        # start-up, whole too.
        optimizer=(_FP32 + _ADAM) * w,
        # The model's half gradients stay on the parameters, summed across micro-batches,
        # until step() copies them (nothing frees them before).
        gradients=half * w,
        reduction=copy if _engine_reduces(inputs) else 0,
        # step() L218-222: "fp32_param.grad = fp16_param.grad.to(fp32_param.dtype)" for every
        # parameter, then AdamW's own temporary.
        step_temporaries=2 * _FP32 * w,
    )


def _bf16_optimizer_states(inputs: PlanInputs, w: int) -> States:
    """BF16_Optimizer (bf16_optimizer.py): bf16 at ZeRO-0 on the pipeline engine, and bf16
    ZeRO-1 accumulating in fp32 on either engine."""
    half, z = weight_bytes(inputs), inputs.zero_group
    accumulation, communicated = accumulation_bytes(inputs), communication_bytes(inputs)
    partition = _ceil(w, z)
    # The engine reduces the flat accumulation buffers, one per param group (weight decay; no
    # decay: biases and norms, under 1% of a GPT): below E elements the two share a bucket,
    # flattened into a copy; above it each goes alone, as a view (get_grads_for_reduction,
    # L541-545, and engine_allreduce_transient). The bucket is converted to the
    # communication dtype when the accumulation dtype differs.
    flat = accumulation * w if w <= ENGINE_ALLREDUCE_BUCKET else 0
    converted = communicated * w if communicated != accumulation else 0
    return States(
        weights=half * w,
        # _setup_for_real_optimizer L182: the fp32 master partition; Adam's moments on it.
        optimizer=(_FP32 + _ADAM) * partition,
        # L191: "fp32_flat_buffer = torch.zeros_like(self.bf16_groups_flat[i],
        # dtype=self.grad_acc_dtype)": the whole model, allocated at start-up.
        gradient_buffers=accumulation * w,
        # The bf16 gradients: one flat buffer per group for the whole run
        # (megatron/training/engines/bf16_gradient_buffer.py; bfloat16.immediate_grad_update,
        # off by default, would free each after its accumulation).
        gradients=half * w,
        reduction=flat + converted,
        # step() L414-418: the partition converted to fp32 when accumulated in bf16; then
        # AdamW's temporary.
        step_temporaries=(_FP32 * partition if accumulation < _FP32 else 0) + _FP32 * partition,
    )


def _zero1_states(inputs: PlanInputs, w: int, largest: int) -> States:
    """DeepSpeedZeroOptimizer at stage 1 (zero/stage_1_and_2.py): fp16 at ZeRO-1, and bf16
    ZeRO-1 accumulating in bf16 (or offloaded)."""
    half, z, zero = weight_bytes(inputs), inputs.zero_group, inputs.zero
    partition = _ceil(w, z)
    master = _FP32 if half != _FP32 else 0
    pipeline = inputs.engine == "deepspeed-pipeline"
    # L397-404: a separate accumulation dtype at stage 1 sums each gradient into a
    # `grad_accum` attribute of that dtype (_fill_param_grad_accum_attribute, L1234-1240),
    # and the bucket takes that dtype (_gradient_reduction_buffer_dtype, L1253-1254).
    separate = inputs.grad_accum_dtype != inputs.precision
    accumulation = accumulation_bytes(inputs) if separate else half
    bucket = zero.reduce_bucket_size * accumulation
    # setup_buckets (L3256-3280): buf_0 at a backward's first gradient, and buf_1 with
    # overlap_comm ("double buffers"), kept to the boundary.
    overlap = effective_overlap_comm(1, zero.overlap_comm, pipeline)
    return States(
        weights=half * w,
        optimizer=(master + _ADAM) * partition,
        # process_gradients (L2284-2291) reduces in the hooks only with partition_gradients
        # (stage 2) or overlap_comm, and reduce_ready_partitions_and_remove_grads (L2293-2295)
        # only at the accumulation boundary: until then the whole model's gradients sum on
        # the parameters, micro-batch after micro-batch.
        gradients=accumulation * w,
        held_buckets=(2 if overlap else 1) * bucket,
        backward_buckets=half * largest,
        # At the boundary the gradients move into the bucket (L1441-1461: the parameter's
        # gradient becomes a view of it); reduce_gradients (L958-969) allocates one more
        # bucket under the pipeline engine ("with PP we must create ipg buffer"), and
        # copy_grads_in_partition (L2192) this rank's partition of the reduced gradients.
        reduction=(bucket if pipeline else 0) + half * partition,
        # step() L3118: the flat gradient partition converted to fp32.
        step_temporaries=_FP32 * partition,
    )


def _zero2_states(inputs: PlanInputs, w: int, largest: int) -> States:
    """DeepSpeedZeroOptimizer at stage 2: each gradient moves into the bucket as it is
    produced and its reduced partition into a gradient partition buffer."""
    half, z, zero = weight_bytes(inputs), inputs.zero_group, inputs.zero
    partition = _ceil(w, z)
    master = _FP32 if half != _FP32 else 0
    # With fp32 accumulation of half gradients the partition is fp32
    # (_build_compact_grad_partition_buffer, L1268-1272); else copy_grads_in_partition
    # (L2192) allocates it in the model's dtype.
    accumulation = _FP32 if inputs.grad_accum_dtype == "fp32" else half
    bucket = zero.reduce_bucket_size * half
    overlap = effective_overlap_comm(2, zero.overlap_comm, inputs.engine == "deepspeed-pipeline")
    return States(
        weights=half * w,
        optimizer=(master + _ADAM) * partition,
        accumulators=accumulation * partition,
        backward_buckets=bucket * (2 if overlap else 1) + half * largest,
        reduction=half * min(w, zero.reduce_bucket_size),
        # The norm's fp64 copy of the largest fragment, then Adam's temporary.
        step_temporaries=8 * min(largest, partition) + _FP32 * partition,
    )


def _zero3_states(inputs: PlanInputs, tensor_sizes: tuple[int, ...]) -> States:
    half, z, zero = weight_bytes(inputs), inputs.zero_group, inputs.zero
    whole, split = zero3_tensors(inputs, tensor_sizes)
    persistent = sum(n for n, _ in whole)
    partitioned = sum(n for n, _ in split)
    partition = sum(padded for _, padded in whole + split) // z
    master = _FP32 if half != _FP32 else 0
    return States(
        weights=half * partition + half * persistent,
        optimizer=(master + _ADAM) * partition,
        # The fp32 gradient partition and the reduce bucket, both allocated at start-up.
        gradient_buffers=_FP32 * partition,
        buffers=half * zero.reduce_bucket_size,
        step_temporaries=_FP32 * partition + 8 * partition + _FP32 * partition,
        # A gathered parameter stays until its backward when it is used again within
        # max_reuse_distance elements: the layers after it, forward and backward.
        gathered=half * min(partitioned, zero.max_reuse_distance // 2),
    )


def fsdp_units(role: RankRole) -> tuple[int, int]:
    """(root, one layer) elements of FSDP2's units on a rank of `role`: `fully_shard` per
    transformer layer, then at the root over what is left (embeddings, final norm, output
    layer)."""
    layer = role.parameters["layers"] // role.num_layers if role.num_layers else 0
    # A share of the parameters alone (the experts' under expert parallelism) has no root.
    return role.parameters.get("embedding", 0) + role.parameters.get("head", 0), layer


def fp8_gathered_sizes(inputs: PlanInputs, role: RankRole) -> dict[int, list[int]]:
    """FSDP2 with `--fp8-param-gather`: by layer number, the elements on a rank of `role` of
    each weight it all-gathers in FP8, 1 byte an element (the FP8 layers' linear weights,
    `megatron.model.fp8.cast_weights_before_all_gather`); empty otherwise."""
    fp8 = inputs.model.fp8
    if not inputs.fsdp or fp8 is None or not fp8.param_gather:
        return {}
    numbers = [n for chunk in role.layers for n in chunk]
    return {n: fp8_weight_sizes(inputs.model, inputs.tp, n, inputs.ep) for n in numbers}


def fsdp_states(inputs: PlanInputs, role: RankRole) -> States:
    """torch FSDP2 (`megatron.training.engines.fsdp`): fp32 parameters sharded with their
    gradients and Adam state, gathered in the compute dtype per unit (torch 2.13,
    distributed/fsdp/_fully_shard), the FP8-gathered weights in 1 byte."""
    z, c, r = inputs.zero_group, weight_bytes(inputs), reduce_bytes(inputs)
    # Each rank keeps ceil(n / Z) of every tensor (dim 0 padded to a multiple of Z).
    shard = sum(_ceil(n, z) for n in role.tensor_sizes)
    whole = shard * z
    root, layer = fsdp_units(role)
    fp8 = fp8_gathered_sizes(inputs, role)
    # c - 1 bytes less per element gathered in FP8; a gathered layer is the stage's least so.
    fp8_whole = sum(_ceil(n, z) * z for sizes in fp8.values() for n in sizes)
    fp8_layer = min((sum(sizes) for sizes in fp8.values()), default=0)
    if inputs.sharding == "optim_grads":
        # reshard_after_forward=False: every unit's gathered weights wait for its backward.
        gathered, prefetched = c * whole - (c - 1) * fp8_whole, 0
    else:
        # The root's forward spans the model's, one layer between its pre- and post-forward
        # hooks; the backward gathers the next layer while one runs (_backward_prefetch).
        one_layer = c * layer - (c - 1) * fp8_layer
        gathered, prefetched = c * root + one_layer, one_layer
    # Until the last micro-batch the gradients stay whole (set_requires_gradient_sync(False));
    # post_backward converts each to the reduce dtype when it differs from the gathered one
    # (_fsdp_param.py to_accumulated_grad_if_needed), and sums the next ones into it.
    carried = r * whole
    # The root's reduce-scatter ends the backward: its whole gradient (carried, else in the
    # gathered dtype) copied into the flat reduce-scatter input (foreach_reduce); reduced in
    # bf16, its output is another tensor before the fp32 shard is made of it.
    root_gradient = (r if inputs.micro_batches > 1 else c) * root
    converted = r * _ceil(root, z) if r != _FP32 else 0
    return States(
        weights=_FP32 * shard,
        optimizer=_ADAM * shard,
        sharded_gradients=_FP32 * shard,
        gathered=gathered,
        prefetched=prefetched,
        unsharded_gradients=carried,
        root_gathered=c * root,
        # foreach_all_gather's flat output, split into each parameter's own storage.
        gather_copy=c * _ceil(root, z) * z,
        reduction=root_gradient + r * _ceil(root, z) * z + converted,
        step_temporaries=_FP32 * shard,  # foreach AdamW's sqrt(exp_avg_sq) list
    )


def model_states(inputs: PlanInputs, role: RankRole) -> States:
    """Weights, gradients, optimizer state and buffers of a rank of `role`, by engine.

    Under DeepSpeed ZeRO 0-2, MoE experts are partitioned over the expert-data-parallel
    group (data-parallel ranks / EP), the rest over the ZeRO group: two shares, added up
    (ZeRO-3 is planned as one share).
    """
    if inputs.deepspeed and role.expert_parameters and inputs.zero.stage < 3:
        dense = _states_of(inputs, role, role.num_parameters - role.expert_parameters, None)
        expert_inputs = dataclasses.replace(inputs, dp=max(1, inputs.dp // inputs.ep), sp=1)
        experts = _states_of(expert_inputs, role, role.expert_parameters, None)
        experts.backward_buckets = 0  # one gradient bucket serves both groups
        experts.held_buckets = 0
        return States(
            **{
                field.name: getattr(dense, field.name) + getattr(experts, field.name)
                for field in dataclasses.fields(States)
            }
        )
    return _states_of(inputs, role, role.num_parameters, role.tensor_sizes)


def _states_of(inputs: PlanInputs, role: RankRole, w: int, sizes: Sequence[int] | None) -> States:
    """The states of `w` parameters (tensors of `sizes`, in order; None: not known apart)."""
    wrapper = inputs.wrapper
    largest = max(role.tensor_sizes, default=0)
    if inputs.fsdp:
        states = fsdp_states(inputs, role)
    elif wrapper is None:
        states = _plain_states(inputs, w)
    elif wrapper is OptimizerWrapper.CLIENT:
        states = _client_states(inputs, w, sizes)
    elif wrapper in (OptimizerWrapper.FP16_UNFUSED, OptimizerWrapper.FP16_FUSED):
        states = _fp16_wrapper_states(inputs, w, sizes)
    elif wrapper is OptimizerWrapper.BF16:
        states = _bf16_optimizer_states(inputs, w)
    elif wrapper is OptimizerWrapper.ZERO and inputs.zero.stage == 1:
        states = _zero1_states(inputs, w, largest)
    elif wrapper is OptimizerWrapper.ZERO:
        states = _zero2_states(inputs, w, largest)
    else:
        states = _zero3_states(inputs, role.tensor_sizes)
    if inputs.zero.offload_optimizer:
        states.offloaded, states.optimizer = states.optimizer, 0
    return states
