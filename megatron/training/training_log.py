"""The TensorBoard / W&B scalars of Megatron-DeepSpeed's `training_log` and
`evaluate_and_print_results` (megatron/training.py at f4157bea), tag for tag.

Most values are written three times, as theirs: against the iteration, as '<tag> vs samples'
against the consumed samples and as '<tag> vs tokens' against the consumed tokens. The flags
(`--log-batch-size-to-tensorboard`, `--log-memory-to-tensorboard`, ...) add or remove the same
groups theirs do. The numbers only some flags ask for are measured here too: the parameter
norm (`--log-params-norm`), the norms of Adam's moments (`--log-optimizer-states-to-tensorboard`)
and the memory in use (`--log-memory-to-tensorboard`). Collectives run on every rank; writing
is left to the rank that holds the writer.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megatron.checkpointing import TrainState
from megatron.core import parallel_state
from megatron.model.moe_aux_loss import PER_LAYER_PREFIX
from megatron.training.monitor import MetricsWriter, _resident_set_bytes
from megatron.training.optimizer import all_reduce_if_distributed, counted_once
from megatron.training.step import StepResult
from megatron.utils import current_device

# The names Megatron gives the x axes of the 'vs' curves (W&B step metrics).
SAMPLES_AXIS = "Samples"
TOKENS_AXIS = "Tokens"

# The timers the report prints and --log-timers-to-tensorboard writes as '<name>-time': those
# of Megatron's timers_to_log our steps start (level 1, step.py), in its order, then ours:
# 'train-step' spans the whole iteration, also on the pipeline engine, where Megatron times none.
TIMERS_TO_LOG = ("forward-backward", "optimizer", "train-step")

# Megatron's optimizer/* tags: sums over elements (then the square root for *_l2), and maxima.
_OPTIMIZER_SUM_TAGS = (
    "variance_l2",
    "variance_sqrt_l2",
    "momentum_l2",
    "weight_l2",
    "variance_l1",
    "variance_sqrt_l1",
    "momentum_l1",
    "weight_l1",
)
_OPTIMIZER_MAX_TAGS = (
    "variance_abs_max",
    "variance_sqrt_abs_max",
    "momentum_abs_max",
    "weight_abs_max",
)


def add_scalar_vs(writer: MetricsWriter, tag: str, value: float, state: TrainState) -> None:
    """`tag` at the iteration, '`tag` vs samples' and '`tag` vs tokens' at the consumed counts."""
    writer.add_scalar(tag, value, state.iteration)
    writer.add_scalar(f"{tag} vs samples", value, state.consumed_train_samples, SAMPLES_AXIS)
    writer.add_scalar(f"{tag} vs tokens", value, state.consumed_train_tokens, TOKENS_AXIS)


def memory_scalars() -> dict[str, float]:
    """Megatron's mem-* tags from the CUDA allocator; the process's resident set on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        return {
            "mem-reserved-bytes": float(stats.get("reserved_bytes.all.current", 0)),
            "mem-allocated-bytes": float(stats.get("allocated_bytes.all.current", 0)),
            "mem-allocated-count": float(stats.get("allocation.all.current", 0)),
        }
    # Megatron has no CPU numbers (it reads torch.cuda.memory_stats()): new tags, CPU only.
    current, peak = _resident_set_bytes()
    return {"mem-rss-bytes": current, "mem-max-rss-bytes": peak}


