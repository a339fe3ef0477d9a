"""Checkpoint weights as one dense model, and the tensor- and pipeline-parallel splits of it.

    dense = load_dense_checkpoint("checkpoints/gpt2")      # either layout, any TP x PP (x V)
    save_megatron_checkpoint(dense, "checkpoints/gpt2_tp4", tp_size=4, pp_size=1)

A `DenseCheckpoint` holds the flat `GPTModel.state_dict()` names of the whole model (tensor
shards concatenated, pipeline stages joined, vocabulary trimmed to the tokenizer's size).
Each parameter is split the way the parallel layers split it:

- vocab-parallel rows (dim 0): `word_embeddings.weight` and the untied `output_layer.weight`,
  padded first (the source's dummy rows when they were kept, see
  `DenseCheckpoint.vocab_padding`, then zero rows);
- column-parallel rows (dim 0): `query_key_value` and `dense_h_to_4h` weights and biases; the
  QKV rows are grouped per key/value head ([nkv, nq/nkv + 2, hn]: a group's query heads, then
  its key and its value head; [np, 3, hn] without GQA, checkpoint version 3.0), so a
  contiguous chunk holds whole groups. With SwiGLU each rank's `dense_h_to_4h` is its gate
  rows, then its up rows: the dense tensor is [gate; up] and each half is split on its own.
  A SwiGLU MLP is told by its shapes (`dense_h_to_4h` has twice as many rows as
  `dense_4h_to_h` has columns; for GeLU they are equal), so no caller can forget it;
- row-parallel columns (dim 1): `self_attention.dense.weight`, `mlp.dense_4h_to_h.weight`;
- replicated: layer norms (LayerNorm or RMSNorm), position embeddings, the row-parallel biases.

An MoE layer (DeepSpeed-MoE, Megatron-DeepSpeed's names) holds every expert of the layer under
its global number (`mlp.deepspeed_moe.experts.deepspeed_experts.{e}.*`), whatever the
expert-parallel size that wrote or will read it; its gate (`mlp.deepspeed_moe.gate.wg.weight`)
and PR-MoE's `mlp.coefficient` are replicated. The experts and PR-MoE's dense MLP
(`mlp.mlp.*`) are whole on every tensor-parallel rank, and split like the dense MLP only with
`--enable-expert-tensor-parallelism` (`expert_tensor_parallel`).

Which parameters each pipeline stage holds (virtual stages included: Megatron's local layer
numbers, `model0`, `model1`, ... per rank file) is decided in `pipeline_stages.py`;
`save_megatron_checkpoint(..., virtual_size=2)` writes such files.

Optimizer and RNG state are not carried: resharding optimizer state is what DeepSpeed's
universal checkpoint is for.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.checkpointing.file_format import (
    CHECKPOINT_VERSION,
    args_dict,
    model_entries,
    nest_model_state,
    plain_args,
    rank_file,
)
from megatron.checkpointing.layouts import (
    CheckpointConversionError,
    locate_checkpoint,
    read_deepspeed_files,
    read_megatron_files,
    write_megatron_directory,
)
from megatron.checkpointing.pipeline_stages import (
    check_pipeline_split,
    chunk_state_dict,
    join_chunks,
)
from megatron.checkpointing.shapes import (
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    check_shapes,
    model_config,
    model_dims,
    resolve_true_vocab_size,
)
from megatron.config import ModelConfig
from megatron.model.sharding import Split, model_splits
from megatron.tokenizer.tokenizer import vocab_size_with_padding

PROGRESS_KEYS = (
    "iteration",
    "consumed_train_samples",
    "consumed_valid_samples",
    "consumed_train_tokens",
    "skipped_iterations",
    "nan_iterations",
    "consecutive_bad_iterations",
)
"""Counters older files keep at the top level instead of in `train_state`."""


@dataclass
class DenseCheckpoint:
    """A whole model's weights and the metadata needed to write it out again."""

    state_dict: dict[str, torch.Tensor]
    """Flat GPTModel names, full size (TP- and PP-merged), vocab rows = `true_vocab_size`."""
    args: dict[str, Any]
    """The checkpoint's flags (what `pretrain_gpt.py` saved, or what an import sets)."""
    iteration: int
    """Training iteration; 0 for imports (written as a `release` checkpoint)."""
    true_vocab_size: int
    """The tokenizer's vocabulary size (50257 for GPT-2), before padding."""
    train_state: dict[str, Any] = field(default_factory=dict)
    """Progress counters (consumed samples and tokens, ...); may be empty."""
    layout: str = "megatron"
    """Where it came from: "megatron", "deepspeed" (or "huggingface" for imports)."""
    vocab_padding: torch.Tensor | None = None
    """The source's embedding rows past `true_vocab_size` (dummy tokens, trained: not zero).

    Written back first when padding again, so a checkpoint converted to the same padded size
    continues training exactly (the dummy logits are part of the softmax); None: zeros."""
    output_layer_padding: torch.Tensor | None = None
    """The same rows of the untied output layer (None: zeros, or no output layer)."""


