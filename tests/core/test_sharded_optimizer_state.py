"""FSDP2 sharding (`megatron.training.engines.fsdp.shard_model`) at DP=4, in a 4-rank gloo world:
each rank's optimizer state (Adam's two moments) and fp32 master weights, measured from the
optimizer's own tensors, are 1/4 of DDP's (up to FSDP2's padding of each parameter's first
dimension to a multiple of 4), under both strategies; and one step from the same weights and
inputs leaves the same (gathered) weights as the unsharded model averaged over the ranks.

A torch_dist save and load of such a run stay sharded (DP=4, and TP=2 x DP=2 with SwiGLU's
halves split across data-parallel ranks and an uneven vocabulary): the tensors a rank
allocates while saving or loading (`tests.allocation_meter`, counted per op) are at most its
own slices of the weights and Adam's moments plus 64 KiB, where gathering them (torch's full
state dicts, what the save did before) allocates the whole state; the loaded weights and
moments are the saved ones, into a sharded model and into an unsharded one."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.layout import Engine, ParallelLayout
from tests.allocation_meter import AllocationMeter
from tests.core.spawn_checks import BODY
from tests.distributed import shared_directory


def _layout(world: int, sharding: str, tp: int = 1) -> ParallelLayout:
    return ParallelLayout(
        Engine.PLAIN, world, tp, False, 1, 1, world // tp, 1, 1, 0, "fp32", sharding=sharding
    )


def _state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(Adam moments, master weights) bytes this rank holds: local shards of DTensors."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    moments = weights = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            weights += local(param).numel() * local(param).element_size()
            for key in ("exp_avg", "exp_avg_sq"):
                tensor = local(optimizer.state[param][key])
                moments += tensor.numel() * tensor.element_size()
    return moments, weights


def _one_step(sharding: str, world: int) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from megatron.model import GPTModel
    from megatron.training.engines.fsdp import shard_model

    config = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(5)
    model = GPTModel(config)
    if sharding != "none":
        model = shard_model(model, _layout(world, sharding))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    rank = dist.get_rank()
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(rank))
    losses = model(tokens[:, :-1], labels=tokens[:, 1:])
    losses.mean().backward()
    if sharding == "none":  # DDP's average, by hand
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
    optimizer.step()
    whole = StateDictOptions(full_state_dict=True)
    weights = (
        get_model_state_dict(model, options=whole) if sharding != "none" else model.state_dict()
    )
    return _state_bytes(optimizer), {name: tensor.detach() for name, tensor in weights.items()}


def _check_quarter_of_ddps_state(sharding: str, world: int) -> None:
    parallel_state.initialize_model_parallel(1, 1)
    (moments, weights), stepped = _one_step(sharding, world)
    (ddp_moments, ddp_weights), expected = _one_step("none", world)
    for mine, full in ((moments, ddp_moments), (weights, ddp_weights)):
        assert full / world <= mine <= full / world * 1.02, (mine, full)
    for name, tensor in expected.items():
        torch.testing.assert_close(stepped[name], tensor, rtol=0, atol=1e-6, msg=name)


def _llama(
    seed: int, layout: ParallelLayout, vocab: int = 130
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A LLaMA-style GPT (SwiGLU, RMSNorm, rotary, untied output, 130 vocabulary rows: uneven
    FSDP2 slices), FSDP2-sharded as `layout` says, and its AdamW."""
    from megatron.core.process_groups import this_rank_groups
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.model import GPTModel
    from megatron.training.engines.fsdp import shard_model

    config = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=vocab,
        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
        activation="swiglu", ffn_hidden_size=40, normalization="rmsnorm",
        untie_embeddings_and_output_weights=True, position_embedding_type="rope",
    )  # fmt: skip
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config, this_rank_groups())
    if layout.sharding != "none":
        model = shard_model(model, layout)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _gathering_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What torch's full state dicts (the save before, and torch's own way) allocate."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    with AllocationMeter() as meter:
        get_model_state_dict(model, options=whole)
        get_optimizer_state_dict(model, optimizer, options=whole)
    return meter.allocated


