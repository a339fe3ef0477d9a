"""GPT cut into pipeline stages for Megatron's own schedules (no DeepSpeed), from GPTModel's parts.

Stage s of S holds the layers `chunk_layer_numbers` assigns it: with virtual stages
(interleaved 1F1B) a rank holds several model chunks, chunk c on pipeline rank r being stage
c x PP + r, as in Megatron-LM. The first stage also holds the embedding, the last the final
norm and the output: the untied `language_model.output_layer`, or for tied embeddings
`word_embeddings_for_head`, Megatron's copy of the word embeddings on the last stage (kept equal
to the first stage's by `megatron.core.pipeline_parallel.embedding_group`).

Module names and each chunk's local layer numbering are Megatron's, so a chunk's state dict is
what Megatron-LM writes in `mp_rank_TT_PPP/model_optim_rng.pt` (`model`, or `model0`,
`model1`, ... with virtual stages).

    chunk(tokens, position_ids)            # first stage: ids [b, s] -> hidden [s(/tp), b, h]
    chunk(hidden)                          # middle stages: hidden -> hidden
    chunk(hidden, labels=labels)           # last stage: per-token loss [b, s], fp32
    chunk(..., document_ids=ids)           # any stage, packed documents (--reset-attention-mask)
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.pipeline_parallel.layout import chunk_layer_numbers, stage_index
from megatron.core.process_groups import ModelGroups, this_rank_groups
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import gather_sequence_parts
from megatron.model.embedding import Embedding
from megatron.model.gpt_model import (
    compile_stage_loss,
    logits_from_hidden,
    loss_from_logits,
    output_layer,
)
from megatron.model.moe_aux_loss import AuxLossTracker
from megatron.model.transformer import ParallelTransformer
from megatron.model.utils import init_method_normal

HEAD_KEY = "word_embeddings_for_head"


class _ChunkLanguageModel(nn.Module):
    """`embedding` (first stage), `encoder` (its layers [+ final norm]), `output_layer`."""

    def __init__(
        self,
        config: ModelConfig,
        groups: ModelGroups,
        moe_losses: AuxLossTracker,
        layers: range,
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        if first:
            self.embedding = Embedding(config, groups)
        self.encoder = ParallelTransformer(
            config, groups, moe_losses, layer_numbers=layers, post_layer_norm=last
        )
        if last and config.untie_embeddings_and_output_weights:
            self.output_layer = output_layer(config)


class GPTPipelineChunk(nn.Module):
    """One pipeline stage of the GPT: a contiguous run of layers and the ends it owns."""

    def __init__(
        self,
        config: ModelConfig,
        stage: int,
        num_stages: int,
        layers: range,
        groups: ModelGroups | None = None,
        moe_losses: AuxLossTracker | None = None,
    ) -> None:
        """`groups`: as `GPTModel`'s (default: this rank's, from the run's device mesh);
        `moe_losses`: the tracker a rank's chunks share (default: the chunk's own)."""
        super().__init__()
        self.config = config
        self.groups = this_rank_groups() if groups is None else groups
        self.moe_losses = AuxLossTracker() if moe_losses is None else moe_losses
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.language_model = _ChunkLanguageModel(
            config, self.groups, self.moe_losses, layers, self.is_first, self.is_last
        )
        tied = not config.untie_embeddings_and_output_weights
        if self.is_last and tied and not self.is_first:
            # Megatron's head copy: made equal to the first stage's embedding after build.
            self.word_embeddings_for_head = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                init_method_normal(config.init_method_std),
                use_cpu_initialization=config.use_cpu_initialization,
                params_dtype=config.torch_dtype,
            )
            # Counted once in the gradient norm (the first stage counts it).
            self.word_embeddings_for_head.weight.shared = True

    def output_weight(self) -> torch.Tensor:
        """The last stage's (vocab-split) output matrix."""
        if self.config.untie_embeddings_and_output_weights:
            return self.language_model.output_layer.weight
        if self.is_first:  # one stage only: the embedding itself
            return self.language_model.embedding.word_embeddings.weight
        return self.word_embeddings_for_head.weight

    def forward(
        self,
        hidden_or_tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage; see the module docstring for what each stage takes and returns.

        `labels` reach every chunk of the last pipeline rank (the schedule passes keyword
        inputs to all of a rank's chunks); only the last stage reads them. `document_ids`
        [b, s] (`--reset-attention-mask`) reach every chunk of every rank the same way.
        """
        hidden = hidden_or_tokens
        if self.is_first:
            hidden = self.language_model.embedding(hidden_or_tokens, position_ids)
        # Causal attention, within each packed document when given.
        hidden = self.language_model.encoder(hidden, document_ids)
        if not self.is_last:
            # What the next stage was told to expect (`activation_shape`): the residual
            # stream's dtype (the parameters', also under autocast), contiguous.
            return hidden.to(self.config.torch_dtype).contiguous()
        logits = logits_from_hidden(hidden, self.output_weight(), self.config)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, vocab / tp]
        compiled = compile_stage_loss(self.config, self.groups)  # no whole-model graph holds it
        losses = loss_from_logits(logits, labels, self.config.check_labels, compiled)  # [b, s(/cp)]
        # Context parallelism: the whole sequence's losses, as GPTModel returns them.
        return gather_sequence_parts(losses, self.config.sequence_split_gradient_scale)


def activation_shape(
    config: ModelConfig, micro_batch_size: int, seq_length: int, groups: ModelGroups
) -> tuple:
    """[s(/cp)(/tp under sequence parallelism), b, h]: what one stage sends the next."""
    tokens = seq_length // groups.context.size
    if config.sequence_parallel:
        tokens //= groups.tensor.size
    return (tokens, micro_batch_size, config.hidden_size)


def build_pipeline_chunks(
    config: ModelConfig,
    pp_rank: int,
    pp_size: int,
    virtual_size: int = 1,
    groups: ModelGroups | None = None,
) -> nn.ModuleList:
    """This pipeline rank's model chunks, in schedule order (chunk c is stage c x PP + rank);
    `groups` as `GPTModel`'s."""
    groups = this_rank_groups() if groups is None else groups
    moe_losses = AuxLossTracker()  # one per rank: its step reads the chunks' sum once
    chunks = nn.ModuleList()
    for chunk in range(virtual_size):
        layers = chunk_layer_numbers(config.num_layers, pp_size, virtual_size, pp_rank, chunk)
        stage = stage_index(pp_rank, chunk, pp_size)
        chunks.append(
            GPTPipelineChunk(config, stage, pp_size * virtual_size, layers, groups, moe_losses)
        )
    return chunks
