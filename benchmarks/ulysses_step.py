"""Benchmark: DeepSpeed-Ulysses (`--ds-sequence-parallel-size S`) on CPU at S = 1, 2, 4: step
time and tokens/s, activation memory per rank, and the attention all-to-all's volume and share.

    python benchmarks/ulysses_step.py                  # 2 layers, h 128, 8 heads, seq 2048
    python benchmarks/ulysses_step.py --quick          # smoke run: h 64, 4 heads, seq 256
    python benchmarks/ulysses_step.py --sizes 1 2 --rounds 20

One long-sequence GPT, trained by the project's own step: `megatron.arguments.parse_args` on
one flag list, `setup_model_and_optimizer(pretrain_gpt.model_provider, args)` (`--deepspeed
--no-pipeline-parallel`, a config file holding only ZeRO stage 0), then `train_step_deepspeed`
with `pretrain_gpt.forward_step`, as `TrainingLoop.step` calls them. Each S runs in its own
world of S fresh gloo processes (one torch thread each; data-parallel 1, micro-batch 1, so
every S trains on the same sample): the S ranks each hold 1/S of the sequence, and attention
runs head-split between DeepSpeed's all-to-alls (`megatron.model.attention.UlyssesAttention`
around `deepspeed.sequence.layer.DistributedAttention`). S = 1 is one process without Ulysses,
the baseline. With 4 ranks on a 2-core machine S = 4 oversubscribes the cores (two processes
per core; the output says so): its step time then measures time-sharing as much as Ulysses.

fp32, dropout 0, no activation recomputation, the default attention backend (SDPA), AdamW
(wd 0.1, clip 1.0), fixed synthetic batches (uniform random token ids, vocabulary 1024), the
same in every world, so the first-step losses must agree with S = 1 (checked and printed).

Timing: every world is started and built first, then the worlds wait between steps on a
barrier with this process, which runs `--warmup` untimed rounds and then `--rounds` timed
rounds; a round runs one training step of every S, the order rotating, each step after a
barrier outside the timing, so slow drifts of the machine's load hit all sizes alike (the
idle worlds sleep meanwhile). Step time = last rank's end - first rank's start; tokens/s =
sequence tokens / median step time; "vs S=1" = median over rounds of t(S=1) / t(S) from the
same round (and the ratio of the medians). The all-to-all (`deepspeed.comm.all_to_all_single`,
which `_SeqAllToAll` calls: q, k, v and the context in forward, again in backward), the
gradient all-reduce and `DeepSpeedEngine.step` are timed from outside with `moe_step.PartClock`
(calls, input bytes per step and rank; share = mean over ranks of time inside / step; the
all-to-all's includes waiting for the group's slowest rank). Steps during which other
processes used more than 0.1 core (`benchmarks/machine.py`) are dropped when at least 3
undisturbed steps remain (the table says how many), else all are used, marked noisy.

Activation memory: during the first (warm-up) step's forward, a `torch.autograd.graph.
saved_tensors_hooks` pack hook records every tensor autograd saves for backward; each distinct
storage counts once (keyed by `untyped_storage().data_ptr()`, its `nbytes()`), parameters left
out. It is a deterministic count of what one micro-batch's forward keeps alive until backward,
per rank (the table shows the largest rank's), not an allocator peak. It falls as about 1/S:
every activation holds 1/S of the tokens, or inside attention the full sequence of 1/S of the
heads. Two things do not follow 1/S: what every rank keeps whole (the token ids, the loss mask:
kilobytes; the causal mask is not materialized), and the one tensor per layer Ulysses adds:
SDPA keeps its head-split output for backward and the output projection its all-to-all'd
input, where one process saves one tensor for both ([s/S, b, h] more per layer).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from itertools import cycle

import torch
import torch.distributed as dist

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import (  # noqa: E402  (benchmarks/machine.py)
    add_model_shape_flags,
    describe_machine,
    format_ms,
    free_port,
    load_average,
    machine_busy_seconds,
    model_shape,
    undisturbed,
)
from moe_step import PARTS, PartClock  # noqa: E402  (benchmarks/moe_step.py)
from worlds import multiprocessing_context, start_world  # noqa: E402  (benchmarks/worlds.py)

import pretrain_gpt  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.deepspeed_facts import skip_deepspeed_cpu_inference_comm  # noqa: E402
from megatron.initialize import set_random_seed  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.training import setup_model_and_optimizer  # noqa: E402
from megatron.training.step import train_step_deepspeed  # noqa: E402

STEP_TIMEOUT_S = 900  # this process gives up on a world that stops answering for this long
LOSS_TOLERANCE = 1e-5  # relative: fp32 sums in another order, nothing more


class SavedForBackward:
    """Bytes of the distinct storages autograd saves for backward inside a `with` block, the
    parameters' own storages left out (each storage once, however many views are saved)."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self._parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        """Sum of the recorded storages' sizes."""
        return sum(self.storages.values())


def megatron_flags(size: int, shape: dict, config_path: str, seed: int) -> list[str]:
    """The command line of the world with `size` sequence-parallel ranks."""
    flags = {
        "--num-layers": shape["num_layers"],
        "--hidden-size": shape["hidden_size"],
        "--num-attention-heads": shape["num_attention_heads"],
        "--seq-length": shape["seq_length"],
        "--max-position-embeddings": shape["seq_length"],
        "--micro-batch-size": shape["micro_batch_size"],
        "--global-batch-size": shape["micro_batch_size"],  # data-parallel 1 at every S
        "--ds-sequence-parallel-size": size,
        "--train-iters": 10_000,
        "--lr": 6e-4,
        "--min-lr": 6e-5,
        "--lr-decay-style": "cosine",
        "--lr-warmup-iters": 2,
        "--weight-decay": 0.1,
        "--clip-grad": 1.0,
        "--hidden-dropout": 0.0,
        "--attention-dropout": 0.0,
        "--seed": seed,
        "--distributed-backend": "gloo",
        "--deepspeed_config": config_path,
    }
    argv = [str(item) for pair in flags.items() for item in pair]
    return argv + ["--deepspeed", "--no-pipeline-parallel"]


def build(size: int, shape: dict, settings: dict) -> tuple:
    """The world's engine, its args and its data (the same samples on every rank and S)."""
    argv = megatron_flags(size, shape, settings["config_path"], settings["seed"])
    with contextlib.redirect_stdout(io.StringIO()):  # the start-up report
        args = parse_args(argv, world_size=size)
        # What a run learns from its tokenizer, here from the shape.
        args = with_settled(
            args, padded_vocab_size=shape["vocab_size"], eod_token_id=shape["vocab_size"] - 1
        )
        set_random_seed(settings["seed"])
        engine, _, _ = setup_model_and_optimizer(pretrain_gpt.model_provider, args)
    generator = torch.Generator().manual_seed(settings["seed"])
    batch = (shape["micro_batch_size"], shape["seq_length"] + 1)
    samples = [
        {"text": torch.randint(0, shape["vocab_size"], batch, generator=generator)}
        for _ in range(4)
    ]
    return engine, args, cycle(samples)


