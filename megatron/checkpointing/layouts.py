"""Finding, reading and writing the two on-disk checkpoint layouts (file I/O only).

Megatron layout (plain torch runs, and what the conversion tools write)::

    {dir}/latest_checkpointed_iteration.txt        "N" or "release"
    {dir}/iter_{N:07d}/mp_rank_{tp:02d}/model_optim_rng.pt            (PP = 1)
    {dir}/iter_{N:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   (PP > 1)
        each holds `model`, or `model0`, `model1`, ... (one per virtual pipeline stage)

DeepSpeed layout (`engine.save_checkpoint`)::

    {dir}/latest                                   the tag, e.g. "global_step20"
    {dir}/{tag}/mp_rank_{tp:02d}_model_states.pt   `module` (flat GPTModel names) + client state
    {dir}/{tag}/layer_{idx:02d}-model_{tp:02d}-model_states.pt   pipeline engine: `module` is
        None and layer idx holds that layer's own keys (0 embedding, 1..L transformer layers,
        L+1 final norm, L+2 the untied output layer `lm_head.weight`; the tied logits layer
        L+2 is not written)
    {dir}/{tag}/zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt   ZeRO-3: placeholders
    {dir}/{tag}/layer_{m}_expert_{e}_mp_rank_{tp:02d}_model_states.pt   DeepSpeed-MoE: expert e
        (its global number) of the m-th MoE layer, its keys the GPTModel names with global
        expert numbers; `module` of the mp_rank file then holds everything but the experts

The tensor arithmetic (merging shards, renumbering pipeline layers) lives in
`megatron.checkpointing.shards`; this module only names, reads and writes files. Every read goes
through `megatron.checkpointing.file_format.load_file` (weights only; for DeepSpeed's files with its
bookkeeping types allowed too), except ZeRO-3 weights, which DeepSpeed's own `zero_to_fp32`
reconstructs from the optimizer partitions (it unpickles fully: convert trusted files only).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from megatron.checkpointing import commit as checkpoint_commit
from megatron.checkpointing.commit import DEEPSPEED_TRACKER_FILENAME, TRACKER_FILENAME
from megatron.checkpointing.file_format import (
    args_dict,
    checkpoint_directory,
    chunk_keys,
    flatten_model_state,
    load_file,
    nest_model_state,
    rank_file,
)
from megatron.moe_config import experts_per_layer


class CheckpointConversionError(ValueError):
    """A checkpoint that cannot be read, converted or written; the message names the file."""


@dataclass
class LocatedCheckpoint:
    """One checkpoint directory inside a `--load` directory, and how it was found."""

    layout: str
    """"megatron" or "deepspeed"."""
    directory: str
    """`{load}/iter_{N:07d}`, `{load}/release` or `{load}/{tag}`."""
    iteration: int | None
    """From the tracker or the directory name; None when only the files can tell."""
    release: bool = False
    tag: str = ""


def _read_trackers(root: str) -> tuple[str | None, tuple[int, bool] | None]:
    """DeepSpeed's tag and Megatron's (iteration, release), each None when absent."""
    try:
        return checkpoint_commit.read_deepspeed_tag(root), checkpoint_commit.read_tracker(root)
    except ValueError as error:
        raise CheckpointConversionError(str(error)) from None


def _existing(located: LocatedCheckpoint, what: str) -> LocatedCheckpoint:
    if not os.path.isdir(located.directory):
        raise CheckpointConversionError(f"{what}, but {located.directory} does not exist")
    return located


def locate_checkpoint(root: str, iteration: int | None = None) -> LocatedCheckpoint:
    """The checkpoint in `root` named by its trackers, or the one of `iteration`.

    `latest` (DeepSpeed) and `latest_checkpointed_iteration.txt` (Megatron) may both be present
    (DeepSpeed runs write both): the DeepSpeed tag wins, with the Megatron tracker's iteration
    when the two agree. Both are read as `megatron.checkpointing.commit` defines them: a
    checkpoint whose commit was interrupted after it was published counts as tracked.
    """
    if not os.path.isdir(root):
        raise CheckpointConversionError(f"checkpoint directory {root} does not exist")
    ds_tracker = os.path.join(root, DEEPSPEED_TRACKER_FILENAME)
    tag, tracker = _read_trackers(root)
    if iteration is not None:
        candidates = [
            LocatedCheckpoint("megatron", checkpoint_directory(root, iteration, False), iteration),
            LocatedCheckpoint(
                "deepspeed",
                os.path.join(root, f"global_step{iteration}"),
                iteration,
                tag=f"global_step{iteration}",
            ),
        ]
        if tag is not None:  # a DeepSpeed run's directory: look there first
            candidates.reverse()
        for candidate in candidates:
            if os.path.isdir(candidate.directory):
                return candidate
        names = " or ".join(c.directory for c in candidates)
        raise CheckpointConversionError(f"no checkpoint of iteration {iteration}: {names} missing")
    if tag is not None:
        number = checkpoint_commit.tag_iteration(tag)
        if tracker is not None and not tracker[1] and number in (None, tracker[0]):
            number = tracker[0]
        found = LocatedCheckpoint("deepspeed", os.path.join(root, tag), number, tag=tag)
        return _existing(found, f"{ds_tracker} names {tag!r}")
    if tracker is None:
        raise CheckpointConversionError(
            f"no checkpoint in {root}: neither {TRACKER_FILENAME} (Megatron) nor "
            f"{DEEPSPEED_TRACKER_FILENAME} (DeepSpeed) is there"
        )
    number, release = tracker
    found = LocatedCheckpoint(
        "megatron", checkpoint_directory(root, number, release), number, release
    )
    return _existing(found, f"{os.path.join(root, TRACKER_FILENAME)} names iteration {number}")


def holds_checkpoint(root: str) -> bool:
    """Whether `root` has a tracker file or a checkpoint directory of either layout."""
    if not os.path.isdir(root):
        return False
    names = os.listdir(root)
    trackers = {TRACKER_FILENAME, DEEPSPEED_TRACKER_FILENAME}
    pattern = re.compile(r"(iter_\d{7}|release|global_step\d+)$")
    return any(name in trackers or pattern.match(name) for name in names)


# --- Megatron layout -------------------------------------------------------------------------


def _megatron_sizes(directory: str) -> tuple[int, int, int, dict[str, Any]]:
    """(TP, PP, EP, contents of the first file) of a Megatron-layout checkpoint directory; EP
    above 1 for Megatron-LM's MoE with expert parallelism (files `mp_rank_TT[_PPP]_EEE`)."""
    candidates = [rank_file(directory, 0, 0, 1), rank_file(directory, 0, 0, 2)]
    candidates.append(rank_file(directory, 0, 0, 2, 0))
    found = [path for path in candidates if os.path.isfile(path)]
    if not found:
        raise CheckpointConversionError(
            f"{directory} holds no Megatron checkpoint file: {candidates[0]} (or {candidates[1]}) "
            "is missing"
        )
    first_path = found[0]
    first = load_file(first_path)
    args = args_dict(first.get("args"))
    ep = int(args.get("expert_model_parallel_size") or 1) if args.get("routed_moe") else 1
    listed = [n for n in os.listdir(directory) if re.fullmatch(r"mp_rank_\d{2}(_\d{3}){0,2}", n)]
    tp = args.get("tensor_model_parallel_size") or len({n[:10] for n in listed})
    pp = args.get("pipeline_model_parallel_size") or len({n[10:] for n in listed})
    if first_path == candidates[1] and pp == 1 and ep == 1:
        raise CheckpointConversionError(
            f"{first_path} is a pipeline stage file, but its args say "
            "pipeline_model_parallel_size 1"
        )
    return int(tp), int(pp), ep, first


