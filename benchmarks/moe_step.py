"""Benchmark: tokens/s of a DeepSpeed-MoE GPT vs the dense GPT of the same active parameters, on
CPU, and the share of the step spent in DeepSpeed's all-to-all.

    python benchmarks/moe_step.py                      # 4 layers, h 256, 8 experts; top-1, top-2
    python benchmarks/moe_step.py --quick              # smoke run: 2 layers, h 64, 3 rounds
    python benchmarks/moe_step.py --experts 4 --topk 2 --rounds 20

Two fresh gloo processes (data-parallel 2, one torch thread each), trained by the project's
own step: `megatron.arguments.parse_args` on one flag list, `setup_model_and_optimizer(
pretrain_gpt.model_provider, args)` (`--deepspeed --no-pipeline-parallel`, a config file
holding only ZeRO stage 0), then `train_step_deepspeed` with `pretrain_gpt.forward_step`, as
`TrainingLoop.step` calls them. For every top-k two setups are built from the same seed:

- moe-topK:   `--num-experts E --expert-interval 1 --moe-expert-parallel-size 2 --topk K`:
  every layer's MLP is DeepSpeed's MoE layer of E experts (E/2 on each rank; tokens reach
  their experts by all-to-all), capacity factor 1.0 with token dropping and min capacity 4
  (Megatron-DeepSpeed's defaults and its MoE scripts' values), each expert our MLP h -> 4h -> h;
- dense-topK: the same GPT without experts and `--ffn-hidden-size` K x 4h: the parameters one
  token passes through match, but for the MoE layer's gate (h x E) and the K - 1 more output
  biases (h) of its K experts.

fp32, dropout 0, no activation recomputation, AdamW (wd 0.1, clip 1.0), fixed synthetic
batches (uniform random token ids, vocabulary 1024 so that the output layer does not dominate
a model this narrow), each rank its own.

Timing: `--warmup` untimed rounds, then `--rounds` timed rounds; a round runs one training step
of every setup, the order rotating, each step after a barrier outside the timing, so slow drifts
of the machine's load hit all setups alike. Step time = last rank's end - first rank's start;
tokens/s = global batch tokens / median step time; "vs dense" = median over rounds of
t(dense) / t(moe) from the same round (and the ratio of the medians). Parts of the step are
timed from outside (nothing in DeepSpeed or megatron is edited): `deepspeed.comm.
all_to_all_single` (what `deepspeed.moe.sharded_moe._AllToAll` calls in forward and, through
itself, in backward), `deepspeed.comm.all_reduce` (the engine's gradient all-reduce) and
`DeepSpeedEngine.step` (clipping, AdamW over the rank's own parameters, the LR schedule) are
replaced by wrappers that add up their wall time, calls and input bytes on each rank. Share =
mean over ranks of (time inside / step time). The all-to-all's includes waiting for the other
rank to arrive (uneven expert loads, the other rank's gating), which is what the step pays for
it. Steps during which other processes used more than 0.1 core
(/proc/stat minus the ranks' own CPU time, `benchmarks/machine.py`) are dropped when at least 3
undisturbed steps remain (the table says how many), else all are used, marked noisy.
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
import time
from collections.abc import Callable
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
from worlds import start_world  # noqa: E402  (benchmarks/worlds.py)

import pretrain_gpt  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.deepspeed_facts import skip_deepspeed_cpu_inference_comm  # noqa: E402
from megatron.initialize import set_random_seed  # noqa: E402
from megatron.model import num_parameters  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.training import setup_model_and_optimizer  # noqa: E402
from megatron.training.step import train_step_deepspeed  # noqa: E402

RANKS = 2
PARTS = ("all-to-all", "all-reduce", "optimizer")


class PartClock:
    """Wall seconds, calls and input bytes inside functions replaced from outside by timed
    wrappers: DeepSpeed's collectives (`deepspeed.comm.all_to_all_single`, what
    `sharded_moe._AllToAll` and DeepSpeed-Ulysses' `sequence.layer._SeqAllToAll` call;
    `deepspeed.comm.all_reduce`, the engine's gradient all-reduce: both looked up on
    `deepspeed.comm` at every call) and `DeepSpeedEngine.step` (at the accumulation boundary:
    clipping, AdamW, the LR schedule)."""

    def __init__(self) -> None:
        import deepspeed.comm as comm
        from deepspeed.runtime.engine import DeepSpeedEngine

        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.calls = dict.fromkeys(PARTS, 0)
        self.bytes = dict.fromkeys(PARTS, 0)
        self._wrap(comm, "all_to_all_single", "all-to-all", tensor_arg=1)  # (output, input)
        self._wrap(comm, "all_reduce", "all-reduce", tensor_arg=0)
        self._wrap(DeepSpeedEngine, "step", "optimizer", tensor_arg=None)

    def _wrap(self, owner: object, attribute: str, part: str, tensor_arg: int | None) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the original's own
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1
                if tensor_arg is not None:
                    tensor = args[tensor_arg]
                    self.bytes[part] += tensor.numel() * tensor.element_size()

        setattr(owner, attribute, timed)

    def reset(self) -> None:
        """Zero every counter (before a step)."""
        for counter in (self.seconds, self.calls, self.bytes):
            for part in counter:
                counter[part] = 0


@dataclass(frozen=True)
class Setup:
    """One model of the comparison."""

    name: str
    top_k: int
    experts: int  # 1: dense


def setups_for(top_ks: list[int], experts: int) -> list[Setup]:
    """dense-topK and moe-topK for every K."""
    return [
        Setup(f"{kind}-top{k}", k, experts if kind == "moe" else 1)
        for k in top_ks
        for kind in ("dense", "moe")
    ]


def megatron_flags(setup: Setup, shape: dict, config_path: str, seed: int) -> list[str]:
    """The command line of one setup."""
    h = shape["hidden_size"]
    flags = {
        "--num-layers": shape["num_layers"],
        "--hidden-size": h,
        "--num-attention-heads": shape["num_attention_heads"],
        "--seq-length": shape["seq_length"],
        "--max-position-embeddings": shape["seq_length"],
        "--micro-batch-size": shape["micro_batch_size"],
        "--global-batch-size": shape["micro_batch_size"] * RANKS,
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
    if setup.experts > 1:
        flags |= {
            "--num-experts": setup.experts,
            "--expert-interval": 1,
            "--moe-expert-parallel-size": RANKS,
            "--topk": setup.top_k,
        }
    else:
        flags["--ffn-hidden-size"] = setup.top_k * 4 * h
    argv = [str(item) for pair in flags.items() for item in pair]
    return argv + ["--deepspeed", "--no-pipeline-parallel"]


def build(setup: Setup, shape: dict, config_path: str, seed: int) -> tuple[Callable, dict]:
    """The setup's training step (a closure over its engine and data) and its sizes."""
    argv = megatron_flags(setup, shape, config_path, seed)
    with contextlib.redirect_stdout(io.StringIO()):  # the start-up report
        args = parse_args(argv, world_size=RANKS)
        # What a run learns from its tokenizer, here from the shape.
        args = with_settled(
            args, padded_vocab_size=shape["vocab_size"], eod_token_id=shape["vocab_size"] - 1
        )
        set_random_seed(seed)
        engine, _, _ = setup_model_and_optimizer(pretrain_gpt.model_provider, args)
    config = ModelConfig.from_args(args)
    sizes = {
        "parameters": num_parameters(config),
        "active": num_parameters(config, active=True),
        "on each rank": sum(p.numel() for p in engine.module.parameters()),  # its experts only
    }
    generator = torch.Generator().manual_seed(seed + dist.get_rank())  # each rank its own data
    size = (shape["micro_batch_size"], shape["seq_length"] + 1)
    batches = [
        {"text": torch.randint(0, shape["vocab_size"], size, generator=generator)} for _ in range(4)
    ]
    data = cycle(batches)

    def step() -> dict[str, float]:
        return train_step_deepspeed(pretrain_gpt.forward_step, data, engine, args).losses

    return step, sizes


