"""Megatron's per-rank files loaded into a model sharded by torch FSDP2.

A sharded run saves torch_dist (`megatron.checkpointing.dist_checkpoint`: each rank its own
slices, nothing gathered); Megatron's files still load into it: an unsharded run's (a DDP run
that turns on `--use-distributed-optimizer` keeps its Adam moments: `name_keyed_optimizer_state`
renames torch's numbered optimizer state by parameter name), and those of this project's
earlier versions, whose sharded runs wrote whole weights into the model file and the whole
optimizer state, keyed by parameter name, into `distrib_optim.pt` beside it. Every rank reads
the whole file and keeps its shard (torch.distributed.checkpoint's `set_model_state_dict` /
`set_optimizer_state_dict` with full state dicts; every rank of the data-parallel group must
call them).
"""

from __future__ import annotations

import os

import torch
from torch import nn

DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` is an FSDP2 module (its parameters DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def has_sharded_chunks(module: nn.Module) -> bool:
    """Whether this rank's model (or any of its pipeline chunks) is sharded by FSDP2."""
    from megatron.checkpointing.pipeline_stages import model_chunks

    return any(is_sharded(chunk) for chunk in model_chunks(module))


def _full(**kwargs: bool) -> object:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def load_full_model_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole weights into `module`, each rank keeping its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, state, options=_full())


def load_full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a name-keyed whole optimizer state (`distrib_optim.pt`'s), sharded or not."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=_full())


def optimizer_file(model_file: str) -> str:
    """`distrib_optim.pt` beside a rank's model file."""
    return os.path.join(os.path.dirname(model_file), DISTRIBUTED_OPTIMIZER_FILE)


def name_keyed_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict, path: str
) -> dict:
    """`saved`, torch's optimizer state dict of an unsharded run (parameters numbered in the
    optimizer's order), keyed by parameter name as `load_full_optimizer_state` takes it.

    The numbering is matched to this optimizer's own parameters, which the same model and
    flags put in the same groups and order; a checkpoint whose groups differ in number or
    size is refused (ValueError naming `path`)."""
    names = {id(param): name for name, param in module.named_parameters()}
    ours = [group["params"] for group in optimizer.param_groups]
    theirs = [group["params"] for group in saved["param_groups"]]
    if [len(group) for group in ours] != [len(group) for group in theirs]:
        raise ValueError(
            f"{path}: its optimizer state has parameter groups of sizes "
            f"{[len(group) for group in theirs]}, this model's optimizer "
            f"{[len(group) for group in ours]}; add --no-load-optim to load the weights only"
        )
    renamed = {
        number: names[id(param)]
        for numbers, params in zip(theirs, ours, strict=True)
        for number, param in zip(numbers, params, strict=True)
    }
    return {
        "state": {renamed[number]: value for number, value in saved["state"].items()},
        "param_groups": [
            dict(group, params=[renamed[number] for number in group["params"]])
            for group in saved["param_groups"]
        ],
    }
