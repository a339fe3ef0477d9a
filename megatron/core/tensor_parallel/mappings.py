"""Every collective the model uses, as autograd functions over its groups (tensor-parallel,
and the sequence split: Ulysses' or context parallelism's).

Model code calls these named regions and never `torch.distributed` directly. Each forward
collective has its transpose as the backward: an all-reduce's backward is the identity, an
all-gather's backward is a reduce-scatter (or a split), and so on. With one tensor-parallel
rank (or no distributed setup) every function is the identity.

Layouts: tensor-parallel splits act on the last dimension; sequence-parallel splits act on
the first dimension of Megatron's `[s, b, h]` activations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state


# torch >= 2.10 renamed the single-tensor collectives; older releases only have the old names.
# Looked up at each call, as every other collective here: a profiler or meter that wraps
# torch.distributed's functions after this module was imported (benchmarks/run_meters.py) sees
# these calls too.
def all_gather_single(
    output: torch.Tensor, tensor: torch.Tensor, group: object, async_op: bool = False
) -> dist.Work | None:
    """Gather `tensor` of every rank of `group` into `output`, concatenated along dim 0 (with
    `async_op`, launched: the handle to wait for)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor, tensor: torch.Tensor, group: object, async_op: bool = False
) -> dist.Work | None:
    """Sum `tensor` over `group` and keep this rank's dim-0 part in `output` (with `async_op`,
    launched: the handle to wait for)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=async_op)


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if _tp_size() == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


def _split_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if world == 1:
        return tensor
    chunk = tensor.size(-1) // world
    rank = parallel_state.get_tensor_model_parallel_rank()
    return tensor[..., rank * chunk : (rank + 1) * chunk].contiguous()


def _gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if world == 1:
        return tensor
    # Gather along dim 0 (contiguous per rank), then move the rank blocks to the last dim.
    gathered = _gather_first_dim(tensor.movedim(-1, 0).contiguous())
    return gathered.movedim(0, -1).contiguous()


def _split_first_dim(tensor: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if world == 1:
        return tensor
    if tensor.size(0) % world != 0:
        raise ValueError(
            f"sequence length {tensor.size(0)} is not divisible by "
            f"--tensor-model-parallel-size {world} (needed by --sequence-parallel)"
        )
    chunk = tensor.size(0) // world
    rank = parallel_state.get_tensor_model_parallel_rank()
    return tensor[rank * chunk : (rank + 1) * chunk].contiguous()


def _gather_first_dim(tensor: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    output = torch.empty(
        (tensor.size(0) * world, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    all_gather_single(output, tensor, group=parallel_state.get_tensor_model_parallel_group())
    return output


def _reduce_scatter_first_dim(tensor: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    output = torch.empty(
        (tensor.size(0) // world, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    reduce_scatter_single(output, tensor, group=parallel_state.get_tensor_model_parallel_group())
    return output


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return _all_reduce(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return _split_last_dim(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return _gather_last_dim(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return _split_first_dim(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first_dim(tensor)

    @staticmethod
    def backward(ctx, grad):
        # A gathered input feeding a tensor-parallel layer gets partial gradients on each
        # rank, which must be summed; one feeding replicated math already has the full one.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first_dim(grad), None
        return _split_first_dim(grad), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return _reduce_scatter_first_dim(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad)


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce the gradient over the tensor-parallel group."""
    return _CopyToTensorParallelRegion.apply(tensor)


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) forward over the tensor-parallel group; identity backward."""
    return _ReduceFromTensorParallelRegion.apply(tensor)


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; gather the gradient."""
    return _ScatterToTensorParallelRegion.apply(tensor)


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dimension; split the gradient."""
    return _GatherFromTensorParallelRegion.apply(tensor)


def scatter_to_sequence_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the sequence (first) dimension; gather the gradient."""
    return _ScatterToSequenceParallelRegion.apply(tensor)


