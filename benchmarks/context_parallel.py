"""Benchmark: context parallelism (`--context-parallel-size C`, ring attention) on CPU at C = 1,
2, 4: tokens/s, activation memory per rank, the ring's bytes against the planner's, and how
much of the ring's transfer time hides behind attention.

    python benchmarks/context_parallel.py                 # 2 layers, h 128, 8 heads, seq 1024
    python benchmarks/context_parallel.py --quick         # smoke run: seq 256, 2 rounds
    python benchmarks/context_parallel.py --sizes 1 2 --rounds 10

One LLaMA-style GPT (SwiGLU, RMSNorm, rotary positions, 8 query and 2 key/value heads, no
biases, fp32, dropout 0, no recomputation), built as `megatron.model.GPTModel` from a
`ModelConfig`, one training step = forward over this rank's two chunks of the sequence (the
load-balanced layout, `mappings.this_ranks_sequence_part`), the whole-sequence mean loss,
backward (ring attention, `--cp-comm-type p2p`), the gradients summed over the C ranks (what
DDP does over data x context ranks, here one all-reduce per parameter) and AdamW. C = 1 is one
process without context parallelism, the baseline. Each C runs in its own world of C fresh
gloo processes (one torch thread each), one after the other, every world training on the
same fixed sample, so the first-step losses must agree (printed). **C = 4 puts 4 processes on
2 cores**: its step time measures time-sharing as much as context parallelism.

Measured, per C:
- tokens/s = sequence tokens / median step time (rank 0, between barriers), and its ratio to
  C = 1;
- activation bytes per rank: what one forward saves for backward, each storage once,
  parameters left out (`tests/planning/saved_tensors.saved_bytes`, saved-tensor hooks), and
  its ratio to C = 1 (about 1/C expected);
- the ring's bytes per step and rank, counted at `mappings.RingTransfer` (wrapped in the
  workers: the bytes of the tensors each transfer sends), against the planner's
  `context_parallel_parts(...)["p2p"]` for the same shape (the ratio must be 1.000);
- the share of the ring's transfer time hidden behind compute: each transfer's time inside
  `wait()` (blocked) against its time from construction to the end of `wait()` (in flight);
  hidden = 1 - blocked / in flight, summed over the timed steps of all ranks. A transfer
  that is done before its `wait()` is called counts its whole life as in flight, so this
  bounds the hidden share from below when the compute in between is short.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import describe_machine, format_ms, free_port  # noqa: E402
from worlds import start_world  # noqa: E402  (benchmarks/worlds.py)

from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import mappings, model_parallel_cuda_manual_seed  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.model import context_parallel as ring_module  # noqa: E402
from megatron.planning.communication import context_parallel_parts  # noqa: E402
from megatron.planning.inputs import PlanInputs, ZeroSettings  # noqa: E402
from megatron.planning.layout import stage_roles  # noqa: E402
from tests.planning.saved_tensors import saved_bytes  # noqa: E402

VOCAB = 1024


def model_config(shape: dict) -> ModelConfig:
    """The LLaMA-style GPT of the benchmark."""
    return ModelConfig(
        num_layers=shape["layers"],
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        vocab_size=VOCAB,
        max_position_embeddings=shape["seq"],
        activation="swiglu",
        normalization="rmsnorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cp_comm_types=("p2p",),
    )


def planned_ring_bytes(shape: dict, size: int) -> int:
    """The planner's ring bytes per step and rank (micro-batch 1, one micro-batch)."""
    inputs = PlanInputs(
        model=model_config(shape),
        world_size=size,
        tp=1,
        pp=1,
        dp=1,
        sp=1,
        cp=size,
        ep=1,
        virtual=1,
        micro_batch=1,
        seq_length=shape["seq"],
        micro_batches=1,
        precision="fp32",
        engine="plain",
        zero=ZeroSettings(),
        grad_accum_dtype="fp32",
        device_type="cpu",
    )
    return context_parallel_parts(inputs, stage_roles(inputs)[0]).get("p2p", 0)


class CountingRingTransfer(mappings.RingTransfer):
    """`RingTransfer` that adds its bytes sent, its life and its time blocked in `wait()` to
    the class's counters."""

    sent_bytes = 0
    in_flight_s = 0.0
    blocked_s = 0.0

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
        self._started = time.perf_counter()
        super().__init__(tensors, group)
        CountingRingTransfer.sent_bytes += sum(t.numel() * t.element_size() for t in self.sent)

    def wait(self) -> list[torch.Tensor]:
        """`RingTransfer.wait`, timed."""
        entered = time.perf_counter()
        received = super().wait()
        done = time.perf_counter()
        CountingRingTransfer.blocked_s += done - entered
        CountingRingTransfer.in_flight_s += done - self._started
        return received

    @classmethod
    def reset(cls) -> None:
        """Zero the counters."""
        cls.sent_bytes, cls.in_flight_s, cls.blocked_s = 0, 0.0, 0.0


