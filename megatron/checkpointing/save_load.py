"""`save_checkpoint` / `load_checkpoint`: Megatron's layout (plain torch) or DeepSpeed's engine.

Megatron layout: `{save}/iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt` with
`args`, `checkpoint_version`, `iteration`, `model` (Megatron's nested `language_model`
dict), `optimizer`, `opt_param_scheduler`, `rng_state` (one entry per data-parallel rank),
`tokens` (Megatron-DeepSpeed's consumed-token count) and our `train_state` counters;
`{save}/latest_checkpointed_iteration.txt` names the newest.
DeepSpeed layout: `{save}/global_step{N}/...` written by `engine.save_checkpoint` with the same
metadata as client state (`rng_state` one entry per global rank), and both `latest` and
Megatron's tracker file. Either way a checkpoint appears under its final name only once every
rank's files are on disk, and the trackers are written last (`megatron.checkpointing.commit`).

Loading reads whichever layout `--load` holds (a DeepSpeed run can start from Megatron-layout
weights and vice versa), checks the model shape and parallel sizes against this run's flags,
and never executes code from a file (`torch.load(weights_only=True)`). An MoE model's
Megatron-layout weights hold every expert, so they load at any `--moe-expert-parallel-size`;
DeepSpeed's own files carry optimizer state split by expert-parallel rank, so resuming one
with its optimizer needs the size it was saved with.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron.atomic_files import atomic_outputs
from megatron.checkpointing import commit as checkpoint_commit
from megatron.checkpointing.async_save import AsyncSaves
from megatron.checkpointing.checks import (
    RESHARD_TOOL,
    CheckpointError,
    check_checkpoint_args,
    check_expert_split,
    check_zero_partitions,
)
from megatron.checkpointing.disk import describe_failure, save_torch_file, tensor_bytes, tree_bytes
from megatron.checkpointing.dist_checkpoint import (
    DCP_METADATA,
    DistCheckpointError,
    first_failure,
    is_dist_checkpoint,
    load_dist_checkpoint,
    read_common,
    save_dist_checkpoint,
)
from megatron.checkpointing.file_format import (
    CHECKPOINT_VERSION,
    HEAD_KEY,
    MEGATRON_FILENAME,
    args_dict,
    checkpoint_directory,
    chunk_keys,
    flatten_model_state,
    load_file,
    model_entries,
    nest_model_state,
    plain_args,
    rank_file,
)
from megatron.checkpointing.layouts import LocatedCheckpoint, locate_checkpoint
from megatron.checkpointing.pipeline_stages import model_chunks
from megatron.checkpointing.rng_state import gather_rng_states, restore_rng_state
from megatron.checkpointing.sharded_states import (
    has_sharded_chunks,
    is_sharded,
    load_full_model_state,
    load_full_optimizer_state,
    name_keyed_optimizer_state,
    optimizer_file,
)
from megatron.checkpointing.train_state import TrainState
from megatron.checkpointing.whole_tensors import WholeTensors, whole_tensors
from megatron.core import parallel_state
from megatron.utils import print_rank_0


def _this_rank_file(directory: str) -> str:
    expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
    return rank_file(
        directory,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_rank() if expert_parallel else None,
    )


def _writes_megatron_file() -> bool:
    """The first of the ranks holding the same weights: data (and context) rank 0, or with
    Megatron-LM's expert parallelism one rank of each (tensor-parallel rank, expert-parallel
    rank) pair that occurs: the first lcm(TP, EP) ranks of the stage (rank i of a stage has
    tensor rank i mod TP and expert rank i mod EP, so those hold every pair once)."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep > 1:
        state = parallel_state.get_parallel_state()
        stage_size = (
            len(state.data_ranks) * state.sequence_split_size * (state.tensor_model_parallel_size)
        )
        return dist.get_rank() % stage_size < math.lcm(state.tensor_model_parallel_size, ep)
    return parallel_state.get_sequence_data_parallel_rank() == 0


