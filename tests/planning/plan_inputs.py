"""`PlanInputs` for a model config and a few layout fields, for the planner's unit tests."""

from __future__ import annotations

from megatron.config import ModelConfig
from megatron.planning.inputs import PlanInputs, ZeroSettings


def plan_inputs(
    config: ModelConfig, path: str, micro_batch: int, seq: int, **layout: int
) -> PlanInputs:
    """`path`: `fp32` (plain fp32), `autocast` (plain bf16) or `ds-bf16` (DeepSpeed bf16)."""
    fields = dict(world_size=1, tp=1, pp=1, dp=1, sp=1, ep=1, virtual=1, micro_batches=1)
    fields.update(layout)
    return PlanInputs(
        model=config,
        micro_batch=micro_batch,
        seq_length=seq,
        precision="fp32" if path == "fp32" else "bf16",
        engine="deepspeed" if path == "ds-bf16" else "plain",
        zero=ZeroSettings(),
        grad_accum_dtype="fp32",
        device_type="cpu",
        **fields,
    )
