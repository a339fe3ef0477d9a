"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

No rank ever holds the full `[s, b, vocab]` logits, and no rank holds its `[tokens, vocab/tp]`
slice in fp32 either: the math runs in fp32 (as Megatron's) on chunks of tokens, so the only
vocabulary-sized fp32 tensor is one chunk's scratch (`CHUNK_BYTES`). The forward takes the
per-token max (one all-reduce of a `[tokens]` vector), then per chunk sums exp(logit - max),
picks the target logit where this rank owns the target id and, for label smoothing, sums the
logits (one all-reduce of those `[k, tokens]` sums). Backward keeps only the logits in their
own dtype and a few `[tokens]` vectors, and recomputes the softmax chunk by chunk into a
gradient in the logits' dtype, with no collective.

A target id outside the vocabulary is owned by no rank, so its loss is silently the log-sum-exp
alone; `check_labels=True` (`--check-labels`) turns it into an error, at one device sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    all_reduce_max_over_tensor_parallel,
    all_reduce_sum_over_tensor_parallel,
)

# Bytes of one chunk's fp32 scratch ([tokens, vocab/tp], the only vocabulary-sized temporary).
# On a GPU, 64 MiB (~330 tokens of GPT-2's 50304 ids at tp 1): each kernel still streams tens
# of microseconds of memory, so kernel launches stay hidden, and the scratch is small next to
# a micro-batch's logits (8x1024 tokens in bf16: 824 MB). On a CPU, a chunk that stays in the
# 32 MiB L3 cache from one pass to the next (shift, exp, sum) runs ~2x faster than the whole
# tensor at once; smaller chunks mean more, shorter parallel regions, which stall when other
# processes hold a core (sweep in benchmarks/RESULTS.md): 8 MiB (~40 tokens) balances both.
# On a CPU a bf16 chunk also has a second fp32 temporary of the same size, briefly.
CHUNK_BYTES = 64 * 2**20
CPU_CHUNK_BYTES = 8 * 2**20


def _token_chunks(logits: torch.Tensor) -> list[slice]:
    """Row ranges of `logits` `[N, v/tp]` whose fp32 copy fits the chunk budget (>= 1 row)."""
    budget = CPU_CHUNK_BYTES if logits.device.type == "cpu" else CHUNK_BYTES
    step = max(1, budget // (4 * logits.size(1)))
    num_tokens = logits.size(0)
    return [slice(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step)]


def _shifted(logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """`logits - max` in fp32 (wider if the logits are), a new tensor: the input is untouched."""
    # bf16 minus a 2-D fp32 tensor is fp32: no separate upcast of the logits is written.
    return torch.sub(logits, logits_max.unsqueeze(-1))  # [n, v/tp]


def _partial_sums(
    logits: torch.Tensor,
    logits_max: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    with_logit_sum: bool,
) -> torch.Tensor:
    """This rank's `[k, N]` share of: sum exp(x - max), x_target - max, and sum (x - max)."""
    num_sums = 3 if with_logit_sum else 2
    stats = torch.zeros(num_sums, logits.size(0), dtype=torch.float32, device=logits.device)
    for rows in _token_chunks(logits):
        shifted = _shifted(logits[rows], logits_max[rows])  # [n, v/tp] fp32
        stats[1, rows] = shifted.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1)
        if with_logit_sum:
            stats[2, rows] = shifted.sum(dim=-1)
        stats[0, rows] = shifted.exp_().sum(dim=-1)
    stats[1].masked_fill_(~owned, 0.0)  # the rank that owns the target contributes it
    return stats


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing):
        partition_vocab = vocab_parallel_logits.size(-1)
        logits = vocab_parallel_logits.reshape(-1, partition_vocab)  # [N, v/tp]
        vocab_start = parallel_state.get_tensor_model_parallel_rank() * partition_vocab
        local_target = target.reshape(-1) - vocab_start  # [N]
        owned = (local_target >= 0) & (local_target < partition_vocab)
        local_target.masked_fill_(~owned, 0)

        # Shift by the global max for a numerically stable log-sum-exp. The max is exact in
        # the logits' dtype, so it needs no fp32 copy of them.
        logits_max = all_reduce_max_over_tensor_parallel(logits.max(dim=-1)[0].float())  # [N]
        smoothed = label_smoothing > 0
        stats = _partial_sums(logits, logits_max, local_target, owned, smoothed)  # [k, N]
        all_reduce_sum_over_tensor_parallel(stats)  # one collective for all k sums
        sum_exp, predicted = stats[0], stats[1]  # [N] each
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted

        vocab_size = partition_vocab * parallel_state.get_tensor_model_parallel_world_size()
        if smoothed:
            # Mix the one-hot target with a uniform distribution over the whole vocabulary.
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_probs = stats[2] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        # The logits as given (no copy), and [N] vectors; the max and sum of exponentials are
        # kept apart because max + log(sum) in fp32 would lose the low bits of large logits.
        ctx.save_for_backward(vocab_parallel_logits, local_target, owned, logits_max, sum_exp)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        saved_logits, local_target, owned, logits_max, sum_exp = ctx.saved_tensors
        logits = saved_logits.reshape(-1, saved_logits.size(-1))  # [N, v/tp]
        grad = torch.empty_like(logits)  # [N, v/tp], the logits' dtype
        grad_output = grad_output.reshape(-1, 1)  # [N, 1]
        # d loss / d logits = softmax - target distribution: (1 - smoothing) on the target
        # (where this rank owns it) and smoothing / V on every id.
        smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        on_target = owned.to(compute_dtype).mul_(-(1.0 - smoothing)).unsqueeze(-1)  # [N, 1]
        for rows in _token_chunks(logits):
            softmax = _shifted(logits[rows], logits_max[rows]).exp_()  # [n, v/tp] fp32
            softmax.div_(sum_exp[rows].unsqueeze(-1))
            softmax.scatter_add_(-1, local_target[rows].unsqueeze(-1), on_target[rows])
            if ctx.label_smoothing > 0:
                softmax.sub_(smoothing / ctx.vocab_size)
            torch.mul(softmax, grad_output[rows], out=grad[rows])  # rounds to the logits' dtype
        return grad.view_as(saved_logits), None, None


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
    Saves for backward the logits as given and a few `[...]` vectors, never an fp32 copy.
    Traced into a compiled graph at TP=1 it is `F.cross_entropy` on the upcast logits (inductor
    fuses that better than the chunks, and chooses what to save).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if check_labels:
        check_labels_in_vocabulary(target, vocab_parallel_logits.size(-1) * tp)
    if tp == 1 and label_smoothing == 0.0 and torch.compiler.is_compiling():
        # Traced into a compiled graph (--torch-compile at TP=1), the plain formula lets
        # inductor fuse the upcast, log-softmax and gather into a few reductions over the
        # logits; the chunk loop would unroll into many small kernels (about 2x slower there).
        logits = vocab_parallel_logits.float()
        return F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none").view(
            target.shape
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