def find_checkpoint(root: str, universal: bool = False) -> LocatedCheckpoint | None:
    """The newest complete checkpoint under `root` by its trackers, or None if there is none.

    The trackers are read as `checkpoint_commit` defines them (after an interrupted commit they
    name the checkpoint it published); `load_checkpoint` also repairs them on disk first.

    The same rule as the conversion tools (`layouts.locate_checkpoint`): DeepSpeed's
    `latest` first, else Megatron's tracker. `universal`: the checkpoint `ds_to_universal`
    recorded in `latest_universal`.
    """
    if universal:
        tag = checkpoint_commit.read_deepspeed_tag(root, "latest_universal")
        if tag is None:
            raise CheckpointError(
                f"--universal-checkpoint: {root}/latest_universal does not exist; convert the "
                "checkpoint first: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                f"{root}/global_stepN --output_folder {root}/global_stepN_universal"
            )
        match = re.match(r"global_step(\d+)", tag)
        found = LocatedCheckpoint(
            "deepspeed", os.path.join(root, tag), int(match.group(1)) if match else 0, tag=tag
        )
        if not os.path.isdir(found.directory):
            raise CheckpointError(f"{root}/latest_universal names {tag}, but it does not exist")
        return found
    try:
        tag = checkpoint_commit.read_deepspeed_tag(root)
        if tag is None and checkpoint_commit.read_tracker(root) is None:
            return None
        found = locate_checkpoint(root)
    except ValueError as error:  # a tracker or journal that cannot be read, as the tools say
        raise CheckpointError(str(error)) from None
    return found if found.iteration is not None else replace(found, iteration=0)


@dataclass(frozen=True)
class CheckpointTarget:
    """What a save writes and a load fills, as the run's engine describes it
    (`megatron.training.engines`): the format is the engine's choice, made there once."""

    model: Any
    """The DeepSpeed engine, a `PlainTrainer` (maybe over DDP or pipeline chunks), or a module."""
    optimizer: Any
    scheduler: Any
    deepspeed_files: bool
    """DeepSpeed's engine writes and reads its own layout (`engine.save_checkpoint`)."""
    pipe_module_names: bool = False
    """The module is DeepSpeed's `PipelineModule` (`GPTModelPipe` parameter names)."""
    engine_name: str = "plain"
    """Saved in the checkpoint's args (`engine`), e.g. for the optimizer-partition check."""
    background_saves: AsyncSaves = field(default_factory=AsyncSaves)
    """The run's `--async-save` save in flight (the engine's, the same for every target it
    describes), committed before the next save starts."""


def _client_state(
    state,  # noqa: ANN001
    args: argparse.Namespace,
    rng_states: list | None,
    target: CheckpointTarget,
) -> dict:
    saved_args = plain_args(args)
    saved_args.engine = target.engine_name
    # Megatron's tools read the sample counters from the checkpoint's args.
    saved_args.consumed_train_samples = state.consumed_train_samples
    saved_args.consumed_valid_samples = state.consumed_valid_samples
    client = {
        "args": saved_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.iteration,
        # Megatron-DeepSpeed's name for the consumed-token counter.
        "tokens": state.consumed_train_tokens,
        "train_state": asdict(state),
    }
    if rng_states is not None:
        client["rng_state"] = rng_states
    return client


def _unwrap(model) -> torch.nn.Module:  # noqa: ANN001 - PlainTrainer, engine or module
    module = getattr(model, "model", model)
    return getattr(module, "module", module)


def model_states(module: torch.nn.Module) -> dict:
    """Megatron's `model` entry, or `model0`, `model1`, ... for this rank's pipeline chunks
    with virtual stages (each chunk numbering its layers from 0, as Megatron-LM)."""
    return model_entries([nest_model_state(chunk.state_dict()) for chunk in model_chunks(module)])


def load_model_states(module: torch.nn.Module, client: dict, path: str) -> None:
    """Load what `model_states` saved into `module`."""
    chunks = model_chunks(module)
    keys = chunk_keys(len(chunks))
    missing = [key for key in keys if key not in client]
    if missing:
        held = sorted(key for key in client if re.fullmatch(r"model\d*", key))
        raise CheckpointError(
            f"{path} holds {', '.join(held) or 'no model'}, this run's {len(chunks)} model "
            f"chunk(s) per pipeline rank need {', '.join(keys)}; convert it with {RESHARD_TOOL}"
        )
    for chunk, key in zip(chunks, keys):
        if is_sharded(chunk):  # FSDP2: every rank loads the whole weights, keeps its shard
            load_full_model_state(chunk, flatten_model_state(client[key]))
        else:
            chunk.load_state_dict(flatten_model_state(client[key]))


