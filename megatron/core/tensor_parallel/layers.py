"""Linear and embedding layers whose weights are split across tensor-parallel ranks.

`ColumnParallelLinear` splits the output features (Y = X [A_1 .. A_p]), `RowParallelLinear`
the input features (Y = sum_i X_i A_i), `VocabParallelEmbedding` the vocabulary rows. Each
returns what its dense twin returns when the shards are put back together, which the tests
check against `torch.nn.Linear` / `torch.nn.Embedding`.

Weights are created on the current default device (use `with torch.device(...)`), or on the
meta device in a meta-device build, their initializers then recorded and run later on each
rank's shard (`meta_init`). With `use_cpu_initialization` the full master weight is drawn on
the CPU and this rank keeps its slice, so the model does not depend on the tensor-parallel
size; otherwise each rank draws its own shard from the model-parallel RNG stream (with one
rank, both are the same draw).

A linear layer's `fp8_matmul` (None: F.linear) replaces the local matmul of its shard, the
communication around it unchanged (`megatron.model.fp8` sets it under `--fp8-format`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    all_reduce_sum_over_tensor_parallel,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    linear_over_sequence_parallel_gather,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.meta_init import initialize, new_parameter
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

InitMethod = Callable[[torch.Tensor], torch.Tensor]
LinearMatmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""F.linear's signature: (input, weight, bias) -> output; megatron.model.fp8's FP8 matmul."""


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact integer division, or an error naming the sizes."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} {numerator} is not divisible by --tensor-model-parallel-size {denominator}"
        )
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: nn.Parameter, partition_dim: int, stride: int):
    """Mark a split parameter (DeepSpeed and checkpoint tools read these attributes)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def mark_sequence_parallel(param: nn.Parameter) -> None:
    """Sum this replicated parameter's gradient over TP ranks as soon as it is computed.

    Under sequence parallelism each rank sees only its part of the sequence, so the gradient
    of a replicated parameter (layer norm, row-parallel bias) is partial on every rank.
    """
    param.sequence_parallel = True
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        param.register_hook(lambda grad: all_reduce_sum_over_tensor_parallel(grad.clone()))


def sum_sharded_sequence_parallel_grads(params: list[nn.Parameter]) -> None:
    """The same sum for parameters torch FSDP2 sharded: it computes with its own unsharded
    copies, so `mark_sequence_parallel`'s hook never fires; each such gradient shard (already
    reduced over the data-parallel ranks) is summed over the TP ranks once per step instead."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    for param in params:
        grad = param.grad
        if grad is not None and getattr(param, "sequence_parallel", False):
            to_local = getattr(grad, "to_local", None)
            if to_local is not None:  # a DTensor: FSDP2's shard
                local = to_local()
                local.copy_(all_reduce_sum_over_tensor_parallel(local.clone()))


def _split_over(tensor_parallel: bool) -> tuple[int, int]:
    """(world, rank) a layer splits its weight over: the TP group's, or (1, 0) when it does
    not split (an MoE expert replicated on every tensor-parallel rank)."""
    if not tensor_parallel:
        return 1, 0
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _initialize_weight(
    weight: nn.Parameter,
    full_shape: tuple[int, int],
    partition_dim: int,
    init_method: InitMethod,
    stride: int,
    use_cpu_initialization: bool,
    tensor_parallel: bool = True,
) -> None:
    world, rank = _split_over(tensor_parallel)

    def fill(local: torch.Tensor) -> None:
        if not use_cpu_initialization:
            with get_cuda_rng_tracker().fork() if world > 1 else nullcontext():
                init_method(local)
            return
        master = torch.empty(full_shape, dtype=torch.float32, device="cpu")
        init_method(master)
        # With stride s, each rank owns every world-th of the s*world interleaved blocks.
        block = local.size(partition_dim) // stride
        blocks = torch.split(master, block, dim=partition_dim)
        local.copy_(torch.cat(blocks[rank::world], dim=partition_dim))

    initialize(weight, fill)


def new_split_parameter(
    full_shape: tuple[int, ...],
    partition_dim: int,
    init_method: InitMethod,
    dtype: torch.dtype,
    use_cpu_initialization: bool,
) -> nn.Parameter:
    """A parameter split over the tensor-parallel ranks along `partition_dim`, marked and drawn
    as a parallel linear layer's weight (e.g. attention sinks: one logit per head)."""
    world, _ = _split_over(True)
    shape = list(full_shape)
    shape[partition_dim] = divide(shape[partition_dim], world, "the split parameter")
    param = new_parameter(tuple(shape), dtype)
    set_tensor_model_parallel_attributes(param, partition_dim, 1)
    _initialize_weight(param, full_shape, partition_dim, init_method, 1, use_cpu_initialization)
    return param


def _zero_bias(size: int, dtype: torch.dtype) -> nn.Parameter:
    bias = new_parameter((size,), dtype)
    initialize(bias, nn.init.zeros_)
    return bias


