"""`--async-save` in a 4-rank gloo world: an FSDP2 run's background save (each rank's own slices
staged by DCP's stager, written by a thread over a gloo group of its own) commits the checkpoint
a synchronous save writes, and a writer failure on one rank (an error other than DCP's or the
disk's, at the write) fails the save on every rank in one line, leaving no checkpoint and no
tracker, while the ranks stay in step for the next save.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.core.spawn_checks import BODY
from tests.core.test_sharded_optimizer_state import _layout, _llama, _whole
from tests.distributed import shared_directory

FAILING_RANK = 2


def _stepped(layout) -> tuple:  # noqa: ANN001
    model, optimizer = _llama(1, layout)
    tokens = torch.randint(0, 130, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    optimizer.step()
    return model, optimizer


def _save_in_background(saves, root: str, iteration: int, model, optimizer, args) -> None:  # noqa: ANN001
    """What `save_load._save_dist_files` does with `--async-save`: staged, written later."""
    from megatron.checkpointing import commit as checkpoint_commit
    from megatron.checkpointing.dist_checkpoint import DCP_METADATA, save_dist_checkpoint
    from megatron.checkpointing.layouts import checkpoint_directory
    from megatron.checkpointing.whole_tensors import whole_tensors

    final = checkpoint_directory(root, iteration)
    staging = checkpoint_commit.begin(final)
    future = save_dist_checkpoint(
        staging, whole_tensors(model, optimizer), {}, args, background=saves.background()
    )
    saves.started(future, final, iteration, DCP_METADATA)


def _check_background_save_commits_what_a_synchronous_one_writes(world: int) -> None:
    from megatron.checkpointing.async_save import AsyncSaves
    from megatron.checkpointing.dist_checkpoint import load_dist_checkpoint
    from megatron.checkpointing.layouts import checkpoint_directory
    from megatron.checkpointing.whole_tensors import whole_tensors

    parallel_state.initialize_model_parallel(1, 1)
    layout = _layout(world, "optim_grads_params")
    args = argparse.Namespace(num_layers=2, layout=layout)
    model, optimizer = _stepped(layout)
    saves = AsyncSaves()
    with shared_directory() as root:
        _save_in_background(saves, root, 1, model, optimizer, args)
        saves.finish()
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as tracker:
            assert tracker.read() == "1"
        loaded, loaded_optimizer = _llama(2, layout)
        load_dist_checkpoint(
            checkpoint_directory(root, 1), whole_tensors(loaded, loaded_optimizer), args
        )
    named = dict(model.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(_whole(param), _whole(named[name])), name
        saved = optimizer.state[named[name]]["exp_avg_sq"]
        assert torch.equal(_whole(loaded_optimizer.state[param]["exp_avg_sq"]), _whole(saved))


def _check_a_writer_failure_on_one_rank_fails_the_save_everywhere(world: int) -> None:
    import torch.distributed.checkpoint as dcp

    from megatron.checkpointing.async_save import AsyncSaves
    from megatron.checkpointing.commit import CheckpointSaveError
    from megatron.checkpointing.layouts import checkpoint_directory

    parallel_state.initialize_model_parallel(1, 1)
    layout = _layout(world, "optim_grads_params")
    args = argparse.Namespace(num_layers=2, layout=layout)
    model, optimizer = _stepped(layout)
    saves = AsyncSaves()
    original = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):  # noqa: ANN001, ANN202
        raise KeyError("the writer's own bug")  # neither DCP's nor the disk's error type

    with shared_directory() as root:
        try:
            if dist.get_rank() == FAILING_RANK:
                dcp.FileSystemWriter.write_data = broken
            _save_in_background(saves, root, 1, model, optimizer, args)
            with pytest.raises(CheckpointSaveError) as failed:
                saves.finish()
            dcp.FileSystemWriter.write_data = original
            message = str(failed.value)
            assert "\n" not in message, message
            assert checkpoint_directory(root, 1) in message and "failed" in message, message
            assert f'rank {FAILING_RANK}: KeyError("the writer\'s own bug")' in message, message
            assert not os.path.exists(checkpoint_directory(root, 1))
            assert not os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))
            # The ranks are in step: the next save (written by every rank now) commits.
            _save_in_background(saves, root, 2, model, optimizer, args)
            saves.finish()
            with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as tracker:
                assert tracker.read() == "2"
        finally:
            dcp.FileSystemWriter.write_data = original


SPAWN_WORLD_SIZES = [4]
CHECKS = {
    "an FSDP2 background save commits what a synchronous save writes": (
        _check_background_save_commits_what_a_synchronous_one_writes
    ),
    f"a writer failure on rank {FAILING_RANK} fails the save on every rank in one line": (
        _check_a_writer_failure_on_one_rank_fails_the_save_everywhere
    ),
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Both checks at DP = world."""
    try:
        for name, fn in CHECKS.items():
            checks.run(name, fn, world)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's worlds, by size."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_async_save(spawned, name: str) -> None:
    """Each check passed on every rank."""
    spawned[4].assert_ok(name)


def test_spawned_body_ran_every_check(spawned) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[4].names() == set(CHECKS), spawned[4].per_rank[0].get(BODY)
