"""The plan's model on layouts no CPU run reaches: DeepSpeed's fp16 wrappers at scale, the
memory table's columns, the roofline's pricing and overlap, the device table."""

from __future__ import annotations

import pytest

from megatron.config import ModelConfig, MoEConfig
from megatron.planning.communication import (
    all_to_all_bytes,
    data_parallel_bytes,
    rank_communication,
)
from megatron.planning.devices import find_device
from megatron.planning.layout import stage_roles
from megatron.planning.memory import COLUMNS, rank_memory
from megatron.planning.plan import build_plan
from megatron.planning.roofline import all_to_all_seconds, estimate_step
from tests.planning.plan_inputs import deepspeed_inputs, plan_inputs

BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size, elements


def _gpt(layers: int = 8, hidden: int = 1024, seq: int = 1024, **extra: object) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=16,
        vocab_size=32768,
        max_position_embeddings=seq,
        **extra,
    )


def test_fp16_zero0_on_the_pipeline_engine_keeps_whole_fp32_state_on_every_rank():
    """DeepSpeed runs FP16_UnfusedOptimizer there (bf16 only gets the partitioned
    BF16_Optimizer): 12 bytes of master weights and Adam state per parameter on every rank,
    and no weight all-gather after the step."""
    inputs = deepspeed_inputs(_gpt(), "fp16", 0, "deepspeed-pipeline", pp=2, dp=8)
    plan = build_plan(inputs)
    for role_plan in plan.roles:
        w = role_plan.role.num_parameters
        assert role_plan.memory.optimizer == 12 * w
        assert role_plan.communication["data_parallel"] == 2 * w  # one fp16 all-reduce
    bf16 = build_plan(deepspeed_inputs(_gpt(), "bf16", 0, "deepspeed-pipeline", pp=2, dp=8))
    assert bf16.roles[0].memory.optimizer == 12 * -(-bf16.roles[0].role.num_parameters // 8)
    assert any("not yet checked on a GPU" in note for note in plan.notes)
    assert any("DeepSpeed 0.19.8" in note for note in plan.notes)


def test_fp16_zero1_holds_the_whole_fp16_gradient_across_micro_batches():
    """DeepSpeedZeroOptimizer at stage 1 reduces only at the accumulation boundary: until
    then every parameter's fp16 gradient sums in place (2 bytes x the whole stage, whatever
    the data-parallel size), beside its 5e8-element fp16 bucket."""
    one = deepspeed_inputs(_gpt(), "fp16", 1, dp=8)
    four = deepspeed_inputs(_gpt(), "fp16", 1, dp=8, micro_batches=4)
    role = stage_roles(one)[0]
    carried = rank_memory(four, role).moments["forward"] - rank_memory(one, role).moments["forward"]
    assert carried == 2 * role.num_parameters + 2 * BUCKET


def test_fp16_zero0_with_fp32_accumulation_is_refused_as_deepspeed_refuses_it():
    from megatron.planning.inputs import PlanningError

    inputs = deepspeed_inputs(_gpt(), "fp16", 0, grad_accum_dtype="fp32", dp=2)
    with pytest.raises(PlanningError, match="ZeRO stage 0"):
        build_plan(inputs)


LAYOUTS = [
    ("plain", plan_inputs(_gpt(), "autocast", 1, 1024, dp=2, world_size=2, micro_batches=2)),
    ("zero0 bf16 pipe", deepspeed_inputs(_gpt(), "bf16", 0, "deepspeed-pipeline", pp=2, dp=2)),
    ("zero1 fp16", deepspeed_inputs(_gpt(), "fp16", 1, dp=4, micro_batches=2)),
    ("zero2 bf16", deepspeed_inputs(_gpt(), "bf16", 2, grad_accum_dtype="fp32", dp=4)),
    ("zero3 bf16", deepspeed_inputs(_gpt(), "bf16", 3, grad_accum_dtype="fp32", dp=4)),
]


@pytest.mark.parametrize("name,inputs", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_the_memory_columns_add_up_to_the_peak(name, inputs):
    for role_plan in build_plan(inputs).roles:
        memory = role_plan.memory
        assert sum(getattr(memory, column) for column in COLUMNS) == memory.peak_bytes, name
        assert memory.moments[memory.peak_at] == memory.peak_bytes


def _inter_node_seconds(inputs, kind: str, factor: float) -> float:
    device = find_device("H100")
    role = stage_roles(inputs)[0]
    return rank_communication(inputs, role)[kind] * factor / device.inter_node_bytes_per_s


def test_zero3_gathers_and_reduce_scatters_are_priced_at_one_ring_pass():
    """(D-1)/D of each all-gather's and reduce-scatter's payload crosses a rank's link, not
    an all-reduce's 2 (D-1)/D. A tiny batch: communication is all there is."""
    inputs = deepspeed_inputs(_gpt(seq=16), "bf16", 3, grad_accum_dtype="fp32", dp=16)
    estimate = estimate_step(inputs, stage_roles(inputs)[0], find_device("H100"))
    one_pass = _inter_node_seconds(inputs, "data_parallel", 15 / 16)
    assert estimate.communication_s == pytest.approx(one_pass, rel=0.01)


def test_ddp_reduction_hides_under_the_backward_but_its_last_bucket():
    """A big batch: the backward outlasts the all-reduce, so only the last 25 MiB bucket
    (reduced after the backward ends) is exposed."""
    inputs = plan_inputs(_gpt(seq=2048), "autocast", 8, 2048, dp=16, world_size=16)
    device = find_device("H100")
    estimate = estimate_step(inputs, stage_roles(inputs)[0], device)
    tail = 25 * 2**20 * 2 * 15 / 16 / device.inter_node_bytes_per_s
    assert estimate.communication_s == pytest.approx(tail)
    assert estimate.communication_s < _inter_node_seconds(inputs, "data_parallel", 2 * 15 / 16)


def test_zero0_reduction_after_the_backward_is_not_hidden():
    inputs = deepspeed_inputs(_gpt(seq=2048), "bf16", 0, "deepspeed", dp=16)
    estimate = estimate_step(inputs, stage_roles(inputs)[0], find_device("H100"))
    assert estimate.communication_s == pytest.approx(
        _inter_node_seconds(inputs, "data_parallel", 2 * 15 / 16)
    )


def test_a_ulysses_all_to_all_inside_a_node_uses_the_node_link():
    """Ulysses S = 4 on 16 ranks: the sequence group is 4 consecutive ranks, one node, even
    though the ZeRO group (all 16) spans two."""
    inputs = deepspeed_inputs(_gpt(seq=4096), "bf16", 1, grad_accum_dtype="fp32", dp=4, sp=4)
    role = stage_roles(inputs)[0]
    device = find_device("H100")
    a2a = all_to_all_bytes(inputs, role) * 3 / 4 / device.intra_node_bytes_per_s
    assert all_to_all_seconds(inputs, role, device) == pytest.approx(a2a)


def _moe(tp: int, ep: int, dp: int, expert_tp: bool = False) -> object:
    moe = MoEConfig(
        experts_per_layer=(1, 8) * 4, expert_parallel_size=ep, expert_tensor_parallel=expert_tp
    )
    return deepspeed_inputs(_gpt(moe=moe), "bf16", 1, grad_accum_dtype="fp32", tp=tp, dp=dp, ep=ep)


def test_moe_all_to_all_carries_one_tp_share_of_the_tokens():
    """DeepSpeed-MoE drops the tensor-parallel ranks' duplicate tokens before dispatching
    (sharded_moe.py drop_tokens) and gathers them after the combine."""
    one, two = _moe(tp=1, ep=4, dp=4), _moe(tp=2, ep=4, dp=4)
    assert all_to_all_bytes(two, stage_roles(two)[0]) * 2 == all_to_all_bytes(
        one, stage_roles(one)[0]
    )
    gathers = rank_communication(two, stage_roles(two)[0])["tensor_parallel"]
    dense = deepspeed_inputs(_gpt(), "bf16", 1, grad_accum_dtype="fp32", tp=2, dp=4)
    assert gathers > rank_communication(dense, stage_roles(dense)[0])["tensor_parallel"]


def test_an_expert_group_inside_a_node_uses_the_node_link():
    """EP 4 at TP 1 over 16 data-parallel ranks: each expert group is 4 neighbours."""
    inputs = _moe(tp=1, ep=4, dp=16)
    role = stage_roles(inputs)[0]
    device = find_device("H100")
    a2a = all_to_all_bytes(inputs, role) * 3 / 4 / device.intra_node_bytes_per_s
    assert all_to_all_seconds(inputs, role, device) == pytest.approx(a2a)


@pytest.mark.parametrize(
    "name,gib", [("H100-96GB", 94), ("H200", 139), ("B200", 175), ("GH200", 94)]
)
def test_the_device_table_knows_the_newer_parts(name, gib):
    device = find_device(name)
    assert device.memory_bytes / 2**30 > gib
    assert device.bf16_flops >= 989e12


def test_data_parallel_bytes_is_the_sum_of_its_collectives():
    inputs = deepspeed_inputs(_gpt(), "bf16", 3, grad_accum_dtype="fp32", dp=4, micro_batches=2)
    role = stage_roles(inputs)[0]
    assert data_parallel_bytes(inputs, role) == rank_communication(inputs, role)["data_parallel"]


def test_full_recomputation_holds_one_recomputed_group_as_the_backward_starts():
    """The backward of a checkpointed group runs its forward again first: one group's full
    activations (here 2 layers, `--recompute-num-layers 2`) beside the stage's kept inputs."""
    from megatron.planning.activations import layer_bytes

    config = _gpt(recompute_granularity="full", recompute_num_layers=2)
    inputs = deepspeed_inputs(config, "bf16", 0, "deepspeed-pipeline", pp=2, dp=2)
    role = stage_roles(inputs)[0]
    plain = deepspeed_inputs(
        _gpt(recompute_granularity="full"), "bf16", 0, "deepspeed-pipeline", pp=2, dp=2
    )
    grouped = rank_memory(inputs, role).moments["backward"]
    single = rank_memory(plain, stage_roles(plain)[0]).moments["backward"]
    # Two layers at once instead of one; the kept inputs: one per group instead of per layer.
    kept = stage_roles(plain)[0].num_layers // 2 * (1024 * 1024 * 2)
    assert grouped - single == layer_bytes(inputs) - kept
