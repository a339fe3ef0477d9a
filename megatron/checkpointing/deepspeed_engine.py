"""Checkpoints through the DeepSpeed engine: crash-safe saving and code-free loading.

`engine.save_checkpoint` writes into the staging directory of `megatron.checkpointing.commit`
(tag `global_step{N}.partial`) with `save_latest=False`; every file is fsynced by the rank
that wrote it; the directory is renamed to `global_step{N}` and both trackers (DeepSpeed's
`latest`, Megatron's `latest_checkpointed_iteration.txt`) are written last. The engine's
checkpoint I/O goes through `SafeCheckpointEngine`: `torch.load(weights_only=True)` with only
the few DeepSpeed types its optimizer files hold allow-listed.

With DeepSpeed-MoE the engine writes, into the same staging tag and through the same
checkpoint engine, one file per expert of each MoE layer (`layer_{m}_expert_{e}_mp_rank_TT_
model_states.pt`, e its global number, written by the expert-parallel rank holding it) and,
at ZeRO-0, one optimizer file per expert-parallel rank (`expp_rank_{r}_mp_rank_TT_optim_
states.pt`); so a checkpoint is published with every expert or not at all. Weights in
Megatron's layout hold every expert under its global number; `this_ranks_experts` picks the
ones this rank holds.

This is one of the few modules that import DeepSpeed.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from deepspeed.checkpoint.constants import (
    ORIGINAL_VOCAB_SIZE,
    PADDED_VOCAB_SIZE,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)
from deepspeed.moe.layer import MoE
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import groups
from deepspeed.utils.tensor_fragment import fragment_address

from megatron.checkpointing import commit as checkpoint_commit
from megatron.checkpointing.disk import describe_failure, save_torch_file, tensor_bytes
from megatron.checkpointing.file_format import SAFE_GLOBALS
from megatron.model.sharding import model_splits

DEEPSPEED_SAFE_GLOBALS = [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def tag_for(iteration: int) -> str:
    """DeepSpeed's tag for `iteration` (Megatron-DeepSpeed's naming)."""
    return f"global_step{iteration}"


class SafeCheckpointEngine:
    """Wraps the engine's checkpoint engine: fsynced saves that keep failures, weights-only loads.

    A write that fails (full disk, quota, permissions) does not raise inside the engine, whose
    save is full of collectives the other ranks are waiting in: the first failure is kept,
    later writes are skipped, and `take_failure` reports it once the engine's save returns.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._failure: tuple[OSError, int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def record_failure(self, error: OSError, size: int = 0) -> None:
        """Keep the first failed write of this save (`size`: bytes it was writing)."""
        if self._failure is None:
            self._failure = (error, size)

    def take_failure(self, save_dir: str) -> str | None:
        """The line saying why this save failed, or None; clears it for the next save."""
        failure, self._failure = self._failure, None
        return None if failure is None else describe_failure(failure[0], save_dir, failure[1])

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create a checkpoint directory; a failure is kept, not raised."""
        try:
            self._inner.makedirs(path, exist_ok=exist_ok)
        except OSError as error:
            self.record_failure(error)

    def save(self, state_dict: dict, path: str) -> None:
        """Write `state_dict` to `path` and flush it to disk; a failure is kept, not raised."""
        if self._failure is not None:
            return
        try:
            if isinstance(self._inner, TorchCheckpointEngine):
                save_torch_file(
                    state_dict,
                    path,
                    _use_new_zipfile_serialization=self._inner.zipfile_serialization,
                )
            else:
                self._inner.save(state_dict, path)
                checkpoint_commit.fsync_path(path)
        except OSError as error:
            self.record_failure(error, tensor_bytes(state_dict))

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read `path` without executing code from it."""
        with torch.serialization.safe_globals(SAFE_GLOBALS + DEEPSPEED_SAFE_GLOBALS):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as error:  # noqa: BLE001 - re-raised with the path
                raise RuntimeError(f"cannot read checkpoint file {path}: {error}") from error


def _name_pattern(name: str) -> str:
    """A regex for parameter `name` and its siblings in other layers: every number that is a
    whole component of the name (a layer's, a pipeline layer's, an expert's) matches any."""
    return re.sub(r"(^|\\\.)\d+(?=\\\.)", r"\1\\d+", re.escape(name)) + "$"


def universal_checkpoint_info(args: Any, pipe_module_names: bool) -> dict:
    """What `deepspeed.checkpoint.ds_to_universal` needs to merge our tensor-parallel shards,
    read off the splits the model's layers declare (`megatron.model.sharding.model_splits`).

    Parameter-name patterns (matched from the start of the name) for the vocabulary (its
    padding is stripped; the untied output layer too), parameters whole on every TP rank,
    row-parallel weights (split along dim 1; the rest are column-parallel, split along dim 0),
    and SwiGLU's gate-and-up weight, whose shards hold two sub-parameters each; one pattern
    serves a parameter of every layer. `pipe_module_names`: the module is DeepSpeed's
    `PipelineModule` (numbered layers, `gpt_to_pipeline_name`). DeepSpeed-MoE's experts,
    which DeepSpeed saves in files of their own, are left to it.
    """
    from megatron.config import ModelConfig
    from megatron.model.pipeline import gpt_to_pipeline_name

    config = ModelConfig.from_args(args)
    tied = not config.untie_embeddings_and_output_weights
    categories: dict[str, list[str]] = {
        VOCABULARY_PARAMETER_PATTERNS: [],
        TP_REPLICATED_PARAMETER_PATTERNS: [],
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
        PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [],
    }
    for name, split in model_splits(config, parameters_only=True).items():
        if ".deepspeed_moe.experts." in name:
            continue
        if pipe_module_names:
            name = gpt_to_pipeline_name(name, config.num_layers, tied)
        if split.vocab:
            category = VOCABULARY_PARAMETER_PATTERNS
        elif split.tensor_dim is None:
            category = TP_REPLICATED_PARAMETER_PATTERNS
        elif split.tensor_dim == 1:
            category = PARAMETER_WITH_ROW_PARALLELISM_PATTERNS
        elif split.swiglu:  # each rank's shard is [gate_r; up_r]: merged as [gate; up]
            category = PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0
        else:
            continue  # column-parallel: ds_to_universal's default
        pattern = _name_pattern(name)
        if pattern not in categories[category]:
            categories[category].append(pattern)
    info = {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        VOCABULARY_PARAMETER_PATTERNS: categories.pop(VOCABULARY_PARAMETER_PATTERNS),
        ORIGINAL_VOCAB_SIZE: args.true_vocab_size,
        PADDED_VOCAB_SIZE: args.padded_vocab_size,
    }
    if args.tensor_model_parallel_size == 1:
        return info
    # DeepSpeed refuses a pattern that matches no parameter: only the model's are listed.
    info.update((key, patterns) for key, patterns in categories.items() if patterns)
    return info


