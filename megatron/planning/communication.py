"""Bytes each rank hands to collectives per training iteration, by kind.

Counted as the issue of record defines them: the input tensor of an all-reduce,
reduce-scatter, broadcast, all-to-all or send, the output of an all-gather; per rank and
iteration, start-up and evaluation excluded. Collectives on groups of one rank count nothing.

- tensor parallel (Megatron, Shoeybi et al. 2019; Korthikanti et al. 2022 with sequence
  parallelism): see `tensor_parallel_bytes`; plus the vocabulary-parallel embedding, the
  output layer's input and the cross entropy's three [s, b] fp32 reductions.
- data parallel: the gradients, once per iteration: DDP's all-reduce of fp32 gradients;
  DeepSpeed's all-reduce (ZeRO-0, BF16_Optimizer) or reduce-scatter (ZeRO 1-3) in the
  gradients' dtype, then ZeRO 1-2's all-gather of the updated weights, ZeRO-3's
  all-gathers of every layer's weights in the forward and again in the backward.
- pipeline: each micro-batch's [s, b, h] activation sent forward and its gradient sent
  back, and the tied embeddings' gradient all-reduce between the first and last stage.
"""

from __future__ import annotations

from megatron.planning.activations import dtypes
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole

_FP32 = 4


def tensor_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Tensor-parallel collective bytes per iteration on a rank of `role`.

    Per layer, c the compute and r the residual dtype's bytes of one [s, b, h]: without
    sequence parallelism the two row-parallel outputs are all-reduced forward (2c) and the
    two column-parallel inputs' gradients backward (2r); with it each column-parallel layer
    all-gathers its input forward and again backward and reduce-scatters the input's
    gradient (2c + r), each row-parallel layer reduce-scatters its output and all-gathers
    that gradient (2c). Full recomputation repeats each layer's forward collectives.
    """
    if inputs.tp == 1:
        return 0
    config = inputs.model
    size = dtypes(inputs)
    hidden = inputs.seq_length * inputs.micro_batch * config.hidden_size
    c, r = hidden * size.compute, hidden * size.residual
    if config.sequence_parallel:
        per_layer, forward = 2 * (2 * c + r) + 2 * (2 * c), 4 * c
    else:
        per_layer, forward = 2 * c + 2 * r, 2 * c
    recomputed = role.num_layers if config.recompute_granularity == "full" else 0
    total = role.num_layers * per_layer + recomputed * forward
    if role.first:  # the vocabulary-parallel embedding's sum (or reduce-scatter), forward
        total += r
    if role.last:
        # The output layer's input (as a column-parallel layer's) and the loss's reductions.
        total += 2 * c + r if config.sequence_parallel else r
        total += 3 * inputs.seq_length * inputs.micro_batch * _FP32
    return total * inputs.micro_batches


def _gradient_bytes(inputs: PlanInputs) -> int:
    if not inputs.deepspeed:
        return _FP32  # fp32 gradients (DDP)
    if inputs.precision == "fp32":
        return _FP32
    if inputs.zero.stage in (1, 2, 3) and inputs.grad_accum_dtype == "fp32":
        return _FP32
    return 2


def data_parallel_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Data-parallel (and ZeRO) collective bytes per iteration on a rank of `role`."""
    group = inputs.zero_group if inputs.deepspeed else inputs.dp * inputs.sp
    if group == 1:
        return 0
    w = role.num_parameters
    grads = _gradient_bytes(inputs) * w
    if not inputs.deepspeed or inputs.zero.stage == 0:
        return grads  # one all-reduce of every gradient
    half = 2 if inputs.precision in ("bf16", "fp16") else _FP32
    if inputs.zero.stage in (1, 2):
        return grads + half * w  # reduce-scatter (or all-reduce) + all-gather of weights
    return grads + 2 * half * w * inputs.micro_batches  # + forward and backward gathers


def pipeline_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Pipeline sends (and tied-embedding reductions) per iteration on a rank of `role`."""
    if inputs.pp == 1:
        return 0
    config = inputs.model
    tokens = inputs.seq_length * inputs.micro_batch
    if config.sequence_parallel:
        tokens //= inputs.tp
    activation = tokens * config.hidden_size * dtypes(inputs).compute
    sends = 0 if role.last else 1  # activations forward
    sends += 0 if role.first else 1  # gradients back
    total = sends * activation * inputs.micro_batches * inputs.virtual
    if inputs.virtual > 1:
        total = 2 * activation * inputs.micro_batches * inputs.virtual
        total -= activation * inputs.micro_batches * (int(role.first) + int(role.last))
    if not config.untie_embeddings_and_output_weights and (role.first or role.last):
        total += _gradient_bytes(inputs) * config.vocab_size // inputs.tp * config.hidden_size
    return total


def rank_communication(inputs: PlanInputs, role: RankRole) -> dict[str, int]:
    """Bytes per iteration by kind, with their `total`."""
    kinds = {
        "tensor_parallel": tensor_parallel_bytes(inputs, role),
        "data_parallel": data_parallel_bytes(inputs, role),
        "pipeline": pipeline_bytes(inputs, role),
        "all_to_all": 0,
    }
    kinds["total"] = sum(kinds.values())
    return kinds