def worker(rank: int, size: int, shape: dict, settings: dict, barrier, out_path: str) -> None:  # noqa: ANN001
    """One rank of the world of `size`; a failure breaks the barrier so that the parent stops."""
    try:
        _rank_work(rank, size, shape, settings, barrier, out_path)
    except BaseException:
        barrier.abort()
        raise


def _rank_work(rank: int, size: int, shape: dict, settings: dict, barrier, out_path: str) -> None:  # noqa: ANN001
    import deepspeed

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        MASTER_PORT=str(settings["ports"][size]),
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_cpu_inference_comm()  # as our runs start DeepSpeed
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(1, 1, size)
    clock = PartClock()
    engine, args, data = build(size, shape, settings)
    saved = SavedForBackward(list(engine.module.parameters()))
    barrier.wait()  # built
    records = []
    for index in range(settings["warmup"] + settings["rounds"]):
        barrier.wait()  # this world's turn
        dist.barrier()
        clock.reset()
        busy, own, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
        with saved if index == 0 else contextlib.nullcontext():  # the warm-up's forward
            losses = train_step_deepspeed(pretrain_gpt.forward_step, data, engine, args).losses
        end = time.perf_counter()
        records.append(
            {
                "warmup": index < settings["warmup"],
                "round": index,
                "step": [start, end],
                "own_cpu": time.process_time() - own,
                "machine_cpu": machine_busy_seconds() - busy,
                "seconds": dict(clock.seconds),
                "calls": dict(clock.calls),
                "bytes": dict(clock.bytes),
                "losses": losses,
            }
        )
        barrier.wait()  # done
    records[0]["activation_bytes"] = saved.bytes
    gathered: list = [None] * size
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as file:
            json.dump(gathered, file)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _watch(contexts: list, barriers: list, stop: threading.Event) -> None:
    """Break every barrier as soon as a rank has died (a signal, the kernel's OOM killer)."""
    while not stop.wait(1.0):
        if any(p.exitcode not in (None, 0) for c in contexts for p in c.processes):
            for barrier in barriers:
                barrier.abort()
            return


