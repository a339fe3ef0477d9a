"""Token and position embeddings: ids [b, s] -> activations [s, b, h]."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core.process_groups import ModelGroups
from megatron.core.tensor_parallel import (
    VocabParallelEmbedding,
    get_cuda_rng_tracker,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.meta_init import initialize, new_parameter
from megatron.model.utils import init_method_normal, sequence_is_split


class Embedding(nn.Module):
    """Vocab-parallel word embeddings plus learned positions, then dropout.

    State-dict names are Megatron's: `word_embeddings.weight`, `position_embeddings.weight`.
    The word embedding is also the output layer (tied logits).
    """

    def __init__(self, config: ModelConfig, groups: ModelGroups) -> None:
        super().__init__()
        self.config = config
        self.sequence_split = sequence_is_split(config, groups)
        init_method = init_method_normal(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            init_method,
            use_cpu_initialization=config.use_cpu_initialization,
            params_dtype=config.torch_dtype,
        )
        if config.position_embedding_type == "learned_absolute":
            shape = (config.max_position_embeddings, config.hidden_size)
            self.position_embeddings = nn.Embedding(
                *shape, _weight=new_parameter(shape, config.torch_dtype)
            )
            # nn.Embedding's own N(0, 1) draw first (it makes one when it makes its weight),
            # then Megatron's: the random stream, hence every later weight, stays Megatron's.
            initialize(self.position_embeddings.weight, lambda w: init_method(nn.init.normal_(w)))
        else:
            self.position_embeddings = None

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[b, s] ids (and positions; default 0..s-1) -> [s(/tp under SP), b, h]."""
        return embed(
            self.word_embeddings,
            self.position_embeddings,
            input_ids,
            position_ids,
            self.config,
            self.sequence_split,
            self.training,
        )


def embed(
    word_embeddings: nn.Module,
    position_embeddings: nn.Module | None,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    config: ModelConfig,
    sequence_split: bool,
    training: bool,
) -> torch.Tensor:
    """`Embedding`'s arithmetic with the given tables: [b, s] ids -> [s(/tp under SP), b, h]
    (also the last pipeline stage's multi-token prediction, through its copy of the word
    embeddings)."""
    embeddings = word_embeddings(input_ids)  # [b, s, h]
    if position_embeddings is not None:
        seq_length = input_ids.size(1)
        if seq_length > config.max_position_embeddings:
            raise ValueError(
                f"sequence of {seq_length} tokens is longer than "
                f"--max-position-embeddings {config.max_position_embeddings}"
            )
        if position_ids is None:
            position_ids = torch.arange(seq_length, device=input_ids.device).unsqueeze(0)
        embeddings = embeddings + position_embeddings(position_ids)
    embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
    rng = contextlib.nullcontext()
    if config.sequence_parallel:
        # The scatter returns a view of this rank's part: a copy lets the whole sequence's
        # embeddings go (the first norm keeps its input), as Megatron-LM clones it.
        embeddings = scatter_to_sequence_parallel_region(embeddings).clone()
    if sequence_split:  # independent dropout on each rank's part
        rng = get_cuda_rng_tracker().fork() if training else rng
    with rng:
        return F.dropout(embeddings, config.hidden_dropout, training)