def install_safe_checkpoint_engine(engine: Any) -> SafeCheckpointEngine:
    """Route `engine`'s checkpoint reads and writes through `SafeCheckpointEngine`."""
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        safe = SafeCheckpointEngine(engine.checkpoint_engine)
        engine.checkpoint_engine = safe
        copy_scripts = getattr(engine, "_copy_recovery_script", None)
        if copy_scripts is not None:
            # Rank 0 copies zero_to_fp32.py with shutil outside the checkpoint engine, just
            # before the engine's closing barrier: a failure there must not skip the barrier.
            def copy_or_keep_failure(save_path: str) -> None:
                try:
                    copy_scripts(save_path)
                except OSError as error:
                    safe.record_failure(error)

            engine._copy_recovery_script = copy_or_keep_failure
    return engine.checkpoint_engine


def save_deepspeed(
    engine: Any,
    save_dir: str,
    iteration: int,
    client_state: dict,
    args: Any,
    pipe_module_names: bool,
    previous: tuple[str, int] | None = None,
) -> None:
    """Save through the engine (a collective), publishing the tag only when complete.

    `previous`: the newest checkpoint and its size, for the free-space check.
    """
    safe = install_safe_checkpoint_engine(engine)
    # Read from the module by both of the engine's save paths (its MoE path refuses the key in
    # client state).
    setattr(
        engine.module, UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info(args, pipe_module_names)
    )
    tag = tag_for(iteration)
    final = os.path.join(save_dir, tag)
    staging = checkpoint_commit.begin(final, previous)
    engine.save_checkpoint(
        save_dir, tag=os.path.basename(staging), client_state=client_state, save_latest=False
    )
    trackers = {
        checkpoint_commit.DEEPSPEED_TRACKER_FILENAME: tag,
        checkpoint_commit.TRACKER_FILENAME: str(iteration),
    }
    checkpoint_commit.commit(final, trackers, safe.take_failure(save_dir))


def load_deepspeed(
    engine: Any, load_dir: str, tag: str, load_optimizer: bool
) -> tuple[str | None, dict]:
    """Load `tag` into the engine; returns (path, client state)."""
    install_safe_checkpoint_engine(engine)
    path, client = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=load_optimizer,
        load_lr_scheduler_states=load_optimizer,
        load_module_only=not load_optimizer,
    )
    return path, client or {}


def this_ranks_experts(module: torch.nn.Module, flat: dict) -> dict:
    """Megatron-layout weights (every MoE expert under its global number) -> what `module`
    holds: rank r of an expert-parallel group of P holds global experts r*E/P ... (r+1)*E/P - 1
    of each E-expert layer, numbered from 0 (as DeepSpeed's `load_moe_state_dict` renumbers).

    Another rank's experts are dropped; numbers past a layer's experts are kept, so that the
    caller reports them as unexpected.
    """
    layers = {
        f"{name}.deepspeed_moe.experts.deepspeed_experts.": layer
        for name, layer in module.named_modules()
        if isinstance(layer, MoE)
    }
    held = {}
    for key, tensor in flat.items():
        prefix = next((prefix for prefix in layers if key.startswith(prefix)), None)
        if prefix is None:
            held[key] = tensor
            continue
        layer = layers[prefix]
        number, _, rest = key.removeprefix(prefix).partition(".")
        first = groups._get_expert_parallel_rank(layer.expert_group_name) * layer.num_local_experts
        if first <= int(number) < first + layer.num_local_experts:
            held[f"{prefix}{int(number) - first}.{rest}"] = tensor
        elif int(number) >= layer.num_experts:
            held[key] = tensor
    return held


def global_expert_names(module: torch.nn.Module) -> dict[str, str]:
    """`module`'s state-dict names of DeepSpeed-MoE experts -> the same names with the
    experts' global numbers (rank r of an expert-parallel group of P holds experts r*E/P ...)."""
    renamed = {}
    names = list(module.state_dict())
    for layer_name, layer in module.named_modules():
        if not isinstance(layer, MoE):
            continue
        prefix = f"{layer_name}.deepspeed_moe.experts.deepspeed_experts."
        first = groups._get_expert_parallel_rank(layer.expert_group_name) * layer.num_local_experts
        for name in names:
            if name.startswith(prefix):
                number, _, rest = name.removeprefix(prefix).partition(".")
                renamed[name] = f"{prefix}{first + int(number)}.{rest}"
    return renamed


def refresh_master_weights(engine: Any) -> None:
    """After writing into `engine.module`, copy the weights into the optimizer's fp32 copy."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()
