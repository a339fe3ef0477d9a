"""Meta-device start-up under FSDP2 (`megatron.core.tensor_parallel.meta_init`, `shard_model`),
in a 4-rank gloo world.

For each layout, a model built on the meta device and sharded (each rank initializing its own
shards) against today's whole build, sharded after a broadcast from the first data-parallel
rank: the gathered weights and the buffers are the same bit for bit, and so are the random
generators' states after start-up (dropout continues alike). The layouts: DP=4 (GPT-2's
block, and LLaMA's with rotary tables and SwiGLU), TP=2 x DP=2 with sequence parallelism and
with `--use-cpu-initialization`, TP=2 x CP=2 (each context-parallel rank draws tensor-parallel
weights from its own stream: both start from the first rank's), Megatron-LM MoE at EP=2 x DP=4
(experts sharded over the expert-data ranks, the router's bias buffers), PP=2 x DP=2 chunks
with the tied embedding's head copy, and FP8 weights gathered in FP8. At TP=1 the weights
also equal a one-process build's: the same model at DP=4 as at DP=1.

Memory, counted per op (`AllocationMeter`, deterministic): today's start-up holds the whole model
at once; the meta-device one its shards plus at most twice the largest parameter (the one
being initialized, and a fill's scratch), never a model-sized allocation.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.config import Fp8Config, ModelConfig, RoutedMoEConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel.meta_init import RngStates, meta_device_build
from megatron.layout import Engine, ParallelLayout
from tests.allocation_meter import AllocationMeter
from tests.core.spawn_checks import BODY

SEED = 1234
GPT2 = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
    max_position_embeddings=16,
)  # fmt: skip
LLAMA = dataclasses.replace(
    GPT2, num_key_value_heads=2, activation="swiglu", normalization="rmsnorm",
    position_embedding_type="rope", add_bias_linear=False,
    untie_embeddings_and_output_weights=True, vocab_size=130,
)  # fmt: skip
MOE = dataclasses.replace(
    GPT2,
    routed_moe=RoutedMoEConfig(
        num_experts=4, moe_layers=(True, True), expert_bias=True, shared_expert_ffn_hidden_size=16
    ),
)


def _layout(sharding: str = "optim_grads_params", precision: str = "fp32") -> ParallelLayout:
    world = dist.get_world_size()
    return ParallelLayout(
        Engine.PLAIN, world, 1, False, 1, 1, world, 1, 1, 0, precision, sharding=sharding
    )


def _seed() -> None:
    """Seed as `megatron.initialize.set_random_seed` does."""
    seed = SEED + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _build(config: ModelConfig, pp: int) -> torch.nn.Module:
    """This rank's GPT, or its pipeline chunks."""
    from megatron.model import GPTModel
    from megatron.model.pipeline_chunks import build_pipeline_chunks

    if pp > 1:
        return build_pipeline_chunks(config, parallel_state.get_pipeline_model_parallel_rank(), pp)
    return GPTModel(config)


def _start(config: ModelConfig, pp: int, meta: bool, layout: ParallelLayout):
    """(gathered states, buffers, generator states after start-up, meter) of one start-up."""
    from megatron.core.pipeline_parallel.schedules import initialize_tied_embedding
    from megatron.training.engines.fsdp import shard_model

    meter = AllocationMeter()
    _seed()
    with meter:
        if meta:
            with meta_device_build():
                model = _build(config, pp)
        else:
            model = _build(config, pp)
        model = shard_model(model, layout)
        if pp > 1:
            initialize_tied_embedding(model)
    states = {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in model.named_parameters()
    }
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    return states, buffers, RngStates.now(), meter, model


def _assert_same(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), (what, ours.keys() ^ theirs.keys())
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), f"{what}: {name} differs"


def _check_as_a_whole_build(
    config: ModelConfig, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, **layout
) -> None:
    """Meta-device start-up == today's whole build at (tp, cp, ep, pp); at TP=CP=PP=1 also a
    one-process build's weights."""
    from megatron.model import GPTModel

    parallel_state.initialize_model_parallel(
        tp, pp, context_parallel_size=cp, expert_parallel_size=ep
    )
    config = dataclasses.replace(config, sequence_parallel=config.sequence_parallel and tp > 1)
    whole, whole_buffers, whole_rng, _, _ = _start(config, pp, False, _layout(**layout))
    meta, meta_buffers, meta_rng, _, model = _start(config, pp, True, _layout(**layout))
    _assert_same(meta, whole, "weights")
    _assert_same(meta_buffers, whole_buffers, "buffers")
    assert meta_rng.same_as(whole_rng), "generator states after start-up"
    for param in model.parameters():  # the attributes our layers and the optimizer read
        assert param.device.type == "cpu" and isinstance(param, DTensor)
    if tp == cp == pp == 1 and ep == 1:
        _seed()
        single = GPTModel(config)
        _assert_same(meta, dict(single.named_parameters()), "a one-process build")


