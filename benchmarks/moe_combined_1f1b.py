"""Benchmark: Megatron-LM's combined 1F1B (`--overlap-moe-expert-parallel-comm`, with and
without `--delay-wgrad-compute`) on CPU at EP = 2 and 4: the share of the expert collectives'
time hidden behind the other micro-batch's compute, measured against the planner's, and the
step time against the same training without it.

    python benchmarks/moe_combined_1f1b.py            # 2 MoE layers, h 256, seq 512
    python benchmarks/moe_combined_1f1b.py --quick    # smoke run: seq 128, 2 rounds

A LLaMA-style MoE GPT (2 layers, each MLP a Megatron-LM routed MoE: top-2 of 8 SwiGLU experts
512 wide, all-to-all dispatcher, aux loss 0.01; 8 heads; fp32, dropout 0), trained by the
project's plain engine from one flag list (`parse_args`, `build_engine`, `TrainingLoop.step`:
DDP's average, the expert reduction, clipping, AdamW), in a world of EP fresh gloo processes
(one torch thread each; data-parallel = expert-parallel = EP; **EP = 4 puts 4 processes on 2
cores**, so its times measure time-sharing too). Each step is 4 micro-batches of 1 sample per
rank. Three setups from one seed: `plain`, `overlap` (the flag) and `overlap+delay` (both
flags); their losses and final weights must be bit-identical (checked, printed).

Measured on every rank, medians over the timed rounds (each step after a barrier):
- step: the step's wall time (slowest rank), and its ratio to plain's;
- exposed: the seconds a step spends waiting in the dispatches and combines (forward and
  backward, summed over the ranks): inside the blocking `all_to_all_single` of the token rows
  without the flag (timed by a wrapper; the per-expert count exchange is left out), blocked in
  the waits with it (`Combined1F1B.timing.blocked`; the first micro-batch's forward and the
  last one's backward have no partner and wait whole, as the plan counts them);
- hidden (measured): 1 - exposed / plain's exposed, the share of the collectives' time taken
  off the step;
- hidden (planned): the planner's share (`megatron.planning.roofline.combined_1f1b_seconds`)
  for this model and layout on a device calibrated on this machine in the same world: its
  fp32 rate = one thread's measured matmul rate (the experts' shape), its link = the measured
  all-to-all bandwidth of the layer's dispatch payload. It counts each collective hidden by
  min(its time, the other pass's next compute piece), M - 1 of M micro-batch pairs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from itertools import cycle

import torch
import torch.distributed as dist

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import describe_machine, format_ms, free_port  # noqa: E402
from worlds import start_world  # noqa: E402  (benchmarks/worlds.py)

import pretrain_gpt  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.initialize import set_random_seed  # noqa: E402
from megatron.planning.devices import Device  # noqa: E402
from megatron.planning.inputs import PlanInputs  # noqa: E402
from megatron.planning.layout import stage_roles  # noqa: E402
from megatron.planning.roofline import combined_1f1b_seconds  # noqa: E402
from megatron.planning.routed_moe import routed_rows  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.training.loop import TrainingLoop  # noqa: E402
from megatron.training.monitor import Timers  # noqa: E402
from megatron.training.training import build_engine  # noqa: E402

SETUPS = {
    "plain": [],
    "overlap": ["--overlap-moe-expert-parallel-comm"],
    "overlap+delay": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
}
VOCAB, MICRO_BATCHES = 1024, 4


class TokenAllToAllClock:
    """Seconds inside blocking `torch.distributed.all_to_all_single` calls on floating-point
    rows (the dispatcher's tokens and their gradients; not the count exchange), through a
    wrapper where `expert_mappings` looks it up at each call."""

    def __init__(self) -> None:
        self.seconds = 0.0
        original = dist.all_to_all_single

        def timed(output, tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if kwargs.get("async_op") or not tensor.is_floating_point():
                return original(output, tensor, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(output, tensor, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        dist.all_to_all_single = timed


def flags(size: int, shape: dict, extra: list[str]) -> list[str]:
    """The command line of one setup in a world of `size` ranks."""
    h = shape["hidden"]
    return [
        *f"--num-layers 2 --hidden-size {h} --num-attention-heads 8 --swiglu "
        f"--normalization RMSNorm --use-rotary-position-embeddings --no-position-embedding "
        f"--disable-bias-linear --seq-length {shape['seq']} --max-position-embeddings "
        f"{shape['seq']} --micro-batch-size 1 --global-batch-size {MICRO_BATCHES * size} "
        "--train-iters 10000 --lr 6e-4 --clip-grad 1.0 --hidden-dropout 0 "
        "--attention-dropout 0 --seed 1234 --distributed-backend gloo --num-experts 8 "
        f"--moe-router-topk 2 --moe-ffn-hidden-size {2 * h} --expert-model-parallel-size "
        f"{size} --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01".split(),
        *extra,
    ]


def build(size: int, shape: dict, extra: list[str]):  # noqa: ANN201 - (loop, args, data)
    """One setup's training loop (plain engine) and its data (each rank its own)."""
    with contextlib.redirect_stdout(io.StringIO()):
        args = parse_args(flags(size, shape, extra), world_size=size)
        args = with_settled(args, padded_vocab_size=VOCAB, eod_token_id=VOCAB - 1)
        set_random_seed(1234)
        engine = build_engine(pretrain_gpt.model_provider, args, pretrain_gpt.forward_step)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [
        {"text": torch.randint(0, VOCAB, (1, shape["seq"] + 1), generator=generator)}
        for _ in range(MICRO_BATCHES)
    ]
    return TrainingLoop(args, engine, Timers(0), None), args, cycle(batches)


def calibrated_device(size: int, shape: dict, args: argparse.Namespace) -> Device:
    """This machine as the planner's device: one thread's matmul rate at the experts' shape,
    the all-to-all bandwidth of one dispatch payload over the world."""
    inputs = PlanInputs.from_args(args, "cpu")
    rows, h = routed_rows(inputs), shape["hidden"]
    a, b = torch.randn(rows, h), torch.randn(h, 4 * h)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    flops = 5 * 2 * rows * h * 4 * h / (time.perf_counter() - start)
    payload, seconds = torch.randn(rows, h), []
    for _ in range(6):
        received = torch.empty_like(payload)
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(received, payload)
        seconds.append(time.perf_counter() - start)
    moved = payload.numel() * 4 * (size - 1) / size
    link = moved / statistics.median(seconds[1:])
    return Device(
        name="this CPU",
        memory_bytes=2**40,
        bf16_flops=flops,
        fp32_flops=flops,
        intra_node_bytes_per_s=link,
        inter_node_bytes_per_s=link,
        gpus_per_node=size,
        compute_capability=(0, 0),
    )


def worker(rank: int, size: int, shape: dict, settings: dict, out_path: str) -> None:
    """One rank: build the setups, run the rounds; rank 0 writes every rank's records."""
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    parallel_state.initialize_model_parallel(expert_parallel_size=size)
    built = {name: build(size, shape, extra) for name, extra in SETUPS.items()}
    device = calibrated_device(size, shape, built["overlap"][1])
    inputs = PlanInputs.from_args(built["overlap"][1], "cpu")
    hidden, total = combined_1f1b_seconds(inputs, stage_roles(inputs)[0], device, efficiency=1.0)
    records, clock = {name: [] for name in SETUPS}, TokenAllToAllClock()
    for index in range(settings["warmup"] + settings["rounds"]):
        for name, (loop, _, data) in built.items():
            overlap = loop.engine.model.comm_overlap
            if overlap is not None:
                overlap.timing = type(overlap.timing)()
            dist.barrier()
            clock.seconds, start = 0.0, time.perf_counter()
            result = loop.step(data)
            end = time.perf_counter()
            blocked = clock.seconds + (overlap.timing.blocked if overlap is not None else 0.0)
            records[name].append(
                {
                    "warmup": index < settings["warmup"],
                    "step": [start, end],
                    "losses": result.losses,
                    "exposed": blocked,
                }
            )
    weights = {  # the final weights, as exact sums (bit-identity across setups)
        name: [float(p.detach().double().sum()) for p in loop.engine.module().parameters()]
        for name, (loop, _, _) in built.items()
    }
    gathered: list = [None] * size
    dist.all_gather_object(gathered, {"records": records, "weights": weights})
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as file:
            json.dump({"ranks": gathered, "planned": hidden / total if total else 0.0}, file)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run_world(size: int, shape: dict, settings: dict) -> dict:
    """A world of `size` ranks: every rank's records and the planned share."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "records.json")
        start_world(worker, (size, shape, settings, out_path), size)
        with open(out_path, encoding="utf-8") as file:
            return json.load(file)


def summarize(result: dict) -> dict:
    """Per setup: median step, measured hidden share; and the bit-identity of the setups."""
    ranks = result["ranks"]
    rows = {}
    for name in SETUPS:
        per_rank = [rank["records"][name] for rank in ranks]
        steps = [step for step in zip(*per_rank) if not step[0]["warmup"]]
        seconds = [max(r["step"][1] for r in s) - min(r["step"][0] for r in s) for s in steps]
        exposed = [sum(r["exposed"] for r in s) for s in steps]
        rows[name] = {"step": statistics.median(seconds), "exposed": statistics.median(exposed)}
    for row in rows.values():
        row["hidden"] = 1 - row["exposed"] / rows["plain"]["exposed"]
    losses = {name: [r["losses"] for r in ranks[0]["records"][name]] for name in SETUPS}
    weights = {name: [rank["weights"][name] for rank in ranks] for name in SETUPS}
    identical = all(losses[name] == losses["plain"] for name in SETUPS) and all(
        weights[name] == weights["plain"] for name in SETUPS
    )
    return {"rows": rows, "identical": identical, "planned": result["planned"]}


def main() -> None:
    """Parse the flags, run each EP's world, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seq 128, 2 rounds")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=None)
    cli = parser.parse_args()
    shape = dict(hidden=256, seq=128 if cli.quick else 512)
    settings = dict(warmup=1, rounds=cli.rounds or (2 if cli.quick else 6))
    print(describe_machine(f"EP gloo processes, 1 thread each; {shape}, {settings}"))
    print(
        "| EP | setup | step | vs plain | exposed expert collectives (all ranks) | "
        "hidden (measured) | hidden (planned) | losses and weights bit-identical |"
    )
    print("|---|---|---|---|---|---|---|---|")  # fmt: skip
    for size in cli.sizes:
        summary = summarize(run_world(size, shape, settings))
        plain = summary["rows"]["plain"]["step"]
        for name, row in summary["rows"].items():
            hidden = "-" if name == "plain" else f"{row['hidden']:.0%}"
            planned = "-" if name == "plain" else f"{summary['planned']:.0%}"
            print(
                f"| {size} | {name} | {format_ms(row['step'])} | {plain / row['step']:.2f}x | "
                f"{format_ms(row['exposed'])} | {hidden} | {planned} | "
                f"{'yes' if summary['identical'] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
