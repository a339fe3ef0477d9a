"""Shared pieces of the model tests: tiny configs, seeded runs, shard gathering, spawned worlds.

A spawned world (`spawn_collect`) computes numbers on every rank and hands them back to the
pytest process, which makes the assertions. Bodies never assert themselves, so a mismatch
cannot leave one rank waiting in a collective that the others skipped; a body that raises
ends the whole world at once (`torch.multiprocessing.spawn` kills the other ranks).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from tests.distributed import run_distributed

LAYER_PARAMETERS = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.query_key_value.weight",
    "self_attention.query_key_value.bias",
    "self_attention.dense.weight",
    "self_attention.dense.bias",
    "post_attention_layernorm.weight",
    "post_attention_layernorm.bias",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight",
    "mlp.dense_4h_to_h.bias",
)
"""Megatron's parameter names inside one transformer layer, in Megatron's order."""

TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
"""A two-layer GPT small enough to run forward and backward in milliseconds."""


def tiny_config(**overrides: object) -> ModelConfig:
    """`TINY` with some fields replaced."""
    return ModelConfig(**{**TINY, **overrides})


def build_model(config: ModelConfig, seed: int = 0) -> GPTModel:
    """A GPTModel whose weights depend only on `seed` (and, without CPU init, on TP)."""
    torch.manual_seed(seed)
    return GPTModel(config)


def random_batch(
    batch: int, seq: int, vocab: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) [batch, seq], labels being the tokens shifted by one."""
    tokens = torch.randint(
        0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed)
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_and_grads(
    model: GPTModel,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    rng_seed: int | None = None,
    **forward_kwargs: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [b, s] and each parameter's gradient of its mean (this rank's shards).

    `rng_seed` reseeds the default and the model-parallel streams first, so two models run
    with the same seed draw the same dropout masks. As `initialize.set_random_seed`, it
    calls `torch.manual_seed` too: on a GPU machine `model_parallel_cuda_manual_seed` seeds
    only the CUDA generator, and most models here run on the CPU.
    """
    model.zero_grad(set_to_none=True)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
        model_parallel_cuda_manual_seed(rng_seed)
    losses = model(tokens, labels=labels, **forward_kwargs)
    losses.mean().backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    return losses.detach(), grads


def gather_shards(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """The full (unsplit) tensor of a tensor-parallel parameter's shard; others unchanged.

    Uses the `partition_dim` and `partition_stride` attributes the parallel layers set: with
    stride s each shard is s blocks, and the full tensor is block 0 of every rank, then
    block 1 of every rank, ... (SwiGLU's [gate_r; up_r] shards give [gate; up]).
    """
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(
        parts, tensor.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    dim, stride = param.partition_dim, param.partition_stride
    blocks = [part.chunk(stride, dim=dim) for part in parts]
    return torch.cat([blocks[rank][j] for j in range(stride) for rank in range(world)], dim=dim)


def full_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`loss_and_grads`' per-rank gradients put back together over the TP group."""
    params = dict(model.named_parameters())
    return {name: gather_shards(grad, params[name]) for name, grad in grads.items()}


def gather_across_tensor_group(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's copy of a same-shaped tensor (to compare them with each other)."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(
        parts, tensor.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return parts


def loss_grads_and_logits(
    model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor, rng_seed: int | None = None
) -> dict[str, object]:
    """`model`'s per-token loss, its whole gradients (`full_grads`) and its whole eval-mode
    logits (the vocabulary shards of every TP rank): what a TP=2 run is compared with TP=1 by."""
    loss, grads = loss_and_grads(model, tokens, labels, rng_seed=rng_seed)
    with torch.no_grad():
        logits = model.eval()(tokens)
    return {
        "loss": loss,
        "grads": full_grads(model, grads),
        "logits": torch.cat(gather_across_tensor_group(logits), dim=-1),  # vocab shards
    }


def _collect_entry(rank: int, world_size: int, body: Callable, out_dir: str, args: tuple) -> None:
    """Spawned per rank: run `body` on one thread and save what it returns."""
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    try:
        results = body(rank, world_size, *args)
    finally:
        parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn_collect(body: Callable, world_size: int, *args: object) -> list[dict]:
    """Run module-level `body(rank, world_size, *args)` on a gloo world; its results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        run_distributed(_collect_entry, world_size, body, out_dir, args)
        return [
            torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            for rank in range(world_size)
        ]


def complex_rotary(tensor: torch.Tensor, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of [s, ..., d] as complex products, positions along dim 0.

    Channel j and channel j + rotary_dim/2 are the real and imaginary parts of one complex
    number, turned by the angle position * base^(-2j / rotary_dim); channels past
    `rotary_dim` pass through. Computed in float64.
    """
    half = rotary_dim // 2
    seq = tensor.size(0)
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq  # [s, half]
    angles = angles.view(seq, *([1] * (tensor.dim() - 2)), half)
    z = torch.complex(tensor[..., :half].double(), tensor[..., half:rotary_dim].double())
    z = z * torch.polar(torch.ones_like(angles), angles)
    rest = tensor[..., rotary_dim:].double()
    return torch.cat((z.real, z.imag, rest), dim=-1).to(tensor.dtype)
