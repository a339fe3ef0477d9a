"""Pipeline stages of a checkpoint: which parameters each model chunk holds, and joining them.

With PP pipeline ranks and V virtual stages per rank the model is cut into PP x V chunks of
L / (PP x V) consecutive layers; chunk c of pipeline rank r is stage c x PP + r
(`megatron.core.pipeline_parallel.layout`, Megatron-LM's interleaved assignment; V = 1 is the
plain even split). Stage 0 also holds the embeddings, the last stage the final layer norm and
either the untied `output_layer` or (more than one stage) `word_embeddings_for_head`, the tied
copy of the word embeddings (also untied with multi-token prediction, whose modules, `mtp.*`,
the last stage holds too). In Megatron's files each chunk numbers its layers from 0, and a
rank file holds `model` (V = 1) or `model0`, `model1`, ... (`file_format.model_entries`).

    local = chunk_state_dict(tp_rank_state, num_layers, pp_size, virtual_size, pp_rank, chunk)
    tp_rank_state = join_chunks(files_models, num_layers)      # files_models[pp_rank][chunk]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from megatron.checkpointing.file_format import HEAD_KEY, MTP_KEY, flatten_model_state
from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.checkpointing.shapes import OUTPUT_LAYER, WORD_EMBEDDINGS
from megatron.core.pipeline_parallel.layout import chunk_layer_numbers, stage_index

HEAD_WEIGHT = HEAD_KEY + ".weight"
_LAYER = re.compile(r"(language_model\.encoder\.layers\.)(\d+)(\..+)")


def model_chunks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """This rank's model chunks: Megatron's schedules build a `ModuleList`, the rest one model."""
    return list(module) if isinstance(module, torch.nn.ModuleList) else [module]


def check_pipeline_split(num_layers: int, pp_size: int, virtual_size: int) -> None:
    """Raise unless PP x V stages split `num_layers` evenly (V > 1 only with PP > 1)."""
    if pp_size < 1 or virtual_size < 1:
        raise CheckpointConversionError(
            f"pipeline-parallel size {pp_size} and virtual stages {virtual_size} must be >= 1"
        )
    if virtual_size > 1 and pp_size == 1:
        raise CheckpointConversionError(
            f"{virtual_size} virtual pipeline stages need a pipeline-parallel size above 1"
        )
    if num_layers % (pp_size * virtual_size) != 0:
        raise CheckpointConversionError(
            f"pipeline-parallel size {pp_size} x {virtual_size} virtual stage(s) does not "
            f"divide num_layers {num_layers}"
        )


def chunk_layers(
    num_layers: int, pp_size: int, virtual_size: int, pp_rank: int, chunk: int
) -> range:
    """0-based global layer numbers of model chunk `chunk` on pipeline rank `pp_rank`."""
    check_pipeline_split(num_layers, pp_size, virtual_size)
    numbers = chunk_layer_numbers(num_layers, pp_size, virtual_size, pp_rank, chunk)
    return range(numbers.start - 1, numbers.stop - 1)  # Megatron's layer numbers count from 1


def renumber_layers(state: dict[str, torch.Tensor], shift: int) -> dict[str, torch.Tensor]:
    """`state` with every `language_model.encoder.layers.{i}` renamed to `{i + shift}`.

    shift = -first layer of a chunk gives Megatron's local numbering; +first undoes it.
    """
    out = {}
    for name, tensor in state.items():
        match = _LAYER.fullmatch(name)
        if match:
            name = f"{match.group(1)}{int(match.group(2)) + shift}{match.group(3)}"
        out[name] = tensor
    return out


def chunk_state_dict(
    flat_tp_rank_state: dict[str, torch.Tensor],
    num_layers: int,
    pp_size: int,
    virtual_size: int,
    pp_rank: int,
    chunk: int,
) -> dict[str, torch.Tensor]:
    """Model chunk `chunk` of pipeline rank `pp_rank` as Megatron's files hold it: its layers
    (`chunk_layers`) numbered from 0, the embeddings on stage 0, the final norm and the output
    layer or, tied, `word_embeddings_for_head.weight` on the last stage."""
    layers = chunk_layers(num_layers, pp_size, virtual_size, pp_rank, chunk)
    stages = pp_size * virtual_size
    stage = stage_index(pp_rank, chunk, pp_size)
    first, last = stage == 0, stage == stages - 1
    out = {}
    for name, tensor in flat_tp_rank_state.items():
        match = _LAYER.fullmatch(name)
        if match:
            keep = int(match.group(2)) in layers
        elif name.startswith("language_model.embedding."):
            keep = first
        elif name.startswith("language_model.encoder.final_layernorm.") or name == OUTPUT_LAYER:
            keep = last
        elif name.startswith(MTP_KEY + "."):  # multi-token prediction: after the last layer
            keep = last
        else:
            raise CheckpointConversionError(f"no pipeline stage holds parameter {name!r}")
        if keep:
            out[name] = tensor
    tied = OUTPUT_LAYER not in flat_tp_rank_state
    mtp = any(name.startswith(MTP_KEY + ".") for name in flat_tp_rank_state)
    # The last stage's copy of the word embeddings: the tied output layer's, or what
    # multi-token prediction embeds its tokens with.
    if last and stages > 1 and (tied or mtp) and WORD_EMBEDDINGS in flat_tp_rank_state:
        out[HEAD_WEIGHT] = flat_tp_rank_state[WORD_EMBEDDINGS]
    return renumber_layers(out, -layers.start)


def merge_pipeline_stages(stages: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Join stage state dicts (global layer numbers); the head copy of the embedding is dropped.

    A checkpoint whose first stage lost its word embeddings takes them from the head copy.
    """
    merged: dict[str, torch.Tensor] = {}
    head = None
    for number, stage in enumerate(stages):
        for name, tensor in stage.items():
            if name == HEAD_WEIGHT:
                head = tensor
                continue
            if name in merged:
                raise CheckpointConversionError(
                    f"parameter {name!r} appears in pipeline stage {number} and an earlier stage"
                )
            merged[name] = tensor
    if WORD_EMBEDDINGS not in merged and head is not None:
        merged[WORD_EMBEDDINGS] = head
    return merged


def join_chunks(ranks: Sequence[Sequence[dict[str, Any]]], num_layers: int) -> dict:
    """One tensor-parallel rank's whole state dict (global layer numbers) from the model chunks
    of its pipeline ranks as Megatron's files hold them (`ranks[pp_rank][chunk]`, nested or
    flat, each chunk's layers numbered from 0)."""
    pp_size, virtual_size = len(ranks), len(ranks[0])
    stages: dict[int, dict[str, torch.Tensor]] = {}
    for pp_rank, chunks in enumerate(ranks):
        for chunk, model in enumerate(chunks):
            start = chunk_layers(num_layers, pp_size, virtual_size, pp_rank, chunk).start
            state = renumber_layers(flatten_model_state(model), start)
            stages[stage_index(pp_rank, chunk, pp_size)] = state
    return merge_pipeline_stages([stages[number] for number in sorted(stages)])