def save_checkpoint(state, target: CheckpointTarget, args: argparse.Namespace) -> None:  # noqa: ANN001
    """Save `state.iteration` to `--save` in the target's layout (a collective on all ranks)."""
    iteration = state.iteration
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save}")
    if getattr(args, "ckpt_format", "torch") != "torch":
        if not _save_dist_files(state, target, args):
            print_rank_0(
                f"  checkpoint at iteration {iteration:7d} staged, written in the background"
            )
            return
    elif target.deepspeed_files:
        from megatron.checkpointing.deepspeed_engine import save_deepspeed

        rng = None if args.no_save_rng else gather_rng_states()
        client = _client_state(state, args, rng, target)
        save_deepspeed(
            target.model,
            args.save,
            iteration,
            client,
            args,
            target.pipe_module_names,
            previous_checkpoint(args.save),
        )
    else:
        _save_megatron_files(state, target, args)
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {args.save}")


def _save_dist_files(state, target: CheckpointTarget, args: argparse.Namespace) -> bool:  # noqa: ANN001
    """`--ckpt-format torch_dist`: every rank writes its slices through torch.distributed.
    checkpoint into the staging directory, published by the same commit as Megatron's files.
    False when the write went to the background (`--async-save`), committed later."""
    save_optimizer = not args.no_save_optim
    holder = _whole_tensors(target)
    common = _client_state(state, args, None, target)
    if save_optimizer:
        common["opt_param_scheduler"] = target.scheduler.state_dict()
        scaler = _loss_scaler_state(target, holder)
        if scaler is not None:
            common["loss_scaler"] = scaler
    from torch.distributed.checkpoint.api import CheckpointException

    saves = target.background_saves
    saves.finish()  # at most one save in flight: the previous one is committed first
    final = checkpoint_directory(args.save, state.iteration)
    staging = checkpoint_commit.begin(final, previous_checkpoint(args.save))
    background = saves.background() if getattr(args, "async_save", False) else None
    failure = None
    try:
        future = save_dist_checkpoint(
            staging,
            holder,
            common,
            args,
            save_optimizer=save_optimizer,
            save_rng=not args.no_save_rng,
            background=background,
        )
        if future is not None:
            saves.started(future, final, state.iteration, DCP_METADATA)
            return False
    except OSError as error:
        failure = describe_failure(error, args.save, tree_bytes(staging))
    except CheckpointException as error:  # DCP's report of a write that failed on some rank
        failure = f"error: saving {final} failed: {first_failure(error)}"
    trackers = checkpoint_commit.megatron_trackers(str(state.iteration))
    checkpoint_commit.commit(final, trackers, failure)
    return True


def _whole_tensors(target: CheckpointTarget) -> WholeTensors:
    """What a torch_dist save reads and a load fills: the engine's whole tensors."""
    if target.deepspeed_files:
        from megatron.checkpointing.deepspeed_tensors import DeepSpeedWholeTensors

        return DeepSpeedWholeTensors(target.model)
    return whole_tensors(_unwrap(target.model), target.optimizer)


def _loss_scaler_state(target: CheckpointTarget, holder: WholeTensors) -> dict | None:
    if target.deepspeed_files:
        return holder.loss_scaler_state()
    scaler = getattr(target.model, "loss_scaler", None)
    return None if scaler is None else scaler.state_dict()


def _load_loss_scaler_state(target: CheckpointTarget, holder: WholeTensors, saved: dict) -> None:
    if target.deepspeed_files:
        holder.load_loss_scaler_state(saved)
    elif getattr(target.model, "loss_scaler", None) is not None:
        target.model.loss_scaler.load_state_dict(saved)


