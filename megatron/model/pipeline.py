"""GPT as a DeepSpeed `PipelineModule`, built from the same layer classes as `GPTModel`.

The layer sequence is: tied embedding ("embed"), the transformer layers, the final layer
norm, and the tied embedding again computing the logits; DeepSpeed keeps the two copies of
the word embedding in sync across the first and last stages. With
`--untie-embeddings-and-output-weights` the embedding is a plain first layer and the last
layer is its own output matrix (`lm_head`, Megatron-DeepSpeed's `LMHeadPipe` name). Inputs are
`((tokens, position_ids), (labels, loss_mask))` per micro-batch, as Megatron-DeepSpeed's
`get_batch_pipe` yields them. Attention is causal; under `--reset-attention-mask` the inputs
hold the document ids third, and they travel between stages beside the hidden states.

This is one of the few modules that import DeepSpeed.
"""

from __future__ import annotations

import functools
import re
from functools import partial

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from megatron.config import ModelConfig
from megatron.core.process_groups import ModelGroups, this_rank_groups
from megatron.core.tensor_parallel import checkpoint
from megatron.model.document_mask import layer_attention_mask
from megatron.model.embedding import Embedding
from megatron.model.gpt_model import (
    compile_stage_loss,
    logits_from_hidden,
    loss_from_logits,
    output_layer,
)
from megatron.model.moe_aux_loss import AuxLossTracker
from megatron.model.transformer import ParallelTransformerLayer
from megatron.model.utils import LayerNorm, RMSNorm

EMBEDDING_KEY = "embed"


