"""initialize_megatron's process-wide settings: whole-line output, TF32 only where a GPU is."""

from __future__ import annotations

import io
import sys

import torch

from megatron.initialize import enable_tf32, write_whole_lines


class _RecordingRaw(io.RawIOBase):
    """An unbuffered byte sink that keeps each write call separately (as a pipe sees them)."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # noqa: ANN001 - bytes-like
        self.calls.append(bytes(data))
        return len(data)


def test_each_printed_line_reaches_the_stream_in_one_write(monkeypatch) -> None:
    """As under `python -u`: unbuffered, write-through; `print` then writes text and newline
    apart, so another rank's line can land between them. After write_whole_lines it cannot."""
    raw = _RecordingRaw()
    stream = io.TextIOWrapper(raw, write_through=True)  # what PYTHONUNBUFFERED gives
    monkeypatch.setattr(sys, "stdout", stream)
    print("steps: 10 loss: 3.2", "iter time (s): 0.5")
    assert len(raw.calls) > 1  # the problem: one line, several writes
    raw.calls.clear()
    write_whole_lines()
    print("steps: 10 loss: 3.2", "iter time (s): 0.5")
    print(" iteration       10/     100 |")
    assert raw.calls == [
        b"steps: 10 loss: 3.2 iter time (s): 0.5\n",
        b" iteration       10/     100 |\n",
    ]


def test_tf32_is_enabled_only_on_a_gpu() -> None:
    before = torch.backends.cuda.matmul.fp32_precision
    enabled = enable_tf32()
    assert enabled == torch.cuda.is_available()
    if not enabled:
        assert torch.backends.cuda.matmul.fp32_precision == before
