"""Peak memory of one rank: model states (`model_states.py`), activations, logits, buffers.

The peak is the largest of these moments of an iteration, each a sum of what is alive then:

- `forward`: the last warm-up forward has run (every micro-batch in flight keeps its
  activations), the loss works over the logits, earlier micro-batches' gradients held;
- `backward`: the same as the backward starts and its gradient buckets are allocated (under
  full recomputation, with the last checkpointed group's forward run again), with the first
  FP8 matmul's transient copies (`fp8.py`);
- `fp8 forward` (FP8 matmuls): the last layer's FP8 matmuls in the last warm-up forward,
  their transient copies beside every kept activation, before the logits exist;
- `boundary`: the last backward ends and gradients are reduced (flat copies);
- `step`: every gradient reduced, the optimizer updating (its temporaries alive);
- `embedding backward` (first stage): the embedding's dense gradient beside the held one,
  the other micro-batches in flight still holding their activations;
- `checkpoint` (a run that saves or loads): a save's or load's device transient beside the
  states (`checkpoint_transient_bytes`: DeepSpeed's engines under torch_dist gather whole
  tensors; every other save writes through host copies, FSDP2's of its own slices);
- `all-gather` (torch FSDP2): the root unit gathered (its flat output beside the
  per-parameter copies) as the forward starts, and under optim_grads_params again as the
  backward starts. FSDP2's gathered weights, the whole gradients it carries across
  micro-batches and its gradient shard join the other moments (`model_states.fsdp_states`).

Each moment is kept by column (weights, gradients, optimizer, activations, logits, buffers),
so the columns a plan prints beside its peak are the peak moment's and add up to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.deepspeed_facts import OptimizerWrapper
from megatron.planning.activations import (
    autocast_copy_bytes,
    layer_bytes,
    logits_bytes,
    logits_working_bytes,
    stage_activation_bytes,
)
from megatron.planning.fp8 import role_transient
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole, micro_batches_in_flight
from megatron.planning.model_states import States, gradient_bytes, model_states

_FP32 = 4

COLUMNS = ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
"""What a rank's bytes are, as the plan's table and JSON list them."""


@dataclass
class RankMemory:
    """Bytes one rank holds at its predicted peak, by column (they add up to `peak_bytes`)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    """Framework buffers, gradient buckets and flat copies, the optimizer's temporaries."""
    peak_bytes: int
    peak_at: str
    """The moment of the peak (`forward`, `backward`, `boundary`, `step`, ...)."""
    moments: dict[str, int] = field(default_factory=dict)
    """Every moment's total."""
    offloaded: int = 0
    """Optimizer bytes held in host memory (ZeRO offload), not on the device."""

    def as_json(self) -> dict:
        """The `memory` object of `--dry-run-json`."""
        return {
            **{column: getattr(self, column) for column in COLUMNS},
            "peak_bytes": self.peak_bytes,
            "peak_at": self.peak_at,
            "moments": dict(self.moments),
            "offloaded_to_host": self.offloaded,
        }


def _moment(*parts: dict[str, int]) -> dict[str, int]:
    """The columns of a moment made of `parts` (each a partial column -> bytes map)."""
    total = dict.fromkeys(COLUMNS, 0)
    for part in parts:
        for column, count in part.items():
            total[column] += count
    return total


def _pipe_outputs(inputs: PlanInputs, role: RankRole) -> int:
    """DeepSpeed's pipeline engine on the last stage: each micro-batch's outputs (the logits)
    stay in its pipe buffer until the buffer is reused.

    pipe/schedule.py TrainSchedule.num_pipe_buffers (L247-256): at least two buffers;
    pipe/engine.py _exec_backward_pass (L798-800) returns on the last stage before
    "self.pipe_buffers['outputs'][buffer_id] = None" (L866), so the last two micro-batches'
    logits are alive through the boundary and the step."""
    if not role.last or inputs.engine != "deepspeed-pipeline":
        return 0
    return min(2, inputs.micro_batches) * logits_bytes(inputs)