def write_training_scalars(
    writer: MetricsWriter,
    args: argparse.Namespace,
    state: TrainState,
    result: StepResult,
    learning_rate: float,
    batch_size: int,
    params_norm: float | None,
) -> None:
    """What `training_log` writes every --tensorboard-log-interval iterations, in its order."""
    add, samples, tokens = (
        writer.add_scalar,
        state.consumed_train_samples,
        state.consumed_train_tokens,
    )
    add("steps-vs-samples/y=steps,x=samples", state.iteration, samples, SAMPLES_AXIS)
    add("steps-vs-samples/y=samples,x=steps", samples, state.iteration)
    add("steps-vs-tokens/y=steps,x=tokens", state.iteration, tokens, TOKENS_AXIS)
    add("steps-vs-tokens/y=tokens,x=steps", tokens, state.iteration)
    if args.log_learning_rate_to_tensorboard:
        add_scalar_vs(writer, "learning-rate/learning-rate", learning_rate, state)
    if args.log_batch_size_to_tensorboard:
        add_scalar_vs(writer, "batch-size/batch-size", batch_size, state)
    for name, value in result.losses.items():
        # Megatron-LM's per-layer MoE tags ('moe/load_balancing_loss_layer_0') as they are.
        tag = name if name.startswith(PER_LAYER_PREFIX) else f"lm-loss-training/{name}"
        add_scalar_vs(writer, tag, value, state)
    # As theirs: only fp16 has a loss scale worth a curve (bf16 and fp32 report none).
    if args.fp16 and result.loss_scale and args.log_loss_scale_to_tensorboard:
        add_scalar_vs(writer, "loss-scale/loss-scale", result.loss_scale, state)
    if args.log_world_size_to_tensorboard:
        add_scalar_vs(writer, "world-size/world-size", args.world_size, state)
    if result.grad_norm is not None:
        add_scalar_vs(writer, "grad-norm/grad-norm", result.grad_norm, state)
    if result.num_zeros_in_grad is not None:
        add_scalar_vs(writer, "num-zeros/num-zeros", result.num_zeros_in_grad, state)
    if params_norm is not None:
        add_scalar_vs(writer, "params-norm/params-norm", params_norm, state)
    # Theirs sets actual_seq_length every iteration (curriculum learning may shorten it).
    add_scalar_vs(writer, "seqlen/actual_seq_length", args.seq_length, state)
    if args.log_memory_to_tensorboard:
        writer.add_scalars(memory_scalars(), state.iteration)


def write_optimizer_state_stats(
    writer: MetricsWriter, stats: dict[str, float], state: TrainState
) -> None:
    """Megatron's optimizer/* tags: first against the consumed tokens, then the iteration."""
    for name, value in stats.items():
        writer.add_scalar(f"{name} vs tokens", value, state.consumed_train_tokens, TOKENS_AXIS)
    writer.add_scalars(stats, state.iteration)


def write_validation_scalars(
    writer: MetricsWriter,
    losses: dict[str, float],
    state: TrainState,
    test: bool = False,
    log_ppl: bool = False,
) -> None:
    """`evaluate_and_print_results`' lm-loss-validation/* tags ('test' for the test set)."""
    data_type = "test" if test else "validation"
    for name, value in losses.items():
        add_scalar_vs(writer, f"lm-loss-validation/{name} {data_type}", value, state)
        if log_ppl:
            # Capped as in the printed block, so a diverged loss still gives a number.
            ppl = math.exp(min(20.0, value))
            add_scalar_vs(writer, f"lm-loss-validation/{name} {data_type} ppl", ppl, state)


def params_l2_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """L2 norm of the whole model from this rank's parameters (Megatron's calc_params_l2_norm).

    Every rank of the model-parallel group must call it. Each weight counts once: replicated
    ones on tensor-parallel rank 0, tied copies on their first stage. ZeRO-3 parameters are
    read from this rank's partition (`ds_tensor`) and summed over the data-parallel group too;
    FSDP2's from this rank's shards, summed over their sharding groups.
    """
    tp_rank_0 = parallel_state.get_tensor_model_parallel_rank() == 0
    device = current_device()
    squares = torch.zeros((), dtype=torch.float64, device=device)
    zero3 = False
    # FSDP2's parameters are DTensors: each rank squares its shard, and the sums of the
    # tensors sharded alike are added over their sharding groups (never gathered).
    sharded: dict[tuple, torch.Tensor] = {}
    for param in params:
        if not counted_once(param, tp_rank_0):
            continue
        data = getattr(param, "ds_tensor", None)
        zero3 = zero3 or data is not None
        data = param.detach() if data is None else data.detach()
        if hasattr(data, "to_local"):
            groups = tuple(
                data.device_mesh.get_group(dim)
                for dim, placement in enumerate(data.placements)
                if placement.is_shard()
            )
            data = data.to_local()
            if groups:
                square = torch.linalg.vector_norm(data, dtype=torch.float64).square().to(device)
                sharded[groups] = sharded[groups] + square if groups in sharded else square
                continue
        # float64: a float32 sum over millions of elements drifts by ~1e-4 on CPU.
        squares += torch.linalg.vector_norm(data, dtype=torch.float64).square().to(device)
    for groups, square in sharded.items():  # the same order on every rank
        for group in groups:
            all_reduce_if_distributed(square, dist.ReduceOp.SUM, group)
        squares += square
    # ZeRO-3 partitions every parameter, so all ranks of a group agree on `zero3`. DeepSpeed
    # partitions over the sequence-data-parallel group (the data-parallel one without Ulysses).
    if zero3:
        all_reduce_if_distributed(
            squares, dist.ReduceOp.SUM, parallel_state.get_sequence_data_parallel_group()
        )
    # get_model_parallel_world_size() is Megatron's legacy name for the tensor-parallel size.
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp * parallel_state.get_pipeline_model_parallel_world_size() > 1:
        all_reduce_if_distributed(
            squares, dist.ReduceOp.SUM, parallel_state.get_model_parallel_group()
        )
    return squares.sqrt().item()


