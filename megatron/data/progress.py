"""Progress lines for long tool runs: documents/s, MB/s and an ETA when the input size is known."""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counts documents and bytes and reports every `log_interval` documents on stderr."""

    def __init__(self, total_bytes: int, log_interval: int) -> None:
        self.total_bytes = total_bytes
        self.log_interval = log_interval
        self.start = time.time()
        self.documents = 0
        self.bytes = 0
        self._next_report = log_interval

    def update(self, documents: int, num_bytes: int, position: int) -> None:
        """Add a finished batch; `position` is how far into the input the reader is."""
        self.documents += documents
        self.bytes += num_bytes
        if self.documents >= self._next_report:
            self._next_report = (self.documents // self.log_interval + 1) * self.log_interval
            self._report(position)

    def _report(self, position: int) -> None:
        elapsed = max(time.time() - self.start, 1e-9)
        line = (
            f"Processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
            f"{self.bytes / elapsed / 1e6:.2f} MB/s)"
        )
        if self.total_bytes > 0 and position > 0:
            fraction = min(position / self.total_bytes, 1.0)
            eta = elapsed * (1 - fraction) / fraction
            line += f", {100 * fraction:.1f}% of input, ETA {format_duration(eta)}"
        print(line + ".", file=sys.stderr, flush=True)

    def finish(self, bad_lines: int, blank_lines: int) -> None:
        """Print the final summary."""
        elapsed = max(time.time() - self.start, 1e-9)
        print(
            f"Done: {self.documents} documents, {self.bytes / 1e6:.1f} MB in {elapsed:.1f} s "
            f"({self.documents / elapsed:.1f} docs/s, {self.bytes / elapsed / 1e6:.2f} MB/s)",
            file=sys.stderr,
            flush=True,
        )
        if bad_lines:
            print(f"skipped {bad_lines} bad lines (--skip-bad-lines)", file=sys.stderr)
        if blank_lines:
            print(f"ignored {blank_lines} blank lines", file=sys.stderr)