def run(sizes: list[int], shape: dict, settings: dict) -> dict[int, list[list[dict]]]:
    """Start a world per S, step them in rotating rounds: {S: per rank, its step records}."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        CUDA_VISIBLE_DEVICES="",  # CPU only, also on a GPU machine
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    began = time.perf_counter()
    mp_context = multiprocessing_context()
    # Each world's ranks and this process.
    barriers = {size: mp_context.Barrier(size + 1) for size in sizes}
    with tempfile.TemporaryDirectory() as scratch:
        config_path = os.path.join(scratch, "ds_config.json")
        with open(config_path, "w", encoding="utf-8") as file:
            json.dump({"zero_optimization": {"stage": 0}}, file)
        settings = dict(settings, config_path=config_path, ports={s: free_port() for s in sizes})
        outputs = {size: os.path.join(scratch, f"records-{size}.json") for size in sizes}
        contexts = [
            start_world(
                worker,
                (size, shape, settings, barriers[size], outputs[size]),
                size,
                join=False,
                preload=("deepspeed",),  # each rank's first import
            )
            for size in sizes
        ]
        stop = threading.Event()
        watcher = threading.Thread(
            target=_watch, args=(contexts, list(barriers.values()), stop), daemon=True
        )
        watcher.start()
        try:
            for barrier in barriers.values():
                barrier.wait(timeout=STEP_TIMEOUT_S)  # every world built
            print(f"started and built the worlds in {time.perf_counter() - began:.0f} s")
            for index in range(settings["warmup"] + settings["rounds"]):
                shift = index % len(sizes)
                for size in sizes[shift:] + sizes[:shift]:
                    barriers[size].wait(timeout=STEP_TIMEOUT_S)  # go
                    barriers[size].wait(timeout=STEP_TIMEOUT_S)  # done
        except threading.BrokenBarrierError:
            for barrier in barriers.values():  # the other worlds stop too
                barrier.abort()
            raise
        finally:
            stop.set()
            watcher.join()  # no longer polls the processes that join() reaps
            for context in contexts:  # raises the first failed rank's error
                while not context.join():
                    pass
        records = {}
        for size in sizes:
            with open(outputs[size], encoding="utf-8") as file:
                records[size] = json.load(file)
        return records


@dataclass
class Row:
    """One sequence-parallel size over its timed steps."""

    size: int
    steps: dict[int, float]  # round -> step seconds
    shares: dict[str, float]  # part -> median over steps of (mean over ranks) / step
    a2a_calls: int
    a2a_megabytes: float  # per step, per rank
    activation_bytes: int  # the largest rank's
    first_loss: float
    kept: str

    @property
    def median(self) -> float:
        """Median step time."""
        return statistics.median(self.steps.values())


def summarize(size: int, ranks: list[list[dict]]) -> Row:
    """Step times, the parts' shares, the activation bytes and the first loss of one S."""
    per_step = [step for step in zip(*ranks) if not step[0]["warmup"]]
    timed, kept = undisturbed(per_step)
    steps, shares = {}, {part: [] for part in PARTS}
    for step in timed:
        seconds = max(r["step"][1] for r in step) - min(r["step"][0] for r in step)
        steps[step[0]["round"]] = seconds
        for part in PARTS:
            shares[part].append(statistics.mean(r["seconds"][part] for r in step) / seconds)
    last = timed[-1][0]
    return Row(
        size=size,
        steps=steps,
        shares={part: statistics.median(values) for part, values in shares.items()},
        a2a_calls=last["calls"]["all-to-all"],
        a2a_megabytes=last["bytes"]["all-to-all"] / 1e6,
        activation_bytes=max(records[0]["activation_bytes"] for records in ranks),
        first_loss=ranks[0][0]["losses"]["lm loss"],
        kept=kept,
    )


def loss_check(rows: list[Row]) -> str:
    """ "first-step loss: ... -> OK" when every S's first loss equals S=1's (fp32 tolerance)."""
    base = rows[0].first_loss
    worst = max(abs(row.first_loss - base) for row in rows)
    verdict = "OK" if worst <= LOSS_TOLERANCE * max(1.0, abs(base)) else "MISMATCH"
    losses = ", ".join(f"S={row.size} {row.first_loss:.6f}" for row in rows)
    return f"first-step loss: {losses} (max |diff| vs S=1 {worst:.1e}) -> {verdict}"


