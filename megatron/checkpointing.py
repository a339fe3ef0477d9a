"""`save_checkpoint` / `load_checkpoint` in Megatron's layout (plain torch) or through the
DeepSpeed engine (`engine.save_checkpoint`, with Megatron's tracker file beside DeepSpeed's).

Megatron layout: `{save}/iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt` and
`{save}/latest_checkpointed_iteration.txt`. Files appear under their final names only when
complete (`megatron.atomic_files`), and the tracker is written last.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, fields

import torch
import torch.distributed as dist

from megatron.atomic_files import atomic_outputs
from megatron.core import parallel_state
from megatron.utils import print_rank_0

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def checkpoint_directory(root: str, iteration: int, release: bool = False) -> str:
    """`{root}/iter_{iteration:07d}` (or `{root}/release`)."""
    return os.path.join(root, "release" if release else f"iter_{iteration:07d}")


def checkpoint_file(root: str, iteration: int, release: bool = False) -> str:
    """This rank's Megatron-layout file for `iteration`."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    rank_dir = f"mp_rank_{tp_rank:02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        rank_dir += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    return os.path.join(
        checkpoint_directory(root, iteration, release), rank_dir, "model_optim_rng.pt"
    )


def read_tracker(root: str) -> tuple[int, bool] | None:
    """(iteration, release) from the tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise ValueError(
            f"{path}: expected an iteration number or 'release', got {text!r}"
        ) from None


def _write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER_FILENAME)
    with atomic_outputs(path) as (partial,):
        with open(partial, "w") as handle:
            handle.write(str(iteration))


def _plain_args(args: argparse.Namespace) -> dict:
    """The flags as plain Python values, loadable with `torch.load(weights_only=True)`."""
    allowed = (int, float, str, bool, type(None))
    out = {}
    for name, value in vars(args).items():
        if isinstance(value, allowed) or (
            isinstance(value, (list, tuple)) and all(isinstance(v, allowed) for v in value)
        ):
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _client_state(state, args: argparse.Namespace) -> dict:  # noqa: ANN001 - a TrainState
    return {**asdict(state), "args": _plain_args(args), "checkpoint_version": CHECKPOINT_VERSION}


def _unwrap(model) -> torch.nn.Module:  # noqa: ANN001 - PlainTrainer or module
    module = getattr(model, "model", model)
    return getattr(module, "module", module)


def save_checkpoint(state, model, optimizer, scheduler, args: argparse.Namespace) -> None:  # noqa: ANN001
    """Save iteration `state.iteration` to `--save` in the layout of this run's engine."""
    iteration = state.iteration
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {args.save}")
    client = _client_state(state, args)
    if args.deepspeed:
        model.save_checkpoint(args.save, tag=f"global_step{iteration}", client_state=client)
    elif parallel_state.get_data_parallel_rank() == 0:
        checkpoint = dict(client, model=_unwrap(model).state_dict())
        if not args.no_save_optim:
            checkpoint["optimizer"] = optimizer.state_dict()
            checkpoint["opt_param_scheduler"] = scheduler.state_dict()
            if getattr(model, "loss_scaler", None) is not None:
                checkpoint["loss_scaler"] = model.loss_scaler.state_dict()
        path = checkpoint_file(args.save, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_outputs(path) as (partial,):
            torch.save(checkpoint, partial)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write_tracker(args.save, iteration)
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {args.save}")


def _state_from(client: dict, args: argparse.Namespace):  # noqa: ANN202
    from megatron.train_loop import TrainState

    if args.finetune:
        return TrainState()
    names = {field.name for field in fields(TrainState)}
    return TrainState(**{k: v for k, v in client.items() if k in names})


def load_checkpoint(model, optimizer, scheduler, args: argparse.Namespace):  # noqa: ANN001, ANN201
    """Resume from `--load` if it holds a checkpoint; returns the `TrainState` to continue."""
    from megatron.train_loop import TrainState

    if not args.load:
        return TrainState()
    load_optimizer = not (args.no_load_optim or args.finetune)
    if args.deepspeed:
        path, client = model.load_checkpoint(
            args.load,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=load_optimizer,
            load_module_only=not load_optimizer,
        )
        if path is None:
            print_rank_0(f"> no checkpoint found in {args.load}; starting from iteration 0")
            return TrainState()
    else:
        tracker = read_tracker(args.load)
        if tracker is None:
            print_rank_0(f"> no {TRACKER_FILENAME} in {args.load}; starting from iteration 0")
            return TrainState()
        path = checkpoint_file(args.load, *tracker)
        client = torch.load(path, map_location="cpu", weights_only=True)
        _unwrap(model).load_state_dict(client["model"])
        if load_optimizer and "optimizer" in client:
            optimizer.load_state_dict(client["optimizer"])
            scheduler.load_state_dict(client["opt_param_scheduler"])
            if "loss_scaler" in client and getattr(model, "loss_scaler", None) is not None:
                model.loss_scaler.load_state_dict(client["loss_scaler"])
    state = _state_from(client or {}, args)
    print_rank_0(f"> loaded checkpoint {path} at iteration {state.iteration}")
    return state
