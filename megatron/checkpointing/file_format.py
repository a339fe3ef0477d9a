"""What a checkpoint file holds, independent of how it is written or split.

- Model weights travel between our code and files as Megatron's nested dict:
  `{"language_model": {"embedding": {"word_embeddings": {"weight": W},
  "position_embeddings": {"weight": P}}, "encoder": {"layers.0.input_layernorm.weight": ...,
  "final_layernorm.weight": ...}}}`; pipeline stages hold their part of it (middle stages
  only `encoder`, the last stage also `word_embeddings_for_head`), under `model`, or with
  virtual pipeline stages one per model chunk under `model0`, `model1`, ... (Megatron-LM's
  keys). In memory we use the flat names of `GPTModel.state_dict()`
  (`language_model.encoder.layers.0...`).
- Files are read with `torch.load(weights_only=True)`: tensors, plain Python values, the few
  types allow-listed here (`argparse.Namespace` for `args`, numpy's RNG state, the standard
  library's types megatron-core allows), and stand-ins for any other class a file names
  (`megatron.checkpointing.foreign_types`: Megatron-LM's `args` hold megatron-core's enums),
  so loading a checkpoint never imports a module or runs code from it; a file that calls code
  (`os.system`, `builtins.eval`, ...) is refused in one line.
"""

from __future__ import annotations

import argparse
import enum
import os
import pathlib
import pickle
import signal
import types
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron.checkpointing.foreign_types import (
    ForeignCodeError,
    ForeignObject,
    foreign_globals,
    plain,
)

CHECKPOINT_VERSION = 3.0
"""Megatron's version tag for the per-head interleaved [np, 3, hn] QKV layout."""

EMBEDDING_PREFIX = "language_model.embedding."
ENCODER_PREFIX = "language_model.encoder."
HEAD_KEY = "word_embeddings_for_head"
OUTPUT_LAYER_PREFIX = "language_model.output_layer."
"""The untied output layer (`--untie-embeddings-and-output-weights`), on the last stage."""
MTP_KEY = "mtp"
"""Multi-token prediction's modules (`--mtp-num-layers`), on the last stage: `model["mtp"]`
holds megatron-core's names below `mtp.` (`layers.0.enorm.weight`, ...)."""
MEGATRON_FILENAME = "model_optim_rng.pt"


def enum_member(enum_class: type, name: str) -> enum.Enum | ForeignObject:
    """What `getattr(SomeEnum, "NAME")` in a pickle means: Python 3.11's first releases (3.11.2,
    Debian 12's python3, say) pickle an enum member so. Only an allow-listed Enum class's member
    by name comes back (a stand-in's for a class not imported here): the loaders map
    `builtins.getattr` here, never to getattr itself."""
    if isinstance(enum_class, type) and issubclass(enum_class, ForeignObject):
        if not isinstance(name, str):
            raise pickle.UnpicklingError(f"{enum_class.foreign_name} has no member {name!r}")
        return enum_class.member(name)
    if not (isinstance(enum_class, type) and issubclass(enum_class, enum.Enum)):
        raise pickle.UnpicklingError(f"getattr on {enum_class!r} is not allowed in a checkpoint")
    if not isinstance(name, str) or name not in enum_class.__members__:
        raise pickle.UnpicklingError(f"{enum_class.__name__} has no member {name!r}")
    return enum_class[name]