def print_table(rows: list[Row], tokens: int) -> None:
    """The markdown table, each S against S=1 (the first row)."""
    base, cores = rows[0], os.cpu_count() or 1
    print(
        "| S | processes | tokens per rank | step (median) | step (min-max) | tokens/s "
        "| vs S=1 (per round; medians) | activation MB per rank | activation vs S=1 "
        "| all-to-all calls, MB per step and rank | all-to-all share | all-reduce share "
        "| optimizer step share | undisturbed steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        paired = [base.steps[r] / t for r, t in row.steps.items() if r in base.steps]
        versus = f"{base.median / row.median:.2f}x"
        if paired:
            versus = f"**{statistics.median(paired):.2f}x**; {versus}"
        processes = f"{row.size}" + (
            f" (oversubscribed: {cores} cores)" if row.size > cores else ""
        )
        times, shares = row.steps.values(), row.shares
        memory = f"{row.activation_bytes / base.activation_bytes:.2f}x (1/S {1 / row.size:.2f})"
        print(
            f"| S={row.size} | {processes} | {tokens // row.size:,} | {format_ms(row.median)} "
            f"| {format_ms(min(times))}-{format_ms(max(times))} | {tokens / row.median:,.0f} "
            f"| {versus} | {row.activation_bytes / 1e6:.1f} | {memory} "
            f"| {row.a2a_calls}, {row.a2a_megabytes:.1f} | {shares['all-to-all']:.1%} "
            f"| {shares['all-reduce']:.1%} | {shares['optimizer']:.1%} | {row.kept} |"
        )


def parse_cli() -> argparse.Namespace:
    """The benchmark's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4], help="values of S")
    add_model_shape_flags(
        parser,
        num_layers=2,
        hidden_size=128,
        num_attention_heads=8,
        seq_length=2048,
        micro_batch_size=1,
        vocab_size=1024,
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 2 layers, h 64, 4 heads, seq 256"
    )
    cli = parser.parse_args()
    if cli.quick:
        cli.num_layers, cli.hidden_size, cli.num_attention_heads = 2, 64, 4
        cli.seq_length, cli.vocab_size, cli.warmup, cli.rounds = 256, 256, 1, 3
    cli.sizes = sorted(set(cli.sizes) | {1})  # S=1 is the baseline of every ratio
    for size in cli.sizes:
        if size < 1 or cli.seq_length % size or cli.num_attention_heads % size:
            parser.error(
                f"--sizes: S={size} must divide --seq-length ({cli.seq_length}) and "
                f"--num-attention-heads ({cli.num_attention_heads})"
            )
    if cli.warmup < 1 or cli.rounds < 1:
        parser.error("--warmup and --rounds must be at least 1")
    return cli


def main() -> None:
    """Run every S in its own world, print the first-step losses and the table."""
    cli = parse_cli()
    shape = model_shape(cli)
    settings = {"warmup": cli.warmup, "rounds": cli.rounds, "seed": cli.seed}
    tokens = cli.micro_batch_size * cli.seq_length
    cores = os.cpu_count() or 1
    worlds = " + ".join(str(size) for size in cli.sizes)
    print(f"command: python {' '.join(sys.argv)}")
    print(describe_machine(f"worlds of {worlds} processes x 1 torch thread"))
    print(
        f"model: {cli.num_layers} layers, hidden {cli.hidden_size}, {cli.num_attention_heads} "
        f"heads, seq {cli.seq_length}, micro-batch {cli.micro_batch_size}, vocab "
        f"{cli.vocab_size}, fp32, dropout 0, ZeRO-0, data-parallel 1; {tokens} tokens per "
        f"step at every S; {cli.warmup} warm-up + {cli.rounds} timed rounds"
    )
    oversubscribed = [size for size in cli.sizes if size > cores]
    if oversubscribed:
        print(
            f"note: S={', S='.join(map(str, oversubscribed))} runs more processes than this "
            f"machine's {cores} cores: its ranks time-share them, which its step time includes"
        )
    began = time.perf_counter()
    records = run(cli.sizes, shape, settings)
    print(f"ran {time.perf_counter() - began:.0f} s; load average at the end {load_average()}")
    rows = [summarize(size, records[size]) for size in cli.sizes]
    print(loss_check(rows))
    print(
        "step = last rank's end - first rank's start; tokens/s = sequence tokens per step / "
        "median step; vs S=1 = t(S=1) / t(S), median over rounds; activation = bytes of the "
        "distinct storages saved for backward in one forward, parameters excluded, largest "
        "rank; shares = time inside deepspeed.comm's all_to_all_single / all_reduce and "
        "DeepSpeedEngine.step over the step, mean of ranks"
    )
    print_table(rows, tokens)


if __name__ == "__main__":
    main()
