"""FSDP2 sharding (`megatron.training.engines.fsdp.shard_model`) at DP=4, in a 4-rank gloo world:
each rank's optimizer state (Adam's two moments) and fp32 master weights, measured from the
optimizer's own tensors, are 1/4 of DDP's (up to FSDP2's padding of each parameter's first
dimension to a multiple of 4), under both strategies; and one step from the same weights and
inputs leaves the same (gathered) weights as the unsharded model averaged over the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.layout import Engine, ParallelLayout
from tests.core.spawn_checks import BODY


def _layout(world: int, sharding: str) -> ParallelLayout:
    return ParallelLayout(
        Engine.PLAIN, world, 1, False, 1, 1, world, 1, 1, 0, "fp32", sharding=sharding
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
    from megatron.checkpointing.sharded_states import full_model_state
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
    weights = full_model_state(model) if sharding != "none" else model.state_dict()
    return _state_bytes(optimizer), {name: tensor.detach() for name, tensor in weights.items()}


def _check_quarter_of_ddps_state(sharding: str, world: int) -> None:
    parallel_state.initialize_model_parallel(1, 1)
    (moments, weights), stepped = _one_step(sharding, world)
    (ddp_moments, ddp_weights), expected = _one_step("none", world)
    for mine, full in ((moments, ddp_moments), (weights, ddp_weights)):
        assert full / world <= mine <= full / world * 1.02, (mine, full)
    for name, tensor in expected.items():
        torch.testing.assert_close(stepped[name], tensor, rtol=0, atol=1e-6, msg=name)


SPAWN_WORLD_SIZES = [4]
CHECKS = {
    f"{sharding}: a quarter of DDP's optimizer state, the same step": (
        _check_quarter_of_ddps_state,
        sharding,
    )
    for sharding in ("optim_grads", "optim_grads_params")
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Both strategies at DP = world."""
    try:
        for name, (fn, *arguments) in CHECKS.items():
            checks.run(name, fn, *arguments, world)
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
