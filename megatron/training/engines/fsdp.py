"""Sharded data parallelism on the plain engine: torch's FSDP2 (`fully_shard`).

Each transformer layer, then the whole GPT, becomes an FSDP2 unit over the data-parallel
ranks (with the context-parallel ones under context parallelism: the gradient group DDP
would use), so every rank keeps 1/DP of each parameter, of its fp32 master copy and of Adam's
moments; parameters are all-gathered for the forward (and again for the backward under the
ZeRO-3 pattern), gradients reduce-scattered and averaged. Tensor parallelism stays ours: FSDP2
shards each rank's tensor-parallel shard. With Megatron-LM's expert parallelism each MoE
layer's experts are their own unit over the ranks holding the same experts (the expert-data
group, as torchtitan shards them), their gradients divided by the whole data-parallel size
(Megatron-LM's scaling: every data-parallel rank's tokens reached them). Which flags choose
which strategy: `megatron.arguments.sharding_flags`.

With `--fp8-param-gather` the FP8 layers' weights are all-gathered in FP8, 1 byte an element
(torchao's float8 all-gather, as torchtitan runs it: `megatron.model.fp8.
cast_weights_before_all_gather`).

Start-up (`--init-model-with-meta-device`, always so under FSDP2 here): the engine builds the
model on the meta device (`megatron.core.tensor_parallel.meta_init`); `shard_model` shards it,
allocates this rank's shards on its device (`to_empty`), puts back the buffers the build
computed, and replays the layers' initializers in the build's order, each on a full-size
temporary where a whole build draws (the default device, the CPU), keeping this rank's rows.
A rank then holds its shards and at most one whole tensor at a time (one parameter, or one MoE
layer's two expert stacks), never the whole model, and its shards are a whole build's, bit for
bit, at any data-parallel size. A model built whole (a provider that loads weights into it,
inside `meta_init.whole_build()`) is moved to the device and sharded as it is.

Either way every rank of the data-parallel group starts from its first rank's weights, as DDP
does on wrapping: context-parallel ranks draw tensor-parallel weights from their own
model-parallel RNG streams (they drop out apart), and FSDP2 would otherwise shard a mixture. A
whole model's states are broadcast from that rank (experts from the first rank holding the
same ones); a meta-built model's initializers are replayed from that rank's generator states
(a few kilobytes, broadcast; experts draw from the default stream, the same on every rank of
a stage), then once more from the rank's own states, values discarded, so that its streams
continue where its own whole build would have left them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.tensor_parallel.meta_init import (
    MetaBuild,
    meta_build_of,
    run_initializers,
)
from megatron.layout import ParallelLayout
from megatron.model.fp8 import cast_weights_before_all_gather
from megatron.model.moe_layer import RoutedMoE, names_outside_data_parallel
from megatron.utils import current_device

# What our layers and the optimizer read from a parameter; FSDP2 makes new ones (DTensors).
_PARAMETER_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "vocab_parallel",
    "swiglu_halves",
    "expert_partition_dim",
    "sequence_parallel",
    "shared",
    "allreduce",
    "group_name",
    "expert_folded_over_tensor_ranks",
)
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_model(
    model: nn.Module,
    layout: ParallelLayout,
    grad_reduce_in_bf16: bool = False,
    overlap_param_gather: bool = False,
) -> nn.Module:
    """`model` with FSDP2 applied per transformer layer and at the root (in place); for
    Megatron's schedules, `model` is this rank's `ModuleList` of chunks and each chunk is a
    root (torch's `PipelineStage` reduce-scatters each chunk's gradients once per step).

    `overlap_param_gather` (`--overlap-param-gather`): each layer issues the next layer's
    all-gather as soon as its own is copied out (FSDP2's explicit forward prefetch), rather
    than when the next layer starts; FSDP2 overlaps the gradient reduce-scatter with the
    backward on its own (`--overlap-grad-reduce` changes nothing more)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    build = meta_build_of(model)
    if build is None:  # built whole
        model.to(current_device())
        _broadcast_initial_states(model, parallel_state.get_sequence_data_parallel_group())
    # The parameters' names, by the tensors a meta-device build recorded.
    names = {id(param): name for name, param in model.named_parameters()}
    # Dense weights are sharded over the data-parallel and sequence-split ranks, experts over
    # the ranks holding the same experts: slices of the run's device mesh and expert mesh.
    mesh = parallel_state.mesh_slice("dp_cp")
    expert_mesh = None
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        expert_mesh = parallel_state.mesh_slice("edp")
    attributes = {
        name: {key: getattr(param, key) for key in _PARAMETER_ATTRIBUTES if hasattr(param, key)}
        for name, param in model.named_parameters()
    }
    # FSDP2 sends a unit's parameters of mixed dtypes (FP8 weights, norms) as bytes (uint8),
    # which gloo carries too (it has no float8 type).
    cast_weights_before_all_gather(model)
    policy = MixedPrecisionPolicy(
        param_dtype=_COMPUTE_DTYPES.get(layout.precision),
        reduce_dtype=torch.bfloat16 if grad_reduce_in_bf16 else torch.float32,
    )
    # ZeRO-3 frees each layer's gathered parameters after its forward; ZeRO-2 keeps them
    # until its backward (one all-gather per step instead of two).
    reshard = layout.sharding == "optim_grads_params"
    roots = list(model) if isinstance(model, nn.ModuleList) else [model]
    for root in roots:
        layers = list(root.language_model.encoder.layers)
        # Multi-token prediction's modules (the last stage) are units of their own too.
        mtp = [module.transformer_layer for module in getattr(root, "mtp", nn.Module()).modules()
               if hasattr(module, "transformer_layer")]  # fmt: skip
        for layer in layers + mtp:
            if expert_mesh is not None and isinstance(layer.mlp, RoutedMoE):
                experts = layer.mlp.experts
                # Averaged over the expert-data ranks here; `reduce_expert_gradients` then
                # rescales to Megatron-LM's sum / DP (torch's own divide factor would need a
                # pre-multiplied sum, which gloo lacks).
                fully_shard(
                    experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy
                )
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(root, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        if overlap_param_gather:
            for layer, following in zip(layers, layers[1:]):
                layer.set_modules_to_forward_prefetch([following])
    if build is not None:
        _materialize(model, build, names)
    for name, param in model.named_parameters():
        for key, value in attributes[name].items():
            setattr(param, key, value)
    return model


def _materialize(model: nn.Module, build: MetaBuild, names: dict[int, str]) -> None:
    """Allocate the sharded meta-built `model` on this rank's device and fill each shard with a
    whole build's values (`names`: parameter name by the id of the tensor the build made)."""
    buffers = dict(model.named_buffers())  # computed for real in the build
    model.to_empty(device=current_device())
    group = parallel_state.get_sequence_data_parallel_group()
    source = [build.rng]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(source, dist.get_global_rank(group, 0), group=group)

    def keep(built: torch.Tensor, value: torch.Tensor) -> None:
        param = model.get_parameter(names[id(built)])
        local = param
        if isinstance(param, DTensor):  # FSDP2's shard: this rank's rows of `value`
            (chunk,) = param.__create_chunk_list__()
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                value = value.narrow(dim, offset, size)
            local = param.to_local()
        local.copy_(value)

    with torch.no_grad():
        for name, buffer in buffers.items():
            model.get_buffer(name).copy_(buffer)
        run_initializers(build, keep, start=source[0])


def _broadcast_initial_states(model: nn.Module, group: object) -> None:
    """Every rank of `group` starts from its first rank's weights, as DDP does on wrapping:
    context-parallel ranks draw tensor-parallel weights from their own model-parallel RNG
    streams (they drop out apart), and FSDP2 would otherwise shard a mixture of them. Experts
    under expert parallelism come from the first rank holding the same experts."""
    apart = set(names_outside_data_parallel(model))
    tensors = [t for name, t in _named_states(model) if name not in apart]
    experts = [t for name, t in _named_states(model) if name in apart and ".experts." in name]
    with torch.no_grad():
        for tensors_of, broadcast_group in (
            (tensors, group),
            (experts, parallel_state.get_expert_data_parallel_group()),
        ):
            if not tensors_of or dist.get_world_size(broadcast_group) == 1:
                continue
            source = dist.get_global_rank(broadcast_group, 0)
            for tensor in tensors_of:
                dist.broadcast(tensor.data, source, group=broadcast_group)


def _named_states(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())