def _adam_states(
    optimizer: object,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(weight, exp_avg, exp_avg_sq) for every parameter this rank's optimizer holds state for.

    Under DeepSpeed the parameters are its fp32 master copies (flat ZeRO partitions); the
    wrappers expose the wrapped AdamW's `state`, and older ones only `optimizer.state`.
    """
    state = getattr(optimizer, "state", None)
    if state is None:
        state = optimizer.optimizer.state
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = state.get(param, {})
            # No state before a parameter's first update (or ever, without a gradient).
            if "exp_avg" in entry and "exp_avg_sq" in entry and param.numel() > 0:
                yield param.detach(), entry["exp_avg"], entry["exp_avg_sq"]


def optimizer_state_stats(optimizer: object, partitioned: bool) -> dict[str, float]:
    """Megatron's optimizer/* values: L2 and L1 norms and absolute maxima of Adam's second
    moment (variance), its square root, the first moment (momentum) and the weights.

    Every rank must call it. As theirs: summed (maxed) over the data-parallel group when the
    state is partitioned, then over the tensor- and pipeline-parallel groups, so a weight that
    several model-parallel ranks hold (norms, a tied embedding) counts once per holder.
    """
    sums, maxima = [], []
    for weight, exp_avg, exp_avg_sq in _adam_states(optimizer):
        variance, momentum, weight = exp_avg_sq.float(), exp_avg.float(), weight.float()
        variance_sqrt = variance.sqrt()
        tensors = (variance, variance_sqrt, momentum, weight)
        # float64 sums, as in params_l2_norm.
        l2 = [torch.linalg.vector_norm(t, dtype=torch.float64).square() for t in tensors]
        l1 = [torch.linalg.vector_norm(t, ord=1, dtype=torch.float64) for t in tensors]
        sums.append(torch.stack(l2 + l1))
        maxima.append(torch.stack([t.abs().max().double() for t in tensors]))
    device = current_device()
    total = torch.stack(sums).sum(0) if sums else torch.zeros(8, dtype=torch.float64)
    largest = torch.stack(maxima).amax(0) if maxima else torch.zeros(4, dtype=torch.float64)
    total, largest = total.to(device), largest.to(device)
    groups = []
    if partitioned:  # over the ranks DeepSpeed partitions across (see params_l2_norm)
        groups.append(parallel_state.get_sequence_data_parallel_group())
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        groups.append(parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        groups.append(parallel_state.get_pipeline_model_parallel_group())
    for group in groups:
        all_reduce_if_distributed(total, dist.ReduceOp.SUM, group)
        all_reduce_if_distributed(largest, dist.ReduceOp.MAX, group)
    total, largest = total.tolist(), largest.tolist()
    values = {}
    for index, name in enumerate(_OPTIMIZER_SUM_TAGS):
        values[f"optimizer/{name}"] = total[index] ** 0.5 if index < 4 else total[index]
    for index, name in enumerate(_OPTIMIZER_MAX_TAGS):
        values[f"optimizer/{name}"] = largest[index]
    return values
