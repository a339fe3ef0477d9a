"""`--fp8-param-gather` under FSDP2 (`megatron.training.engines.fsdp.shard_model` with
`megatron.model.fp8.cast_weights_before_all_gather`) at DP=2, in the session's 2-rank gloo world.

A tiny FP8 GPT (2 layers, h 64) trains a few steps with our guarded AdamW (gradient clipping
over the shards), with and without the FP8 all-gather, under both strategies. What must hold:

- in fp32, the same losses and gradients bit for bit: tensorwise scaling takes each weight's
  amax over all its shards (one all-reduce before the gather), so the shards cast to FP8 and
  gathered are exactly the FP8 weight the matmul casts from the gathered fp32 weight;
- each FP8 weight travels 1 byte an element (every other parameter in its own dtype), counted
  on FSDP2's all-gather itself, and reaches the layer as torchao's `Float8TrainingTensor`;
- the checkpoint (torch_dist: each rank's slices, nothing gathered) holds plain fp32 weights
  and Adam moments, the same tensors as the run without the FP8 gather, and loads back (a
  fresh model and optimizer, still gathering in FP8, then more steps, equal);
- in bf16 (FSDP2 gathers the other weights in bf16) the FP8 weight is cast from the fp32
  master weight, not from its bf16 copy as without the flag (a few percent of its FP8 values
  then differ by one FP8 step): bitwise torchao's cast of the fp32 weight, and losses within
  FP8's rounding (1e-2 relative, the bound of TP=2 against TP=1 in tests/model/test_fp8.py;
  measured here about 2e-3) of the run without the flag.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from megatron.config import Fp8Config, ModelConfig
from megatron.core import parallel_state
from megatron.layout import Engine, ParallelLayout
from tests.distributed import shared_directory

CONFIG = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
    max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
    use_cpu_initialization=True,
)  # fmt: skip
STEPS = 3
STRATEGIES = ("optim_grads", "optim_grads_params")
WATCHED = "language_model.encoder.layers.1.mlp.dense_h_to_4h"
"""An FP8 layer whose gathered weight the runs look at."""


class _CountingAllGather(DefaultAllGather):
    """FSDP2's own all-gather, recording each call's bytes sent by this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[int] = []

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001, ANN204
        self.sent.append(input_tensor.numel() * input_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, async_op)


def _model_and_optimizer(sharding: str, precision: str, gather: bool, seed: int = 5):
    from megatron.model import GPTModel
    from megatron.training.engines.fsdp import shard_model
    from megatron.training.optimizer import GuardedAdamW

    world = dist.get_world_size()
    layout = ParallelLayout(
        Engine.PLAIN, world, 1, False, 1, 1, world, 1, 1, 0, precision, sharding=sharding
    )
    torch.manual_seed(seed)
    model = GPTModel(ModelConfig(**CONFIG, fp8=Fp8Config(param_gather=gather)))
    initial = model.get_submodule(WATCHED).weight.detach().clone()
    model = shard_model(model, layout)
    optimizer = GuardedAdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8,
        clip_grad=1.0, model_parallel_group=parallel_state.get_model_parallel_group(),
        shard_group=parallel_state.get_sequence_data_parallel_group(),
    )  # fmt: skip
    return model, optimizer, initial


def _step(model, optimizer, step: int, precision: str) -> tuple[float, dict[str, torch.Tensor]]:  # noqa: ANN001
    """One training step on this rank's batch: (loss, each whole gradient)."""
    generator = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 17), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), grads


def _train(sharding: str, precision: str, gather: bool) -> dict:
    """STEPS steps: losses, gradients, bytes of each layer's all-gathers, the gathered weight."""
    model, optimizer, initial = _model_and_optimizer(sharding, precision, gather)
    layers = model.language_model.encoder.layers
    counters = [_CountingAllGather() for _ in layers]
    for layer, counter in zip(layers, counters):
        layer.set_custom_all_gather(counter)
    gathered = []  # copied at once: FSDP2 frees the gathered storage after the layer
    model.get_submodule(WATCHED).register_forward_pre_hook(
        lambda module, args: gathered.append(_copy(module.weight.detach()))
    )
    losses, grads = zip(*(_step(model, optimizer, step, precision) for step in range(STEPS)))
    return dict(
        model=model, optimizer=optimizer, initial=initial, losses=losses, grads=grads,
        sent=[counter.sent for counter in counters], gathered=gathered[0],
    )  # fmt: skip