def _virtual_size(first: dict[str, Any]) -> int:
    """Model chunks per rank file: the args' `virtual_pipeline_model_parallel_size`, else the
    number of `model0`, `model1`, ... entries (1: a single `model`)."""
    saved = args_dict(first.get("args")).get("virtual_pipeline_model_parallel_size")
    counted = len([key for key in first if re.fullmatch(r"model\d+", key)])
    return int(saved or counted or 1)


def read_megatron_files(directory: str) -> tuple[dict[str, Any], list[list[list[dict]]]]:
    """(metadata, models[tp][pp][chunk]) of a Megatron-layout checkpoint: each rank file's
    `model`, or its `model0`, `model1`, ... with virtual pipeline stages.

    Metadata is the first file without its models, optimizer and RNG entries; the optimizer
    state of the other files is dropped as soon as each is read.
    """
    tp, pp, ep, first = _megatron_sizes(directory)
    keys = chunk_keys(_virtual_size(first))
    cache: dict[str, list[dict]] = {}
    first_path = _first_path(directory)

    def chunks_of(path: str) -> list[dict]:
        """The model chunks of one rank file (read once; the first file is already read)."""
        if path not in cache:
            contents = first if path == first_path else load_file(path)
            missing = [key for key in keys if key not in contents]
            if missing:
                raise CheckpointConversionError(
                    f"{path} has no {missing[0]!r} entry (the checkpoint has {len(keys)} "
                    "model chunk(s) per file)"
                )
            cache[path] = [contents[key] for key in keys]
        return cache[path]

    models = []
    for tp_rank in range(tp):
        row = []
        for pp_rank in range(pp):
            if ep == 1:
                row.append(chunks_of(_shard_file(directory, tp_rank, pp_rank, pp, None, tp, ep)))
                continue
            # Folded expert parallelism writes one file per (tensor rank, expert rank) pair a
            # rank holds: this tensor rank's dense weights from any of its files, each expert
            # block from any file of its expert rank (experts are whole on every tensor rank).
            dense = chunks_of(_shard_file(directory, tp_rank, pp_rank, pp, None, tp, ep))
            blocks = [
                chunks_of(_shard_file(directory, None, pp_rank, pp, ep_rank, tp, ep))
                for ep_rank in range(ep)
            ]
            row.append(_join_expert_ranks(dense, blocks))
        models.append(row)
    cache.clear()
    skip = {"optimizer", "opt_param_scheduler", "rng_state", "loss_scaler", *keys}
    metadata = {k: v for k, v in first.items() if k not in skip}
    metadata.setdefault("args", {})
    return metadata, models