def _local_linear(
    fp8_matmul: LinearMatmul | None,
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """This rank's matmul: F.linear, or the FP8 one."""
    if fp8_matmul is None:
        return F.linear(input_, weight, bias)
    return fp8_matmul(input_, weight, bias)


def _gathered_fp8_linear(
    fp8_matmul: LinearMatmul,
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The FP8 matmul of the sequence-parallel all-gather of the input (whose gradient is
    reduce-scattered). Unlike `linear_over_sequence_parallel_gather` the gathered input is
    kept for the backward, which torchao's FP8 matmul recasts from it."""
    device = input_.device.type
    if torch.is_autocast_enabled(device):  # the half type crosses the wire, as F.linear's path
        input_ = input_.to(torch.get_autocast_dtype(device))
    return fp8_matmul(gather_from_sequence_parallel_region(input_, True), weight, bias)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by output columns; returns (output, bias or None).

    `tensor_parallel=False` keeps the whole weight on every rank and communicates nothing
    (Megatron-DeepSpeed's MoE experts without expert tensor parallelism).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        use_cpu_initialization: bool = False,
        params_dtype: torch.dtype = torch.float32,
        stride: int = 1,
        tensor_parallel: bool = True,
    ) -> None:
        super().__init__()
        world, _ = _split_over(tensor_parallel)
        self.split = world > 1
        self.output_size_per_partition = divide(output_size, world, "output size")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and gather_output:
            raise ValueError(
                "a column-parallel layer cannot gather its output under sequence parallelism"
            )
        self.weight = new_parameter((self.output_size_per_partition, input_size), params_dtype)
        _initialize_weight(
            self.weight,
            (output_size, input_size),
            0,
            init_method,
            stride,
            use_cpu_initialization,
            tensor_parallel,
        )
        if tensor_parallel:
            set_tensor_model_parallel_attributes(self.weight, 0, stride)
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, params_dtype)
            if tensor_parallel:
                set_tensor_model_parallel_attributes(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.fp8_matmul: LinearMatmul | None = None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s(/tp under SP), b, in] -> [s, b, out/tp] (or [s, b, out] with gather_output)."""
        bias = None if self.skip_bias_add else self.bias
        if not self.split:
            output = _local_linear(self.fp8_matmul, input_, self.weight, bias)
            return output, (self.bias if self.skip_bias_add else None)
        if self.sequence_parallel and self.fp8_matmul is not None:
            output = _gathered_fp8_linear(self.fp8_matmul, input_, self.weight, bias)
        elif self.sequence_parallel:
            output = linear_over_sequence_parallel_gather(input_, self.weight, bias)
        else:
            output = _local_linear(
                self.fp8_matmul, copy_to_tensor_model_parallel_region(input_), self.weight, bias
            )
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by input rows; the bias is added after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        use_cpu_initialization: bool = False,
        params_dtype: torch.dtype = torch.float32,
        stride: int = 1,
        tensor_parallel: bool = True,
    ) -> None:
        super().__init__()
        world, _ = _split_over(tensor_parallel)
        self.split = world > 1
        self.input_size_per_partition = divide(input_size, world, "input size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "a row-parallel layer under sequence parallelism needs a parallel input"
            )
        self.weight = new_parameter((output_size, self.input_size_per_partition), params_dtype)
        _initialize_weight(
            self.weight,
            (output_size, input_size),
            1,
            init_method,
            stride,
            use_cpu_initialization,
            tensor_parallel,
        )
        if tensor_parallel:
            set_tensor_model_parallel_attributes(self.weight, 1, stride)
        if bias:
            self.bias = _zero_bias(output_size, params_dtype)
            if self.sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self.fp8_matmul: LinearMatmul | None = None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, in/tp] -> [s(/tp under SP), b, out], summed over tensor-parallel ranks."""
        if not self.split:
            partial = _local_linear(self.fp8_matmul, input_, self.weight, None)
            if self.skip_bias_add or self.bias is None:
                return partial, self.bias
            return partial + self.bias, None
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_)
        partial = _local_linear(self.fp8_matmul, input_, self.weight, None)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial)
        else:
            output = reduce_from_tensor_model_parallel_region(partial)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        return output + self.bias, None


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows; each rank looks up the ids it owns."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_method: InitMethod,
        use_cpu_initialization: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        per_partition = divide(num_embeddings, world, "padded vocabulary size")
        self.vocab_start_index = parallel_state.get_tensor_model_parallel_rank() * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = new_parameter((per_partition, embedding_dim), params_dtype)
        _initialize_weight(
            self.weight, (num_embeddings, embedding_dim), 0, init_method, 1, use_cpu_initialization
        )
        set_tensor_model_parallel_attributes(self.weight, 0, 1)
        self.weight.vocab_parallel = True  # the rows are the (padded) vocabulary

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids of any shape -> embeddings of shape [*ids.shape, h], summed over TP ranks."""
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(embeddings)


def linear_with_vocab_parallel_weight(
    input_: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool, gather_output: bool
) -> torch.Tensor:
    """Logits against a vocab-split (tied) embedding: [s(/tp), b, h] -> [s, b, v/tp or v]."""
    if sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = linear_over_sequence_parallel_gather(input_, weight, None)
    else:
        logits = F.linear(copy_to_tensor_model_parallel_region(input_), weight)
    if gather_output:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits
