"""Faults injected at a named point of a run, to test what users see when a rank dies or stalls.

`MEGATRON_TRAINING_FAULT=ACTION@ITERATION:RANK` makes global rank RANK act as it begins
iteration ITERATION (counted from 1, as the log line counts):

- `stop`: SIGSTOP itself, as a rank stuck in a hung file read or a wedged GPU would stall;
- `kill`: SIGKILL itself, as a rank on a lost node would vanish.

Under `torchrun --max-restarts`, only the first attempt is faulted (torchrun's
`TORCHELASTIC_RESTART_COUNT` is 0), so the restarted job runs through.
"""

from __future__ import annotations

import os
import re
import signal

import torch.distributed as dist

FAULT_ENV = "MEGATRON_TRAINING_FAULT"
_ACTIONS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}


def parse_fault(text: str) -> tuple[int, int, int]:
    """(signal, iteration, rank) of a `MEGATRON_TRAINING_FAULT` value."""
    match = re.fullmatch(r"(stop|kill)@(\d+):(\d+)", text)
    if match is None:
        raise ValueError(f"{FAULT_ENV}={text!r}: expected ACTION@ITERATION:RANK, e.g. stop@3:1")
    return _ACTIONS[match.group(1)], int(match.group(2)), int(match.group(3))


def inject_training_fault(iteration: int) -> None:
    """Stop or kill this process if `MEGATRON_TRAINING_FAULT` names `iteration` and its rank."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    signum, at_iteration, at_rank = parse_fault(wanted)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if (iteration, rank) == (at_iteration, at_rank):
        print(f"[{FAULT_ENV}] rank {rank}: {signal.Signals(signum).name} at iteration {iteration}")
        os.kill(os.getpid(), signum)
