"""The DeepSpeed config's "activation_checkpointing" section reaches `deepspeed.checkpointing`.

Two gloo ranks at tensor-parallel size 2, a 2-layer GPT (hidden 64) with full recomputation
and dropout on, configured as `initialize_megatron` configures it (`validate_args` on the flags
plus a config section, then `use_deepspeed_activation_checkpointing(args)`):
- `"partition_activations": true`: what DeepSpeed keeps for backward of each recomputed layer
  is this rank's half of its input (the two halves are the input kept whole without it), and
  the loss and every gradient equal those of the run without partitioning and of the run
  without recomputation, exactly;
- `"cpu_checkpointing": true` sets DeepSpeed's `CPU_CHECKPOINT` and keeps the halves on the
  CPU (the only device here, so that much is what this machine can observe), same gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.settled_args import with_settled
from tests.core.spawn_checks import BODY

SEQ, BATCH, HIDDEN = 16, 2, 64
FLAGS = (
    f"--num-layers 2 --hidden-size {HIDDEN} --num-attention-heads 4 --seq-length {SEQ} "
    "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --tensor-model-parallel-size 2 "
    "--use-cpu-initialization --checkpoint-activations --deepspeed "
    "--deepspeed-activation-checkpointing"
).split()


def _args(section: dict):
    """Validated args for FLAGS with `section` as the config's "activation_checkpointing"."""
    from megatron.arguments import build_parser, typed_flags, validate_args

    parser = build_parser()
    args = parser.parse_args(FLAGS)
    args.deepspeed_config_dict = {"activation_checkpointing": section}
    args = validate_args(args, dist.get_world_size(), typed_flags(parser, FLAGS))
    return with_settled(args, padded_vocab_size=128)


def _checkpoint_nodes(loss: torch.Tensor) -> list:
    """The backward nodes of DeepSpeed's CheckpointFunction in `loss`'s graph."""
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "deepspeed_saved_tensors"):
            found.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def _kept_activations(loss: torch.Tensor) -> list[torch.Tensor]:
    """Per recomputed layer (last first), the activation DeepSpeed keeps for backward (when
    partitioned, the tensor it saves is emptied and carries the partition as `saved_data`)."""
    kept = []
    for node in _checkpoint_nodes(loss):
        (hidden,) = [t for t in node.deepspeed_saved_tensors if torch.is_floating_point(t)]
        kept.append(getattr(hidden, "saved_data", hidden).detach().clone())
    return kept


def _run(args, recompute: bool):
    """Loss, gradients and kept activations of one forward+backward, configured by `args`."""
    from megatron.config import ModelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.initialize import use_deepspeed_activation_checkpointing
    from megatron.model import GPTModel

    use_deepspeed_activation_checkpointing(args)
    config = ModelConfig.from_args(args)
    config.recompute_granularity = "full" if recompute else None
    torch.manual_seed(0)
    model = GPTModel(config)
    tokens = torch.randint(0, 128, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(11)
    model_parallel_cuda_manual_seed(11)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    kept = _kept_activations(loss)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], kept


def _assert_same_training(run, reference) -> None:
    # Bitwise on purpose: the same layout (tp 2) twice, the recompute replaying the forward's
    # kernels on the same values, partitioning and offloading only moving them.
    assert run[0] == reference[0]
    for grad, expected in zip(run[1], reference[1], strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def _check_partitioned_activations() -> None:
    from deepspeed.runtime.activation_checkpointing import checkpointing

    whole = _run(_args({"partition_activations": False}), recompute=True)
    assert not checkpointing.PARTITION_ACTIVATIONS and checkpointing.num_layers == 2
    partitioned = _run(_args({"partition_activations": True}), recompute=True)
    assert checkpointing.PARTITION_ACTIVATIONS and not checkpointing.CPU_CHECKPOINT
    plain = _run(_args({"partition_activations": False}), recompute=False)
    assert plain[2] == [] and len(whole[2]) == len(partitioned[2]) == 2
    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for full, half in zip(whole[2], partitioned[2], strict=True):
        assert full.shape == (SEQ, BATCH, HIDDEN) and half.shape == (SEQ * BATCH * HIDDEN // 2,)
        torch.testing.assert_close(half, full.flatten().chunk(2)[rank], rtol=0, atol=0)
        halves = [torch.empty_like(half) for _ in range(2)]
        dist.all_gather(halves, half, group=group)
        torch.testing.assert_close(torch.cat(halves), full.flatten(), rtol=0, atol=0)
    _assert_same_training(partitioned, whole)
    _assert_same_training(partitioned, plain)


def _check_cpu_checkpointing() -> None:
    from deepspeed.runtime.activation_checkpointing import checkpointing

    section = {"partition_activations": True, "cpu_checkpointing": True}
    offloaded = _run(_args(section), recompute=True)
    assert checkpointing.CPU_CHECKPOINT and checkpointing.PARTITION_ACTIVATIONS
    assert [half.device.type for half in offloaded[2]] == ["cpu", "cpu"]
    assert all(half.numel() == SEQ * BATCH * HIDDEN // 2 for half in offloaded[2])
    _assert_same_training(offloaded, _run(_args({}), recompute=True))
    assert not checkpointing.CPU_CHECKPOINT


SPAWN_WORLD_SIZES = [2]


def spawn_body(checks, rank: int, world: int) -> None:
    """The checks at tp 2, on DeepSpeed's communication backend (it adopts the gloo group)."""
    import deepspeed

    from megatron.core.tensor_parallel import random as tp_random

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(world, 1)
    try:
        checks.run("partitioned activations", _check_partitioned_activations)
        checks.run("cpu checkpointing", _check_cpu_checkpointing)
    finally:
        tp_random.use_builtin_checkpointing()
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's check outcomes in the session's 2-rank world."""
    return spawned_suite[__name__][2]


def test_partition_activations_from_the_config_keeps_half_and_trains_the_same(spawned):
    """The section's partition_activations: each rank keeps its half; loss and grads exact."""
    spawned.assert_ok("partitioned activations")


def test_cpu_checkpointing_from_the_config_keeps_the_halves_on_the_cpu(spawned):
    """The section's cpu_checkpointing: DeepSpeed's CPU_CHECKPOINT on, halves on the CPU."""
    spawned.assert_ok("cpu checkpointing")


def test_spawned_body_ran_every_check(spawned):
    """Nothing escaped the checks, and every check has a test."""
    expected = {"partitioned activations", "cpu checkpointing"}
    assert spawned.names() == expected, spawned.per_rank[0].get(BODY)
