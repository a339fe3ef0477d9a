"""`--exit-signal-handler`: a SIGTERM asks the run to save a checkpoint and exit cleanly.

The handler only records the signal; the training loop checks the flag once per iteration on
every rank together (one small all-reduce), so all ranks stop after the same iteration, save
it, and exit 0. Schedulers (SLURM's `--signal`, Kubernetes) send SIGTERM before killing a job.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType


class ExitSignalHandler:
    """Context manager recording whether `signum` arrived; restores the old handler on exit."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.received = False
        self._previous = None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __enter__(self) -> ExitSignalHandler:
        self._previous = signal.signal(self.signum, self._record)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        signal.signal(self.signum, self._previous)
