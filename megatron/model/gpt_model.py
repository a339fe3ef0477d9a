"""The GPT model: embeddings, the transformer stack, and the output layer; whole, or one
pipeline stage of it (megatron-core's shape: the same class with its ends switched off).

The output layer is the word embedding matrix (tied, GPT-2) or, with
`--untie-embeddings-and-output-weights` (LLaMA), its own `language_model.output_layer`.

    model = GPTModel(config, groups)             # groups: this rank's ModelGroups
                                                 # (default: sliced from the device mesh)
    loss = model(tokens, labels=labels)          # per-token loss [b, s], fp32 (under
                                                 # DeepSpeed-Ulysses the whole sequence's)
    logits = model(tokens)                       # [b, s, vocab / tp] (or vocab)
    logits = model(tokens, inference_params=cache)  # generation: see inference_params.py

    stage = GPTModel(config, groups, stage=s, num_stages=S, layers=range(a, b))
                                                 # Megatron's schedules: pipeline_chunks.py

The module tree reproduces Megatron's state-dict names
(`language_model.embedding.word_embeddings.weight`,
`language_model.encoder.layers.0.self_attention.query_key_value.weight`, ...), a stage's
those of Megatron-LM's `mp_rank_TT_PPP` files.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.core.process_groups import ModelGroups, this_rank_groups
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    linear_with_vocab_parallel_weight,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.cross_entropy import check_labels_in_vocabulary
from megatron.core.tensor_parallel.mappings import gather_sequence_parts
from megatron.model.embedding import Embedding, embed
from megatron.model.inference_params import InferenceParams
from megatron.model.moe_aux_loss import AuxLossTracker
from megatron.model.multi_token_prediction import MultiTokenPredictionBlock, attach_mtp_losses
from megatron.model.transformer import ParallelTransformer
from megatron.model.utils import init_method_normal, sequence_is_split


def output_layer(config: ModelConfig) -> ColumnParallelLinear:
    """The untied output layer: a vocab-parallel [vocab / tp, h] weight, no bias."""
    layer = ColumnParallelLinear(
        config.hidden_size,
        config.vocab_size,
        init_method_normal(config.init_method_std),
        bias=False,
        use_cpu_initialization=config.use_cpu_initialization,
        params_dtype=config.torch_dtype,
    )
    layer.weight.vocab_parallel = True  # its rows are the (padded) vocabulary
    return layer


class TransformerLanguageModel(nn.Module):
    """[`embedding`] + `encoder` (the layers [and the final norm]) [+ `output_layer`]."""

    def __init__(
        self,
        config: ModelConfig,
        groups: ModelGroups,
        moe_losses: AuxLossTracker,
        layers: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        """`layers`: the layer numbers held (default all); `pre_process`: holds the
        embedding; `post_process`: the final norm and the untied output layer."""
        super().__init__()
        if pre_process:
            self.embedding = Embedding(config, groups)
        self.encoder = ParallelTransformer(
            config, groups, moe_losses, layer_numbers=layers, post_layer_norm=post_process
        )
        if post_process and config.untie_embeddings_and_output_weights:
            self.output_layer = output_layer(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """[b, s] ids (or, without the embedding, hidden states) -> hidden [s(/tp), b, h]."""
        hidden = input_ids
        if hasattr(self, "embedding"):
            hidden = self.embedding(input_ids, position_ids)
        return self.encoder(hidden, attention_mask, inference_params)


def logits_from_hidden(
    hidden: torch.Tensor, output_weight: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """[s(/tp), b, h] -> [s, b, vocab/tp], or [s, b, vocab] unless `parallel_output`."""
    return linear_with_vocab_parallel_weight(
        hidden,
        output_weight,
        sequence_parallel=config.sequence_parallel,
        gather_output=not config.parallel_output,
    )


def loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    check_labels: bool = False,
    compiled: bool = False,
) -> torch.Tensor:
    """[s, b, vocab/tp] logits and [b, s] labels -> per-token fp32 loss [b, s].

    `check_labels` (`--check-labels`): a label outside the vocabulary raises ValueError.
    `compiled` (`compile_stage_loss`: a pipeline's last stage under `--torch-compile` at TP=1,
    where no whole-model graph holds the loss): run under `torch.compile`, where the cross
    entropy is `F.cross_entropy` on the upcast logits, fused by inductor into a few reductions
    and one gradient kernel. Eager it is the chunked vocab-parallel loop: at GPT-2's
    vocabulary ~25 chunks per 8x1024-token micro-batch on a GPU, ~5 full-chunk kernels per
    chunk each way (vocab_parallel_cross_entropy's note: about 2x slower than fused).
    """
    if compiled and not torch.compiler.is_compiling():
        if check_labels:  # eagerly: the check's device sync would break the graph
            check_labels_in_vocabulary(labels.transpose(0, 1), logits.size(-1))
        return compiled_loss_from_logits()(logits, labels)
    target = labels.transpose(0, 1)  # [s, b]
    return vocab_parallel_cross_entropy(logits, target, check_labels=check_labels).transpose(0, 1)


def compile_stage_loss(config: ModelConfig, groups: ModelGroups) -> bool:
    """Whether a pipeline's last stage computes its loss compiled (`loss_from_logits(...,
    compiled=True)`): under `--torch-compile` at TP=1, as `GPTModel` would in its whole-model
    graph (with TP the loss's all-reduces stay in the eager vocab-parallel loop)."""
    return config.torch_compile and groups.tensor.size == 1


@functools.cache
def compiled_loss_from_logits():
    """`loss_from_logits` under `torch.compile` (a pipeline's last stage), made once."""
    return torch.compile(loss_from_logits)


class GPTModel(nn.Module):
    """The GPT language model, or one stage of it (`pipeline.py` rearranges its layers for
    DeepSpeed's pipeline engine)."""

    def __init__(
        self,
        config: ModelConfig,
        groups: ModelGroups | None = None,
        *,
        stage: int = 0,
        num_stages: int = 1,
        layers: range | None = None,
        moe_losses: AuxLossTracker | None = None,
    ) -> None:
        """`groups`: the process groups this rank's layers communicate over (default: this
        rank's, sliced from the run's device mesh; one process's outside torch.distributed).

        A pipeline stage (Megatron's schedules, `build_pipeline_chunks`): stage `stage` of
        `num_stages` holding the layer numbers `layers`; the first stage also holds the
        embedding, the last the final norm and the output (for tied embeddings on a later
        stage than the first, `word_embeddings_for_head`, Megatron's copy of the word
        embeddings, made equal to the first stage's by `megatron.core.pipeline_parallel`).
        `moe_losses`: the MoE loss tracker the steps read (default: the model's own; a rank's
        stages share one).
        """
        super().__init__()
        self.config = config
        self.groups = this_rank_groups() if groups is None else groups
        self.moe_losses = AuxLossTracker() if moe_losses is None else moe_losses
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.language_model = TransformerLanguageModel(
            config, self.groups, self.moe_losses, layers, self.is_first, self.is_last
        )
        tied = not config.untie_embeddings_and_output_weights
        if self.is_last and not self.is_first and (tied or config.mtp is not None):
            # The tied output layer's and multi-token prediction's copy of the embeddings.
            self.word_embeddings_for_head = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                init_method_normal(config.init_method_std),
                use_cpu_initialization=config.use_cpu_initialization,
                params_dtype=config.torch_dtype,
            )
            # Counted once in the gradient norm (the first stage counts it).
            self.word_embeddings_for_head.weight.shared = True
        if self.is_last and config.mtp is not None:
            self.mtp = MultiTokenPredictionBlock(config, self.groups, self.moe_losses)

    def word_embeddings_weight(self) -> torch.Tensor:
        """The (vocab-split) embedding matrix (of the first stage)."""
        return self.language_model.embedding.word_embeddings.weight

    def output_weight(self) -> torch.Tensor:
        """The (vocab-split) output matrix (of the last stage): the untied output layer's,
        the embeddings', or a later stage's copy of them."""
        if self.config.untie_embeddings_and_output_weights:
            return self.language_model.output_layer.weight
        if self.is_first:
            return self.word_embeddings_weight()
        return self.word_embeddings_for_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_params: InferenceParams | None = None,
        document_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        mtp_input_ids: torch.Tensor | None = None,
        mtp_position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] when `labels` are given, else logits [b, s, vocab(/tp)].

        `attention_mask`: None for causal attention, or bool [b|1, 1, s, s], True = masked;
        `document_ids` [b, s] instead: causal attention within each packed document
        (`--reset-attention-mask`).
        `inference_params`: the key/value cache of generation (eval mode, causal attention);
        `input_ids` then hold the positions from its `sequence_len_offset` on, and
        `position_ids` default to those positions.

        A pipeline stage after the first takes the previous stage's hidden states
        [s(/tp), b, h] as `input_ids`; one before the last returns its own (in the parameters'
        dtype, what `activation_shape` announced). The schedule passes `labels` and
        `document_ids` to every chunk of a rank; only the last stage reads the labels.

        With multi-token prediction (`config.mtp`) the last stage also computes its modules'
        losses (`multi_token_prediction.py`): `loss_mask` [b, s] (default: every position)
        weighs them, and a last stage without the embedding gets the token ids and positions
        as `mtp_input_ids`, `mtp_position_ids`. The returned per-token losses are the next
        token's; the modules' weighted losses reach the backward through them.
        """
        if document_ids is not None:
            if attention_mask is not None:
                raise ValueError("give attention_mask or document_ids, not both")
            attention_mask = document_ids
        if inference_params is not None:
            position_ids = self._check_inference(
                input_ids, position_ids, attention_mask, inference_params
            )
        elif (
            self.config.torch_compile
            and self.config.compile_whole_model
            and self.num_stages == 1
            and self.groups.tensor.size == 1
        ):
            # No collective inside the model: one graph from the ids to the loss.
            return compiled_gpt_forward()(self, input_ids, position_ids, attention_mask, labels)
        if not hasattr(self, "mtp") or labels is None or inference_params is not None:
            return self.model_forward(
                input_ids, position_ids, attention_mask, labels, inference_params
            )
        if self.is_first:
            mtp_input_ids, mtp_position_ids = input_ids, position_ids
        elif mtp_input_ids is None:
            raise ValueError("the last stage's multi-token prediction needs mtp_input_ids")
        hidden = self.language_model(input_ids, position_ids, attention_mask)
        losses = self.output_forward(hidden, labels)
        weighted = self.mtp(
            hidden,
            mtp_input_ids,
            mtp_position_ids,
            labels,
            loss_mask,
            attention_mask,
            self._mtp_embed,
            self._mtp_head,
        )
        return attach_mtp_losses(losses, weighted, self.moe_losses)

    def _mtp_embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Multi-token prediction's embedding: the first stage's, or the last stage's copy of
        the word embeddings (no position embeddings there: validation refuses them)."""
        if self.is_first:
            return self.language_model.embedding(input_ids, position_ids)
        split = sequence_is_split(self.config, self.groups)
        return embed(
            self.word_embeddings_for_head, None, input_ids, None, self.config, split, self.training
        )

    def _mtp_head(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The output layer and per-token loss [b, s] of a prediction module's hidden states."""
        logits = logits_from_hidden(hidden, self.output_weight(), self.config)
        return loss_from_logits(logits, labels, False)

    def model_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """`forward`'s arithmetic, after the key/value cache checks."""
        hidden = self.language_model(input_ids, position_ids, attention_mask, inference_params)
        return self.output_forward(hidden, labels)

    def output_forward(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The decoder's output [s(/tp), b, h] -> what `forward` returns: a stage's
        activations, logits, or (with `labels`) per-token losses."""
        if not self.is_last:
            # What the next stage was told to expect (`activation_shape`): the residual
            # stream's dtype (the parameters', also under autocast), contiguous.
            return hidden.to(self.config.torch_dtype).contiguous()
        logits = logits_from_hidden(hidden, self.output_weight(), self.config)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, vocab(/tp)]
        if not self.config.parallel_output:
            raise ValueError("the loss needs vocab-parallel logits (parallel_output=True)")
        # A stage of several computes its loss compiled where the whole model would have
        # (no whole-model graph holds it).
        compiled = self.num_stages > 1 and compile_stage_loss(self.config, self.groups)
        losses = loss_from_logits(logits, labels, self.config.check_labels, compiled)  # [b, s(/S)]
        # DeepSpeed-Ulysses and context parallelism: every rank gets the whole sequence's
        # losses, so the loss function averages over the whole loss mask; each rank
        # back-propagates its own part.
        return gather_sequence_parts(losses, self.config.sequence_split_gradient_scale)  # [b, s]

    def _check_inference(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inference_params: InferenceParams,
    ) -> torch.Tensor:
        """Reject what the key/value cache cannot do; the positions of the new tokens [1|b, s]."""
        if self.training:
            raise RuntimeError("inference_params (the key/value cache) needs model.eval()")
        if self.config.sequence_parallel:
            raise ValueError("inference_params (the key/value cache) needs --sequence-parallel off")
        if attention_mask is not None:
            raise ValueError("inference_params (the key/value cache) takes no attention_mask")
        offset, s = inference_params.sequence_len_offset, input_ids.size(1)
        if offset + s > self.config.max_position_embeddings:
            raise ValueError(
                f"positions up to {offset + s} exceed --max-position-embeddings "
                f"{self.config.max_position_embeddings}"
            )
        if position_ids is None:
            position_ids = torch.arange(offset, offset + s, device=input_ids.device)[None]
        return position_ids


@functools.cache
def compiled_gpt_forward():
    """`GPTModel.model_forward` under `torch.compile` (`--torch-compile` at TP=1), made once."""
    return torch.compile(GPTModel.model_forward)
