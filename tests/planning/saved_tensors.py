"""Measure what a GPT forward keeps for backward: the bytes of every tensor autograd saves,
each storage once, the parameters (whose storage the model owns anyway) left out.

A tensor counts only while autograd still holds it when the forward ends: a graph node
whose outputs were all dropped (the top-k of the load-balancing loss, whose values nobody
keeps) frees what it saved, and a later tensor may take the same address. An output freed
until the backward recomputes it counts nothing."""

from __future__ import annotations

import contextlib
import weakref

import torch

from megatron.config import ModelConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel


def saved_bytes(config: ModelConfig, micro_batch: int, seq: int, autocast: bool) -> int:
    """Bytes a training forward of `config` over a [micro_batch, seq] batch keeps."""
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(config).train()
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq))
    positions = torch.arange(seq).expand(micro_batch, seq).contiguous()
    saved: list[tuple[weakref.ref, int]] = []  # (the tensor, its storage's address)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved.append((weakref.ref(tensor), storage.data_ptr()))
        return tensor

    region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), region:
        output = model(tokens, positions, None, labels=tokens)  # holds the graph
    # Sizes when the forward ends: a storage freed until the backward refills it
    # (`--recompute-modules layernorm / moe_act / mla_up_proj`) counts 0.
    kept = {
        address: ref().untyped_storage().nbytes() for ref, address in saved if ref() is not None
    }
    del output
    return sum(kept.values())