# --- tensor-parallel splits ------------------------------------------------------------------


def checkpoint_splits(args: dict[str, Any]) -> dict[str, Split]:
    """How each tensor of the model a checkpoint's args describe is split, as its layers
    declare it (`megatron.model.sharding.model_splits`; MoE experts split over the
    tensor-parallel ranks only with `--enable-expert-tensor-parallelism`)."""
    return model_splits(model_config(args))


def _split(splits: dict[str, Split], name: str) -> Split:
    split = splits.get(name)
    if split is None:
        raise CheckpointConversionError(
            f"{name!r} is not a tensor of the model the checkpoint's args describe"
        )
    return split


def check_tp_divides(config: ModelConfig, tp_size: int) -> None:
    """Raise unless `tp_size` splits the model's heads, key/value heads and MLP evenly."""
    for name, size in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("ffn_hidden_size", config.ffn_hidden_size),
    ):
        if size % tp_size != 0:
            raise CheckpointConversionError(
                f"tensor-parallel size {tp_size} does not divide {name} {size}"
            )


def _chunk(name: str, tensor: torch.Tensor, tp: int, split: Split) -> list:
    """The `tp` tensor-parallel shards of full tensor `name` (replicated: `tp` copies)."""
    dim = split.tensor_dim
    if dim is None:
        return [tensor] * tp
    halves = tensor.chunk(2, dim=0) if split.swiglu else [tensor]
    for half in halves:
        if half.size(dim) % tp != 0:
            raise CheckpointConversionError(
                f"{name} has size {half.size(dim)} along dim {dim}, which tensor-parallel "
                f"size {tp} does not divide"
            )
    parts = [half.chunk(tp, dim=dim) for half in halves]
    return [torch.cat([part[rank] for part in parts], dim=dim) for rank in range(tp)]


def _join(name: str, parts: Sequence[torch.Tensor], split: Split) -> torch.Tensor:
    """The full tensor `name` from its tensor-parallel shards (replicated: rank 0's)."""
    dim = split.tensor_dim
    if dim is None:
        return parts[0].clone()
    if not split.swiglu:
        return torch.cat(list(parts), dim=dim)
    halves = [part.chunk(2, dim=0) for part in parts]  # each rank: [gate_r; up_r]
    return torch.cat([half[0] for half in halves] + [half[1] for half in halves])


def _resize_vocab(
    state: dict[str, torch.Tensor], rows: int, splits: dict[str, Split]
) -> dict[str, torch.Tensor]:
    """`state` with its vocabulary matrices cut or zero-padded to `rows` rows."""
    out = dict(state)
    for name, tensor in state.items():
        if not _split(splits, name).vocab:
            continue
        if rows <= tensor.size(0):
            out[name] = tensor[:rows].clone()
        else:
            pad = tensor.new_zeros(rows - tensor.size(0), *tensor.shape[1:])
            out[name] = torch.cat([tensor, pad], dim=0)
    return out


def shard_state_dict(
    dense: dict[str, torch.Tensor],
    tp_size: int,
    tp_rank: int,
    padded_vocab_size: int,
    splits: dict[str, Split],
) -> dict[str, torch.Tensor]:
    """The GPTModel state dict of tensor-parallel rank `tp_rank` of `tp_size`, each tensor
    split as `splits` (`checkpoint_splits`, `model_splits`: the layers' declarations) says.

    The vocabulary is padded with zero rows to `padded_vocab_size` before it is split.
    Attention heads are not counted here: `check_tp_divides` checks a model's split. MoE
    experts stay whole unless the model splits them (`--enable-expert-tensor-parallelism`).
    """
    if not 0 <= tp_rank < tp_size:
        raise CheckpointConversionError(f"tensor-parallel rank {tp_rank} not in [0, {tp_size})")
    rows = dense[WORD_EMBEDDINGS].size(0) if WORD_EMBEDDINGS in dense else 0
    if padded_vocab_size < rows:
        raise CheckpointConversionError(
            f"padded vocabulary size {padded_vocab_size} is smaller than the {rows} rows of "
            f"{WORD_EMBEDDINGS}"
        )
    padded = _resize_vocab(dense, padded_vocab_size, splits)
    return {
        name: _chunk(name, tensor, tp_size, _split(splits, name))[tp_rank].clone()
        for name, tensor in padded.items()
    }


