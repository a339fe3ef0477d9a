"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

No rank ever holds the full `[s, b, vocab]` logits: each subtracts the global max (one
all-reduce), sums its exponentials (another), and picks the target logit if it owns the
target id (a third). The backward is softmax minus one-hot, computed locally. Math runs in
fp32 whatever the logits' dtype, as Megatron does.

A target id outside the vocabulary is owned by no rank, so its loss is silently the log-sum-exp
alone; `check_labels=True` (`--check-labels`) turns it into an error, at one device sync.
"""

from __future__ import annotations

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    all_reduce_max_over_tensor_parallel,
    all_reduce_sum_over_tensor_parallel,
)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing):
        logits = vocab_parallel_logits.float()
        # Shift by the global max for a numerically stable log-sum-exp.
        logits_max = all_reduce_max_over_tensor_parallel(logits.max(dim=-1)[0])
        logits = logits - logits_max.unsqueeze(-1)

        partition_vocab = logits.size(-1)
        vocab_start = parallel_state.get_tensor_model_parallel_rank() * partition_vocab
        outside = (target < vocab_start) | (target >= vocab_start + partition_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = all_reduce_sum_over_tensor_parallel(predicted.masked_fill(outside, 0.0))

        exp_logits = logits.exp()
        sum_exp = all_reduce_sum_over_tensor_parallel(exp_logits.sum(dim=-1))
        loss = sum_exp.log() - predicted
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))

        vocab_size = partition_vocab * parallel_state.get_tensor_model_parallel_world_size()
        if label_smoothing > 0:
            # Mix the one-hot target with a uniform distribution over the whole vocabulary.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            log_probs = logits - sum_exp.log().unsqueeze(-1)
            mean_log_probs = all_reduce_sum_over_tensor_parallel(log_probs.sum(dim=-1)) / vocab_size
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # reuse the buffer: d loss / d logits = softmax - target distribution
        on_target = (~outside).float()
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
            grad.scatter_add_(
                -1, local_target.unsqueeze(-1), -(1.0 - smoothing) * on_target.unsqueeze(-1)
            )
            grad.sub_(smoothing / ctx.vocab_size)
        else:
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_target.unsqueeze(-1))
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None


class LabelOutOfVocabularyError(ValueError):
    """A target id outside the vocabulary (`--check-labels`); the message says which and where."""


def check_labels_in_vocabulary(target: torch.Tensor, vocab_size: int) -> None:
    """LabelOutOfVocabularyError naming the first target id outside [0, vocab_size), and where.

    `target` is `[s, b]` (Megatron's layout) or any shape (then the index is a tuple). Costs
    one device sync; needs no collective, since every tensor-parallel rank holds all targets.
    """
    outside = (target < 0) | (target >= vocab_size)
    if not bool(outside.any()):  # the device sync
        return
    index = tuple(int(i) for i in outside.nonzero()[0])
    where = (
        f"sequence position {index[0]}, batch index {index[1]}"
        if len(index) == 2
        else f"index {index}"
    )
    raise LabelOutOfVocabularyError(
        f"label {int(target[index])} at {where} is outside the vocabulary of {vocab_size} "
        "(the padded size the logits cover); were the data tokenized with another vocabulary?"
    )


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    check_labels: bool = False,
) -> torch.Tensor:
    """Per-token loss `[...]` from logits `[..., vocab/tp]` and target ids `[...]`, in fp32.

    Equals `F.cross_entropy(full_logits, target, reduction="none")` on the gathered logits.
    `check_labels`: first raise ValueError for a target id outside the (padded) vocabulary.
    """
    if check_labels:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        check_labels_in_vocabulary(target, vocab_parallel_logits.size(-1) * tp)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
