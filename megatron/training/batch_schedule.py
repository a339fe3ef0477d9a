"""The global batch size per iteration: constant, or ramped up as `--rampup-batch-size`.

Megatron's rule: `--rampup-batch-size START INCREMENT SAMPLES` grows the global batch from
START by INCREMENT in equal steps over the first SAMPLES consumed samples, then holds
`--global-batch-size`. Every size on the way must be a multiple of micro-batch x DP size.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizeSchedule:
    """Global batch size as a function of consumed samples."""

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    rampup: tuple[int, int, int] | None = None
    """(start, increment, ramp samples) from --rampup-batch-size, or None for constant."""

    def __post_init__(self) -> None:
        per_step = self.micro_batch_size * self.data_parallel_size
        if self.rampup is None:
            return
        start, increment, samples = self.rampup
        flag = "--rampup-batch-size"
        if start < 1 or increment < 1 or samples < 0:
            raise ValueError(f"{flag} {start} {increment} {samples}: all must be positive")
        if (self.global_batch_size - start) % increment != 0 or start > self.global_batch_size:
            raise ValueError(
                f"{flag}: --global-batch-size ({self.global_batch_size}) minus the start "
                f"({start}) must be a non-negative multiple of the increment ({increment})"
            )
        if start % per_step or increment % per_step:
            raise ValueError(
                f"{flag}: start ({start}) and increment ({increment}) must be multiples of "
                f"--micro-batch-size x data-parallel size = {per_step}"
            )

    def at(self, consumed_samples: int) -> int:
        """Global batch size of the iteration that starts after `consumed_samples`."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        steps = (self.global_batch_size - start) // increment
        if steps == 0 or consumed_samples >= samples:
            return self.global_batch_size
        samples_per_step = samples / steps
        return min(
            start + int(consumed_samples / samples_per_step) * increment, self.global_batch_size
        )

    def micro_batches_at(self, consumed_samples: int) -> int:
        """Micro-batches each data-parallel rank runs in that iteration."""
        return self.at(consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    def iterations_for(self, train_samples: int) -> int:
        """How many iterations consume `train_samples` (the last may be partial: counted)."""
        consumed, iterations = 0, 0
        while consumed < train_samples:
            consumed += self.at(consumed)
            iterations += 1
        return iterations
