"""Every random generator a training step draws from, captured and restored for checkpoints.

A resumed run must drop out exactly the activations the uninterrupted run would have, so a
checkpoint carries Python's `random`, numpy's, torch's CPU generator, the CUDA generator when
a GPU is present, and the model-parallel streams of the RNG tracker (Megatron's keys:
`random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state`,
`rng_tracker_states`). States differ per rank, so a file holds one entry per rank of a group
(Megatron's Megatron-layout files: per data-parallel rank).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import get_cuda_rng_tracker


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Make every generator continue from `state` (as written by `capture_rng_state`)."""
    random.setstate(_as_tuple(state["random_rng_state"]))
    np.random.set_state(_as_tuple(state["np_rng_state"]))
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker_states = state.get("rng_tracker_states")
    if tracker_states:
        get_cuda_rng_tracker().set_states(tracker_states)


def _as_tuple(value: Any) -> tuple:
    # random.setstate wants nested tuples; a round trip through some formats yields lists.
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) if isinstance(v, list) else v for v in value)
    return value


def gather_rng_states(group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """The generator states of every rank of `group`, in group-rank order (a collective)."""
    state = capture_rng_state()
    if not dist.is_initialized():
        return [state]
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return states
