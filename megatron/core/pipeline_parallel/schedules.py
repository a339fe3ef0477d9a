"""This rank's model chunks run by torch.distributed.pipelining's 1F1B or interleaved 1F1B.

`PipelineRunner` wraps each chunk in a `PipelineStage` over the pipeline group of
`parallel_state` and runs one global batch (its micro-batches concatenated on dim 0) through
`Schedule1F1B` (one chunk per rank) or `ScheduleInterleaved1F1B` (virtual stages), for
training (forward and backward of every micro-batch) or evaluation (forward only). The
shapes and dtypes passed between stages are declared to torch (`PipelineRunner._stage`), not
inferred; one schedule per micro-batch count is kept (a batch-size ramp changes it).

The loss of each micro-batch is computed on the last stage by the caller's `loss_fn(output,
target)`; torch's `scale_grads` then divides the gradients by the number of micro-batches, so
they are those of the mean loss over the global batch, as without a pipeline.

The collectives around a step live here too: the tied word embedding's gradient all-reduce
between the first and the last stage (`sync_tied_embedding_grads`, Megatron's embedding
group) and the data-parallel gradient average (`average_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state

# Elements per all-reduce of the data-parallel gradient average (bounds the extra memory).
_BUCKET_ELEMENTS = 1 << 25


class PipelineRunner:
    """Runs global batches through this rank's chunks with Megatron's 1F1B schedules."""

    def __init__(
        self,
        chunks: nn.ModuleList,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        tokens_shape: tuple[int, int],
        activation_shape: tuple[int, ...],
        activation_dtype: torch.dtype,
    ) -> None:
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.device = device
        self.tokens_shape = tokens_shape
        self.activation = (activation_shape, activation_dtype)
        self._schedules: dict[tuple[int, bool], object] = {}

    def _stage(self, chunk: nn.Module):  # noqa: ANN202 - a torch PipelineStage
        """`chunk` as a torch stage whose inputs and outputs are declared, not inferred.

        Declared shapes spare torch's first-step inference, a forward pass whose dropout
        would draw from the tensor-parallel RNG stream (which torch does not fork), so a
        resumed run would not repeat the masks of an uninterrupted one.
        """
        shape, dtype = self.activation

        def meta(size: tuple, kind: torch.dtype, grad: bool = True) -> torch.Tensor:
            return torch.empty(size, dtype=kind, device="meta", requires_grad=grad)

        tokens = (meta(self.tokens_shape, torch.long, False),) * 2  # tokens, position ids
        inputs = tokens if chunk.is_first else (meta(shape, dtype),)
        outputs = (
            (meta(self.tokens_shape, torch.float32),) if chunk.is_last else (meta(shape, dtype),)
        )
        group = parallel_state.get_pipeline_model_parallel_group()
        # Imported here: torch.distributed.pipelining imports torch's compiler (seconds of
        # start-up), which processes without a pipeline never need.
        from torch.distributed.pipelining import PipelineStage

        return PipelineStage(
            chunk,
            chunk.stage,
            chunk.num_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=group,
        )

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (it feeds the tokens)."""
        return any(chunk.is_first for chunk in self.chunks)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the losses)."""
        return any(chunk.is_last for chunk in self.chunks)

    def _schedule(self, microbatches: int, train: bool):  # noqa: ANN202 - a torch schedule
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        key = (microbatches, train)
        if key not in self._schedules:
            stages = [self._stage(chunk) for chunk in self.chunks]
            if len(stages) == 1 and microbatches < stages[0].num_stages:
                # Fewer micro-batches than stages: 1F1B never reaches its steady state and is
                # all forwards, then all backwards (Megatron's 1F1B too); torch calls it GPipe.
                schedule = ScheduleGPipe(stages[0], microbatches, loss_fn=self.loss_fn)
            elif len(stages) == 1:
                schedule = Schedule1F1B(stages[0], microbatches, loss_fn=self.loss_fn)
            else:
                schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=self.loss_fn)
            self._schedules[key] = schedule
        return self._schedules[key]

    def run(
        self,
        microbatches: int,
        inputs: tuple[torch.Tensor, ...],
        labels: torch.Tensor,
        target: torch.Tensor,
        train: bool = True,
    ) -> list[torch.Tensor]:
        """One global batch: forward (and backward when `train`) of every micro-batch.

        `inputs` (tokens, position ids) go to the first stage, a third one (document ids) and
        `labels` as keywords to every chunk and to the last stage's, `target` to `loss_fn`;
        each is the whole batch, split on dim 0. Returns the micro-batch losses
        on the last stage, an empty list elsewhere.
        """
        schedule = self._schedule(microbatches, train)
        # A third input, the document ids of packed documents, goes to every stage's chunks.
        inputs, documents = inputs[:2], inputs[2:]
        args = inputs if self.is_first else ()
        kwargs = {"labels": labels} if self.is_last else {}
        if self.is_last and any(hasattr(chunk, "mtp") for chunk in self.chunks):
            # Multi-token prediction on the last stage: the tokens it embeds, the loss mask.
            kwargs.update(loss_mask=target, mtp_input_ids=inputs[0], mtp_position_ids=inputs[1])
        if documents:
            kwargs["document_ids"] = documents[0]
        last_target = target if self.is_last else None
        losses: list[torch.Tensor] = []
        if train:
            schedule.step(*args, target=last_target, losses=losses, return_outputs=False, **kwargs)
        else:
            with torch.no_grad():
                schedule.eval(*args, target=last_target, losses=losses, **kwargs)
        return losses if self.is_last else []


def _tied_embedding_weight(chunks: nn.ModuleList) -> torch.Tensor | None:
    """This rank's copy of the shared word embedding: the first stage's, or the last stage's
    copy (the tied output layer's, or multi-token prediction's, which embeds with it)."""
    for chunk in chunks:
        shared = not chunk.config.untie_embeddings_and_output_weights or chunk.config.mtp
        if not shared or chunk.num_stages == 1:
            return None
        if chunk.is_first:
            return chunk.language_model.embedding.word_embeddings.weight
        if chunk.is_last:
            return chunk.word_embeddings_for_head.weight
    return None


def _embedding_group_all_reduce(tensor: torch.Tensor) -> None:
    group = parallel_state.get_embedding_group()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)


@torch.no_grad()
def initialize_tied_embedding(chunks: nn.ModuleList) -> None:
    """Make the last stage's head copy equal to the first stage's word embedding (Megatron:
    zero it, then all-reduce over the embedding group). A collective of every pipeline rank
    holding either end; the others return at once. Under FSDP2 each end's shards (equal
    slices at one data-parallel index, as `sync_tied_embedding_grads` sums them)."""
    weight = _tied_embedding_weight(chunks)
    if weight is None:
        return
    local = weight.data.to_local() if hasattr(weight.data, "to_local") else weight.data
    if not any(chunk.is_first for chunk in chunks):
        local.zero_()
    _embedding_group_all_reduce(local)


def sync_tied_embedding_grads(chunks: nn.ModuleList) -> None:
    """Sum the two copies' gradients (Megatron's embedding group), so both update alike.

    Under FSDP2 each copy's gradient is a shard (a DTensor): both ends shard the same shape
    over equal data-parallel groups, so the shards at one data-parallel index add up alike.
    """
    weight = _tied_embedding_weight(chunks)
    if weight is not None and weight.grad is not None:
        grad = weight.grad
        _embedding_group_all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad)


def average_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Average gradients over the data-parallel `group` in coalesced buckets (Megatron's DDP)."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return
    grads = [param.grad for param in params if param.grad is not None]
    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for grad in grads:
        per_dtype = buckets.setdefault(grad.dtype, [[]])
        if sum(g.numel() for g in per_dtype[-1]) + grad.numel() > _BUCKET_ELEMENTS:
            per_dtype.append([])
        per_dtype[-1].append(grad)
    for per_dtype in buckets.values():
        for bucket in per_dtype:
            if not bucket:
                continue
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(reduced)


def broadcast_from_last_stage(values: dict[str, float]) -> dict[str, float]:
    """The last pipeline stage's `values` on every stage of this pipeline."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    state = parallel_state.get_parallel_state()
    holder = [values if parallel_state.is_pipeline_last_stage() else None]
    group = parallel_state.get_pipeline_model_parallel_group()
    dist.broadcast_object_list(holder, src=state.pipeline_ranks[-1], group=group)
    return holder[0]