def _copy(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a gathered weight, torchao's FP8 tensor (its bytes and scale) or not."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    if not isinstance(weight, Float8TrainingTensor):
        return weight.clone()
    return Float8TrainingTensor(
        weight._data.clone(), weight._scale.clone(), weight._orig_dtype,
        weight._linear_mm_config, weight._gemm_input_role,
    )  # fmt: skip


def _expected_bytes(layer: torch.nn.Module, fp8_bytes: int) -> int:
    """This rank's all-gather input for `layer`: its shard of each parameter, FP8-gathered
    weights at `fp8_bytes` an element (dimensions are even: FSDP2 pads nothing)."""
    total = 0
    for param in layer.parameters():
        local = param.to_local()
        total += local.numel() * (fp8_bytes if _cast(local) else local.element_size())
    return total


def _cast(local: torch.Tensor) -> bool:
    """Whether a parameter's shard is wrapped for the FP8 all-gather."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return isinstance(local, WeightWithDynamicFloat8CastTensor)


def _check_fp32_bitwise_one_byte_and_checkpoint(sharding: str) -> None:
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    plain = _train(sharding, "fp32", gather=False)
    fp8 = _train(sharding, "fp32", gather=True)
    assert fp8["losses"] == plain["losses"], (fp8["losses"], plain["losses"])
    for step, (ours, theirs) in enumerate(zip(fp8["grads"], plain["grads"])):
        for name, grad in theirs.items():
            assert torch.equal(ours[name], grad), (step, name)
    # What travelled: 1 byte per element of each FP8 weight's shard, 4 without the flag.
    assert isinstance(fp8["gathered"], Float8TrainingTensor)
    assert fp8["gathered"]._data.dtype == torch.float8_e4m3fn
    assert isinstance(plain["gathered"], torch.Tensor) and plain["gathered"].dtype == torch.float32
    for layer, ours, theirs in zip(fp8["model"].language_model.encoder.layers, fp8["sent"],
                                   plain["sent"]):  # fmt: skip
        assert ours and set(ours) == {_expected_bytes(layer, 1)}, ours
        assert set(theirs) == {_expected_bytes(layer, 4)} and len(theirs) == len(ours)
        assert _expected_bytes(layer, 1) < _expected_bytes(layer, 4)
    # The checkpoint: plain fp32 tensors, the same as without the flag; they load back.
    with shared_directory() as directory:
        for run, where in ((fp8, "fp8"), (plain, "plain")):
            _save(run["model"], run["optimizer"], sharding, os.path.join(directory, where))
        stored = _stored(os.path.join(directory, "fp8"))
        assert stored == _stored(os.path.join(directory, "plain"))  # names, shapes, dtypes
        assert {dtype for _, dtype in stored.values()} == {torch.float32}, stored
        model, optimizer, _ = _model_and_optimizer(sharding, "fp32", gather=True, seed=6)
        _load(model, optimizer, sharding, os.path.join(directory, "fp8"))
    for (name, mine), theirs in zip(model.state_dict().items(), fp8["model"].state_dict().values()):
        assert torch.equal(_whole(mine), _whole(theirs)), name
    assert _cast(model.get_submodule(WATCHED).weight.to_local())  # still gathered in FP8
    assert (
        _step(model, optimizer, STEPS, "fp32")[0]
        == _step(fp8["model"], fp8["optimizer"], STEPS, "fp32")[0]
    )


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.checkpointing.fsdp_slices import stored_tensor

    whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return stored_tensor(whole)


def _args(sharding: str) -> argparse.Namespace:
    world = dist.get_world_size()
    layout = ParallelLayout(
        Engine.PLAIN, world, 1, False, 1, 1, world, 1, 1, 0, "fp32", sharding=sharding
    )
    return argparse.Namespace(num_layers=CONFIG["num_layers"], layout=layout)


def _save(model, optimizer, sharding: str, directory: str) -> None:  # noqa: ANN001
    from megatron.checkpointing.dist_checkpoint import save_dist_checkpoint
    from megatron.checkpointing.whole_tensors import whole_tensors

    if dist.get_rank() == 0:
        os.makedirs(directory)
    dist.barrier()
    holder = whole_tensors(model, optimizer)
    save_dist_checkpoint(directory, holder, {}, _args(sharding), save_rng=False)


def _load(model, optimizer, sharding: str, directory: str) -> None:  # noqa: ANN001
    from megatron.checkpointing.dist_checkpoint import load_dist_checkpoint
    from megatron.checkpointing.whole_tensors import whole_tensors

    holder = whole_tensors(model, optimizer)
    assert load_dist_checkpoint(directory, holder, _args(sharding), load_rng=False)


def _stored(directory: str) -> dict[str, tuple]:
    """Each tensor the checkpoint holds: its global shape and dtype."""
    from megatron.checkpointing.dist_checkpoint import _SafeReader

    metadata = _SafeReader.create(directory).read_metadata().state_dict_metadata
    return {
        name: (tuple(entry.size), entry.properties.dtype)
        for name, entry in metadata.items()
        if hasattr(entry, "size") and not name.startswith("rng_state")
    }


def _check_bf16_casts_the_fp32_master_weight() -> None:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    from megatron.model.fp8 import Float8Matmul

    plain = _train("optim_grads_params", "bf16", gather=False)
    fp8 = _train("optim_grads_params", "bf16", gather=True)
    gathered = fp8["gathered"]
    assert gathered.dtype == torch.bfloat16  # FSDP2's compute dtype: the matmul's output
    matmul = Float8Matmul(Fp8Config())
    cast = hp_tensor_to_float8_dynamic(
        fp8["initial"], torch.float8_e4m3fn, matmul.mm_config, gemm_input_role=GemmInputRole.WEIGHT
    )
    assert torch.equal(gathered._scale, cast._scale)
    assert torch.equal(gathered._data.view(torch.uint8), cast._data.view(torch.uint8))
    for ours, theirs in zip(fp8["losses"], plain["losses"]):
        assert abs(ours - theirs) / theirs < 1e-2, (fp8["losses"], plain["losses"])


CHECKS = {
    **{
        f"{sharding} fp32: FP8 all-gather is bitwise, 1 byte/element, plain checkpoint": (
            _check_fp32_bitwise_one_byte_and_checkpoint,
            sharding,
        )
        for sharding in STRATEGIES
    },
    "optim_grads_params bf16: the FP8 weight is cast from the fp32 master": (
        _check_bf16_casts_the_fp32_master_weight,
    ),
}
SPAWN_WORLD_SIZES = [2]


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check at DP=2."""
    parallel_state.initialize_model_parallel(1, 1)
    try:
        for name, (fn, *arguments) in CHECKS.items():
            checks.run(name, fn, *arguments)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's 2-rank world."""
    return spawned_suite[__name__][2]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_fp8_param_gather(spawned, name: str) -> None:
    """Each check passed on both ranks."""
    spawned.assert_ok(name)


def test_spawned_body_ran_every_check(spawned) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned.names() == set(CHECKS)