def worker(rank: int, setups: list[Setup], shape: dict, settings: dict, out_path: str) -> None:
    """One rank: build every setup, run the rounds; rank 0 writes all ranks' records."""
    import deepspeed

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_cpu_inference_comm()  # as our runs start DeepSpeed
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(1, 1)
    clock = PartClock()
    built = {
        setup.name: build(setup, shape, settings["config_path"], settings["seed"])
        for setup in setups
    }
    records: dict[str, list[dict]] = {setup.name: [] for setup in setups}
    for index in range(settings["warmup"] + settings["rounds"]):
        shift = index % len(setups)
        for setup in setups[shift:] + setups[:shift]:
            dist.barrier()
            clock.reset()
            busy, own, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
            losses = built[setup.name][0]()
            end = time.perf_counter()
            records[setup.name].append(
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
    gathered: list = [None] * RANKS
    dist.all_gather_object(gathered, records)
    if rank == 0:
        sizes = {name: sizes for name, (_, sizes) in built.items()}
        with open(out_path, "w", encoding="utf-8") as file:
            json.dump({"ranks": gathered, "sizes": sizes}, file)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run(setups: list[Setup], shape: dict, settings: dict) -> dict:
    """Spawn the ranks: {"ranks": per rank {setup: records}, "sizes": {setup: counts}}."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        CUDA_VISIBLE_DEVICES="",  # CPU only, also on a GPU machine
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    with tempfile.TemporaryDirectory() as scratch:
        config_path = os.path.join(scratch, "ds_config.json")
        with open(config_path, "w", encoding="utf-8") as file:
            json.dump({"zero_optimization": {"stage": 0}}, file)
        out_path = os.path.join(scratch, "records.json")
        settings = dict(settings, config_path=config_path)
        start_world(worker, (setups, shape, settings, out_path), RANKS)
        with open(out_path, encoding="utf-8") as file:
            return json.load(file)


@dataclass
class Row:
    """One setup over its timed steps."""

    setup: Setup
    sizes: dict
    steps: dict[int, float]  # round -> step seconds
    shares: dict[str, float]  # part -> median over steps of (mean over ranks) / step
    a2a_calls: int
    a2a_megabytes: float  # per step, per rank
    first_losses: dict[str, float]
    kept: str

    @property
    def median(self) -> float:
        """Median step time."""
        return statistics.median(self.steps.values())


def summarize(setup: Setup, ranks: list[list[dict]], sizes: dict) -> Row:
    """Step times and the parts' shares of one setup from both ranks' records."""
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
        setup=setup,
        sizes=sizes,
        steps=steps,
        shares={part: statistics.median(values) for part, values in shares.items()},
        a2a_calls=last["calls"]["all-to-all"],
        a2a_megabytes=last["bytes"]["all-to-all"] / 1e6,
        first_losses=ranks[0][0]["losses"],
        kept=kept,
    )


def print_table(rows: list[Row], tokens: int) -> None:
    """The markdown table: each MoE row against the dense row of the same top-k."""
    dense = {row.setup.top_k: row for row in rows if row.setup.experts == 1}
    print(
        "| setup | experts (per rank) | parameters (on each rank) | active per token "
        "| step (median) | step (min-max) | tokens/s | vs dense (per round; medians) "
        "| all-to-all share | all-to-all calls, MB per step and rank | all-reduce share "
        "| optimizer step share | undisturbed steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = dense[row.setup.top_k]
        paired = [base.steps[r] / t for r, t in row.steps.items() if r in base.steps]
        versus = (
            f"**{statistics.median(paired):.2f}x**; {base.median / row.median:.2f}x"
            if paired
            else f"{base.median / row.median:.2f}x"
        )
        count = row.setup.experts
        experts = "-" if count == 1 else f"{count} ({count // RANKS})"
        times, sizes, shares = row.steps.values(), row.sizes, row.shares
        print(
            f"| {row.setup.name} | {experts} | {sizes['parameters']:,} ({sizes['on each rank']:,}) "
            f"| {sizes['active']:,} | {format_ms(row.median)} "
            f"| {format_ms(min(times))}-{format_ms(max(times))} "
            f"| {tokens / row.median:,.0f} | {versus} | {shares['all-to-all']:.1%} "
            f"| {row.a2a_calls}, {row.a2a_megabytes:.1f} | {shares['all-reduce']:.1%} "
            f"| {shares['optimizer']:.1%} | {row.kept} |"
        )


def parse_cli() -> argparse.Namespace:
    """The benchmark's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    parser.add_argument("--topk", nargs="+", type=int, choices=[1, 2], default=[1, 2])
    add_model_shape_flags(
        parser,
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=128,
        micro_batch_size=4,
        vocab_size=1024,
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 2 layers, h 64, seq 32, 4 experts"
    )
    cli = parser.parse_args()
    if cli.quick:
        cli.num_layers, cli.hidden_size, cli.seq_length, cli.micro_batch_size = 2, 64, 32, 2
        cli.experts, cli.vocab_size, cli.warmup, cli.rounds = 4, 256, 1, 3
    if cli.experts < 2 or cli.experts % RANKS:
        parser.error(f"--experts must be a multiple of the expert-parallel size {RANKS}")
    if cli.warmup < 1 or cli.rounds < 1:
        parser.error("--warmup and --rounds must be at least 1")
    return cli


def main() -> None:
    """Run every setup in the same two processes, print the losses and the table."""
    cli = parse_cli()
    shape = model_shape(cli)
    settings = {"warmup": cli.warmup, "rounds": cli.rounds, "seed": cli.seed}
    setups = setups_for(list(dict.fromkeys(cli.topk)), cli.experts)
    tokens = cli.micro_batch_size * cli.seq_length * RANKS
    print(f"command: python {' '.join(sys.argv)}")
    print(describe_machine(f"{RANKS} processes x 1 torch thread"))
    print(
        f"model: {cli.num_layers} layers, hidden {cli.hidden_size}, {cli.num_attention_heads} "
        f"heads, seq {cli.seq_length}, micro-batch {cli.micro_batch_size} per rank, vocab "
        f"{cli.vocab_size}, fp32, dropout 0, ZeRO-0, data-parallel {RANKS}; MoE: {cli.experts} "
        f"experts in every layer over expert-parallel {RANKS}; {tokens} tokens per step; "
        f"{cli.warmup} warm-up + {cli.rounds} timed rounds"
    )
    began = time.perf_counter()
    result = run(setups, shape, settings)
    print(f"ran {time.perf_counter() - began:.0f} s; load average at the end {load_average()}")
    rows = [
        summarize(
            setup,
            [rank[setup.name] for rank in result["ranks"]],
            result["sizes"][setup.name],
        )
        for setup in setups
    ]
    for row in rows:
        losses = ", ".join(f"{name} {value:.4f}" for name, value in row.first_losses.items())
        print(f"first step, {row.setup.name}: {losses}")
    print(
        "step = last rank's end - first rank's start; tokens/s = tokens per step / median step; "
        "vs dense = t(dense) / t(moe) of the same top-k, median over rounds; shares = time "
        "inside deepspeed.comm's all_to_all_single / all_reduce and DeepSpeedEngine.step over "
        "the step, mean of ranks"
    )
    print_table(rows, tokens)


if __name__ == "__main__":
    main()