def gather_from_sequence_parallel_region(
    tensor: torch.Tensor, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather along the sequence dimension; reduce-scatter (or split) the gradient."""
    return _GatherFromSequenceParallelRegion.apply(tensor, tensor_parallel_output_grad)


class _LinearOverSequenceGather(torch.autograd.Function):
    """F.linear of the sequence-parallel all-gather of the input, keeping only this rank's
    part of the input for backward and gathering it again there (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication under --sequence-parallel): 1/tp of the
    activation memory of keeping the gathered input, for one more all-gather per layer.

    Under autocast the input is cast to the autocast dtype before the gather (the matmul
    would cast the gathered copy anyway: the same numbers, half the bytes), and the input's
    gradient is reduce-scattered in the input's own dtype, as the plain form does.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias):
        device = input_.device.type
        ctx.input_dtype = input_.dtype
        if torch.is_autocast_enabled(device):
            input_ = input_.to(torch.get_autocast_dtype(device))
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        total = _gather_first_dim(input_)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        total = _gather_first_dim(input_)  # [s, b, in], gathered again
        grad_total = grad_output.matmul(weight.to(grad_output.dtype))
        grad_input = _reduce_scatter_first_dim(grad_total.to(ctx.input_dtype))
        rows = grad_output.reshape(-1, grad_output.size(-1))
        grad_weight = rows.t().matmul(total.reshape(-1, total.size(-1)).to(rows.dtype))
        grad_bias = rows.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight.to(weight.dtype), grad_bias


def linear_over_sequence_parallel_gather(
    input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """[s/tp, b, in] -> F.linear over the gathered [s, b, in]; the backward gathers the
    input again and reduce-scatters its gradient."""
    return _LinearOverSequenceGather.apply(input_, weight, bias)


def reduce_scatter_to_sequence_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter along the sequence dimension; all-gather the gradient."""
    return _ReduceScatterToSequenceParallelRegion.apply(tensor)


def all_reduce_max_over_tensor_parallel(tensor: torch.Tensor) -> torch.Tensor:
    """In-place max over the tensor-parallel group (no autograd; for numerics like logit max)."""
    if _tp_size() > 1:
        dist.all_reduce(
            tensor, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    return tensor


def all_reduce_sum_over_tensor_parallel(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over the tensor-parallel group (no autograd)."""
    if _tp_size() > 1:
        dist.all_reduce(tensor, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


def broadcast_from_tensor_parallel_src(tensor: torch.Tensor) -> torch.Tensor:
    """In-place broadcast from the first rank of the tensor-parallel group (no autograd)."""
    if _tp_size() > 1:
        dist.broadcast(
            tensor,
            src=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
    return tensor


def broadcast_object_from_tensor_parallel_src(obj: object) -> object:
    """The first tensor-parallel rank's `obj` (any picklable value), returned on every rank."""
    if _tp_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(
        holder,
        src=parallel_state.get_tensor_model_parallel_src_rank(),
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    return holder[0]


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's equal 1-D share of a flattened tensor (for partitioned activations)."""
    flat = tensor.reshape(-1)
    world = _tp_size()
    if world == 1:
        return flat
    if flat.numel() % world != 0:
        raise ValueError(
            f"cannot partition an activation of {flat.numel()} elements over "
            f"--tensor-model-parallel-size {world}"
        )
    # A copy, not a view: the point is to free the rest of the input's memory.
    return _split_first_dim(flat).clone()


def gather_split_1d_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Reassemble the flat tensor split by `split_tensor_into_1d_equal_chunks`."""
    return _gather_first_dim(tensor)


# The sequence split: DeepSpeed-Ulysses (its attention all-to-alls are DeepSpeed's
# `DistributedAttention`, which `megatron.model.attention` wraps) and context parallelism (whose
# attention exchanges keys and values with the functions below). Under context parallelism a
# rank holds two chunks of every sequence, Megatron's load-balanced layout: cut into 2C chunks,
# rank r holds chunks r and 2C-1-r, so every rank has as much causal attention to compute.
def _context_chunks(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def this_ranks_sequence_part(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's part of `tensor` along `dim` ([b, s] -> [b, s/S] by default): the contiguous
    1/S under Ulysses, chunks r and 2C-1-r of 2C under context parallelism; the identity when
    the sequence is whole. No communication."""
    world = parallel_state.get_sequence_split_world_size()
    if world == 1:
        return tensor
    rank = parallel_state.get_sequence_split_rank()
    if parallel_state.get_context_parallel_world_size() == 1:
        part = tensor.size(dim) // world
        return tensor.narrow(dim, rank * part, part)
    chunk = tensor.size(dim) // (2 * world)
    first, second = _context_chunks(rank, world)
    return torch.cat(
        (tensor.narrow(dim, first * chunk, chunk), tensor.narrow(dim, second * chunk, chunk)),
        dim=dim,
    )


def this_ranks_sequence_positions(length: int, device: torch.device) -> torch.Tensor:
    """Global positions [s/S] of the `length` tokens this rank holds (see above)."""
    world = parallel_state.get_sequence_split_world_size()
    return this_ranks_sequence_part(
        torch.arange(length * world, device=device, dtype=torch.long), dim=0
    )


def _gathered_to_natural_order(size: int, length: int, device: torch.device) -> torch.Tensor:
    """Indices that put the ranks' concatenated context-parallel parts ([r0 part, r1 part,
    ...], `length` tokens each) back in sequence order."""
    chunk = length // 2
    order = torch.empty(2 * size, dtype=torch.long)
    for rank in range(size):
        first, second = _context_chunks(rank, size)
        order[first], order[second] = 2 * rank, 2 * rank + 1  # natural chunk -> gathered chunk
    tokens = order[:, None] * chunk + torch.arange(chunk)[None]
    return tokens.reshape(-1).to(device)


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The indices that undo `tensor.index_select(dim, order)` for a permutation `order`."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def sequence_order_of_context_parallel_parts(length: int, device: torch.device) -> torch.Tensor:
    """Indices [length] that put the context-parallel ranks' parts, concatenated in rank order
    (`length` tokens in all), in sequence order (`--cp-comm-type a2a`)."""
    world = parallel_state.get_context_parallel_world_size()
    return _gathered_to_natural_order(world, length // world, device)


def _gather_sequence_split(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Every split rank's part along `dim`, joined in sequence order (no autograd)."""
    group = parallel_state.get_sequence_split_group()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    joined = torch.cat(parts, dim=dim)
    if parallel_state.get_context_parallel_world_size() == 1:
        return joined
    return joined.index_select(
        dim, _gathered_to_natural_order(world, tensor.size(dim), joined.device)
    )


class _GatherSequenceParts(torch.autograd.Function):
    """[b, s/S] parts of the split ranks -> [b, s]; the backward keeps this rank's part."""

    @staticmethod
    def forward(ctx, tensor, gradient_scale):
        ctx.gradient_scale = gradient_scale
        return _gather_sequence_split(tensor, dim=1)

    @staticmethod
    def backward(ctx, grad):
        part = this_ranks_sequence_part(grad).contiguous()
        return (part if ctx.gradient_scale == 1 else part * ctx.gradient_scale), None


def gather_sequence_parts(tensor: torch.Tensor, gradient_scale: int = 1) -> torch.Tensor:
    """Every split rank's [b, s/S] part of `tensor` (Ulysses or context parallel), joined to
    [b, s] in sequence order on every rank; the gradient of this rank's part is its slice of
    the whole one, times `gradient_scale` (the identity when the sequence is whole)."""
    if parallel_state.get_sequence_split_world_size() == 1:
        return tensor
    return _GatherSequenceParts.apply(tensor, gradient_scale)


class _GatherContextParallelKeyValues(torch.autograd.Function):
    """[b, n, s/C, hn] -> [b, n, s, hn] in sequence order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, tensor):
        return _gather_sequence_split(tensor, dim=2)

    @staticmethod
    def backward(ctx, grad):
        group = parallel_state.get_context_parallel_group()
        world = dist.get_world_size(group)
        # Back to the ranks' concatenated order, so rank r's part is the r-th slice.
        length = grad.size(2) // world
        order = _gathered_to_natural_order(world, length, grad.device)
        grad = grad.index_select(2, inverse_order(order)).movedim(2, 0).contiguous()
        output = torch.empty((length, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(output, grad, group=group)
        return output.movedim(0, 2)


def gather_context_parallel_key_values(tensor: torch.Tensor) -> torch.Tensor:
    """Keys or values [b, n, s/C, hn] of every context-parallel rank, in sequence order
    (`--cp-comm-type allgather`); their gradients are summed back to the owners."""
    return _GatherContextParallelKeyValues.apply(tensor)


class RingTransfer:
    """Send tensors to the next rank of the context-parallel ring (`group`, default this
    rank's) and receive the previous rank's (same shapes) without waiting: `wait()` returns
    what arrived. Ring attention starts one before computing on the block in hand, so the
    transfer hides behind the attention."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
        if group is None:
            group = parallel_state.get_context_parallel_group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        following = dist.get_global_rank(group, (rank + 1) % world)
        previous = dist.get_global_rank(group, (rank - 1) % world)
        self.sent = [tensor.contiguous() for tensor in tensors]
        self.received = [torch.empty_like(tensor) for tensor in self.sent]
        operations = [dist.P2POp(dist.isend, tensor, following, group) for tensor in self.sent]
        operations += [dist.P2POp(dist.irecv, tensor, previous, group) for tensor in self.received]
        self.requests = dist.batch_isend_irecv(operations)

    def wait(self) -> list[torch.Tensor]:
        """Block until both directions are done; the received tensors."""
        for request in self.requests:
            request.wait()
        self.sent = []
        return self.received


def sum_over_pipeline(values: dict[str, float]) -> dict[str, float]:
    """Every pipeline stage's named values, summed by name (a stage may lack some names): one
    object all-gather over the pipeline-parallel group (reported values, once per step)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return dict(values)
    group = parallel_state.get_pipeline_model_parallel_group()
    stages: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, values, group=group)
    total: dict[str, float] = {}
    for stage in stages:
        for name, value in (stage or {}).items():
            total[name] = total.get(name, 0.0) + value
    return total
