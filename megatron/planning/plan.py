"""A plan: every rank's memory and communication, FLOPs, and on a named device the roofline.

plan = build_plan(PlanInputs.from_args(args, "cuda"), device=find_device("H100"))
print(format_plan(plan)); json.dump(plan.as_json(), file)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron.deepspeed_facts import DEEPSPEED_VERSION_READ
from megatron.model.fp8 import has_fp8_tensor_cores
from megatron.model.model_size import flops_per_token, num_parameters
from megatron.model.moe_router import expert_capacity
from megatron.planning.communication import (
    context_parallel_parts,
    has_expert_parallel_kind,
    rank_communication,
)
from megatron.planning.devices import Device
from megatron.planning.dtypes import dtypes
from megatron.planning.fp8 import (
    Fp8Transient,
    gathered_input_bytes,
    linear_layer_count,
    role_transient,
)
from megatron.planning.inputs import PlanInputs
from megatron.planning.layout import RankRole, rank_places, stage_roles
from megatron.planning.memory import RankMemory, rank_memory
from megatron.planning.roofline import StepEstimate, estimate_step
from megatron.planning.routed_moe import (
    BALANCED_LOAD_NOTE,
    dispatch_bytes,
    routed_mlp_bytes,
    routed_rows,
    routed_tokens,
)

_GIB = 1024**3

# What the model does not predict, said in every plan.
NOT_MODELLED = (
    "not predicted: the CUDA context and allocator fragmentation (kept as the device's "
    "headroom), the data loader's pinned batches, torch.compile's workspaces, a DeepSpeed-MoE "
    "expert's load without token dropping (the bound is planned), and on CPU the "
    "framework's own resident memory"
)


@dataclass
class RolePlan:
    """One pipeline stage's ranks: what they hold and send."""

    role: RankRole
    memory: RankMemory
    communication: dict[str, int]


@dataclass
class Plan:
    """The whole job's plan."""

    inputs: PlanInputs
    roles: list[RolePlan]
    device: Device | None
    estimate: StepEstimate | None
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The largest predicted peak of any rank."""
        return max(role.memory.peak_bytes for role in self.roles)

    @property
    def fits(self) -> bool | None:
        """Whether every rank fits the device (None without a device)."""
        return None if self.device is None else self.peak_bytes <= self.device.usable_bytes

    def as_json(self) -> dict:
        """`--dry-run-json`: one entry per global rank, then the job's figures."""
        ranks = []
        inputs = self.inputs
        for place in rank_places(inputs):
            role = self.roles[place.pp_rank]
            ranks.append(
                {
                    "rank": place.rank,
                    "tp_rank": place.tp_rank,
                    "pp_rank": place.pp_rank,
                    "dp_rank": place.dp_rank,
                    "sp_rank": place.sp_rank,
                    "cp_rank": place.sp_rank if inputs.cp > 1 else 0,
                    "parameters": role.role.num_parameters,
                    "layers": role.role.num_layers,
                    "memory": role.memory.as_json(),
                    "comm_bytes_per_iteration": dict(role.communication),
                }
            )
        inputs = self.inputs
        result = {
            "world_size": inputs.world_size,
            "layout": {
                "tensor_parallel": inputs.tp,
                "pipeline_parallel": inputs.pp,
                "virtual_pipeline": inputs.virtual,
                "data_parallel": inputs.dp,
                "sequence_parallel_ulysses": inputs.sp,
                "context_parallel": inputs.cp,
                "cp_comm_types": list(inputs.model.cp_comm_types) if inputs.cp > 1 else [],
                "expert_parallel": inputs.ep,
                "engine": inputs.engine,
                "zero_stage": inputs.zero.stage,
                "sharding": inputs.sharding,
                "precision": inputs.precision,
                "micro_batch_size": inputs.micro_batch,
                "micro_batches_per_iteration": inputs.micro_batches,
                "seq_length": inputs.seq_length,
            },
            "parameters": num_parameters(inputs.model),
            "flops_per_iteration": flops_per_token(inputs.model, inputs.seq_length)
            * inputs.seq_length
            * inputs.micro_batch
            * inputs.micro_batches
            * inputs.dp,
            "ranks": ranks,
            "peak_bytes": self.peak_bytes,
            "notes": list(self.notes) + [NOT_MODELLED],
        }
        fp8 = inputs.model.fp8
        if fp8 is not None:
            transient = _largest_fp8_transient(self)
            result["fp8"] = {
                "format": fp8.format,
                "recipe": fp8.recipe,
                "wgrad": fp8.wgrad,
                "param_gather": fp8.param_gather and inputs.fsdp,
                "linear_layers": linear_layer_count(inputs.model),
                "transient_forward_bytes": transient.forward,
                "transient_backward_bytes": transient.backward,
            }
        if self.device is not None:
            estimate = self.estimate
            result["device"] = {
                "name": self.device.name,
                "usable_bytes": self.device.usable_bytes,
                "fits": self.fits,
                "step_seconds": estimate.step_s,
                "mfu": estimate.mfu,
                "tokens_per_second": estimate.tokens_per_s,
                "bubble": estimate.bubble,
            }
            if fp8 is not None:
                result["device"]["fp8_flops_per_iteration"] = estimate.fp8_flops
                result["device"]["fp8_peak_flops"] = self.device.fp8_flops
            if inputs.model.routed_moe is not None and inputs.model.routed_moe.overlap_expert_comm:
                result["device"]["expert_comm_hidden"] = estimate.expert_comm_hidden
            if inputs.cp > 1:
                result["device"]["context_parallel_exposed_seconds"] = estimate.context_parallel_s
                result["device"]["context_parallel_hidden"] = estimate.context_parallel_hidden
        return result