def _save_megatron_files(state, target: CheckpointTarget, args: argparse.Namespace) -> None:  # noqa: ANN001
    """Megatron's per-rank files, written by data-parallel rank 0 of each TP x PP rank (the
    first of its data x context-parallel ranks: the weights are the same on all of them). An
    FSDP2-sharded run saves torch_dist instead (the argument checks refuse this format for
    it: its whole tensors would be gathered onto every rank)."""
    iteration = state.iteration
    model = target.model
    module = _unwrap(model)
    if has_sharded_chunks(module):
        raise CheckpointError(
            "an FSDP2-sharded run saves --ckpt-format torch_dist only (Megatron's per-rank "
            "files would gather its whole tensors)"
        )
    save_optimizer = not args.no_save_optim
    rng = None if args.no_save_rng else gather_rng_states(_data_parallel_group())
    final = checkpoint_directory(args.save, iteration)
    staging = checkpoint_commit.begin(final, previous_checkpoint(args.save))
    failure = None
    if _writes_megatron_file():
        checkpoint = _client_state(state, args, rng, target)
        checkpoint.update(model_states(module))
        if save_optimizer:
            checkpoint["optimizer"] = target.optimizer.state_dict()
            checkpoint["opt_param_scheduler"] = target.scheduler.state_dict()
            if getattr(model, "loss_scaler", None) is not None:
                checkpoint["loss_scaler"] = model.loss_scaler.state_dict()
        path = _this_rank_file(staging)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with atomic_outputs(path) as (partial,):
                save_torch_file(checkpoint, partial)
        except OSError as error:
            failure = describe_failure(error, args.save, tensor_bytes(checkpoint))
    checkpoint_commit.commit(final, checkpoint_commit.megatron_trackers(str(iteration)), failure)


def previous_checkpoint(save_dir: str) -> tuple[str, int] | None:
    """(directory, size in bytes) of the newest checkpoint in `save_dir`, on rank 0 only.

    A save's free-space check expects the new checkpoint to be as large as this one.
    """
    if (dist.is_initialized() and dist.get_rank() != 0) or not os.path.isdir(save_dir):
        return None
    try:
        found = find_checkpoint(save_dir)
    except (ValueError, OSError):  # an unreadable tracker: the save itself repairs or reports it
        return None
    if found is None or not os.path.isdir(found.directory):
        return None
    return found.directory, tree_bytes(found.directory)


def _data_parallel_group():  # noqa: ANN202
    """The ranks one file's RNG states come from: data (x context) parallel."""
    return parallel_state.get_sequence_data_parallel_group() if dist.is_initialized() else None


def _load_optimizer_state(module, optimizer, client: dict, path: str) -> bool:  # noqa: ANN001
    """Load the optimizer state of a Megatron file (or of `distrib_optim.pt` beside it, from
    a sharded run); either loads into a sharded or an unsharded run. False when it has none."""
    gathered = optimizer_file(path)
    if os.path.isfile(gathered):
        load_full_optimizer_state(module, optimizer, load_file(gathered))
        return True
    if "optimizer" not in client:
        return False
    if has_sharded_chunks(module):  # saved without sharding: each rank takes its shard of it
        try:
            state = name_keyed_optimizer_state(module, optimizer, client["optimizer"], path)
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        load_full_optimizer_state(module, optimizer, state)
        return True
    optimizer.load_state_dict(client["optimizer"])
    return True


def _train_state(client: dict, iteration: int) -> TrainState:
    saved = dict(client.get("train_state") or {})
    if not saved:  # Megatron's own files: iteration at the top, sample counters in args
        saved_args = args_dict(client.get("args"))
        for name in ("consumed_train_samples", "consumed_valid_samples"):
            saved[name] = client.get(name, saved_args.get(name, 0))
        saved["consumed_train_tokens"] = client.get("tokens", 0)
    saved["iteration"] = client.get("iteration", iteration)
    names = {field.name for field in fields(TrainState)}
    return TrainState(**{k: v for k, v in saved.items() if k in names})


def _restore_rng(client: dict, group_rank: int, group_size: int, path: str) -> None:
    states = client.get("rng_state")
    if states is None:
        print_rank_0(f"> {path} has no RNG state; random generators keep their seeds")
        return
    if isinstance(states, dict):
        states = [states]
    if len(states) != group_size:
        print_rank_0(
            f"> {path} holds RNG states of {len(states)} ranks, this run has {group_size}: "
            "random generators keep their seeds"
        )
        return
    restore_rng_state(states[group_rank])


def _continue_schedule(scheduler, state) -> None:  # noqa: ANN001
    # Without saved scheduler state, put the learning rate where the schedule has reached.
    if state.consumed_train_samples:
        scheduler.step(
            increment=state.consumed_train_samples, token_num=state.consumed_train_tokens
        )
        print_rank_0(
            f"> no optimizer/scheduler state loaded; learning-rate schedule continues at "
            f"sample {state.consumed_train_samples}"
        )


