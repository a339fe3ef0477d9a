"""Training: `pretrain()`, the loop, the step functions, optimizer, schedules and monitoring.

- `training.py`: `pretrain()`, `build_engine()` and `setup_model_and_optimizer()` (Megatron's
  entry points).
- `engines/`: one class per engine of `megatron.layout.Engine` behind one interface.
- `loop.py`: the engine-agnostic iteration loop; `step.py` and `megatron_schedules_step.py`:
  the steps the engines take.
- `optimizer.py`: AdamW param groups, clipping, loss scaling; `scheduler.py`: the LR and
  weight-decay schedule; `batch_schedule.py`: the global batch size ramp.
- `monitor.py`: Megatron's log line, timers, TensorBoard / W&B; `training_log.py`: the
  scalars Megatron-DeepSpeed writes there (tags, flags, parameter and optimizer-state norms);
  `signal_handler.py`: exit on a signal after a checkpoint.

Megatron's import path is kept: `from megatron.training import pretrain`. The entry points
are resolved on first use because `pretrain()` parses the flags (`megatron.arguments`), whose
checks use this package's schedules; importing `megatron.training.scheduler` therefore loads
only the scheduler, and the imports still point one way (tests/test_import_graph.py).
"""

from __future__ import annotations

import importlib
from typing import Any

# Names of megatron/training/training.py that Megatron scripts import from megatron.training.
_ENTRY_POINTS = (
    "build_data_iterators",
    "evaluate",
    "evaluate_and_print_results",
    "pretrain",
    "setup_model_and_optimizer",
)

__all__ = list(_ENTRY_POINTS)


def __getattr__(name: str) -> Any:
    """`megatron.training.pretrain` and the other entry points, imported on first use."""
    if name in _ENTRY_POINTS:
        return getattr(importlib.import_module("megatron.training.training"), name)
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ENTRY_POINTS))
