"""How each tensor of a model is split over the parallel ranks, as its layers declare it.

The layer that owns a parameter marks it when it makes it, and nothing else decides:

- `ColumnParallelLinear` / `RowParallelLinear` / `VocabParallelEmbedding` (megatron.core.
  tensor_parallel.layers): `partition_dim` (0 for column-parallel rows and the vocabulary, 1
  for row-parallel columns) and `partition_stride` (2 for SwiGLU's `dense_h_to_4h`: each rank
  holds its block of the gate rows and its block of the up rows), Megatron's attributes;
  none on a layer built whole (an MoE expert without expert tensor parallelism);
- SwiGLU's `dense_h_to_4h` (`ParallelMLP`, an expert's too): `swiglu_halves`, its rows the
  gate rows then the up rows, split or whole;
- the vocabulary's rows (`VocabParallelEmbedding`, the untied output layer): `vocab_parallel`,
  padded to a multiple of the tensor-parallel size and resized when a checkpoint moves;
- Megatron-LM's stacked experts (`GroupedExperts`): `expert_partition_dim` 0, the global
  expert number, split over the expert-parallel ranks.

Everything else (norms, biases of row-parallel layers, routers, buffers) is whole on every
rank. `declared_splits(module)` reads the marks off a live model (the torch_dist writer reads
this rank's chunks); `model_splits(config)` builds the model on the meta device to read them
without a device or a checkpoint's tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from megatron.config import ModelConfig


@dataclass(frozen=True)
class Split:
    """How one state-dict tensor is split (the default: whole on every rank)."""

    tensor_dim: int | None = None
    """The dimension tensor parallelism splits; None: whole on every tensor-parallel rank."""
    stride: int = 1
    """Blocks of `tensor_dim` a rank holds: 2 for SwiGLU's [gate; up] (a rank's shard is
    [gate_r; up_r])."""
    swiglu: bool = False
    """SwiGLU's [gate; up] rows (a rank's shard [gate_r; up_r]), whether split or whole."""
    vocab: bool = False
    """The rows are the vocabulary (padded; resized when a checkpoint changes its padding)."""
    expert_dim: int | None = None
    """The dimension expert parallelism splits (Megatron-LM's stacked experts: 0)."""


def split_of(tensor: torch.Tensor) -> Split:
    """The split a layer declared on `tensor` (whole when it declared none)."""
    tensor_parallel = getattr(tensor, "tensor_model_parallel", False)
    return Split(
        tensor_dim=tensor.partition_dim if tensor_parallel else None,
        stride=getattr(tensor, "partition_stride", 1) if tensor_parallel else 1,
        swiglu=getattr(tensor, "swiglu_halves", False),
        vocab=getattr(tensor, "vocab_parallel", False),
        expert_dim=getattr(tensor, "expert_partition_dim", None),
    )


def declared_splits(module: nn.Module, parameters_only: bool = False) -> dict[str, Split]:
    """The split of every entry of `module.state_dict()` (parameters as their layers declared
    them; buffers whole), or of its parameters only."""
    splits = {} if parameters_only else {name: Split() for name in module.state_dict()}
    for name, param in module.named_parameters(remove_duplicate=False):
        if parameters_only or name in splits:
            splits[name] = split_of(param)
    return splits


def model_splits(config: ModelConfig, parameters_only: bool = False) -> dict[str, Split]:
    """`declared_splits` of the `GPTModel` `config` describes, built on the meta device (no
    memory, no initialization) as one process holding every expert: the names are its
    state-dict keys (or parameter names), the whole model's (DeepSpeed-MoE's experts under
    their global numbers)."""
    from megatron.core.process_groups import ModelGroups
    from megatron.model.gpt_model import GPTModel

    config = dataclasses.replace(config, use_cpu_initialization=False)
    if config.moe is not None:
        config = dataclasses.replace(
            config, moe=dataclasses.replace(config.moe, expert_parallel_size=1)
        )
    with torch.device("meta"):
        model = GPTModel(config, ModelGroups())
    return declared_splits(model, parameters_only)
