"""Bytes each rank hands to collectives per training iteration, by kind.

Counted as the issue of record defines them: the input tensor of an all-reduce,
reduce-scatter, broadcast, all-to-all or send, the output of an all-gather; per rank and
iteration, start-up and evaluation excluded. Collectives on groups of one rank count nothing.

- tensor parallel (Megatron, Shoeybi et al. 2019; Korthikanti et al. 2022 with sequence
  parallelism): see `tensor_parallel_bytes`; plus the vocabulary-parallel embedding, the
  output layer's input and the cross entropy's three [s, b] fp32 reductions.
- data parallel: DDP's all-reduce of fp32 gradients once per iteration; torch FSDP2's
  all-gathers (FP8 weights in 1 byte under `--fp8-param-gather`) and reduce-scatter
  (`fsdp_collectives`); DeepSpeed's per engine and ZeRO stage
  (see `data_parallel_bytes`).
- pipeline: each micro-batch's [s, b, h] activation sent forward and its gradient sent
  back, and the tied embeddings' gradient all-reduce between the first and last stage.
- context parallel: each layer's key/value exchange over the C ranks of its group, by
  `--cp-comm-type` (see `context_parallel_parts`), and the loss gather; every other kind
  then moves the rank's s / C tokens, and gradients are summed over data x context ranks.
- all-to-all: DeepSpeed-Ulysses' and the experts' (DeepSpeed-MoE's dispatch and combine,
  Megatron-LM MoE's `alltoall` dispatcher, `routed_moe.dispatch_bytes`).
- expert parallel: Megatron-LM MoE's `allgather` dispatcher, its all-gathers and
  reduce-scatters over the EP ranks of each MoE layer (`expert_parallel_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.config import ModelConfig
from megatron.deepspeed_facts import OptimizerWrapper, effective_overlap_comm
from megatron.model.model_size import runs_in_fp8
from megatron.planning.dtypes import dtypes
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole
from megatron.planning.model_states import (
    communication_bytes,
    fp8_gathered_sizes,
    fsdp_units,
    reduce_bytes,
    weight_bytes,
    zero3_tensors,
)
from megatron.planning.routed_moe import (
    dispatch_bytes,
    is_routed_layer,
    routed_expert_parameters,
)

_FP32 = 4
_DDP_BUCKET = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb=25
_FP16_WRAPPERS = (OptimizerWrapper.FP16_UNFUSED, OptimizerWrapper.FP16_FUSED)


def tensor_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Tensor-parallel collective bytes per iteration on a rank of `role`.

    Per layer, c the compute and r the residual dtype's bytes of one [s, b, h]: without
    sequence parallelism the two row-parallel outputs are all-reduced forward (2c) and the
    two column-parallel inputs' gradients backward (2r); with it each column-parallel layer
    all-gathers its input forward and again backward and reduce-scatters the input's
    gradient (2c + r; in an FP8 layer, which keeps the gathered input and casts it before
    the gather, 2c), each row-parallel layer reduce-scatters its output and all-gathers
    that gradient (2c). Full recomputation repeats each layer's forward collectives. The
    gradients of replicated weights that each rank computes a part of (norms and row-parallel
    biases under sequence parallelism, the QK norms always) are summed as they are computed.
    """
    if inputs.tp == 1:
        return 0
    config = inputs.model
    size = dtypes(inputs)
    hidden = inputs.local_seq_length * inputs.micro_batch * config.hidden_size
    c, r = hidden * size.compute, hidden * size.residual
    if config.sequence_parallel:
        per_layer, forward = 2 * (2 * c + r) + 2 * (2 * c), 4 * c
    else:
        per_layer, forward = 2 * c + 2 * r, 2 * c
    recomputed = role.num_layers if config.recompute_granularity == "full" else 0
    total = role.num_layers * per_layer + recomputed * forward
    # A routed MoE layer's experts communicate over the expert-parallel group (the dispatcher),
    # not the tensor-parallel one: only a shared expert is a tensor-parallel MLP.
    numbers = [n for chunk in role.layers for n in chunk]
    moe = config.routed_moe
    if moe is not None and not moe.shared_expert_ffn_hidden_size:
        routed = sum(is_routed_layer(config, n) for n in numbers)
        mlp, mlp_forward = ((2 * c + r) + 2 * c, 2 * c) if config.sequence_parallel else (c + r, c)
        total -= routed * mlp + (routed if recomputed else 0) * mlp_forward
    if config.sequence_parallel:
        # An FP8 layer's column-parallel layers keep their gathered input (no gather again in
        # the backward) and reduce-scatter its gradient in the compute dtype: 2c, not 2c + r.
        total -= sum(runs_in_fp8(config, n) for n in numbers) * 2 * r
    if role.first:  # the vocabulary-parallel embedding's sum, forward (and with sequence
        total += 2 * r if config.sequence_parallel else r  # parallelism its scatter's gather)
    if config.sequence_parallel:
        # Each micro-batch's gradients of the replicated norms and row-parallel biases,
        # summed over the tensor-parallel ranks as they are computed.
        h = config.hidden_size
        norm = h if config.normalization == "rmsnorm" else 2 * h
        replicated = role.num_layers * (2 * norm + (2 * h if config.add_bias_linear else 0))
        replicated += norm if role.last else 0
        if moe is not None:  # each rank routes its own tokens: the router's weight, and at
            # EP 1 the experts (replicated then), are summed alike
            per_moe_layer = moe.num_experts * h
            if moe.expert_parallel_size == 1:
                per_moe_layer += routed_expert_parameters(config)
            replicated += sum(is_routed_layer(config, n) for n in numbers) * per_moe_layer
        total += replicated * size.residual
    if config.qk_layernorm:  # the QK norms' gradients, each rank's from its heads, summed alike
        width = config.kv_channels * (1 if config.normalization == "rmsnorm" else 2)
        total += role.num_layers * 2 * width * size.residual
    if role.last:
        # The output layer's input (as a column-parallel layer's) and the loss's reductions.
        total += 2 * c + r if config.sequence_parallel else r
        total += 3 * inputs.local_seq_length * inputs.micro_batch * _FP32
    return total * inputs.micro_batches


@dataclass(frozen=True)
class Collective:
    """One data-parallel collective of an iteration: its payload and when it runs."""

    op: str
    """`all_reduce`, `all_gather` or `reduce_scatter`."""
    bytes: int
    """Payload per iteration (summed over its micro-batches)."""
    group: int
    """Ranks in its group."""
    overlap: str = "none"
    """What it runs under: `none` (exposed), `backward` (issued bucket by bucket as the
    backward produces gradients) or `compute` (ZeRO-3's prefetched gathers)."""
    per_micro_batch: bool = False
    """Issued in every micro-batch (else once, in the last)."""
    bucket_bytes: int = 0
    """The last bucket's payload: it waits for the end of its backward, so never hides."""
    stride: int = 1
    """Global ranks between two neighbours of its group (whether it fits in a node)."""


def data_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Data-parallel (and ZeRO) collective bytes per iteration on a rank of `role`."""
    return sum(collective.bytes for collective in data_parallel_collectives(inputs, role))


def data_parallel_collectives(inputs: PlanInputs, role: RankRole) -> list[Collective]:
    """Data-parallel (and ZeRO) collectives per iteration on a rank of `role`.

    DDP all-reduces fp32 gradients once per iteration, bucket by bucket under the last
    micro-batch's backward. DeepSpeed 0.19, by wrapper (megatron/deepspeed_facts.py): ZeRO-0
    and BF16_Optimizer all-reduce every gradient once, after the last backward, in the
    communication dtype (the model's unless `communication_data_type` says otherwise);
    BF16_Optimizer and ZeRO 1-2 then all-gather the updated weights; ZeRO-1 reduces at the
    boundary (under its backward with `overlap_comm`), ZeRO-2 each micro-batch's bucketed
    gradients (pre-divided all-reduces: stages 1-2 never call reduce-scatter); ZeRO-3
    all-gathers every partitioned parameter in each forward (again in the backward beyond
    `stage3_max_reuse_distance`), reduce-scatters each micro-batch's gradients and gathers
    the persistent small parameters after the step.
    """
    group = inputs.zero_group  # data x sequence-split ranks (Ulysses' or context parallel)
    experts = role.expert_parameters
    if experts:  # the experts' share, over the expert-data-parallel group (EP ranks apart)
        if inputs.model.routed_moe is not None:
            # Megatron-LM's MoE folds EP over the tensor, context and data ranks of a stage:
            # its expert-data-parallel group is TP x CP x DP / EP ranks, EP apart.
            edp = inputs.tp * inputs.split * inputs.dp // inputs.ep
            expert_inputs = dataclasses.replace(inputs, tp=1, dp=edp, sp=1, cp=1)
        else:
            expert_inputs = dataclasses.replace(inputs, dp=inputs.dp // inputs.ep, sp=1)
        dense = _with_parameters(role, role.num_parameters - experts)
        expert_share = data_parallel_collectives(expert_inputs, _with_parameters(role, experts))
        # A DeepSpeed-MoE expert-data-parallel group's ranks are EP x TP apart
        # (deepspeed/utils/groups.py _create_expert_and_data_parallel, TP-strided).
        spread = [dataclasses.replace(c, stride=c.stride * inputs.ep) for c in expert_share]
        return data_parallel_collectives(inputs, dense) + spread
    if group == 1:
        return []
    collectives = _data_parallel_collectives(inputs, role, group)
    # Data-parallel ranks are TP apart; with a sequence split the data x split group is too
    # (tp-cp-dp-pp order: the split ranks sit between tensor and data ranks).
    return [dataclasses.replace(c, stride=inputs.tp) for c in collectives]


def _data_parallel_collectives(inputs: PlanInputs, role: RankRole, group: int) -> list:
    """`data_parallel_collectives` of one share of the parameters, over `group` ranks."""
    w, m = role.num_parameters, inputs.micro_batches
    if inputs.fsdp:
        return fsdp_collectives(inputs, role, group)
    if not inputs.deepspeed:
        if inputs.engine == "megatron-pipeline":  # average_gradients after the schedule
            return [Collective("all_reduce", _FP32 * w, group)]
        # torch's DDP: 25 MiB buckets (bucket_cap_mb) reduced as the backward fills them.
        return [Collective("all_reduce", _FP32 * w, group, "backward", False, _DDP_BUCKET)]
    half = weight_bytes(inputs)
    reduced = communication_bytes(inputs) * w
    zero, wrapper = inputs.zero, inputs.wrapper
    gather = Collective("all_gather", half * w, group)  # after the step: never hidden
    pipeline = inputs.engine == "deepspeed-pipeline"
    overlapped = effective_overlap_comm(zero.stage, zero.overlap_comm, pipeline)
    overlap = "backward" if overlapped else "none"
    bucket = communication_bytes(inputs) * zero.reduce_bucket_size
    if wrapper in (OptimizerWrapper.CLIENT, *_FP16_WRAPPERS):
        return [Collective("all_reduce", reduced, group)]
    if wrapper is OptimizerWrapper.BF16:
        return [Collective("all_reduce", reduced, group), gather]
    if zero.stage == 1:
        return [Collective("all_reduce", reduced, group, overlap, False, bucket), gather]
    if zero.stage == 2:
        return [Collective("all_reduce", m * reduced, group, overlap, True, bucket), gather]
    whole, split = zero3_tensors(inputs, role.tensor_sizes)
    persistent = sum(padded for _, padded in whole)
    partitioned = sum(padded for _, padded in split)
    regathered = max(0, partitioned - zero.max_reuse_distance // 2)
    gathers = m * half * (partitioned + regathered)
    scattered = m * communication_bytes(inputs) * (persistent + partitioned)
    prefetch = half * zero.prefetch_bucket_size
    return [
        Collective("all_gather", gathers, group, "compute", True, prefetch),
        Collective("reduce_scatter", scattered, group, overlap, True, bucket),
        Collective("all_gather", half * persistent, group),
    ]


def fsdp_collectives(inputs: PlanInputs, role: RankRole, group: int) -> list[Collective]:
    """torch FSDP2's collectives per iteration over `group` (the data x context ranks).

    Every micro-batch's forward all-gathers each unit (each layer, then the root) in the
    compute dtype, its output the unit padded to a multiple of the group; optim_grads_params
    gathers each again in the backward (reshard_after_forward; so does optim_grads between
    micro-batches, but not within one: reshard_after_backward frees the weights after every
    backward either way, so both gather once per micro-batch forward). The last micro-batch's
    backward reduce-scatters each unit's summed gradients once, in the reduce dtype (the
    earlier ones skip it: set_requires_gradient_sync(False)). The root's gather opens the
    forward and its reduce-scatter closes the backward: neither hides.

    With `--fp8-param-gather` the FP8 layers' linear weights travel in FP8, 1 byte an element
    (c - 1 less), each after an all-reduce (MAX) of its shard's fp32 amax, 4 bytes, so that
    every rank casts with one scale (torchao's `WeightWithDynamicFloat8CastTensor.
    fsdp_pre_all_gather`, `reduce_amax=True`).
    """
    z, c, r = group, weight_bytes(inputs), reduce_bytes(inputs)
    padded = sum(-(-n // z) * z for n in role.tensor_sizes)
    root = -(-fsdp_units(role)[0] // z) * z
    passes = 2 if inputs.sharding == "optim_grads_params" else 1
    fp8 = [n for sizes in fp8_gathered_sizes(inputs, role).values() for n in sizes]
    fp8_padded = sum(-(-n // z) * z for n in fp8)
    gathers = passes * inputs.micro_batches * (c * padded - (c - 1) * fp8_padded)
    collectives = [
        Collective("all_gather", gathers, group, "compute", True, c * root),
        Collective("reduce_scatter", r * padded, group, "backward", False, r * root),
    ]
    if fp8:
        amax = passes * inputs.micro_batches * _FP32 * len(fp8)
        collectives.append(Collective("all_reduce", amax, group))
    return collectives


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
    tokens = inputs.local_seq_length * inputs.micro_batch
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


def deepspeed_pipeline_gathers(inputs: PlanInputs, role: RankRole) -> int:
    """DeepSpeed's pipeline engine at TP > 1: the tensor-parallel all-gathers of partitioned
    sends (one per activation received, two per micro-batch in the sender's backward)."""
    if inputs.engine != "deepspeed-pipeline" or inputs.tp == 1 or inputs.pp == 1:
        return 0
    tokens = inputs.local_seq_length * inputs.micro_batch
    activation = tokens * inputs.model.hidden_size * dtypes(inputs).compute
    received = 0 if role.first else 1
    sent = 0 if role.last else 2
    return (received + sent) * activation * inputs.micro_batches


def expert_capacity(inputs: PlanInputs, experts: int) -> int:
    """Tokens each expert takes per micro-batch (DeepSpeed's `_capacity`): ceil(tokens /
    experts x factor), x 2 for top-2, at least `min_capacity`. Without token dropping it is
    the busiest expert's load, which depends on the data: the plan assumes the bound, every
    token (padded to a multiple of TP at TP > 1 without expert tensor parallelism,
    sharded_moe.py top1gating L248-259)."""
    moe = inputs.model.moe
    tokens = inputs.seq_length * inputs.micro_batch
    if not moe.drop_tokens:
        return tokens if moe.expert_tensor_parallel else -(-tokens // inputs.tp) * inputs.tp
    factor = moe.train_capacity_factor * (2 if moe.top_k == 2 else 1)
    return max(-(-int(tokens * factor) // experts), moe.min_capacity)


def _moe_layers(inputs: PlanInputs, role: RankRole) -> list[int]:
    """The expert count of each MoE layer on a rank of `role`."""
    if inputs.model.moe is None:
        return []
    per_layer = inputs.model.moe.experts_per_layer
    return [per_layer[n - 1] for chunk in role.layers for n in chunk if per_layer[n - 1] > 1]


def _dispatched_bytes(inputs: PlanInputs, experts: int) -> int:
    """One micro-batch's [experts, capacity, h] dispatch tensor on one rank."""
    size = dtypes(inputs).compute
    return experts * expert_capacity(inputs, experts) * inputs.model.hidden_size * size


def all_to_all_parts(inputs: PlanInputs, role: RankRole) -> dict[str, int]:
    """All-to-all bytes per iteration, by group: `ulysses` (DeepSpeed-Ulysses' four per layer
    each way: query, key, value to heads, the context back to the sequence) and `experts`
    (DeepSpeed-MoE's dispatch and combine of the [experts, capacity, h] tokens each way, per
    MoE layer spread over more than one rank; Megatron-LM MoE's `alltoall` dispatcher, see
    `routed_dispatch_bytes`).

    At TP > 1 DeepSpeed-MoE sends 1/TP of the capacity: every tensor-parallel rank routes
    the same tokens, so moe/sharded_moe.py MOELayer.forward (L686-698) keeps this rank's
    share (`drop_tokens(dispatched_input, dim=1)`, moe/mappings.py _drop_tokens) before the
    dispatch, and the combine carries what the experts made of it (L718-732), gathered back
    after (`gather_tokens`, L739-742; see `moe_tensor_parallel_bytes`).
    """
    config, size = inputs.model, dtypes(inputs).compute
    parts = {"ulysses": 0, "experts": 0}
    if inputs.sp > 1:
        local = inputs.seq_length // inputs.sp * inputs.micro_batch
        width = 2 * config.projection_size + 2 * config.kv_projection_size
        parts["ulysses"] = 2 * role.num_layers * local * width * size * inputs.micro_batches
    for experts in _moe_layers(inputs, role):
        if min(inputs.ep, experts) > 1:
            parts["experts"] += 4 * _dispatched_bytes(inputs, experts) // inputs.tp
    parts["experts"] *= inputs.micro_batches
    parts["experts"] += routed_dispatch_bytes(inputs, role).get("all_to_all", 0)
    return parts


def routed_dispatch_bytes(inputs: PlanInputs, role: RankRole) -> dict[str, int]:
    """Megatron-LM MoE's dispatcher bytes per iteration on a rank of `role`, by op
    (`routed_moe.dispatch_bytes` of each of its MoE layers and micro-batches): `all_to_all`,
    or `all_gather` and `reduce_scatter`. Planned for a balanced expert load at EP > 1."""
    numbers = [n for chunk in role.layers for n in chunk]
    layers = sum(is_routed_layer(inputs.model, n) for n in numbers)
    if not layers:
        return {}
    per_layer = dispatch_bytes(inputs, dtypes(inputs))
    return {op: layers * count * inputs.micro_batches for op, count in per_layer.items()}


def expert_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Megatron-LM MoE's `allgather` dispatcher: its all-gathers and reduce-scatters over the
    expert-parallel group per iteration (`routed_dispatch_bytes`)."""
    per_op = routed_dispatch_bytes(inputs, role)
    return per_op.get("all_gather", 0) + per_op.get("reduce_scatter", 0)


def all_to_all_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """All-to-all bytes per iteration (`all_to_all_parts`, both groups)."""
    return sum(all_to_all_parts(inputs, role).values())


def moe_tensor_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """DeepSpeed-MoE's tensor-parallel all-gathers at TP > 1 (bytes of their outputs).

    Per MoE layer and micro-batch (moe/sharded_moe.py MOELayer.forward): the combine's output
    gathered forward (`gather_tokens`, L739-742) and the dispatch's `drop_tokens` gathering
    its gradient backward (moe/mappings.py _DropTokens.backward); with expert tensor
    parallelism also the dispatch's `gather_tokens` (L710-713) forward and the combine's
    `drop_tokens` (L718-724) backward. Full recomputation repeats the forward ones.
    """
    if inputs.tp == 1:
        return 0
    forward = 2 if inputs.model.moe is not None and inputs.model.moe.expert_tensor_parallel else 1
    passes = 2 * forward + (forward if inputs.model.recompute_granularity == "full" else 0)
    per_micro_batch = sum(_dispatched_bytes(inputs, e) for e in _moe_layers(inputs, role))
    return passes * per_micro_batch * inputs.micro_batches


def context_parallel_layer_bytes(inputs: PlanInputs, comm_type: str) -> dict[str, int]:
    """One layer's context-parallel bytes per micro-batch on one rank, by pass: `forward`
    (run again by full recomputation) and `backward`.

    KV = 2 b (s/C) g hn e, the keys and values of this rank's tokens (g key/value heads per
    tensor-parallel rank, e the compute dtype's bytes; MLA's by `attention_widths`):
    - `p2p` (ring attention): forward C-1 sends of KV to the next rank; backward C-1 sends
      of KV again and C sends of their gradients, which travel in fp32 (KV x 4 / e);
    - `allgather`: forward the all-gather of K and V (its output: C x KV), backward the
      reduce-scatter of their gradients in the compute dtype (its input: C x KV);
    - `a2a`: DeepSpeed-Ulysses' all-to-alls over the CP group: query, key, value and the
      context forward (b (s/C) (2 np + 2 g) hn e), their transposes backward.
    """
    config, c, e = inputs.model, inputs.cp, dtypes(inputs).compute
    tokens = inputs.local_seq_length * inputs.micro_batch
    query, key, value, context = attention_widths(config)
    if comm_type == "p2p":
        # The ring's kernels take one head size: MLA's narrower values travel padded to it.
        key_values = tokens * 2 * key // inputs.tp * e
        gradients = key_values // e * _FP32
        return {"forward": (c - 1) * key_values, "backward": (c - 1) * key_values + c * gradients}
    key_values = tokens * (key + value) // inputs.tp * e
    if comm_type == "allgather":
        return {"forward": c * key_values, "backward": c * key_values}
    width = (query + key + value + context) // inputs.tp  # q, k, v there, the context back
    return {"forward": tokens * width * e, "backward": tokens * width * e}


def attention_widths(config: ModelConfig) -> tuple[int, int, int, int]:
    """Per token, all heads: the query, key, value and context widths (multi-latent
    attention's keys carry the shared rotary channels, its values their own width)."""
    if config.mla is None:
        kv = config.kv_projection_size
        return config.projection_size, kv, kv, config.projection_size
    mla, heads = config.mla, config.num_attention_heads
    query = heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim)
    return query, query, heads * mla.v_head_dim, heads * mla.v_head_dim


def context_parallel_parts(inputs: PlanInputs, role: RankRole) -> dict[str, int]:
    """Context-parallel bytes per iteration on a rank of `role`, by kind: `p2p`, `allgather`,
    `a2a` (each layer's, see `context_parallel_layer_bytes`, twice the forward's under full
    recomputation) and `losses` (the last stage's all-gather of each micro-batch's fp32
    per-token losses [b, s], so every rank averages over the whole sequence). Empty at C 1."""
    if inputs.cp == 1:
        return {}
    parts = {"p2p": 0, "allgather": 0, "a2a": 0, "losses": 0}
    recomputed = inputs.model.recompute_granularity == "full"
    for number in (n for chunk in role.layers for n in chunk):
        comm_type = inputs.cp_comm_type(number)
        layer = context_parallel_layer_bytes(inputs, comm_type)
        passes = 2 * layer["forward"] if recomputed else layer["forward"]
        parts[comm_type] += passes + layer["backward"]
    if role.last:
        parts["losses"] = inputs.seq_length * inputs.micro_batch * _FP32
    return {kind: count * inputs.micro_batches for kind, count in parts.items()}


def has_expert_parallel_kind(inputs: PlanInputs) -> bool:
    """Whether the plan has an `expert_parallel` kind: Megatron-LM MoE's `allgather`
    dispatcher over more than one rank."""
    moe = inputs.model.routed_moe
    return moe is not None and moe.dispatcher == "allgather" and inputs.ep > 1


def rank_communication(inputs: PlanInputs, role: RankRole) -> dict[str, int]:
    """Bytes per iteration by kind, with their `total` (`context_parallel` under CP,
    `expert_parallel` with Megatron-LM MoE's all-gather dispatcher at EP > 1)."""
    kinds = {
        "tensor_parallel": tensor_parallel_bytes(inputs, role)
        + deepspeed_pipeline_gathers(inputs, role)
        + moe_tensor_parallel_bytes(inputs, role),
        "data_parallel": data_parallel_bytes(inputs, role),
        "pipeline": pipeline_bytes(inputs, role),
        "all_to_all": all_to_all_bytes(inputs, role),
    }
    if inputs.cp > 1:
        kinds["context_parallel"] = sum(context_parallel_parts(inputs, role).values())
    if has_expert_parallel_kind(inputs):
        kinds["expert_parallel"] = expert_parallel_bytes(inputs, role)
    kinds["total"] = sum(kinds.values())
    return kinds