def _check_memory(config: ModelConfig) -> None:
    """Today's start-up holds the whole model at once; the meta-device one holds this rank's
    shards (1/DP of the model) and at most one initializer's temporaries at a time (one
    parameter, or an MoE layer's two expert stacks, plus a fill's scratch), none model-sized.
    (FSDP2 allocates the shards inside DTensor ops, below what `AllocationMeter` sees: they are
    measured from the local tensors.)"""
    parallel_state.initialize_model_parallel(1, 1)
    world = dist.get_world_size()
    _, _, _, whole, _ = _start(config, 1, False, _layout())
    states, _, _, meta, model = _start(config, 1, True, _layout())
    model_bytes = sum(t.numel() * t.element_size() for t in states.values())
    largest = max(t.numel() * t.element_size() for t in states.values())
    shard_bytes = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    assert whole.peak >= model_bytes, (whole.peak, model_bytes)
    assert shard_bytes <= model_bytes / world * 1.1, (shard_bytes, model_bytes)
    assert meta.peak <= 2 * largest < model_bytes / world, (meta.peak, largest, model_bytes)
    assert meta.largest == largest, (meta.largest, largest)


SPAWN_WORLD_SIZES = [4]
CHECKS = {
    "DP=4 GPT-2: a whole build's weights, buffers and generator states": partial(
        _check_as_a_whole_build, GPT2
    ),
    "DP=4 LLaMA (rotary tables), optim_grads": partial(
        _check_as_a_whole_build, LLAMA, sharding="optim_grads"
    ),
    "TP=2 x DP=2, sequence parallelism": partial(
        _check_as_a_whole_build, dataclasses.replace(LLAMA, sequence_parallel=True), tp=2
    ),
    "TP=2 x DP=2, --use-cpu-initialization": partial(
        _check_as_a_whole_build, dataclasses.replace(GPT2, use_cpu_initialization=True), tp=2
    ),
    "TP=2 x CP=2: the first context-parallel rank's weights": partial(
        _check_as_a_whole_build, LLAMA, tp=2, cp=2
    ),
    "MoE EP=2 x DP=4: experts and router buffers": partial(_check_as_a_whole_build, MOE, ep=2),
    "PP=2 x DP=2 chunks, the tied embedding's head copy": partial(
        _check_as_a_whole_build, GPT2, pp=2
    ),
    "FP8 weights gathered in FP8": partial(
        _check_as_a_whole_build,
        dataclasses.replace(GPT2, hidden_size=64, fp8=Fp8Config(param_gather=True)),
    ),
    "memory: shards plus two parameters, never the whole model": partial(
        _check_memory, dataclasses.replace(GPT2, hidden_size=64, num_layers=4)
    ),
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check, each in its own parallel state."""
    for name, check in CHECKS.items():
        try:
            checks.run(name, check)
        finally:
            parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's worlds, by size."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_meta_device_start_up(spawned, name: str) -> None:
    """Each check passed on every rank."""
    spawned[4].assert_ok(name)


def test_spawned_body_ran_every_check(spawned) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[4].names() == set(CHECKS), spawned[4].per_rank[0].get(BODY)


@pytest.mark.parametrize(
    "config",
    [
        dataclasses.replace(GPT2, apply_layernorm_1p=True, qk_layernorm=True),
        LLAMA,
        dataclasses.replace(GPT2, use_cpu_initialization=True),
        MOE,
    ],
    ids=["gpt2-layernorm1p-qk", "llama", "cpu-initialization", "routed-moe"],
)
def test_replay_in_one_process_is_a_whole_build(config: ModelConfig) -> None:
    """Without torch.distributed: a meta-device build replayed into whole tensors is the whole
    build, parameters, buffers and the generators after it."""
    from megatron.core.tensor_parallel.meta_init import meta_build_of, run_initializers
    from megatron.model import GPTModel

    _seed()
    whole = GPTModel(config)
    after_whole = RngStates.now()
    _seed()
    with meta_device_build():
        meta = GPTModel(config)
    assert all(param.is_meta for param in meta.parameters())
    names = {id(param): name for name, param in meta.named_parameters()}
    values: dict[str, torch.Tensor] = {}
    run_initializers(meta_build_of(meta), lambda t, value: values.setdefault(names[id(t)], value))
    _assert_same(values, dict(whole.named_parameters()), "weights")
    _assert_same(dict(meta.named_buffers()), dict(whole.named_buffers()), "buffers")
    assert RngStates.now().same_as(after_whole)


def test_a_parameter_made_outside_the_helpers_is_named() -> None:
    """A meta-device build refuses parameters it cannot replay; `whole_build` builds for real
    inside one."""
    from megatron.core.tensor_parallel.meta_init import (
        initialize,
        meta_build_of,
        new_parameter,
        whole_build,
    )
    from megatron.model.utils import init_method_normal

    def module(**parameters: torch.nn.Parameter) -> torch.nn.Module:
        holder = torch.nn.Module()
        for name, param in parameters.items():
            holder.register_parameter(name, param)
        return holder

    with meta_device_build():
        made = new_parameter((2, 3), torch.float32)
        initialize(made, init_method_normal(0.02))
        unfilled = new_parameter((3,), torch.float32)
        real = torch.nn.Parameter(torch.ones(3))
        with whole_build():
            inside = new_parameter((3,), torch.float32)
            initialize(inside, torch.nn.init.ones_)
    assert made.is_meta and unfilled.is_meta and not inside.is_meta
    assert torch.equal(inside, torch.ones(3))
    with pytest.raises(RuntimeError, match="parameter unfilled was made on the meta device"):
        meta_build_of(module(made=made, unfilled=unfilled))
    with pytest.raises(RuntimeError, match="parameter real was made outside"):
        meta_build_of(module(made=made, real=real))
    assert meta_build_of(module(real=real)) is None
    assert meta_build_of(module(made=made)) is not None