SAFE_GLOBALS = [
    (enum_member, "builtins.getattr"),
    argparse.Namespace,
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
    np._core.multiarray._reconstruct,
    np._core.multiarray.scalar,
    # numpy 1.x's names for the same (files written before numpy 2)
    (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    (np._core.multiarray.scalar, "numpy.core.multiarray.scalar"),
    # The standard library's data types in megatron-core's own allow-list
    # (megatron/core/safe_globals.py): `args.exit_signal` is a `signal.Signals` member.
    signal.Signals,
    types.SimpleNamespace,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
]


def load_file(path: str, mmap: bool = False, extra_globals: list | None = None) -> dict[str, Any]:
    """Read a checkpoint file without executing code from it (weights_only, allow-listed;
    other classes it names become inert stand-ins, `foreign_types`).

    `mmap=True` maps the tensors instead of reading them: cheap when only metadata is needed.
    `extra_globals`: more allowed types (DeepSpeed's, for the files its engine writes).
    Raises RuntimeError naming the file when it cannot be read or calls code.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    mmap = mmap and zipfile.is_zipfile(path)  # the legacy (non-zip) format cannot be mapped
    with torch.serialization.safe_globals(SAFE_GLOBALS + list(extra_globals or [])):
        try:
            stand_ins = foreign_globals(path)
        except ForeignCodeError as error:
            raise RuntimeError(f"cannot read checkpoint file {path}: {error}") from None
        with torch.serialization.safe_globals(stand_ins):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except Exception as error:  # noqa: BLE001 - re-raised with the path
                raise RuntimeError(f"cannot read checkpoint file {path}: {error}") from error


def checkpoint_directory(root: str, iteration: int, release: bool = False) -> str:
    """Megatron's `{root}/iter_{iteration:07d}` (or `{root}/release`)."""
    return os.path.join(root, "release" if release else f"iter_{iteration:07d}")


def rank_file(
    directory: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int | None = None
) -> str:
    """`{directory}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt` of one
    model-parallel rank; `ep_rank` with Megatron-LM's expert parallelism above 1 (its naming:
    each expert-parallel rank holds other experts)."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    if ep_rank is not None:
        name += f"_{ep_rank:03d}"
    return os.path.join(directory, name, MEGATRON_FILENAME)


def chunk_keys(virtual_size: int) -> list[str]:
    """A rank file's model entries: `model`, or Megatron-LM's `model0`, `model1`, ... for
    `virtual_size` > 1 virtual pipeline stages (one model chunk each)."""
    return ["model"] if virtual_size == 1 else [f"model{chunk}" for chunk in range(virtual_size)]


def model_entries(chunks: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{`chunk_keys` name: nested model} of one rank's model chunks."""
    return dict(zip(chunk_keys(len(chunks)), chunks))


def plain_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags as a Namespace of plain values (what `weights_only` loading accepts)."""
    allowed = (int, float, str, bool, type(None))
    out = argparse.Namespace()
    for name, value in vars(args).items():
        if isinstance(value, allowed):
            setattr(out, name, value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, allowed) for v in value):
            setattr(out, name, list(value))
    return out


def args_dict(args: argparse.Namespace | dict | None) -> dict[str, Any]:
    """A checkpoint's `args` as a dict (older files stored a dict, Megatron a Namespace), enum
    members as their flags spell them (`plain`: Megatron-LM's `attention_backend` is "auto")."""
    if args is None:
        return {}
    saved = dict(args) if isinstance(args, dict) else dict(vars(args))
    return {name: plain(value) for name, value in saved.items()}


def nest_model_state(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Flat `GPTModel`-style names -> Megatron's nested `model` dict (any subset of keys)."""
    embedding: dict[str, dict[str, torch.Tensor]] = {}
    encoder: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    output: dict[str, torch.Tensor] = {}
    mtp: dict[str, torch.Tensor] = {}
    for name, tensor in flat.items():
        if name.startswith(EMBEDDING_PREFIX):
            module, _, param = name.removeprefix(EMBEDDING_PREFIX).partition(".")
            embedding.setdefault(module, {})[param] = tensor
        elif name.startswith(ENCODER_PREFIX):
            encoder[name.removeprefix(ENCODER_PREFIX)] = tensor
        elif name.startswith(HEAD_KEY + "."):
            head[name.removeprefix(HEAD_KEY + ".")] = tensor
        elif name.startswith(OUTPUT_LAYER_PREFIX):
            output[name.removeprefix(OUTPUT_LAYER_PREFIX)] = tensor
        elif name.startswith(MTP_KEY + "."):
            mtp[name.removeprefix(MTP_KEY + ".")] = tensor
        else:
            raise KeyError(f"no place in Megatron's checkpoint layout for parameter {name!r}")
    language_model: dict[str, Any] = {}
    if embedding:
        language_model["embedding"] = embedding
    if encoder:
        language_model["encoder"] = encoder
    if output:
        language_model["output_layer"] = output
    nested: dict[str, Any] = {"language_model": language_model}
    if head:
        nested[HEAD_KEY] = head
    if mtp:
        nested[MTP_KEY] = mtp
    return nested


def flatten_model_state(model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Megatron's nested `model` dict (or an already flat one) -> flat `GPTModel` names.

    Accepts older Megatron spellings: `transformer` for `encoder`, `attention` for
    `self_attention`. The last pipeline stage's `word_embeddings_for_head` comes back as
    `word_embeddings_for_head.weight`.
    """
    if "language_model" not in model:
        return dict(model)
    flat: dict[str, torch.Tensor] = {}
    language_model = model["language_model"]
    for module, params in language_model.get("embedding", {}).items():
        for param, tensor in params.items():
            flat[f"{EMBEDDING_PREFIX}{module}.{param}"] = tensor
    encoder = language_model.get("encoder", language_model.get("transformer", {}))
    for name, tensor in encoder.items():
        name = name.replace(".attention.", ".self_attention.")
        flat[ENCODER_PREFIX + name] = tensor
    for param, tensor in language_model.get("output_layer", {}).items():
        flat[OUTPUT_LAYER_PREFIX + param] = tensor
    for param, tensor in model.get(HEAD_KEY, {}).items():
        flat[f"{HEAD_KEY}.{param}"] = tensor
    for name, tensor in model.get(MTP_KEY, {}).items():
        flat[f"{MTP_KEY}.{name}"] = tensor
    return flat