def _first_path(directory: str) -> str | None:
    """The file `_megatron_sizes` read first."""
    for path in (
        rank_file(directory, 0, 0, 1),
        rank_file(directory, 0, 0, 2),
        rank_file(directory, 0, 0, 2, 0),
    ):
        if os.path.isfile(path):
            return path
    return None


def _shard_file(
    directory: str,
    tp_rank: int | None,
    pp_rank: int,
    pp: int,
    ep_rank: int | None,
    tp: int,
    ep: int,
) -> str:
    """The rank file of this pipeline stage holding tensor rank `tp_rank` and expert rank
    `ep_rank` (None: any); the missing-file error names the checkpoint's sizes."""
    tp_ranks = range(tp) if tp_rank is None else [tp_rank]
    ep_ranks = [None] if ep == 1 else (range(ep) if ep_rank is None else [ep_rank])
    for t in tp_ranks:
        for e in ep_ranks:
            path = rank_file(directory, t, pp_rank, pp, e)
            if os.path.isfile(path):
                return path
    wanted = rank_file(directory, tp_rank or 0, pp_rank, pp, None if ep == 1 else (ep_rank or 0))
    raise CheckpointConversionError(
        f"missing shard file {wanted} (the checkpoint has tensor-parallel size {tp}, "
        f"pipeline-parallel size {pp} and expert-parallel size {ep})"
    )


def _join_expert_ranks(dense: list[dict], blocks: list[list[dict]]) -> list[dict]:
    """One stage's model chunks: the dense weights of `dense` (a file of the tensor rank), each
    MoE layer's stacked experts concatenated over the expert ranks' `blocks` in rank order
    (global numbers)."""
    joined = []
    for index, chunk in enumerate(dense):
        merged = dict(flatten_model_state(chunk))
        flats = [flatten_model_state(block[index]) for block in blocks]
        for name in merged:
            if ".mlp.experts." in name:
                merged[name] = torch.cat([flat[name] for flat in flats])
        joined.append(nest_model_state(merged))
    return joined


# --- DeepSpeed layout ------------------------------------------------------------------------