def _metadata(found: LocatedCheckpoint) -> tuple[str, dict, str | None]:
    """(file, contents, missing) holding this rank's weights (Megatron) or the run's metadata
    (DS). Where this rank's Megatron file does not exist (another split), the first rank's file
    stands in (`missing` names the absent one), so that the layout check that follows refuses
    in the same line on every rank."""
    if found.layout == "megatron" and is_dist_checkpoint(found.directory):
        try:
            return (*read_common(found.directory), None)
        except DistCheckpointError as error:
            raise CheckpointError(str(error)) from None
    if found.layout == "megatron":
        path = _this_rank_file(found.directory)
        if os.path.isfile(path):
            return path, load_file(path), None
        names = sorted(n for n in os.listdir(found.directory) if n.startswith("mp_rank_"))
        if not names:
            raise CheckpointError(f"{found.directory} holds no rank file ({path} does not exist)")
        other = os.path.join(found.directory, names[0], MEGATRON_FILENAME)
        return other, load_file(other, mmap=True), path
    from megatron.checkpointing.deepspeed_engine import DEEPSPEED_SAFE_GLOBALS

    # Every model-parallel rank's file carries the same metadata; this one always exists
    # (named per data-parallel rank too at ZeRO-3, where rank 0's has it).
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    path = os.path.join(found.directory, f"mp_rank_{tp_rank:02d}_model_states.pt")
    zero3 = os.path.join(found.directory, f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt")
    if not os.path.isfile(path) and os.path.isfile(zero3):
        path = zero3
    return path, load_file(path, mmap=True, extra_globals=DEEPSPEED_SAFE_GLOBALS), None


def _refuse_missing_rank_file(missing: str, saved: dict) -> None:
    """This rank's file is absent although the saved layout matches ours: say so, with the
    sizes the checkpoint was saved at."""
    sizes = [
        f"{flag} {saved.get(name)}"
        for flag, name in (
            ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
            ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
            ("--expert-model-parallel-size", "expert_model_parallel_size"),
        )
        if saved.get(name) is not None
    ]
    raise CheckpointError(
        f"{missing} does not exist (the checkpoint was saved with {', '.join(sizes)}): a rank "
        "file is missing"
    )


def _pipeline_weights(flat: dict, args: argparse.Namespace) -> dict:
    """Megatron-layout names of one stage (local layer numbers) -> `GPTModelPipe` names."""
    from megatron.model.pipeline import EMBEDDING_KEY, gpt_to_pipeline_name

    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    offset = parallel_state.get_pipeline_model_parallel_rank() * (args.num_layers // pp_size)
    renamed = {}
    for name, tensor in flat.items():
        if name.startswith(HEAD_KEY + "."):
            renamed[f"tied_modules.{EMBEDDING_KEY}.word_embeddings." + name.split(".")[-1]] = tensor
            continue
        match = re.match(r"(language_model\.encoder\.layers\.)(\d+)(\..+)", name)
        if match:
            name = f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}"
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        renamed[gpt_to_pipeline_name(name, args.num_layers, tied)] = tensor
    return renamed


def _load_weights(
    target: CheckpointTarget, flat: dict, args: argparse.Namespace, path: str
) -> None:
    """Load model weights saved in the other layout (no optimizer state) into this run."""
    module = _unwrap(target.model)
    if target.pipe_module_names:
        flat = _pipeline_weights(flat, args)
    if getattr(args, "moe", False):
        from megatron.checkpointing.deepspeed_engine import this_ranks_experts

        flat = this_ranks_experts(module, flat)
    expected = module.state_dict()
    unexpected = sorted(set(flat) - set(expected))
    # A later pipeline stage holds an (unused) copy of the position embeddings.
    missing = sorted(k for k in set(expected) - set(flat) if "position_embeddings" not in k)
    if unexpected or missing:
        raise CheckpointError(
            f"{path} does not match this model (unexpected {unexpected[:3]}, missing "
            f"{missing[:3]}); convert it with {RESHARD_TOOL}"
        )
    for name, tensor in flat.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, this model "
                f"{tuple(expected[name].shape)}"
            )
    module.load_state_dict(flat, strict=False)
    if target.deepspeed_files:
        from megatron.checkpointing.deepspeed_engine import refresh_master_weights

        refresh_master_weights(target.model)


