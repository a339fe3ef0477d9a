"""FP8 matmuls in the plan (`--fp8-format`, megatron.model.fp8): which matmuls run in FP8, what
torchao's FP8 matmul allocates beside them, and the FLOPs that run at the device's FP8 peak.

Which: every tensor-parallel linear layer of a transformer layer `Fp8Config.covers_layer`
names (`model_size.fp8_layer_parameters`: attention's QKV and output projection, the MLP's two,
DeepSpeed-MoE's experts', a routed MoE layer's shared expert's). The embedding, the output
layer, routers, Megatron-LM MoE's grouped experts and attention's core stay in the run's
precision.

Transient memory of one FP8 matmul of M rows (tokens), K inputs and N outputs on this rank
(i the compute dtype's bytes), as torchao 0.18's `matmul_with_hp_or_float8_args`
(torchao/float8/float8_linear.py) runs eagerly. It saves the high-precision input and weight,
so what it keeps for the backward is what F.linear keeps; its FP8 copies live inside one pass:

- a cast to FP8 (`hp_tensor_to_float8_dynamic`: `tensor.to(float32) * scale`, clamped, then
  `.to(float8)`) holds the fp32 scaled and clamped copies beside its 1-byte result: 9 bytes an
  element at its height (`CAST`), 1 byte after;
- forward: the input's cast (9 MK); the weight's beside the input's FP8 copy (MK + 9 NK), both
  before the output exists (so less i MN, the output F.linear would hold too); the scaled
  matmul over both (MK + NK) beside the output; with a bias (QKV's), the biased output beside the
  product (i MN); an MLP's second matmul also has the MLP's locals beside it
  (`Fp8Matmul.held`: alive only inside a layer, so no moment without FP8 counts them);
- backward: the output gradient's cast (9 MN) and the weight's again (MN + 9 NK), both kept
  to the end; the input gradient's matmul copies the FP8 weight to column-major
  (`preprocess_addmm`, NK) and writes i MK; with FP8 weight gradients (not
  `--no-fp8-wgrad`) the output gradient is cast again (9 MN) and the input (9 MK), both kept,
  and the matmul copies them to the layouts `torch._scaled_mm` takes (MN + MK), writing i NK;
- on CPUs, torch's `_scaled_mm` (`cpu_scaled_mm_bytes`) also makes its second operand
  contiguous, and its reference kernel (where oneDNN's is not used: `cpu_scaled_mm_is_onednn`,
  by the CPU's AMX) multiplies fp32 copies of both into an fp32 product;
- under FSDP2 with `--fp8-param-gather` the weight arrives in FP8 (its cast is gone); each rank
  casts its shard instead, before the gather (9 bytes an element of the largest shard).

Each pass's height is its largest step; a stage's is its largest FP8 matmul's, planned with
every activation alive (the last layer's forward, the first backward). torch.compile fuses the
casts, so there the eager figure is an upper bound. Besides: under sequence parallelism each
FP8 column-parallel layer keeps its gathered input (`keeps_gathered_input`) and so does not
gather it again in the backward (`communication.tensor_parallel_bytes`); torch.autocast casts
no FP8 layer's weights (`activations.autocast_copy_bytes`); FSDP2 with `--fp8-param-gather`
gathers the FP8 weights in 1 byte (`model_states.fp8_gathered_sizes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron.config import ModelConfig
from megatron.model.model_size import (
    fp8_forward_flops_per_token,
    fp8_layer_parameters,
    runs_in_fp8,
)
from megatron.planning.communication import expert_capacity
from megatron.planning.dtypes import dtypes
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole
from megatron.planning.routed_moe import is_routed_layer

CAST = 9
"""Bytes per element at an FP8 cast's height: the fp32 scaled copy, the fp32 clamped copy and
the FP8 result (float8_training_tensor.py `_ToFloat8ConstrFunc`, float8_utils.py
`to_fp8_saturated`)."""
_FP32 = 4


@dataclass(frozen=True)
class Fp8Matmul:
    """One FP8 matmul of a rank: [rows, inputs] x [inputs, outputs] (this rank's shard)."""

    rows: int
    inputs: int
    outputs: int
    bias: bool = False
    """The bias is added to the product inside the layer (QKV's; the others skip it)."""
    held: int = 0
    """Bytes its layer holds beside its forward that no kept activation counts: for an MLP's
    second matmul, the first one's output (still the MLP's local) and, when the matmul keeps
    a cast of it, the activation's own output (fp32 under autocast with a linear bias)."""


def keeps_gathered_input(inputs: PlanInputs, layer_number: int | None) -> bool:
    """Whether layer `layer_number`'s column-parallel layers (QKV, the MLP's first) keep their
    sequence-parallel all-gathered input, [s, b, h] instead of [s/tp, b, h], for the backward
    (`layers._gathered_fp8_linear`: torchao's matmul saves the input it multiplied)."""
    config = inputs.model
    fp8 = runs_in_fp8(config, layer_number or 1)
    return fp8 and config.sequence_parallel and inputs.tp > 1


def linear_layer_count(config: ModelConfig) -> int:
    """The model's linear layers that multiply in FP8 (every expert's counted)."""
    return sum(len(fp8_layer_parameters(config, n)) for n in range(1, config.num_layers + 1))


def _expert_rows(inputs: PlanInputs, experts: int) -> int:
    """Rows one DeepSpeed-MoE expert multiplies per micro-batch: its capacity from each of the
    layer's EP ranks, 1/TP of it at TP > 1 without expert tensor parallelism
    (`communication.all_to_all_parts`)."""
    moe = inputs.model.moe
    rows = min(inputs.ep, experts) * expert_capacity(inputs, experts)
    return rows if moe.expert_tensor_parallel else rows // inputs.tp


def layer_matmuls(inputs: PlanInputs, layer_number: int) -> list[Fp8Matmul]:
    """The FP8 matmuls of layer `layer_number` on one rank (its held experts' only)."""
    config, tp = inputs.model, inputs.tp
    experts = config.moe.experts_per_layer[layer_number - 1] if config.moe else 1
    held = -(-experts // min(inputs.ep, experts))
    expert_tp = config.moe is not None and config.moe.expert_tensor_parallel
    tokens = inputs.local_seq_length * inputs.micro_batch
    bias = config.add_bias_linear or config.add_qkv_bias
    matmuls = []
    for spec in fp8_layer_parameters(config, layer_number):
        if spec.expert is not None and spec.expert >= held:
            continue
        split = tp if spec.expert is None or expert_tp else 1
        outputs, width = spec.shape
        if spec.tensor_split == 0:
            outputs = -(-outputs // split)
        elif spec.tensor_split == 1:
            width = -(-width // split)
        rows = tokens if spec.expert is None else _expert_rows(inputs, experts)
        qkv = spec.name.endswith("query_key_value.weight")
        held = _mlp_held(inputs, rows, width) if spec.name.endswith("4h_to_h.weight") else 0
        matmuls.append(Fp8Matmul(rows, width, outputs, bias=qkv and bias, held=held))
    return matmuls


def _mlp_held(inputs: PlanInputs, rows: int, ffn: int) -> int:
    """`Fp8Matmul.held` of an MLP's second matmul over `rows` x `ffn` (`mlp.ParallelMLP`)."""
    size = dtypes(inputs)
    first = (2 * ffn if inputs.model.gated else ffn) * rows * size.compute
    cast = size.activation_input != size.compute
    return first + (rows * ffn * size.activation_input if cast else 0)


def cpu_scaled_mm_is_onednn(mixed: bool) -> bool:
    """Whether torch's CPU `_scaled_mm` runs oneDNN's kernel on this machine: with oneDNN
    enabled, on a CPU with AMX-int8 for operands of one FP8 type, AMX-fp16 for `mixed` ones
    (e5m2 gradients against e4m3 weights); else its reference kernel
    (aten/src/ATen/native/Blas.cpp `_scaled_mm_out_cpu`)."""
    import torch

    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if mixed:
        return torch.cpu._is_amx_fp16_supported()
    return torch.cpu._is_amx_tile_supported()


def cpu_scaled_mm_bytes(m: int, k: int, n: int, out_bytes: int, mixed: bool) -> int:
    """What torch's CPU `_scaled_mm` allocates beside its output for [m, k] x [k, n] (`mixed`:
    operands of two FP8 types): the second operand made contiguous (kn FP8); in the reference
    kernel also fp32 copies of each operand scaled (each `.to(float32)` beside its product
    with the scale), their fp32 product and, for a half output, its copy in the output dtype;
    oneDNN's (`cpu_scaled_mm_is_onednn`) multiplies the FP8 operands as they are (measured
    with the allocator's events: tests/planning/test_fp8_plan.py)."""
    if cpu_scaled_mm_is_onednn(mixed):
        return k * n
    upcasts = max(
        8 * m * k,
        4 * m * k + 8 * k * n,
        4 * m * k + 4 * k * n + 4 * m * n + (out_bytes * m * n if out_bytes != _FP32 else 0),
    )
    return k * n + upcasts


def _gathers_fp8_weights(inputs: PlanInputs) -> bool:
    """FSDP2 all-gathers the FP8 layers' weights already cast (`--fp8-param-gather`)."""
    return inputs.fsdp and inputs.model.fp8.param_gather


def _shard_cast(inputs: PlanInputs, matmul: Fp8Matmul) -> int:
    """FSDP2 with FP8 gathers: the cast of this rank's shard of the weight before its gather."""
    return CAST * -(-matmul.inputs * matmul.outputs // inputs.zero_group)


def forward_bytes(inputs: PlanInputs, matmul: Fp8Matmul) -> int:
    """The height of one FP8 matmul's forward above what F.linear would hold (its output and
    saved tensors are the same): see the module's docstring. The casts come before the
    output exists, so they count less the output."""
    m, k, n = matmul.rows, matmul.inputs, matmul.outputs
    half = dtypes(inputs).compute
    cpu = cpu_scaled_mm_bytes(m, k, n, half, False) if inputs.device_type == "cpu" else 0
    gathered = _gathers_fp8_weights(inputs)
    weight = 0 if gathered else n * k  # the weight's FP8 copy
    output = half * m * n
    steps = [CAST * m * k - output, m * k + weight + cpu]
    steps.append((_shard_cast(inputs, matmul) if gathered else m * k + CAST * n * k) - output)
    if matmul.bias:
        steps.append(half * m * n)  # `output + bias` beside the product
    return max(steps) + matmul.held


def backward_bytes(inputs: PlanInputs, matmul: Fp8Matmul) -> int:
    """The height of one FP8 matmul's backward, its gradients included while the FP8 copies
    live beside them: see the module's docstring."""
    m, k, n = matmul.rows, matmul.inputs, matmul.outputs
    half = dtypes(inputs).compute
    cpu = inputs.device_type == "cpu"
    gathered = _gathers_fp8_weights(inputs)
    weight = 0 if gathered else n * k
    gradient = m * n  # the output gradient's FP8 copy
    steps = [CAST * gradient]
    if gathered and inputs.sharding == "optim_grads_params":
        steps.append(_shard_cast(inputs, matmul))  # gathered again for the backward
    elif not gathered:
        steps.append(gradient + CAST * n * k)
    input_gradient = gradient + weight + n * k + half * m * k
    # The output gradient is e5m2 under the hybrid format, the weight and input e4m3.
    mixed = inputs.model.fp8.format == "hybrid"
    steps.append(input_gradient + (cpu_scaled_mm_bytes(m, n, k, half, mixed) if cpu else 0))
    held = gradient + weight + half * m * k  # and the input gradient, to the end
    if not inputs.model.fp8.wgrad:  # the weight gradient's matmul in high precision
        return max(steps + [held + half * n * k])
    steps += [held + CAST * gradient, held + gradient + CAST * m * k]
    copies = 2 * gradient + 2 * m * k  # second FP8 copies, and the layouts _scaled_mm takes
    weight_gradient = held + copies + half * n * k
    steps.append(weight_gradient + (cpu_scaled_mm_bytes(n, m, k, half, mixed) if cpu else 0))
    return max(steps)


@dataclass(frozen=True)
class Fp8Transient:
    """The largest FP8 matmul's transient bytes on a rank, by pass."""

    forward: int = 0
    backward: int = 0


def stage_transient(inputs: PlanInputs, layer_numbers: Sequence[int]) -> Fp8Transient:
    """The heights of the FP8 matmuls of a stage's layers (zero without FP8)."""
    matmuls = [mm for n in layer_numbers for mm in layer_matmuls(inputs, n)]
    if not matmuls:
        return Fp8Transient()
    return Fp8Transient(
        forward=max(forward_bytes(inputs, mm) for mm in matmuls),
        backward=max(backward_bytes(inputs, mm) for mm in matmuls),
    )


def role_transient(inputs: PlanInputs, role: RankRole) -> Fp8Transient:
    """`stage_transient` of the layers a rank of `role` runs."""
    return stage_transient(inputs, [n for chunk in role.layers for n in chunk])


def fp8_flops(inputs: PlanInputs) -> float:
    """FLOPs each rank runs in FP8 per iteration: every FP8 matmul's forward, input gradient
    and (unless `--no-fp8-wgrad`) weight gradient, and its forward again under full
    recomputation; averaged over the ranks like the model's FLOPs."""
    config = inputs.model
    if config.fp8 is None:
        return 0.0
    passes = 3 if config.fp8.wgrad else 2
    passes += 1 if config.recompute_granularity == "full" else 0
    tokens = inputs.micro_batch * inputs.micro_batches * inputs.dp * inputs.seq_length
    return passes * fp8_forward_flops_per_token(config) * tokens / inputs.world_size


def gathered_input_bytes(inputs: PlanInputs, layer_numbers: Sequence[int]) -> int:
    """What `keeps_gathered_input` adds to a micro-batch's activations on a stage: each FP8
    column-parallel layer's whole input instead of its 1/tp part (QKV's; the dense MLP's
    first)."""
    tokens = inputs.local_seq_length * inputs.micro_batch
    part = (tokens - tokens // inputs.tp) * inputs.model.hidden_size * dtypes(inputs).compute
    layers = [n for n in layer_numbers if keeps_gathered_input(inputs, n)]
    return sum(part * (1 if is_routed_layer(inputs.model, n) else 2) for n in layers)
