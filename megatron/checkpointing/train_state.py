"""`TrainState`: the counters a checkpoint carries; the training loop advances them.

It lives with the checkpoints (below `megatron.training`) so saving and loading need nothing
from the loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Counters that a checkpoint carries and a resumed run continues from."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    consecutive_bad_iterations: int = 0
