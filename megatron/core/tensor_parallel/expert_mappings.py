"""The collectives of Megatron-LM's MoE layers, over the expert-parallel group, as autograd
functions (the companion of `mappings.py`, which holds the tensor-parallel and sequence ones).

Each forward collective has its transpose as the backward: the tokens' all-to-all goes back
with the splits swapped, an all-gather's backward is a reduce-scatter and the other way round.
With one expert-parallel rank every function is the identity.

The `*_hidden` functions are the same collectives launched without waiting, for Megatron-LM's
combined 1F1B (`megatron.core.pipeline_parallel.combined_1f1b`): once launched, forward or
backward, `overlap.hide` lets the other micro-batch's pass compute while they travel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_gather_single, reduce_scatter_single


def _ep_size() -> int:
    return parallel_state.get_expert_model_parallel_world_size()


def _all_to_all(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    dist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=parallel_state.get_expert_model_parallel_group(),
    )
    return output


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, output_splits, input_splits):  # noqa: ANN001, ANN205
        ctx.splits = (output_splits, input_splits)
        return _all_to_all(tensor, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits), None, None


def all_to_all_over_expert_parallel(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Send `input_splits[r]` rows of `tensor` (in order) to expert-parallel rank r; receive
    `output_splits[r]` rows from each: [sum(input_splits), ...] -> [sum(output_splits), ...]."""
    if _ep_size() == 1:
        return tensor
    return _AllToAll.apply(tensor, output_splits, input_splits)


class _Launched:
    """An asynchronous collective and the tensors it reads or writes until it is waited for."""

    def __init__(self, work: dist.Work, *tensors: torch.Tensor) -> None:
        self.work, self.tensors = work, tensors

    def wait(self) -> None:
        """Block (on CPUs) or order the current stream (on GPUs) until it is done."""
        self.work.wait()
        self.tensors = ()


def _launch_all_to_all(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]
) -> tuple[torch.Tensor, _Launched]:
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    work = dist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=parallel_state.get_expert_model_parallel_group(),
        async_op=True,
    )
    return output, _Launched(work, tensor)


class _StartAllToAll(torch.autograd.Function):
    """Launch the all-to-all without waiting; `_WaitAllToAll` waits. Backward: the reverse
    all-to-all (synchronous)."""

    @staticmethod
    def forward(ctx, tensor, output_splits, input_splits, in_flight):  # noqa: ANN001, ANN205
        ctx.splits = (output_splits, input_splits)
        output, launched = _launch_all_to_all(tensor, output_splits, input_splits)
        in_flight.append(launched)  # the input stays alive until the wait
        return output

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits), None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """The received rows once the all-to-all `_StartAllToAll` launched is done."""

    @staticmethod
    def forward(ctx, output, in_flight):  # noqa: ANN001, ANN205
        in_flight.pop().wait()
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


def all_to_all_over_expert_parallel_while(
    tensor: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    compute: Callable[[], object],
) -> tuple[torch.Tensor, object]:
    """`all_to_all_over_expert_parallel`, with `compute()` run while the rows travel (its
    result returned beside them): the same values, the transfer hidden behind the compute
    (forward; the backward's reverse all-to-all is synchronous)."""
    if _ep_size() == 1:
        return tensor, compute()
    in_flight: list = []
    output = _StartAllToAll.apply(tensor, output_splits, input_splits, in_flight)
    try:
        result = compute()
    except BaseException:
        in_flight[0].wait()  # never leave a collective in flight
        raise
    return _WaitAllToAll.apply(output, in_flight), result


def exchange_counts_over_expert_parallel(counts: torch.Tensor) -> torch.Tensor:
    """[EP, n] counts, row r for rank r -> [EP, n], row r from rank r (no gradient)."""
    if _ep_size() == 1:
        return counts
    received = torch.empty_like(counts)
    dist.all_to_all_single(
        received, counts.contiguous(), group=parallel_state.get_expert_model_parallel_group()
    )
    return received


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    output = tensor.new_empty((tensor.size(0) * _ep_size(), *tensor.shape[1:]))
    all_gather_single(output, tensor, group=parallel_state.get_expert_model_parallel_group())
    return output


def _reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    output = tensor.new_empty((tensor.size(0) // _ep_size(), *tensor.shape[1:]))
    reduce_scatter_single(output, tensor, group=parallel_state.get_expert_model_parallel_group())
    return output


class _GatherFromExpertParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):  # noqa: ANN001, ANN205
        return _gather(tensor)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _reduce_scatter(grad)


class _ReduceScatterToExpertParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):  # noqa: ANN001, ANN205
        return _reduce_scatter(tensor)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _gather(grad)


def gather_from_expert_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Every expert-parallel rank's rows, in rank order: [n, ...] -> [EP x n, ...]."""
    if _ep_size() == 1:
        return tensor
    return _GatherFromExpertParallel.apply(tensor)


