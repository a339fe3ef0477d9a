"""The planner's model of Megatron-LM's combined 1F1B (`--overlap-moe-expert-parallel-comm`):
`roofline.combined_1f1b_seconds` against its formula, the step estimate it shortens, and the
dry run's line."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.config import ModelConfig, RoutedMoEConfig
from megatron.planning.devices import DEVICES, Device
from megatron.planning.layout import stage_roles
from megatron.planning.roofline import all_to_all_seconds, combined_1f1b_seconds, estimate_step
from megatron.planning.routed_moe import routed_rows
from tests.planning.plan_inputs import plan_inputs

LAYERS, HIDDEN, SEQ, MICRO_BATCHES = 2, 128, 128, 4


def _inputs(overlap: bool = True, ep: int = 2, micro_batches: int = MICRO_BATCHES):
    config = ModelConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        vocab_size=1024,
        max_position_embeddings=SEQ,
        activation="swiglu",
        routed_moe=RoutedMoEConfig(
            num_experts=4,
            moe_layers=(True,) * LAYERS,
            dispatcher="alltoall",
            expert_parallel_size=ep,
            overlap_expert_comm=overlap,
        ),
    )
    inputs = plan_inputs(
        config, "autocast", 1, SEQ, ep=ep, dp=2, world_size=2, micro_batches=micro_batches
    )
    return inputs, stage_roles(inputs)[0]


def _device(flops: float, link: float) -> Device:
    return dataclasses.replace(
        DEVICES["H100"], bf16_flops=flops, intra_node_bytes_per_s=link, inter_node_bytes_per_s=link
    )


def test_slow_links_hide_what_the_other_micro_batch_computes() -> None:
    """Collectives far longer than any compute piece: each hides exactly the piece beside it,
    A and 2A behind the attention's forward and backward, X and 2X behind the experts'."""
    inputs, role = _inputs()
    device = _device(flops=1e12, link=1e3)
    hidden, total = combined_1f1b_seconds(inputs, role, device, efficiency=1.0)
    assert total == all_to_all_seconds(inputs, role, device)
    h, tokens = HIDDEN, SEQ
    experts = routed_rows(inputs) * (2 * h * 2 * 4 * h + 2 * 4 * h * h) / 1e12  # SwiGLU 4h
    attention = tokens * (2 * h * 3 * h + 2 * 2 * SEQ * h + 2 * h * h + 2 * h * 4) / 1e12
    expected = LAYERS * (MICRO_BATCHES - 1) * 3 * (attention + experts)
    assert hidden == pytest.approx(expected, rel=1e-12)


def test_fast_links_hide_all_but_the_unpaired_passes() -> None:
    """Compute far longer than any collective: everything is hidden but the first
    micro-batch's forward and the last one's backward, (M - 1) / M."""
    inputs, role = _inputs()
    hidden, total = combined_1f1b_seconds(inputs, role, _device(flops=1e3, link=1e15))
    assert hidden / total == pytest.approx((MICRO_BATCHES - 1) / MICRO_BATCHES, rel=1e-12)
    on = estimate_step(inputs, role, _device(flops=1e3, link=1e15))
    off = estimate_step(*_inputs(overlap=False), _device(flops=1e3, link=1e15))
    assert off.communication_s - on.communication_s == pytest.approx(hidden, rel=1e-9)
    assert on.expert_comm_hidden == pytest.approx(0.75) and off.expert_comm_hidden == 0.0


@pytest.mark.parametrize(
    "changes", [dict(overlap=False), dict(ep=1), dict(micro_batches=1)], ids=str
)
def test_nothing_hidden(changes: dict) -> None:
    inputs, role = _inputs(**changes)
    assert combined_1f1b_seconds(inputs, role, DEVICES["H100"])[0] == 0.0
