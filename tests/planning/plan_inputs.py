"""`PlanInputs` for a model config and a few layout fields, for the planner's unit tests."""

from __future__ import annotations

import dataclasses
import math

from megatron.config import ModelConfig
from megatron.planning.inputs import PlanInputs, ZeroSettings


def plan_inputs(
    config: ModelConfig, path: str, micro_batch: int, seq: int, **layout: int
) -> PlanInputs:
    """`path`: `fp32` (plain fp32), `autocast` (plain bf16) or `ds-bf16` (DeepSpeed bf16)."""
    fields = dict(world_size=1, tp=1, pp=1, dp=1, sp=1, cp=1, ep=1, virtual=1, micro_batches=1)
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


def deepspeed_inputs(
    config: ModelConfig,
    precision: str,
    stage: int,
    engine: str = "deepspeed",
    grad_accum_dtype: str | None = None,
    device_type: str = "cuda",
    zero: dict | None = None,
    **layout: int,
) -> PlanInputs:
    """A DeepSpeed job's `PlanInputs` (micro-batch 1, the model's sequence), `layout` fields
    as in `plan_inputs`; `world_size` follows TP x PP x DP x Ulysses x CP unless given."""
    fields = dict(tp=1, pp=1, dp=1, sp=1, cp=1, ep=1, virtual=1, micro_batches=1)
    fields.update(layout)
    sizes = ("tp", "pp", "dp", "sp", "cp")
    fields.setdefault("world_size", math.prod(fields[size] for size in sizes))
    settings = dataclasses.replace(ZeroSettings(), stage=stage, **(zero or {}))
    return PlanInputs(
        model=config,
        micro_batch=1,
        seq_length=config.max_position_embeddings,
        precision=precision,
        engine=engine,
        zero=settings,
        grad_accum_dtype=grad_accum_dtype or precision,
        device_type=device_type,
        **fields,
    )
