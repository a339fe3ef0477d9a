"""GPT cut into pipeline stages for Megatron's own schedules (no DeepSpeed): `GPTModel` stages.

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

from torch import nn

from megatron.config import ModelConfig
from megatron.core.pipeline_parallel.layout import chunk_layer_numbers, stage_index
from megatron.core.process_groups import ModelGroups, this_rank_groups
from megatron.model.gpt_model import GPTModel
from megatron.model.moe_aux_loss import AuxLossTracker


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
            GPTModel(
                config,
                groups,
                stage=stage,
                num_stages=pp_size * virtual_size,
                layers=layers,
                moe_losses=moe_losses,
            )
        )
    return chunks