def merge_tp_shards(
    shards: Sequence[dict[str, torch.Tensor]], splits: dict[str, Split]
) -> dict[str, torch.Tensor]:
    """Concatenate the state dicts of all TP ranks (replicated tensors from rank 0), each
    tensor joined as `splits` says.

    The vocabulary stays padded; see `DenseCheckpoint` for the trimmed form. SwiGLU's
    `dense_h_to_4h` joins the ranks' gate halves, then their up halves. MoE experts are taken
    from rank 0 unless the model splits them.
    """
    names = list(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            extra = sorted(set(shard) ^ set(names))[:3]
            raise CheckpointConversionError(
                f"tensor-parallel rank {rank} holds other parameters than rank 0 ({extra} ...)"
            )
    return {
        name: _join(name, [shard[name] for shard in shards], _split(splits, name)) for name in names
    }


# --- reading and writing whole checkpoints ---------------------------------------------------


def _train_state(metadata: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    saved = dict(metadata.get("train_state") or {})
    for key in PROGRESS_KEYS:
        if key not in saved and key in metadata:
            saved[key] = metadata[key]
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        if key not in saved and args.get(key) is not None:
            saved[key] = args[key]
    return saved


def load_dense_checkpoint(
    load_dir: str, iteration: int | None = None, true_vocab_size: int | None = None
) -> DenseCheckpoint:
    """Read every shard of the checkpoint in `load_dir` (either layout, or torch_dist: ours or
    megatron-core's, `megatron.checkpointing.megatron_core`) into one model.

    `iteration` picks a checkpoint other than the one the trackers name; `true_vocab_size`
    overrides the tokenizer size for files that do not record it.
    """
    from megatron.checkpointing.dist_checkpoint import (
        DistCheckpointError,
        is_dist_checkpoint,
        read_common,
    )
    from megatron.checkpointing.megatron_core import read_dist_dense

    located = locate_checkpoint(load_dir, iteration)
    dist = located.layout == "megatron" and is_dist_checkpoint(located.directory)
    if dist:
        # torch_dist, ours or megatron-core's: whole tensors already, read in this process.
        try:
            args, merged = read_dist_dense(located.directory)
            metadata = dict(read_common(located.directory)[1], args=args)
        except DistCheckpointError as error:
            raise CheckpointConversionError(str(error)) from None
    elif located.layout == "megatron":
        metadata, models = read_megatron_files(located.directory)
        args = args_dict(metadata.get("args"))
        num_layers = model_dims(args)["num_layers"]
        shards = [join_chunks(row, num_layers) for row in models]
    else:
        metadata, shards = read_deepspeed_files(load_dir, located)
        args = args_dict(metadata.get("args"))
    splits = checkpoint_splits(args)
    if not dist:
        merged = merge_tp_shards(shards, splits)
    check_shapes(merged, args, located.directory)
    padded = args.get("padded_vocab_size")
    rows = merged[WORD_EMBEDDINGS].size(0)
    if padded is not None and padded != rows:
        raise CheckpointConversionError(
            f"{located.directory}: {WORD_EMBEDDINGS} has {rows} rows, but the checkpoint's args "
            f"say padded_vocab_size {padded}"
        )
    vocab = resolve_true_vocab_size(args, true_vocab_size, located.directory)
    if vocab > rows:
        raise CheckpointConversionError(
            f"true vocabulary size {vocab} exceeds the {rows} embedding rows of {located.directory}"
        )
    number = located.iteration
    if number is None or located.release:
        number = 0 if located.release else int(metadata.get("iteration", 0))
    output = merged.get(OUTPUT_LAYER)
    return DenseCheckpoint(
        vocab_padding=merged[WORD_EMBEDDINGS][vocab:].clone(),
        output_layer_padding=None if output is None else output[vocab:].clone(),
        state_dict=_resize_vocab(merged, vocab, splits),
        args=args,
        iteration=number,
        true_vocab_size=vocab,
        train_state=_train_state(metadata, args),
        layout=located.layout,
    )


def _target_args(dense: DenseCheckpoint, sizes: tuple[int, int, int], divisible: int) -> dict:
    """`dense.args` for files split (TP, PP, V) with vocabulary padding `divisible`."""
    tp, pp, virtual = sizes
    layers = dense.args["num_layers"]
    args = dict(dense.args)
    args.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
        num_layers_per_virtual_pipeline_stage=layers // (pp * virtual) if virtual > 1 else None,
        make_vocab_size_divisible_by=divisible,
        padded_vocab_size=vocab_size_with_padding(
            dense.true_vocab_size, divisible, tp, verbose=False
        ),
        true_vocab_size=dense.true_vocab_size,
    )
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        if key in dense.train_state:
            args[key] = dense.train_state[key]
    return args


def _expert_block(
    state: dict[str, torch.Tensor], ep_size: int, ep_rank: int
) -> dict[str, torch.Tensor]:
    """`state` with each Megatron-LM MoE layer's stacked experts cut to expert rank
    `ep_rank`'s block of `ep_size`."""
    if ep_size == 1:
        return state
    return {
        name: tensor.chunk(ep_size)[ep_rank].clone() if ".mlp.experts." in name else tensor
        for name, tensor in state.items()
    }


def save_megatron_checkpoint(
    dense: DenseCheckpoint,
    save_dir: str,
    tp_size: int,
    pp_size: int,
    make_vocab_size_divisible_by: int | None = None,
    overwrite: bool = False,
    virtual_size: int = 1,
    expert_size: int | None = None,
) -> str:
    """Write `dense` in Megatron's layout split TP x PP (x V virtual pipeline stages, each
    rank file then holding `model0`, `model1`, ...); returns the checkpoint directory.

    Megatron-LM's MoE (`routed_moe`) is written for `expert_size` expert-parallel ranks
    (default: the source's `--expert-model-parallel-size`): above 1, one file per (tensor,
    pipeline, expert rank), `mp_rank_TT[_PPP]_EEE`, holding that rank's block of each layer's
    experts, as Megatron-LM names them.

    Iteration 0 is written as `release`. Nothing is touched when `save_dir` already holds a
    checkpoint (unless `overwrite`) or when the model cannot be split this way.
    """
    num_layers = model_dims(dense.args)["num_layers"]
    if tp_size < 1:
        raise CheckpointConversionError(f"tensor-parallel size must be >= 1, got {tp_size}")
    config = model_config(dense.args)
    check_tp_divides(config, tp_size)
    check_pipeline_split(num_layers, pp_size, virtual_size)
    if config.moe is not None and pp_size * virtual_size > 1:
        raise CheckpointConversionError(
            f"pipeline-parallel size {pp_size} x {virtual_size} virtual stage(s): a "
            "Mixture-of-Experts model runs without pipeline parallelism (DeepSpeed-MoE on "
            "--no-pipeline-parallel); write it with pipeline-parallel size 1"
        )
    check_shapes(dense.state_dict, dense.args, "the model to save")
    divisible = (
        make_vocab_size_divisible_by or dense.args.get("make_vocab_size_divisible_by") or 128
    )
    target = _target_args(dense, (tp_size, pp_size, virtual_size), divisible)
    ep_size = 1
    if dense.args.get("routed_moe"):
        ep_size = expert_size or int(dense.args.get("expert_model_parallel_size") or 1)
        experts = int(config.routed_moe.num_experts)
        if ep_size < 1 or experts % ep_size:
            raise CheckpointConversionError(
                f"expert-parallel size {ep_size}: must divide the {experts} experts"
            )
        target["expert_model_parallel_size"] = ep_size
    elif expert_size not in (None, 1):
        raise CheckpointConversionError(
            f"expert-parallel size {expert_size}: the checkpoint has no Megatron-LM MoE layers "
            "(DeepSpeed-MoE's experts are whole in every file; the run chooses "
            "--moe-expert-parallel-size)"
        )
    padded = target["padded_vocab_size"]
    state = dict(dense.state_dict)
    for name, rows in (
        (WORD_EMBEDDINGS, dense.vocab_padding),
        (OUTPUT_LAYER, dense.output_layer_padding),
    ):
        if rows is not None and name in state:  # the source's dummy rows first, then zeros
            state[name] = torch.cat([state[name], rows[: padded - dense.true_vocab_size]])
    metadata = {
        "args": plain_args(argparse.Namespace(**target)),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": dense.iteration,
    }
    files, splits = {}, checkpoint_splits(target)
    for tp_rank in range(tp_size):
        whole = shard_state_dict(state, tp_size, tp_rank, padded, splits)
        for ep_rank in range(ep_size):
            shard = _expert_block(whole, ep_size, ep_rank)
            for pp_rank in range(pp_size):
                chunks = [
                    nest_model_state(
                        chunk_state_dict(shard, num_layers, pp_size, virtual_size, pp_rank, chunk)
                    )
                    for chunk in range(virtual_size)
                ]
                name = rank_file("", tp_rank, pp_rank, pp_size, ep_rank if ep_size > 1 else None)
                files[name] = {
                    **metadata,
                    **model_entries(chunks),
                    "train_state": dict(dense.train_state),
                }
    release = dense.iteration == 0
    directory = "release" if release else f"iter_{dense.iteration:07d}"
    tracker = "release" if release else str(dense.iteration)
    return write_megatron_directory(save_dir, directory, files, tracker, overwrite)