def deepspeed_model_file(directory: str, mp_rank: int) -> str:
    """`{directory}/mp_rank_{mp:02d}_model_states.pt` (ZeRO 0-2, both engines)."""
    return os.path.join(directory, f"mp_rank_{mp_rank:02d}_model_states.pt")


def deepspeed_layer_file(directory: str, layer: int, tp_rank: int) -> str:
    """`{directory}/layer_{idx:02d}-model_{tp:02d}-model_states.pt` (the pipeline engine)."""
    return os.path.join(directory, f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt")


def deepspeed_expert_file(directory: str, moe_layer: int, expert: int, tp_rank: int) -> str:
    """DeepSpeed-MoE's file of global expert `expert` of the `moe_layer`-th MoE layer (counting
    MoE layers only, from 0), as its `_get_expert_ckpt_name` names it."""
    name = f"layer_{moe_layer}_expert_{expert}_mp_rank_{tp_rank:02d}_model_states.pt"
    return os.path.join(directory, name)


def _read_experts(directory: str, args: dict[str, Any], tp_rank: int) -> dict[str, Any]:
    """Every expert of every MoE layer that `args` describe, from DeepSpeed's expert files."""
    counts = args.get("num_experts") or [1]
    try:
        per_layer = experts_per_layer(counts, args["num_layers"], args.get("expert_interval", 2))
    except (KeyError, ValueError) as error:
        raise CheckpointConversionError(
            f"{directory}: its args do not describe the MoE layers ({error})"
        ) from None
    flat: dict[str, Any] = {}
    for moe_layer, count in enumerate(count for count in per_layer if count > 1):
        for expert in range(count):
            path = deepspeed_expert_file(directory, moe_layer, expert, tp_rank)
            if not os.path.isfile(path):
                raise CheckpointConversionError(
                    f"missing expert file {path} (the checkpoint's args say --num-experts "
                    f"{' '.join(map(str, counts))} --expert-interval "
                    f"{args.get('expert_interval', 2)})"
                )
            flat.update(load_deepspeed_file(path))
    return flat


def load_deepspeed_file(path: str) -> dict[str, Any]:
    """`load_file` with DeepSpeed's bookkeeping types allowed (bf16/fp16 optimizer metadata)."""
    from megatron.checkpointing.deepspeed_engine import DEEPSPEED_SAFE_GLOBALS

    with torch.serialization.safe_globals(DEEPSPEED_SAFE_GLOBALS):
        return load_file(path)


def _zero3_model_file(directory: str) -> str:
    return os.path.join(directory, "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _deepspeed_sizes(metadata: dict[str, Any]) -> tuple[int, int]:
    args = args_dict(metadata.get("args"))
    dims = metadata.get("checkpoint_parallel_dimensions") or {}
    tp = args.get("tensor_model_parallel_size") or dims.get("tp_degree") or 1
    pp = args.get("pipeline_model_parallel_size") or dims.get("pp_degree") or 1
    return int(tp), int(pp)


def _pipeline_layer_name(layer: int, num_layers: int, key: str) -> str:
    """GPTModel name of key `key` of pipeline layer `layer` (0 .. num_layers + 2)."""
    if layer == 0:
        return "language_model.embedding." + key
    if layer <= num_layers:
        return f"language_model.encoder.layers.{layer - 1}.{key}"
    if layer == num_layers + 1:
        return "language_model.encoder.final_layernorm." + key
    return "language_model.output_layer." + key.removeprefix("lm_head.")


def _read_pipeline_layers(directory: str, tp_rank: int, num_layers: int) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for layer in range(num_layers + 3):
        path = deepspeed_layer_file(directory, layer, tp_rank)
        if layer == num_layers + 2 and not os.path.isfile(path):
            break  # tied output layer: DeepSpeed writes the embedding once, as layer 0
        if not os.path.isfile(path):
            raise CheckpointConversionError(
                f"missing shard file {path} (pipeline layer {layer} of tensor-parallel rank "
                f"{tp_rank}; the checkpoint's args say num_layers {num_layers})"
            )
        for key, tensor in load_deepspeed_file(path).items():
            flat[_pipeline_layer_name(layer, num_layers, key)] = tensor
    return flat


def _zero3_state_dict(root: str, located: LocatedCheckpoint, tp: int, pp: int) -> dict:
    if tp != 1 or pp != 1:
        raise CheckpointConversionError(
            f"{located.directory} is a ZeRO-3 checkpoint with tensor-parallel size {tp} and "
            f"pipeline-parallel size {pp}: only TP=1 without pipeline can be converted "
            "(DeepSpeed's zero_to_fp32 does not merge tensor-parallel shards)"
        )
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32 reports its progress on stdout; keep stdout for the tools' own lines.
    with contextlib.redirect_stdout(sys.stderr):
        return dict(get_fp32_state_dict_from_zero_checkpoint(root, located.tag))


def read_deepspeed_files(
    root: str, located: LocatedCheckpoint
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metadata, flat GPTModel state dict of each TP rank) of a DeepSpeed checkpoint, MoE
    experts included (under their global numbers).

    Metadata is the client state plus DeepSpeed's bookkeeping keys of the first model file
    (`args`, `iteration`, `ds_config`, ...), without `module` and `optimizer`.
    """
    directory = located.directory
    path = deepspeed_model_file(directory, 0)
    zero3 = not os.path.isfile(path) and os.path.isfile(_zero3_model_file(directory))
    if zero3:
        path = _zero3_model_file(directory)
    if not os.path.isfile(path):
        raise CheckpointConversionError(f"missing DeepSpeed model file {path}")
    first = load_deepspeed_file(path)
    metadata = {k: v for k, v in first.items() if k not in ("module", "optimizer", "rng_state")}
    metadata.setdefault("args", {})
    tp, pp = _deepspeed_sizes(first)
    stage = (first.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0)
    if zero3 or stage == 3:
        return metadata, [_zero3_state_dict(root, located, tp, pp)]
    if first.get("module") is None:
        num_layers = args_dict(first.get("args")).get("num_layers")
        if num_layers is None:
            num_layers = len(glob.glob(os.path.join(directory, "layer_*-model_00-*.pt"))) - 2
        return metadata, [_read_pipeline_layers(directory, t, num_layers) for t in range(tp)]
    if pp != 1:
        raise CheckpointConversionError(
            f"{path} holds a `module` but its args say pipeline_model_parallel_size {pp}"
        )
    shards = [dict(first["module"])]
    for tp_rank in range(1, tp):
        rank_path = deepspeed_model_file(directory, tp_rank)
        if not os.path.isfile(rank_path):
            raise CheckpointConversionError(
                f"missing shard file {rank_path} (the checkpoint has tensor-parallel size {tp})"
            )
        module = load_deepspeed_file(rank_path).get("module")
        if module is None:
            raise CheckpointConversionError(f"{rank_path} has no `module` weights")
        shards.append(dict(module))
    args = args_dict(first.get("args"))
    for tp_rank, shard in enumerate(shards):
        shard.update(_read_experts(directory, args, tp_rank))
    return metadata, shards


# --- writing the Megatron layout -------------------------------------------------------------


def write_megatron_directory(
    root: str, name: str, files: dict[str, dict[str, Any]], tracker: str, overwrite: bool
) -> str:
    """Write `files` ({relative path: contents}) as `{root}/{name}`, then the tracker.

    Everything goes into `{root}/{name}.partial` first (`megatron.checkpointing.commit`; each
    file fsynced); the directory is renamed into place and only then the tracker is
    (atomically) rewritten, so an interrupted write leaves `root` as it was. Refuses a `root`
    that already holds a checkpoint unless `overwrite`; overwriting then removes a DeepSpeed
    `latest` file (in the same commit), which would otherwise be read in preference to the new
    tracker.
    """
    if holds_checkpoint(root) and not overwrite:
        raise CheckpointConversionError(
            f"{root} already holds a checkpoint; choose another directory or overwrite it"
        )
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, name)
    staging = checkpoint_commit.begin(final)
    for relative, contents in files.items():
        path = os.path.join(staging, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(contents, path)
        checkpoint_commit.fsync_path(path)
    checkpoint_commit.commit(final, checkpoint_commit.megatron_trackers(tracker))
    return final