def worker(rank: int, size: int, shape: dict, settings: dict, out_dir: str) -> None:
    """One rank of a world of `size`: measure, then write its results to `out_dir`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    parallel_state.initialize_model_parallel(1, 1, 1, size)
    ring_module.RingTransfer = CountingRingTransfer  # what RingAttention constructs
    config = model_config(shape)
    activation = saved_bytes(config, 1, shape["seq"] // size, autocast=False)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    sample = torch.randint(
        0, VOCAB, (1, shape["seq"] + 1), generator=torch.Generator().manual_seed(1)
    )
    tokens, labels = sample[:, :-1], sample[:, 1:]
    positions = torch.arange(shape["seq"])[None]
    tokens, labels, positions = (
        mappings.this_ranks_sequence_part(t).contiguous() for t in (tokens, labels, positions)
    )
    steps, losses, ring = [], [], []
    for step in range(settings["warmup"] + settings["rounds"]):
        CountingRingTransfer.reset()
        dist.barrier()
        start = time.perf_counter()
        loss = model(tokens, positions, None, labels=labels).mean()  # whole-sequence losses
        loss.backward()
        if size > 1:
            for param in model.parameters():
                dist.all_reduce(param.grad, group=parallel_state.get_context_parallel_group())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        losses.append(loss.item())
        if step >= settings["warmup"]:
            steps.append(time.perf_counter() - start)
            counters = CountingRingTransfer
            ring.append((counters.sent_bytes, counters.in_flight_s, counters.blocked_s))
    result = {"steps": steps, "first_loss": losses[0], "activation": activation, "ring": ring}
    with open(os.path.join(out_dir, f"{size}-{rank}.json"), "w") as file:
        json.dump(result, file)
    dist.destroy_process_group()


def run_world(size: int, shape: dict, settings: dict, out_dir: str) -> list[dict]:
    """Spawn a world of `size` ranks; each rank's results."""
    # Each world's port in its ranks' environment: the fork server keeps the first world's.
    start_world(worker, (size, shape, settings, out_dir), size, {"MASTER_PORT": str(free_port())})
    ranks = []
    for rank in range(size):
        with open(os.path.join(out_dir, f"{size}-{rank}.json")) as file:
            ranks.append(json.load(file))
    return ranks


def summarize(size: int, ranks: list[dict], shape: dict, baseline: dict | None) -> dict:
    """One table row of a world's results (`baseline`: C = 1's row)."""
    step = statistics.median(ranks[0]["steps"])
    tokens_per_s = shape["seq"] / step
    activation = max(rank["activation"] for rank in ranks)
    sent = ranks[0]["ring"][0][0]
    in_flight = sum(r[1] for rank in ranks for r in rank["ring"])
    blocked = sum(r[2] for rank in ranks for r in rank["ring"])
    planned = planned_ring_bytes(shape, size)
    return {
        "C": size,
        "tokens per rank": shape["seq"] // size,
        "step": step,
        "tokens/s": tokens_per_s,
        "speed": tokens_per_s / baseline["tokens/s"] if baseline else 1.0,
        "activation": activation,
        "memory": activation / baseline["activation"] if baseline else 1.0,
        "ring": sent,
        "planned": planned,
        "hidden": 1.0 - blocked / in_flight if in_flight else None,
        "loss": ranks[0]["first_loss"],
        "same bytes every step": all(r[0] == sent for rank in ranks for r in rank["ring"]),
    }


def print_table(rows: list[dict]) -> None:
    """The Markdown table RESULTS.md holds."""
    print(
        "| C | processes | tokens per rank | step (median) | tokens/s | vs C=1 | activation MB "
        "per rank | activation vs C=1 (1/C) | ring MB per step and rank (counted) | planned "
        "| counted / planned | ring time hidden |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cores = os.cpu_count() or 1
    for row in rows:
        c = row["C"]
        processes = f"{c} (oversubscribed: {cores} cores)" if c > cores else str(c)
        ratio = f"{row['ring'] / row['planned']:.3f}" if row["planned"] else "-"
        hidden = f"{row['hidden']:.0%}" if row["hidden"] is not None else "-"
        print(
            f"| C={c} | {processes} | {row['tokens per rank']:,} | {format_ms(row['step'])} | "
            f"{row['tokens/s']:,.0f} | **{row['speed']:.2f}x** | {row['activation'] / 1e6:.2f} | "
            f"{row['memory']:.2f}x ({1 / c:.2f}) | {row['ring'] / 1e6:.3f} | "
            f"{row['planned'] / 1e6:.3f} | {ratio} | {hidden} |"
        )


def main() -> None:
    """Parse the flags, run every C, print the header, the table and the loss check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="seq 256, 1 warm-up, 2 rounds")
    cli = parser.parse_args()
    if cli.quick:
        cli.seq, cli.warmup, cli.rounds = 256, 1, 2
    shape = {"seq": cli.seq, "layers": cli.layers, "hidden": cli.hidden}
    shape.update(heads=cli.heads, kv_heads=cli.kv_heads)
    settings = {"warmup": cli.warmup, "rounds": cli.rounds}
    os.environ["OMP_NUM_THREADS"] = "1"
    print(describe_machine("one torch thread per rank, C processes per world"))
    started = time.time()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as out_dir:
        for size in cli.sizes:
            ranks = run_world(size, shape, settings, out_dir)
            rows.append(summarize(size, ranks, shape, rows[0] if rows else None))
    print_table(rows)
    losses = [row["loss"] for row in rows]
    spread = max(losses) - min(losses)
    verdict = "OK" if spread <= 1e-4 * abs(losses[0]) else "DIFFER"
    print(
        "first-step losses: "
        + ", ".join(f"C={row['C']} {row['loss']:.6f}" for row in rows)
        + f" (max |diff| {spread:.1e}) -> {verdict}; ring bytes the same every step: "
        + str(all(row["same bytes every step"] for row in rows))
        + f"; {time.time() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
