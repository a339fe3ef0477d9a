"""Compare two checkpoint directories leaf by leaf (tensors bitwise), ignoring `args`."""

from __future__ import annotations

import os
import shutil
from enum import Enum
from typing import Any

import numpy as np
import torch

from megatron.checkpointing import commit as checkpoint_commit
from megatron.checkpointing.deepspeed_engine import SafeCheckpointEngine

IGNORED_KEYS = {"args"}
"""The flags differ between a straight run and a stopped-and-resumed one (--exit-interval)."""


def raw_trackers(root: str) -> tuple[str | None, str | None]:
    """The text of DeepSpeed's `latest` and of Megatron's tracker file as on disk (None: absent)."""
    texts = []
    for name in (checkpoint_commit.DEEPSPEED_TRACKER_FILENAME, checkpoint_commit.TRACKER_FILENAME):
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path) as handle:
                texts.append(handle.read())
        else:
            texts.append(None)
    return texts[0], texts[1]


def load_any(path: str) -> Any:
    """A Megatron- or DeepSpeed-written file, read weights-only."""
    return SafeCheckpointEngine(None).load(path, map_location="cpu")


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts/lists/tuples into {path: leaf}."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in IGNORED_KEYS:
                continue
            out.update(leaves(item, f"{prefix}/{key}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for index, item in enumerate(value):
            out.update(leaves(item, f"{prefix}[{index}]"))
        return out
    if hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, np.ndarray, Enum)):
        return leaves(vars(value), prefix)  # e.g. DeepSpeed's LossScaler objects
    return {prefix: value}


def checkpoint_files(directory: str) -> list[str]:
    """Every `.pt` file under `directory`, relative paths, sorted."""
    found = []
    for root, _, files in os.walk(directory):
        for name in files:
            if name.endswith(".pt"):
                found.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(found)


def differences(first: str, second: str) -> list[str]:
    """What differs between two checkpoint directories (empty when identical)."""
    names = checkpoint_files(first)
    if names != checkpoint_files(second):
        return [f"files differ: {names} vs {checkpoint_files(second)}"]
    problems = []
    for name in names:
        a = leaves(load_any(os.path.join(first, name)))
        b = leaves(load_any(os.path.join(second, name)))
        if a.keys() != b.keys():
            problems.append(f"{name}: keys differ {sorted(set(a) ^ set(b))[:5]}")
            continue
        for key, value in a.items():
            other = b[key]
            if isinstance(value, torch.Tensor):
                same = isinstance(other, torch.Tensor) and torch.equal(value, other)
            elif isinstance(value, np.ndarray):
                same = np.array_equal(value, other)
            else:
                same = value == other or (value != value and other != other)  # NaN == NaN
            if not same:
                problems.append(f"{name}{key} differs")
    return problems


def rolled_back(save: str, iteration: int, into: str) -> str:
    """A copy of `save` holding only its checkpoint of `iteration`, trackers pointing at it
    (what a user does to go back to an earlier checkpoint)."""
    tag = f"global_step{iteration}"
    deepspeed_layout = os.path.isdir(os.path.join(save, tag))
    name = tag if deepspeed_layout else f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(save, name), os.path.join(into, name))
    checkpoint_commit.write_tracker(
        os.path.join(into, checkpoint_commit.TRACKER_FILENAME), str(iteration)
    )
    if deepspeed_layout:
        checkpoint_commit.write_tracker(
            os.path.join(into, checkpoint_commit.DEEPSPEED_TRACKER_FILENAME), tag
        )
    return into
