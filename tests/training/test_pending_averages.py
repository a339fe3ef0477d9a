"""`PendingAverages`: the reported losses queued before the optimizer step, read after it.

Issue 56: on a GPU the loss read after the step waited for the step's kernels (a `.tolist()`
is stream-ordered), so the host could not queue the next iteration until the device drained.
The averages are now copied to pinned memory behind an event before the step; the read waits
for that event only. Checked here: the averages are `average_over_data_parallel`'s (plain
values and Megatron-LM's [sum, count] pairs, several names in one read), and on a GPU the
read after queued work returns the values of when it was made, not what later kernels wrote.
"""

from __future__ import annotations

import pytest
import torch

from megatron.training.step import PendingAverages, average_over_data_parallel


def test_averages_per_micro_batch_and_per_token() -> None:
    """Plain sums divide by the micro-batches; [sum, count] pairs by their count."""
    sums = {
        "lm loss": torch.tensor(6.0),
        "per token": torch.tensor([12.0, 4.0]),
        "aux": torch.tensor(0.75),
    }
    expected = {"lm loss": 2.0, "per token": 3.0, "aux": 0.25}
    assert PendingAverages(sums, 3).result() == expected
    assert average_over_data_parallel(sums, 3) == expected
    assert PendingAverages({}, 3).result() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_read_waits_for_the_losses_not_for_later_work() -> None:
    """Pinned, event-ordered: the values as queued, though the source changes afterwards."""
    source = torch.full((), 8.0, device="cuda")
    pending = PendingAverages({"lm loss": source}, 4)
    assert pending.ready is not None and pending.host.is_pinned()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # later work on the stream, as the optimizer step is
        big = big @ big / 64
    source.fill_(100.0)
    assert pending.result() == {"lm loss": 2.0}
    torch.cuda.synchronize()