def _check_torch_dist_stays_sharded(sharding: str, world: int, tp: int) -> None:
    from megatron.checkpointing.dist_checkpoint import load_dist_checkpoint, save_dist_checkpoint
    from megatron.checkpointing.whole_tensors import whole_tensors

    parallel_state.initialize_model_parallel(tp, 1)
    layout = _layout(world, sharding, tp)
    args = argparse.Namespace(num_layers=2, layout=layout)
    model, optimizer = _llama(1, layout)
    tokens = torch.randint(0, 130, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    optimizer.step()
    moments, weights = _state_bytes(optimizer)
    own = moments + weights
    with shared_directory() as directory:
        with AllocationMeter() as saving:
            save_dist_checkpoint(
                directory, whole_tensors(model, optimizer), {}, args, save_rng=False
            )
        loaded, loaded_optimizer = _llama(2, layout)
        with AllocationMeter() as loading:
            load_dist_checkpoint(
                directory, whole_tensors(loaded, loaded_optimizer), args, load_rng=False
            )
        gathering = _gathering_bytes(model, optimizer)
        plain, plain_optimizer = _llama(3, _layout(world, "none", tp))
        load_dist_checkpoint(directory, whole_tensors(plain, plain_optimizer), args, load_rng=False)
        # Padded to another multiple: the vocabulary's common rows, zeros past the saved ones.
        resized = {rows: _llama(4, layout, rows) for rows in (128, 136)}
        for other, other_optimizer in resized.values():
            holder = whole_tensors(other, other_optimizer)
            load_dist_checkpoint(directory, holder, args, load_rng=False)
    assert saving.allocated <= own + 64 * 1024, (saving.allocated, own)
    assert loading.allocated <= own + 64 * 1024, (loading.allocated, own)
    assert gathering >= world // tp * own * 0.9, (gathering, own)  # what sharding avoids
    named = dict(model.named_parameters())
    for other, other_optimizer in ((loaded, loaded_optimizer), (plain, plain_optimizer)):
        for name, param in other.named_parameters():
            torch.testing.assert_close(_whole(param), _whole(named[name]), rtol=0, atol=0)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    _whole(other_optimizer.state[param][key]),
                    _whole(optimizer.state[named[name]][key]),
                    rtol=0, atol=0, msg=f"{name} {key}",
                )  # fmt: skip
    for rows, (other, other_optimizer) in resized.items():
        for name, param in other.named_parameters():
            for mine, saved in (
                (_whole(param), _whole(named[name])),
                (
                    _whole(other_optimizer.state[param]["exp_avg"]),
                    _whole(optimizer.state[named[name]]["exp_avg"]),
                ),
            ):
                if getattr(param, "vocab_parallel", False):
                    saved = _vocabulary_rows(saved, mine.size(0))
                assert torch.equal(mine, saved), (rows, name)


def _vocabulary_rows(shard: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows a tensor-parallel rank holding `rows` vocabulary rows takes from the saved
    matrix whose rank holds `shard`: the common rows, zeros past the saved ones."""
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    saved = torch.cat(pieces)
    start = parallel_state.get_tensor_model_parallel_rank() * rows
    wanted = torch.zeros(rows, *shard.shape[1:], dtype=shard.dtype)
    kept = saved[start : start + rows]
    wanted[: kept.size(0)] = kept
    return wanted


SPAWN_WORLD_SIZES = [4]
CHECKS = {
    **{
        f"{sharding}: a quarter of DDP's optimizer state, the same step": (
            _check_quarter_of_ddps_state,
            sharding,
        )
        for sharding in ("optim_grads", "optim_grads_params")
    },
    **{
        f"{sharding} tp={tp}: torch_dist saves and loads this rank's slices only": (
            _check_torch_dist_stays_sharded,
            sharding,
            tp,
        )
        for sharding, tp in (("optim_grads_params", 1), ("optim_grads", 2))
    },
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Both strategies at DP = world."""
    try:
        for name, (fn, sharding, *arguments) in CHECKS.items():
            checks.run(name, fn, sharding, world, *arguments)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's worlds, by size."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_sharded_optimizer_state(spawned, name: str) -> None:
    """Each check passed on every rank."""
    spawned[4].assert_ok(name)


def test_spawned_body_ran_every_check(spawned) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[4].names() == set(CHECKS), spawned[4].per_rank[0].get(BODY)


def test_an_unsharded_optimizer_state_is_renamed_by_parameter_and_checked() -> None:
    """torch's numbered optimizer state dict, keyed by parameter name for FSDP2's loader: each
    entry goes to the parameter at its place in the groups; groups of other sizes refused."""
    from megatron.checkpointing.sharded_states import name_keyed_optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    decay, no_decay = [model[0].weight, model[1].weight], [model[0].bias, model[1].bias]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0}])
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    renamed = name_keyed_optimizer_state(model, optimizer, saved, "ckpt/model_optim_rng.pt")
    assert [group["params"] for group in renamed["param_groups"]] == [
        ["0.weight", "1.weight"],
        ["0.bias", "1.bias"],
    ]
    named = dict(model.named_parameters())
    for name, state in renamed["state"].items():
        assert torch.equal(state["exp_avg"], optimizer.state[named[name]]["exp_avg"])
    other = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"ckpt/model_optim_rng.pt: .* sizes \[2, 2\], .* \[4\]"):
        name_keyed_optimizer_state(model, other, saved, "ckpt/model_optim_rng.pt")