def build_plan(inputs: PlanInputs, device: Device | None = None, notes: list | None = None) -> Plan:
    """Plan every pipeline stage of `inputs`; with `device`, the roofline of the busiest (and
    its compute capability for the runtime's rules, on a GPU plan)."""
    if device is not None and inputs.device_type == "cuda":
        inputs = dataclasses.replace(inputs, compute_capability=device.compute_capability)
    roles = []
    for role in stage_roles(inputs):
        roles.append(RolePlan(role, rank_memory(inputs, role), rank_communication(inputs, role)))
    estimate = None
    if device is not None:
        busiest = max(roles, key=lambda plan: plan.communication["total"])
        estimate = estimate_step(inputs, busiest.role, device)
    notes = list(notes or []) + deepspeed_notes(inputs) + fp8_notes(inputs, device)
    notes += checkpoint_notes(roles)
    moe = inputs.model.routed_moe
    if moe is not None and inputs.ep > 1 and expert_capacity(moe, routed_tokens(inputs)) is None:
        notes.append(BALANCED_LOAD_NOTE)
    return Plan(inputs, roles, device, estimate, notes)


def deepspeed_notes(inputs: PlanInputs) -> list[str]:
    """What a DeepSpeed plan is read from, and what of it no GPU has checked yet."""
    if not inputs.deepspeed:
        return []
    wrapper = inputs.wrapper
    notes = [
        f"DeepSpeed's optimizer wrapper {wrapper.value} and its memory terms as read from "
        f"DeepSpeed {DEEPSPEED_VERSION_READ}'s source (megatron/deepspeed_facts.py)"
    ]
    if inputs.precision == "fp16":
        notes.append(
            f"fp16 terms: read from DeepSpeed {DEEPSPEED_VERSION_READ}'s source and measured on "
            "a CPU with fp16 support (benchmarks/planner_accuracy.py), not yet checked on a GPU "
            "against torch.cuda.max_memory_allocated"
        )
    return notes


def checkpoint_notes(roles: list[RolePlan]) -> list[str]:
    """The `checkpoint` moment's line where a save or load holds device memory of its own."""
    worst = max(roles, key=lambda plan: plan.memory.moments.get("checkpoint", 0))
    total = worst.memory.moments.get("checkpoint", 0)
    if not total:
        return []
    return [
        f"a save or load gathers this rank's whole fp32 weights and Adam moments "
        f"(DeepSpeed with --ckpt-format torch_dist): {_gib(total)} GiB at that moment on "
        f"stage {worst.role.pp_rank}; DeepSpeed's own format (--ckpt-format torch) writes "
        "each rank's partition"
    ]


def fp8_notes(inputs: PlanInputs, device: Device | None) -> list[str]:
    """What an FP8 plan assumes: eager casts, and a device without FP8 tensor cores (the
    runtime's check, `has_fp8_tensor_cores`) or without an FP8 peak in the table."""
    if inputs.model.fp8 is None:
        return []
    notes = []
    if inputs.model.torch_compile:
        notes.append(
            "FP8 casts planned as torchao runs them eagerly (fp32 scaled and clamped copies, 9 "
            "bytes an element at each cast); torch.compile fuses them: the FP8 transient is "
            "an upper bound"
        )
    if device is not None and not has_fp8_tensor_cores(device.compute_capability):
        notes.append(
            f"{device.name} has no FP8 tensor cores: a run with --fp8-format stops there at "
            f"start-up; its FP8 matmuls are timed at the {inputs.precision} peak"
        )
    elif device is not None and device.fp8_flops is None:
        notes.append(
            f"{device.name}: no FP8 peak in the device table; its FP8 matmuls are timed at the "
            f"{inputs.precision} peak"
        )
    return notes


