"""Checkpoints: save and load in Megatron's or DeepSpeed's layout, and the files' formats.

- `save_load.py`: `save_checkpoint()` / `load_checkpoint()` / `find_checkpoint()`; `checks.py`:
  whether a checkpoint fits the run; `dist_checkpoint.py`, `async_save.py`: the torch_dist
  format (torch.distributed.checkpoint) and its background saves.
- `commit.py`: how a checkpoint is published (staging directory, commit journal, trackers).
- `disk.py`: free space before a save, one-line reasons when a write fails.
- `deepspeed_engine.py`: the DeepSpeed engine's side of saving and loading.
- `layouts.py`: finding and reading either layout; `file_format.py`: what a file holds;
  `saved_args.py`: the flags a checkpoint was saved with (`--use-checkpoint-args`).
- `shards.py`, `shapes.py`: tensor-parallel (re)sharding and model shapes, for the tools;
  `pipeline_stages.py`: which layers each pipeline stage (virtual ones too) holds.
- `huggingface.py`: GPT-2 weights to and from Hugging Face `transformers`.
- `rng_state.py`, `train_state.py`: the RNG states and the counters a checkpoint carries.

Megatron's import path is kept: `from megatron.checkpointing import save_checkpoint`.
"""

from megatron.checkpointing.disk import CheckpointSaveError
from megatron.checkpointing.save_load import (
    CheckpointError,
    check_checkpoint_args,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron.checkpointing.train_state import TrainState

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "TrainState",
    "check_checkpoint_args",
    "find_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