def recomputed_group_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Under full recomputation, what one checkpointed group keeps while its backward runs:
    the backward first runs the group's forward again, so its layers hold everything they
    keep without recomputation (`layer_bytes`) until their own backward. Groups are
    `--recompute-num-layers` layers (`uniform`), or single layers (`block`)."""
    config = inputs.model
    if config.recompute_granularity != "full" or role.num_layers == 0:
        return 0
    group = config.recompute_num_layers if config.recompute_method == "uniform" else 1
    numbers = [n for chunk in role.layers for n in chunk]
    return sum(layer_bytes(inputs, layer_number=n) for n in numbers[-min(group, len(numbers)) :])


def rank_memory(inputs: PlanInputs, role: RankRole) -> RankMemory:
    """The predicted peak of a rank of `role`, and what it is made of."""
    states = model_states(inputs, role)
    in_flight = micro_batches_in_flight(inputs, role.pp_rank)
    numbers = [n for chunk in role.layers for n in chunk]
    per_micro_batch = stage_activation_bytes(
        inputs, role.num_layers, role.first, role.last, numbers
    )
    activations = int(in_flight * per_micro_batch)
    activations += autocast_copy_bytes(inputs, role.num_layers, role.last, numbers)
    pipe_outputs = _pipe_outputs(inputs, role)
    logits = logits_bytes(inputs) + logits_working_bytes(inputs) if role.last else 0
    if pipe_outputs:  # the previous micro-batch's logits, still in their pipe buffer
        logits += pipe_outputs - logits_bytes(inputs)
    fixed = _fixed(states)
    held = {"gradients": states.gradients + states.accumulators, "buffers": states.held_buckets}
    # From the first backward to the step; carried into later forwards with accumulation. A
    # backward's first gradient allocates the accumulators and buckets, not the gradients.
    several = inputs.micro_batches > 1
    carried = _moment(held, {"gradients": states.unsharded_gradients}) if several else {}
    first_gradient = carried or {"gradients": states.accumulators, "buffers": states.held_buckets}
    gathered = {"weights": states.gathered}
    forward = _moment(fixed, gathered, carried, {"activations": activations, "logits": logits})
    # Gradient buckets are allocated at a backward's first parameter gradient: after the
    # loss and the output layer (their logits freed, but for the pipe buffers'), beside the
    # output weight's gradient.
    head_gradient = gradient_bytes(inputs) * role.parameters["head"] if role.last else 0
    recomputed = recomputed_group_bytes(inputs, role)  # the last group's, as it starts
    # FP8 matmuls' transient copies (`fp8.py`): the first backward's, or under full
    # recomputation its forward's run again, beside everything still kept.
    fp8 = role_transient(inputs, role)
    full = inputs.model.recompute_granularity == "full"
    fp8_backward = max(fp8.backward, fp8.forward) if full else fp8.backward
    backward = _moment(
        fixed,
        gathered,
        first_gradient,
        {"activations": activations + recomputed, "logits": pipe_outputs},
        {"buffers": states.backward_buckets + fp8_backward, "gradients": head_gradient},
        {"weights": states.prefetched},
    )
    late = {"logits": pipe_outputs, "gradients": states.sharded_gradients}
    boundary = _moment(fixed, held, late, {"buffers": states.backward_buckets + states.reduction})
    step = _moment(fixed, held, late, {"buffers": states.step_temporaries})
    moments = {"forward": forward, "backward": backward, "boundary": boundary, "step": step}
    if fp8.forward:
        # The last layer's FP8 matmuls in the last warm-up forward: before the logits exist.
        columns = {"activations": activations, "buffers": fp8.forward}
        moments["fp8 forward"] = _moment(fixed, gathered, carried, columns)
    checkpoint = checkpoint_transient_bytes(inputs, role)
    if checkpoint:
        moments["checkpoint"] = _moment(fixed, {"buffers": checkpoint})
    if states.gather_copy:
        moments["all-gather"] = _fsdp_root_gather(inputs, states, fixed, carried, activations)
    if role.first:
        # The embedding's backward ends each micro-batch's backward on the first stage: a
        # dense gradient of the whole word-embedding shard, added to the held one after.
        # By then that micro-batch's activations are gone, the others' in flight are not.
        rows = inputs.model.vocab_size // inputs.tp
        embedding = gradient_bytes(inputs) * rows * inputs.model.hidden_size
        remaining = activations - int(per_micro_batch / inputs.virtual)
        # FSDP2: the root's weights are still gathered; the gradients are whole until the
        # last micro-batch, where the layers' are shards by now (the root's still whole).
        fsdp = {"weights": states.root_gathered, "gradients": states.unsharded_gradients}
        if not several:
            fsdp["gradients"] = states.sharded_gradients + gradient_bytes(inputs) * (
                role.parameters["embedding"] + role.parameters["head"]
            )
        moments["embedding backward"] = _moment(
            fixed,
            held,
            {"logits": pipe_outputs},
            fsdp if inputs.fsdp else {},
            {"gradients": embedding, "activations": max(0, remaining)},
        )
    totals = {name: sum(columns.values()) for name, columns in moments.items()}
    peak_at = max(totals, key=totals.__getitem__)
    return RankMemory(
        **moments[peak_at],
        peak_bytes=totals[peak_at],
        peak_at=peak_at,
        moments=totals,
        offloaded=states.offloaded,
    )


def checkpoint_transient_bytes(inputs: PlanInputs, role: RankRole) -> int:
    """Device bytes a checkpoint save or load adds on a rank of `role` beside its states.

    DeepSpeed's engines under `--ckpt-format torch_dist` gather each parameter's whole fp32
    master weight and Adam moments (`megatron.checkpointing.deepspeed_tensors`: DeepSpeed's
    `safe_get_full_*`), all of this rank's tensor-parallel x pipeline shard before writing,
    and load into tensors of those whole shapes: 12 bytes a parameter. Every other save
    writes each tensor through a host copy (torch.save, DCP's writer; under FSDP2 each rank
    its own slices: `megatron.checkpointing.fsdp_slices`) and every other load reads into
    host buffers before copying into the rank's tensors: nothing the device holds at once
    beyond one tensor's copy, which the plan does not count."""
    if not (inputs.checkpoints and inputs.deepspeed and inputs.checkpoint_format == "torch_dist"):
        return 0
    if inputs.wrapper is None or inputs.wrapper is OptimizerWrapper.CLIENT:
        return 0  # fp32 ZeRO-0: the client optimizer's own tensors are written in place
    return 3 * _FP32 * role.num_parameters


def _fsdp_root_gather(
    inputs: PlanInputs, states: States, fixed: dict, carried: dict, activations: int
) -> dict[str, int]:
    """FSDP2's gather of the root unit (the largest: the embeddings): its flat all-gather
    output and the per-parameter copies made of it, at the forward's start, and under
    optim_grads_params again as the backward starts, beside the kept activations and
    logits."""
    gather = {"weights": states.root_gathered + states.gather_copy}
    if inputs.sharding != "optim_grads_params":
        return _moment(fixed, carried, gather)
    return _moment(
        fixed, carried, gather, {"activations": activations, "logits": logits_bytes(inputs)}
    )


def _fixed(states: States) -> dict[str, int]:
    """What a rank holds all through the iteration."""
    return {
        "weights": states.weights,
        "optimizer": states.optimizer,
        "gradients": states.gradient_buffers,
        "buffers": states.buffers,
    }