def _largest_fp8_transient(plan: Plan) -> Fp8Transient:
    """The largest FP8 transient of any stage, by pass."""
    transients = [role_transient(plan.inputs, role.role) for role in plan.roles]
    return Fp8Transient(
        forward=max(t.forward for t in transients), backward=max(t.backward for t in transients)
    )


def _fp8_line(plan: Plan) -> str:
    """The FP8 line: the recipe, how many linear layers, the transient copies at the peak,
    and what else FP8 changes in this plan."""
    inputs = plan.inputs
    fp8, config = inputs.model.fp8, inputs.model
    transient = _largest_fp8_transient(plan)
    largest = max(transient.forward, transient.backward)
    line = (
        f"  FP8 matmuls {fp8.format} {fp8.recipe}: {linear_layer_count(config)} linear "
        f"layers; transient FP8 copies {largest / 2**20:.1f} MiB (largest per rank: forward "
        f"{transient.forward / 2**20:.1f}, backward {transient.backward / 2**20:.1f} MiB, in "
        f"'buffers'); embedding, output layer and attention core in {inputs.precision}"
    )
    if not fp8.wgrad:
        line += "; weight gradients in high precision"
    kept = max(
        gathered_input_bytes(inputs, [n for chunk in role.role.layers for n in chunk])
        for role in plan.roles
    )
    if kept:
        line += f"; whole-sequence inputs kept +{kept / 2**20:.1f} MiB per micro-batch"
    if fp8.param_gather and inputs.fsdp:
        line += "; FSDP2 gathers their weights in FP8"
    if plan.estimate is not None and plan.device.fp8_flops:
        share = plan.estimate.fp8_flops / plan.estimate.executed_flops
        line += f"; {share:.0%} of the FLOPs at {plan.device.fp8_flops / 1e12:,.0f} TFLOP/s FP8"
    return line


def _gib(count: float) -> str:
    return f"{count / _GIB:.2f}"


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value >= 1 else f"{value * 1e3:.2f} ms"


def _context_parallel_line(plan: Plan) -> str:
    """The CP line: the busiest stage's bytes by kind and, on a device, how much of their
    time the ring hides behind attention."""
    inputs = plan.inputs
    busiest = max(plan.roles, key=lambda role: role.communication["context_parallel"])
    parts = context_parallel_parts(inputs, busiest.role)
    kinds = ", ".join(f"{kind} {count / 1e6:.1f}" for kind, count in parts.items() if count)
    types = sorted(set(inputs.model.cp_comm_types))
    line = (
        f"  context parallel {inputs.cp} ({'/'.join(types)}): "
        f"{busiest.communication['context_parallel'] / 1e6:.1f} MB per rank and iteration "
        f"({kinds} MB)"
    )
    if plan.estimate is None:
        return line + "; name a device (--dry-run-device) for its overlap with attention"
    estimate = plan.estimate
    return (
        f"{line}; {estimate.context_parallel_hidden:.0%} of its time hidden behind "
        f"attention, {_seconds(estimate.context_parallel_s)} exposed"
    )


def _routed_moe_line(plan: Plan) -> str:
    """The routed MoE line: what one MoE layer keeps and sends per micro-batch on a rank."""
    inputs = plan.inputs
    moe = inputs.model.routed_moe
    size = dtypes(inputs)
    layers = sum(moe.moe_layers)
    dispatched = dispatch_bytes(inputs, size)
    sent = ", ".join(
        f"{op.replace('_', '-')} {count / 1e6:.1f}" for op, count in dispatched.items()
    )
    kept = (
        "capacity-bound" if expert_capacity(moe, routed_tokens(inputs)) is not None else "balanced"
    )
    return (
        f"  routed MoE: {layers} of {inputs.model.num_layers} layers, top-{moe.top_k} of "
        f"{moe.num_experts} experts, EP {inputs.ep}, {moe.dispatcher} dispatcher; per MoE "
        f"layer and micro-batch on a rank: {routed_rows(inputs):,} expert rows ({kept}), "
        f"activations {routed_mlp_bytes(inputs, size) / _GIB:.2f} GiB (in 'activ'), "
        + (f"dispatch {sent} MB" if sent else "no dispatch (EP 1)")
        + _combined_1f1b_note(plan)
    )


