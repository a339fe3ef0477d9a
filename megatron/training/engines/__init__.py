"""The engines: one class per `megatron.layout.Engine`, all behind `TrainingEngine`.

- `plain.py`: torch DDP; `deepspeed.py`: DeepSpeed's engine and its pipeline engine (the
  zero count of `--log-num-zeros-in-grad` on them in `deepspeed_zeros.py`);
  `megatron_schedules.py`: Megatron's schedules on torch.distributed.pipelining.
- `base.py`: the interface (build the model, create with optimizer and scheduler, train step,
  evaluate, batch-size ramp, checkpoint target / save / load) and the optimizer build.

`engine_class(layout)` is the one place an `Engine` value becomes code.
"""

from __future__ import annotations

from megatron.layout import Engine, ParallelLayout
from megatron.training.engines.base import PipelineBatch, TrainingEngine
from megatron.training.engines.deepspeed import DeepSpeedEngine, DeepSpeedPipeEngine
from megatron.training.engines.megatron_schedules import MegatronSchedulesEngine
from megatron.training.engines.plain import PlainEngine

ENGINES: dict[Engine, type[TrainingEngine]] = {
    Engine.PLAIN: PlainEngine,
    Engine.DEEPSPEED: DeepSpeedEngine,
    Engine.DEEPSPEED_PIPE: DeepSpeedPipeEngine,
    Engine.MEGATRON_SCHEDULES: MegatronSchedulesEngine,
}


def engine_class(layout: ParallelLayout) -> type[TrainingEngine]:
    """The class of the layout's engine."""
    return ENGINES[layout.engine]


__all__ = ["ENGINES", "PipelineBatch", "TrainingEngine", "engine_class"]
