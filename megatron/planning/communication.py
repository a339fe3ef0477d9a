"""Bytes each rank hands to collectives per training iteration, by kind.

Counted as the issue of record defines them: the input tensor of an all-reduce,
reduce-scatter, broadcast, all-to-all or send, the output of an all-gather; per rank and
iteration, start-up and evaluation excluded. Collectives on groups of one rank count nothing.

- tensor parallel (Megatron, Shoeybi et al. 2019; Korthikanti et al. 2022 with sequence
  parallelism): see `tensor_parallel_bytes`; plus the vocabulary-parallel embedding, the
  output layer's input and the cross entropy's three [s, b] fp32 reductions.
- data parallel: DDP's all-reduce of fp32 gradients once per iteration; DeepSpeed's per
  engine and ZeRO stage (see `data_parallel_bytes`).
- pipeline: each micro-batch's [s, b, h] activation sent forward and its gradient sent
  back, and the tied embeddings' gradient all-reduce between the first and last stage.
"""

from __future__ import annotations

import dataclasses

from megatron.planning.activations import dtypes
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole
from megatron.planning.memory import communication_bytes, weight_bytes, zero3_tensors

_FP32 = 4


def tensor_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Tensor-parallel collective bytes per iteration on a rank of `role`.

    Per layer, c the compute and r the residual dtype's bytes of one [s, b, h]: without
    sequence parallelism the two row-parallel outputs are all-reduced forward (2c) and the
    two column-parallel inputs' gradients backward (2r); with it each column-parallel layer
    all-gathers its input forward and again backward and reduce-scatters the input's
    gradient (2c + r), each row-parallel layer reduce-scatters its output and all-gathers
    that gradient (2c). Full recomputation repeats each layer's forward collectives.
    """
    if inputs.tp == 1:
        return 0
    config = inputs.model
    size = dtypes(inputs)
    hidden = inputs.seq_length * inputs.micro_batch * config.hidden_size
    c, r = hidden * size.compute, hidden * size.residual
    if config.sequence_parallel:
        per_layer, forward = 2 * (2 * c + r) + 2 * (2 * c), 4 * c
    else:
        per_layer, forward = 2 * c + 2 * r, 2 * c
    recomputed = role.num_layers if config.recompute_granularity == "full" else 0
    total = role.num_layers * per_layer + recomputed * forward
    if role.first:  # the vocabulary-parallel embedding's sum, forward (and with sequence
        total += 2 * r if config.sequence_parallel else r  # parallelism its scatter's gather)
    if config.sequence_parallel:
        # Each micro-batch's gradients of the replicated norms and row-parallel biases,
        # summed over the tensor-parallel ranks as they are computed.
        h = config.hidden_size
        norm = h if config.normalization == "rmsnorm" else 2 * h
        replicated = role.num_layers * (2 * norm + (2 * h if config.add_bias_linear else 0))
        replicated += norm if role.last else 0
        total += replicated * size.residual
    if role.last:
        # The output layer's input (as a column-parallel layer's) and the loss's reductions.
        total += 2 * c + r if config.sequence_parallel else r
        total += 3 * inputs.seq_length * inputs.micro_batch * _FP32
    return total * inputs.micro_batches


def data_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Data-parallel (and ZeRO) collective bytes per iteration on a rank of `role`.

    DeepSpeed 0.19 (see megatron/planning/memory.py for the wrappers): ZeRO-0 and
    BF16_Optimizer all-reduce every gradient once per iteration in the communication dtype
    (the model's unless `communication_data_type` says otherwise); BF16_Optimizer then
    all-gathers the updated weights; ZeRO-2 all-reduces each micro-batch's bucketed gradients
    (pre-divided: stages 1-2 never call reduce-scatter) and all-gathers the weights; ZeRO-3
    all-gathers every partitioned parameter in each forward (again in the backward beyond
    `stage3_max_reuse_distance`), reduce-scatters each micro-batch's gradients and gathers
    the persistent small parameters after the step.
    """
    group = inputs.zero_group if inputs.deepspeed else inputs.dp * inputs.sp
    experts = role.expert_parameters
    if experts:  # the experts' share, over the expert-data-parallel group (EP ranks apart)
        expert_inputs = dataclasses.replace(inputs, dp=inputs.dp // inputs.ep, sp=1)
        dense = _with_parameters(role, role.num_parameters - experts)
        return data_parallel_bytes(inputs, dense) + data_parallel_bytes(
            expert_inputs, _with_parameters(role, experts)
        )
    if group == 1:
        return 0
    w, m = role.num_parameters, inputs.micro_batches
    if not inputs.deepspeed:
        return _FP32 * w  # DDP's (or average_gradients') all-reduce of fp32 gradients
    half = weight_bytes(inputs)
    reduced = communication_bytes(inputs) * w
    zero = inputs.zero
    if zero.stage == 0:
        if half != _FP32 and inputs.engine == "deepspeed-pipeline":
            return reduced + half * w  # BF16_Optimizer: all-reduce, then all-gather
        return reduced
    if zero.stage == 1:
        return reduced + half * w
    if zero.stage == 2:
        return m * reduced + half * w
    whole, split = zero3_tensors(inputs, role.tensor_sizes)
    persistent = sum(padded for _, padded in whole)
    partitioned = sum(padded for _, padded in split)
    regathered = max(0, partitioned - zero.max_reuse_distance // 2)
    gathers = half * (partitioned + regathered)
    reduce_scattered = communication_bytes(inputs) * (persistent + partitioned)
    return m * (gathers + reduce_scattered) + half * persistent


def _with_parameters(role: RankRole, count: int) -> RankRole:
    """`role` holding `count` parameters (one tensor, no experts): a share of its own."""
    return dataclasses.replace(
        role, parameters={"layers": count}, tensor_sizes=(count,), expert_parameters=0
    )


def _tied_gradient_bytes(inputs: PlanInputs) -> int:
    """Bytes per element of the tied embedding gradient summed between the end stages."""
    if not inputs.deepspeed or inputs.precision == "fp32":
        return _FP32
    # BF16_Optimizer with fp32 accumulation sums its fp32 copy; bf16 ZeRO-0 the bf16 one.
    return _FP32 if inputs.grad_accum_dtype == "fp32" else 2


def pipeline_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Pipeline sends (and tied-embedding reductions) per iteration on a rank of `role`."""
    if inputs.pp == 1:
        return 0
    config = inputs.model
    tokens = inputs.seq_length * inputs.micro_batch
    if config.sequence_parallel or inputs.engine == "deepspeed-pipeline":
        # Sequence parallelism sends each rank's part; DeepSpeed's engine partitions its
        # sends over the tensor-parallel ranks (and all-gathers them on arrival).
        tokens //= inputs.tp
    activation = tokens * config.hidden_size * dtypes(inputs).compute
    chunks = 2 * inputs.virtual - int(role.first) - int(role.last)  # sends per micro-batch
    total = chunks * activation * inputs.micro_batches
    if not config.untie_embeddings_and_output_weights and (role.first or role.last):
        vocab_rows = config.vocab_size // inputs.tp
        total += _tied_gradient_bytes(inputs) * vocab_rows * config.hidden_size
    return total


def _deepspeed_pipeline_gathers(inputs: PlanInputs, role: RankRole) -> int:
    """DeepSpeed's pipeline engine at TP > 1: the tensor-parallel all-gathers of partitioned
    sends (one per activation received, two per micro-batch in the sender's backward)."""
    if inputs.engine != "deepspeed-pipeline" or inputs.tp == 1 or inputs.pp == 1:
        return 0
    tokens = inputs.seq_length * inputs.micro_batch
    activation = tokens * inputs.model.hidden_size * dtypes(inputs).compute
    received = 0 if role.first else 1
    sent = 0 if role.last else 2
    return (received + sent) * activation * inputs.micro_batches


def expert_capacity(inputs: PlanInputs, experts: int) -> int:
    """Tokens each expert takes per micro-batch (DeepSpeed's `_capacity`): ceil(tokens /
    experts x factor), x 2 for top-2, at least `min_capacity`. Without token dropping it is
    the busiest expert's load, which depends on the data: the plan assumes the bound."""
    moe = inputs.model.moe
    tokens = inputs.seq_length * inputs.micro_batch
    if not moe.drop_tokens:
        return tokens
    factor = moe.train_capacity_factor * (2 if moe.top_k == 2 else 1)
    return max(-(-int(tokens * factor) // experts), moe.min_capacity)


def all_to_all_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """All-to-all bytes per iteration: DeepSpeed-Ulysses' four per layer each way (query,
    key, value to heads, the context back to the sequence), and DeepSpeed-MoE's dispatch and
    combine of the [experts, capacity, h] tokens each way, per MoE layer."""
    config, size = inputs.model, dtypes(inputs).compute
    total = 0
    if inputs.sp > 1:
        local = inputs.seq_length // inputs.sp * inputs.micro_batch
        width = 2 * config.projection_size + 2 * config.kv_projection_size
        total += 2 * role.num_layers * local * width * size
    if config.moe is not None and inputs.ep > 1:
        for chunk in role.layers:
            for number in chunk:
                experts = config.moe.experts_per_layer[number - 1]
                if experts > 1 and min(inputs.ep, experts) > 1:
                    capacity = expert_capacity(inputs, experts)
                    total += 4 * experts * capacity * config.hidden_size * size
    return total * inputs.micro_batches


def rank_communication(inputs: PlanInputs, role: RankRole) -> dict[str, int]:
    """Bytes per iteration by kind, with their `total`."""
    kinds = {
        "tensor_parallel": tensor_parallel_bytes(inputs, role)
        + _deepspeed_pipeline_gathers(inputs, role),
        "data_parallel": data_parallel_bytes(inputs, role),
        "pipeline": pipeline_bytes(inputs, role),
        "all_to_all": all_to_all_bytes(inputs, role),
    }
    kinds["total"] = sum(kinds.values())
    return kinds
