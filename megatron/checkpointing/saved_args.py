"""The flags a checkpoint was saved with, read before anything is built (`--use-checkpoint-args`).

Every layout keeps the saving run's `args` (and `checkpoint_version`) in each metadata file:
Megatron's per-rank `model_optim_rng.pt`, torch_dist's `common.pt`, DeepSpeed's
`mp_rank_XX_model_states.pt` (ZeRO-3: `zero_pp_rank_0_mp_rank_XX_model_states.pt`). The first
of them is read here, tensors memory-mapped and never executed, by any process: no
torch.distributed, no parallel groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megatron.checkpointing.checks import CheckpointError
from megatron.checkpointing.dist_checkpoint import (
    DistCheckpointError,
    is_dist_checkpoint,
    read_common,
)
from megatron.checkpointing.file_format import MEGATRON_FILENAME, args_dict, load_file
from megatron.checkpointing.layouts import LocatedCheckpoint
from megatron.checkpointing.save_load import find_checkpoint


@dataclass(frozen=True)
class SavedArgs:
    """A checkpoint's saved flags and where they come from."""

    args: dict[str, Any]
    path: str
    """The file they were read from."""
    version: float
    """Its `checkpoint_version` (0 when absent, as Megatron reads it)."""


def read_saved_args(load: str, universal: bool = False) -> SavedArgs | None:
    """The flags saved in the checkpoint `--load` names (its trackers' newest); None when
    `load` holds no checkpoint. `universal`: the one of `latest_universal`."""
    found = find_checkpoint(load, universal) if os.path.isdir(load) else None
    if found is None:
        return None
    try:
        path, contents = _metadata_file(found)
    except (FileNotFoundError, RuntimeError) as error:  # missing or unreadable: one line
        raise CheckpointError(str(error)) from None
    saved = args_dict(contents.get("args"))
    if not saved:
        raise CheckpointError(f"{path} holds no saved arguments (`args`)")
    return SavedArgs(saved, path, float(contents.get("checkpoint_version", 0)))


def _metadata_file(found: LocatedCheckpoint) -> tuple[str, dict[str, Any]]:
    """(path, contents) of the first file of `found` that carries the run's metadata."""
    directory = found.directory
    if found.layout == "megatron" and is_dist_checkpoint(directory):
        try:
            return read_common(directory)
        except DistCheckpointError as error:
            raise CheckpointError(str(error)) from None
    if found.layout == "megatron":
        names = sorted(name for name in os.listdir(directory) if name.startswith("mp_rank_"))
        if not names:
            raise CheckpointError(f"{directory} holds no rank file (mp_rank_*)")
        path = os.path.join(directory, names[0], MEGATRON_FILENAME)
        return path, load_file(path, mmap=True)
    from megatron.checkpointing.deepspeed_engine import DEEPSPEED_SAFE_GLOBALS

    path = os.path.join(directory, "mp_rank_00_model_states.pt")
    zero3 = os.path.join(directory, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if not os.path.isfile(path) and os.path.isfile(zero3):
        path = zero3
    return path, load_file(path, mmap=True, extra_globals=DEEPSPEED_SAFE_GLOBALS)