def reduce_scatter_to_expert_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the expert-parallel ranks, each keeping its block: [EP x n, ...] -> [n, ...]."""
    if _ep_size() == 1:
        return tensor
    return _ReduceScatterToExpertParallel.apply(tensor)


def gather_indices_from_expert_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """`gather_from_expert_parallel_region` for tensors without gradients (routing choices)."""
    if _ep_size() == 1:
        return tensor
    return _gather(tensor)


def reduce_expert_gradient(grad: torch.Tensor) -> None:
    """An expert's gradient in place: summed over the ranks holding the same expert and divided
    by the data-parallel size (with the sequence split), as Megatron-LM scales expert
    gradients, so that it equals the data-parallel average that dense weights get: every
    data-parallel rank's tokens reached the expert through the dispatcher."""
    grad.div_(parallel_state.get_sequence_data_parallel_world_size())
    if parallel_state.get_expert_data_parallel_world_size() > 1:
        dist.all_reduce(grad, group=parallel_state.get_expert_data_parallel_group())


def _launch_gather(tensor: torch.Tensor) -> tuple[torch.Tensor, _Launched]:
    tensor = tensor.contiguous()
    output = tensor.new_empty((tensor.size(0) * _ep_size(), *tensor.shape[1:]))
    group = parallel_state.get_expert_model_parallel_group()
    work = all_gather_single(output, tensor, group=group, async_op=True)
    return output, _Launched(work, tensor)


def _launch_reduce_scatter(tensor: torch.Tensor) -> tuple[torch.Tensor, _Launched]:
    tensor = tensor.contiguous()
    output = tensor.new_empty((tensor.size(0) // _ep_size(), *tensor.shape[1:]))
    group = parallel_state.get_expert_model_parallel_group()
    work = reduce_scatter_single(output, tensor, group=group, async_op=True)
    return output, _Launched(work, tensor)


Launch = Callable[[tuple], tuple[tuple, list]]
"""Launches collectives on a tuple of tensors (None for absent gradients): their outputs and
the `_Launched` handles to wait for."""


class _HiddenCollective(torch.autograd.Function):
    """`launch(tensors)` with the other pass computing while it travels (`overlap.hide`); the
    backward does the same with `transpose` on the gradients."""

    @staticmethod
    def forward(ctx, overlap, launch, transpose, *tensors):  # noqa: ANN001, ANN205
        ctx.overlap, ctx.transpose = overlap, transpose
        outputs, launched = launch(tensors)
        overlap.hide(launched, backward=False)
        ctx.mark_non_differentiable(*(out for out in outputs if not out.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        grads, launched = ctx.transpose(grads)
        ctx.overlap.hide(launched, backward=True)
        return (None, None, None, *grads)


def all_to_all_hidden(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], overlap: object
) -> torch.Tensor:
    """`all_to_all_over_expert_parallel` with `overlap` (a `Combined1F1B`) hiding it, and its
    transpose in the backward, behind the other micro-batch's compute."""
    if _ep_size() == 1:
        return tensor

    def launch(tensors: tuple) -> tuple[tuple, list]:
        output, launched = _launch_all_to_all(tensors[0], output_splits, input_splits)
        return (output,), [launched]

    def transpose(grads: tuple) -> tuple[tuple, list]:
        grad, launched = _launch_all_to_all(grads[0], input_splits, output_splits)
        return (grad,), [launched]

    (output,) = _HiddenCollective.apply(overlap, launch, transpose, tensor)
    return output


def gather_hidden(overlap: object, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`gather_from_expert_parallel_region` of each of `tensors` (integer ones without a
    gradient), hidden by `overlap` as `all_to_all_hidden`; the backward's reduce-scatters too."""
    if _ep_size() == 1:
        return tensors

    def launch(inputs: tuple) -> tuple[tuple, list]:
        pairs = [_launch_gather(tensor) for tensor in inputs]
        return tuple(out for out, _ in pairs), [launched for _, launched in pairs]

    def transpose(grads: tuple) -> tuple[tuple, list]:
        outputs, handles = [], []
        for tensor, grad in zip(tensors, grads, strict=True):
            if not tensor.is_floating_point() or grad is None:
                outputs.append(None)
                continue
            out, launched = _launch_reduce_scatter(grad)
            outputs.append(out)
            handles.append(launched)
        return tuple(outputs), handles

    return _HiddenCollective.apply(overlap, launch, transpose, *tensors)


def reduce_scatter_hidden(tensor: torch.Tensor, overlap: object) -> torch.Tensor:
    """`reduce_scatter_to_expert_parallel_region` hidden by `overlap` (its backward's
    all-gather too)."""
    if _ep_size() == 1:
        return tensor

    def launch(inputs: tuple) -> tuple[tuple, list]:
        output, launched = _launch_reduce_scatter(inputs[0])
        return (output,), [launched]

    def transpose(grads: tuple) -> tuple[tuple, list]:
        grad, launched = _launch_gather(grads[0])
        return (grad,), [launched]

    (output,) = _HiddenCollective.apply(overlap, launch, transpose, tensor)
    return output