def load_checkpoint(target: CheckpointTarget, args: argparse.Namespace) -> TrainState:
    """Resume from `--load` if it holds a checkpoint; returns the `TrainState` to continue.

    As Megatron: `--finetune` and `release` checkpoints load weights only and start at
    iteration 0; `--no-load-optim` / `--no-load-rng` skip those parts. A missing or empty
    `--load` directory starts a fresh run and says so.
    """
    if not args.load:
        return TrainState()
    universal = getattr(args, "universal_checkpoint", False)
    found = None
    if os.path.isdir(args.load):
        # A run killed inside a save left its trackers to finish: rank 0 does so before reads.
        try:
            checkpoint_commit.recover(args.load)
        except ValueError as error:  # a commit journal that cannot be read
            raise CheckpointError(str(error)) from None
        found = find_checkpoint(args.load, universal)
    if found is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise CheckpointError(
                f"--exit-on-missing-checkpoint: no checkpoint in --load {args.load} (a typo in "
                "the path would otherwise start training from scratch)"
            )
        print_rank_0(f"> no checkpoint found in {args.load}; starting from iteration 0")
        return TrainState()
    path, client, missing = _metadata(found)
    any_layout = found.layout == "megatron" and is_dist_checkpoint(found.directory)
    check_checkpoint_args(args_dict(client.get("args")), args, path, any_layout)
    if missing is not None:
        _refuse_missing_rank_file(missing, args_dict(client.get("args")))
    fresh = args.finetune or found.release
    load_optimizer = not (args.no_load_optim or fresh)
    optimizer_loaded = rng_restored = False
    deepspeed_holder = None  # a DeepSpeed engine that loaded a torch_dist checkpoint
    model, optimizer, scheduler = target.model, target.optimizer, target.scheduler
    if target.deepspeed_files and found.layout == "deepspeed":
        from megatron.checkpointing.deepspeed_engine import load_deepspeed

        if load_optimizer:
            check_expert_split(args_dict(client.get("args")), args, path)
            if not universal:
                check_zero_partitions(
                    args_dict(client.get("args")), args, found, target.pipe_module_names
                )
        _, client = load_deepspeed(model, args.load, found.tag, load_optimizer)
        optimizer_loaded = load_optimizer
    elif found.layout == "deepspeed":
        if client.get("module") is None:
            raise CheckpointError(
                f"{path} was saved by DeepSpeed's pipeline engine; convert it to Megatron's "
                f"layout with {RESHARD_TOOL} --load {args.load} --save NEW_DIR"
            )
        _load_weights(target, dict(client["module"]), args, path)
    elif is_dist_checkpoint(found.directory):
        rng_restored = not (fresh or args.no_load_rng)
        holder = _whole_tensors(target)
        try:
            optimizer_loaded = load_dist_checkpoint(
                found.directory,
                holder,
                args,
                load_optimizer=load_optimizer,
                load_rng=rng_restored,
            )
        except DistCheckpointError as error:
            raise CheckpointError(str(error)) from None
        if optimizer_loaded:
            scheduler.load_state_dict(client["opt_param_scheduler"])
            if "loss_scaler" in client:
                _load_loss_scaler_state(target, holder, client["loss_scaler"])
        if target.deepspeed_files:
            deepspeed_holder = holder
    elif target.deepspeed_files:
        _load_weights(target, flatten_model_state(client["model"]), args, path)
    else:
        module = _unwrap(model)
        load_model_states(module, client, path)
        if load_optimizer and _load_optimizer_state(module, optimizer, client, path):
            scheduler.load_state_dict(client["opt_param_scheduler"])
            if "loss_scaler" in client and getattr(model, "loss_scaler", None) is not None:
                model.loss_scaler.load_state_dict(client["loss_scaler"])
            optimizer_loaded = True
    state = TrainState() if fresh else _train_state(client, found.iteration)
    if deepspeed_holder is not None:
        deepspeed_holder.restore_counters(state.iteration, state.consumed_train_samples)
    if not fresh and not optimizer_loaded:
        _continue_schedule(scheduler, state)
    if not (fresh or args.no_load_rng or rng_restored):
        if found.layout == "deepspeed":
            _restore_rng(client, dist.get_rank(), dist.get_world_size(), path)
        else:
            dp = (
                parallel_state.get_sequence_data_parallel_rank(),
                parallel_state.get_sequence_data_parallel_world_size(),
            )
            _restore_rng(client, *dp, path)
    print_rank_0(
        f"> loaded {'torch_dist' if any_layout else found.layout} checkpoint {found.directory} "
        f"at iteration {found.iteration}" + (" (weights only)" if fresh else "")
    )
    return state