class EmbeddingPipe(Embedding):
    """The embedding stage: (tokens, position_ids[, document_ids]) -> hidden [s, b, h], or
    (hidden, document_ids) with packed documents, which then travel with the activations."""

    def forward(
        self, inputs: tuple[torch.Tensor, ...] | torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Accept the micro-batch inputs as DeepSpeed hands them over."""
        if isinstance(inputs, torch.Tensor):
            return super().forward(inputs)
        tokens, position_ids = inputs[0], inputs[1] if len(inputs) > 1 else None
        hidden = super().forward(tokens, position_ids)
        return (hidden, inputs[2]) if len(inputs) > 2 else hidden


def _hidden_and_documents(
    inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A stage's activations: hidden [s(/tp), b, h] alone, or with the document ids [b, s]."""
    if isinstance(inputs, torch.Tensor):
        return inputs, None
    return inputs[0], inputs[1]


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """A transformer layer taking and returning the stage's activations (DeepSpeed's stage
    interface): hidden, or (hidden, document ids) under `--reset-attention-mask`.

    The class name is the one DeepSpeed's `GPTModelPipe` recompute rule looks for.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_number: int,
        groups: ModelGroups,
        moe_losses: AuxLossTracker,
    ) -> None:
        super().__init__(config, layer_number, groups, moe_losses)

    def forward(
        self, inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[s(/tp), b, h] -> [s(/tp), b, h], causal attention (within each document)."""
        hidden, documents = _hidden_and_documents(inputs)
        hidden = super().forward(hidden, layer_attention_mask(documents, self.window))
        return hidden if documents is None else (hidden, documents)


class LayerNormPipe(LayerNorm):
    """The final layer norm as a pipeline layer (it drops the document ids)."""

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[s(/tp), b, h] -> normalized [s(/tp), b, h]."""
        return super().forward(_hidden_and_documents(inputs)[0])


class RMSNormPipe(RMSNorm):
    """The final RMSNorm as a pipeline layer (it drops the document ids)."""

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[s(/tp), b, h] -> normalized [s(/tp), b, h]."""
        return super().forward(_hidden_and_documents(inputs)[0])


class LMHeadPipe(nn.Module):
    """The untied output layer as the last pipeline layer: hidden -> vocab-parallel logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head = output_layer(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> [s, b, vocab / tp]."""
        return logits_from_hidden(hidden, self.lm_head.weight, self.config)


def _logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    return logits_from_hidden(hidden, embedding.word_embeddings.weight, embedding.config)


def masked_mean_loss(
    logits: torch.Tensor,
    labels: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
    check_labels: bool = False,
    compiled: bool = False,
) -> torch.Tensor:
    """Mean per-token loss over the positions where `loss_mask` is 1 (all if no mask).

    `compiled`: the per-token loss runs under `torch.compile` (`loss_from_logits`; GPTModelPipe
    binds `compile_stage_loss(config, groups)`: DeepSpeed calls this outside the compiled layers).
    """
    if isinstance(labels, torch.Tensor):
        return loss_from_logits(logits, labels, check_labels, compiled).mean()
    targets, loss_mask = labels
    losses = loss_from_logits(logits, targets, check_labels, compiled)
    loss_mask = loss_mask.float()
    return (losses * loss_mask).sum() / loss_mask.sum()


class GPTModelPipe(PipelineModule):
    """GPT-2 split into pipeline stages over `groups` (default: this rank's, from the run's
    device mesh).

    The class name matters: DeepSpeed recomputes only `ParallelTransformerLayerPipe` layers
    of a `GPTModelPipe` when activation checkpointing is on.
    """

    def __init__(
        self,
        config: ModelConfig,
        partition_method: str = "type:transformer",
        groups: ModelGroups | None = None,
    ) -> None:
        groups = this_rank_groups() if groups is None else groups
        moe_losses = AuxLossTracker()  # this stage's layers' (read as self.moe_losses)
        # DeepSpeed records the tied attribute from the first spec with the key.
        tied = "word_embeddings.weight"
        untied = config.untie_embeddings_and_output_weights
        embedding = (
            LayerSpec(EmbeddingPipe, config, groups)
            if untied
            else TiedLayerSpec(EMBEDDING_KEY, EmbeddingPipe, config, groups, tied_weight_attr=tied)
        )
        specs = [embedding]
        specs += [
            LayerSpec(ParallelTransformerLayerPipe, config, number, groups, moe_losses)
            for number in range(1, config.num_layers + 1)
        ]
        norm = RMSNormPipe if config.normalization == "rmsnorm" else LayerNormPipe
        specs.append(LayerSpec(norm, config))
        specs.append(
            LayerSpec(LMHeadPipe, config)
            if untied
            else TiedLayerSpec(
                EMBEDDING_KEY,
                EmbeddingPipe,
                config,
                groups,
                forward_fn=_logits,
                tied_weight_attr=tied,
            )
        )
        topology = PipeModelDataParallelTopology(
            num_pp=groups.pipeline.size, num_mp=groups.tensor.size, num_dp=groups.data.size
        )
        recompute = config.recompute_granularity == "full"
        super().__init__(
            layers=specs,
            loss_fn=partial(
                masked_mean_loss,
                check_labels=config.check_labels,
                compiled=compile_stage_loss(config, groups),
            ),
            topology=topology,
            partition_method=partition_method,
            activation_checkpoint_interval=config.recompute_num_layers if recompute else 0,
            activation_checkpoint_func=lambda function, *inputs: checkpoint(
                function, config.distribute_saved_activations, *inputs
            ),
        )
        self.groups = groups
        self.moe_losses = moe_losses
        # As GPTModel compiles ids to loss in one graph: here the stage, layer to layer (the
        # loss is DeepSpeed's separate call, compiled on its own: compile_stage_loss).
        self.compiled_stage = (
            config.torch_compile
            and config.compile_whole_model
            and groups.tensor.size == 1
            and not recompute
        )

    def forward(
        self, inputs: tuple[torch.Tensor, ...] | torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """DeepSpeed's stage forward; under `--torch-compile` (TP=1, no recompute) one graph
        from the stage's inputs to its outputs, without eager kernels between its layers."""
        if not self.compiled_stage:
            return super().forward(inputs)
        self.micro_offset += 1  # DeepSpeed's micro-batch count (its optional per-layer seeds)
        return compiled_stage_forward()(self, inputs)

    def stage_forward(
        self, inputs: tuple[torch.Tensor, ...] | torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The stage's layers in order, as `PipelineModule.forward` runs them without
        activation checkpointing (and without `seed_layers`, which GPTModelPipe never sets)."""
        for layer in self.forward_funcs:
            inputs = layer(inputs)
        return inputs

    def _synchronize_tied_weights(self) -> None:
        """DeepSpeed's broadcast of the tied embedding weight, outside autograd.

        DeepSpeed calls `dist.broadcast` on the parameter itself with grad enabled (at
        construction and after loading a checkpoint); autograd then records the in-place
        `c10d::broadcast_`, which has no autograd kernel, and the first backward warns that
        gradients may be silently wrong. A broadcast is a copy of values: no gradient to track.
        """
        with torch.no_grad():
            super()._synchronize_tied_weights()


@functools.cache
def compiled_stage_forward():
    """`GPTModelPipe.stage_forward` under `torch.compile`, made once."""
    return torch.compile(GPTModelPipe.stage_forward)


def gpt_to_pipeline_name(name: str, num_layers: int, tied: bool = True) -> str:
    """Map a `GPTModel` state-dict key to the matching `GPTModelPipe` key.

    `tied`: False for a model with `--untie-embeddings-and-output-weights`.
    """
    if name.startswith("language_model.embedding."):
        prefix = f"tied_modules.{EMBEDDING_KEY}." if tied else "0."
        return prefix + name.removeprefix("language_model.embedding.")
    if name == "language_model.output_layer.weight" and not tied:
        return f"{num_layers + 2}.lm_head.weight"
    match = re.match(r"language_model\.encoder\.layers\.(\d+)\.(.+)", name)
    if match:
        return f"{int(match.group(1)) + 1}.{match.group(2)}"
    if name.startswith("language_model.encoder.final_layernorm."):
        return f"{num_layers + 1}." + name.removeprefix("language_model.encoder.final_layernorm.")
    raise KeyError(f"no pipeline counterpart for parameter {name!r}")


def load_gpt_state_dict_into_pipeline(
    pipeline: GPTModelPipe, state_dict: dict[str, torch.Tensor], num_layers: int
) -> None:
    """Copy the local stage's parameters from a (same-TP) `GPTModel` state dict."""
    local = pipeline.state_dict()
    tied = not pipeline_untied(pipeline)
    for name, tensor in state_dict.items():
        pipe_name = gpt_to_pipeline_name(name, num_layers, tied)
        if pipe_name in local:
            local[pipe_name].copy_(tensor)


def pipeline_untied(pipeline: GPTModelPipe) -> bool:
    """Whether `pipeline` has its own output layer (`--untie-embeddings-and-output-weights`)."""
    return not pipeline.tied_modules