def _combined_1f1b_note(plan: Plan) -> str:
    """With `--overlap-moe-expert-parallel-comm`, how much of the dispatcher's time it hides."""
    if not plan.inputs.model.routed_moe.overlap_expert_comm or plan.inputs.ep == 1:
        return ""
    if plan.estimate is None:
        return "; combined 1F1B (name a device with --dry-run-device for its overlap)"
    hidden = plan.estimate.expert_comm_hidden
    return f"; combined 1F1B hides {hidden:.0%} of its time behind the other micro-batch"


def format_plan(plan: Plan) -> str:
    """The plan as the dry run prints it: one block per stage, then the verdict."""
    inputs = plan.inputs
    lines = [
        f"dry run: {inputs.world_size} ranks = TP {inputs.tp}"
        + (f" x CP {inputs.cp}" if inputs.cp > 1 else "")
        + f" x PP {inputs.pp}"
        + (f" (x{inputs.virtual} virtual)" if inputs.virtual > 1 else "")
        + f" x DP {inputs.dp}"
        + (f" (EP {inputs.ep})" if inputs.ep > 1 else "")
        + (f" x Ulysses {inputs.sp}" if inputs.sp > 1 else "")
        + f"; {inputs.engine}"
        + (f" ZeRO-{inputs.zero.stage}" if inputs.deepspeed else "")
        + (f" FSDP2 {inputs.sharding}" if inputs.fsdp else "")
        + f", {inputs.precision}, micro-batch {inputs.micro_batch} x {inputs.micro_batches}"
        + f" per iteration, seq {inputs.seq_length}",
        f"  model: {num_parameters(inputs.model):,} parameters, "
        f"{flops_per_token(inputs.model, inputs.seq_length) / 1e9:.3f} GFLOPs per token",
    ]
    header = (
        f"  {'stage':>5} {'params':>14} {'weights':>8} {'grads':>8} {'optim':>8} "
        f"{'activ':>8} {'logits':>8} {'buffers':>8} {'PEAK GiB':>9} {'at':>8}  "
        f"{'TP MB':>9} {'DP MB':>9} {'PP MB':>9} {'A2A MB':>9}"
        + (f" {'CP MB':>9}" if inputs.cp > 1 else "")
        + (f" {'EP MB':>9}" if has_expert_parallel_kind(inputs) else "")
    )
    lines.append(header)
    for role_plan in plan.roles:
        memory, comm = role_plan.memory, role_plan.communication
        lines.append(
            f"  {role_plan.role.pp_rank:>5} {role_plan.role.num_parameters:>14,} "
            f"{_gib(memory.weights):>8} {_gib(memory.gradients):>8} {_gib(memory.optimizer):>8} "
            f"{_gib(memory.activations):>8} {_gib(memory.logits):>8} {_gib(memory.buffers):>8} "
            f"{_gib(memory.peak_bytes):>9} {memory.peak_at:>8}  "
            f"{comm['tensor_parallel'] / 1e6:>9.1f} {comm['data_parallel'] / 1e6:>9.1f} "
            f"{comm['pipeline'] / 1e6:>9.1f} {comm['all_to_all'] / 1e6:>9.1f}"
            + (f" {comm['context_parallel'] / 1e6:>9.1f}" if inputs.cp > 1 else "")
            + (f" {comm['expert_parallel'] / 1e6:>9.1f}" if "expert_parallel" in comm else "")
        )
    lines.append(
        "  (memory in GiB per rank of each pipeline stage at its peak moment, by column: they "
        "add up to PEAK; communication in MB per rank and iteration, payloads handed to the "
        "collectives)"
    )
    if plan.device is not None:
        estimate = plan.estimate
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(
            f"  {plan.device.name}: peak {_gib(plan.peak_bytes)} GiB of "
            f"{_gib(plan.device.usable_bytes)} GiB usable -> {verdict}; "
            f"estimated step {_seconds(estimate.step_s)} (compute "
            f"{_seconds(estimate.compute_s)}, communication {_seconds(estimate.communication_s)}, "
            "bubble "
            f"{estimate.bubble:.1%}), MFU {estimate.mfu:.1%}, "
            f"{estimate.tokens_per_s:,.0f} tokens/s"
        )
    if inputs.cp > 1:
        lines.append(_context_parallel_line(plan))
    if inputs.model.routed_moe is not None:
        lines.append(_routed_moe_line(plan))
    if inputs.model.fp8 is not None:
        lines.append(_fp8_line(plan))
    for note in plan.notes + [NOT_MODELLED]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
