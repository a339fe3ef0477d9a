"""Benchmark: tokens/s of a Megatron-LM-style MoE GPT (`--num-experts` with `--moe-*` flags,
`megatron/model/moe_layer.py`) vs the dense GPT of the same active parameters, on CPU; grouped
GEMM vs the per-expert loop; the all-to-all vs the all-gather dispatcher; and the share of the
step spent in the dispatcher's collectives.

    python benchmarks/routed_moe_step.py                # 4 layers, h 256, 8 experts, top-2
    python benchmarks/routed_moe_step.py --quick        # smoke run: 2 layers, h 64, 3 rounds
    python benchmarks/routed_moe_step.py --experts 4 --topk 1 2 --rounds 20

Two fresh gloo processes (data-parallel 2, one torch thread each), trained by the project's
own plain engine (no DeepSpeed): `megatron.arguments.parse_args` on one flag list,
`build_engine(pretrain_gpt.model_provider, args, pretrain_gpt.forward_step)`, then one
`TrainingLoop.step` per step (DDP, clipping, AdamW, the expert-gradient reduction, the LR
schedule). For every top-k, four setups are built from the same seed:

- moe-topK-grouped:   `--num-experts E --moe-router-topk K --expert-model-parallel-size 2
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-aux-loss-coeff 0.01`: every
  layer's MLP is the routed MoE layer (E/2 experts on each rank, h -> 4h -> h each, dropless),
  its local experts run as one `torch.nn.functional.grouped_mm` per weight;
- moe-topK-loop:      the same without `--moe-grouped-gemm`: one matmul per local expert;
- moe-topK-allgather: the grouped setup with `--moe-token-dispatcher-type allgather` (every
  rank gathers all tokens, runs its experts, a reduce-scatter returns the sums);
- dense-topK:         no experts and `--ffn-hidden-size` K x 4h: the MLP parameters one token
  passes through match, but for the router (E x h and its E biases) and the K - 1 more output
  biases (h).

fp32, dropout 0, no activation recomputation, AdamW (wd 0.1, clip 1.0), fixed synthetic
batches (uniform random token ids, vocabulary 1024 so that the output layer does not dominate
a model this narrow), each rank its own. The MoE setups start from the same weights and data,
so their first-step losses must agree (checked and printed).

Timing as `benchmarks/moe_step.py`: `--warmup` untimed rounds, then `--rounds` timed rounds; a
round runs one step of every setup, the order rotating, each step after a barrier outside the
timing. Step time = last rank's end - first rank's start; tokens/s = global batch tokens /
median step; "vs dense" = median over rounds of t(dense) / t(setup) from the same round (and
the ratio of the medians); "vs loop" the same against moe-topK-loop. Parts of the step are
timed from outside (nothing in megatron is edited): `torch.distributed.all_to_all_single`
(what `expert_mappings` calls, looked up on `torch.distributed` at every call: the token
all-to-alls forward and backward and the per-expert count exchange), `expert_mappings.
all_gather_single` / `reduce_scatter_single` (the all-gather dispatcher's collectives, wrapped
in that module, apart from the tensor-parallel ones) are replaced by wrappers that add up wall time,
calls and input bytes on each rank; `torch.nn.functional.grouped_mm` calls are counted (to
show the grouped path ran, not the loop it falls back to); the optimizer share is the step's
own level-1 'optimizer' timer (expert-gradient reduction, clipping, AdamW). DDP's gradient
all-reduce runs inside its C++ reducer, overlapped with the backward, and is not separated.
Share = mean over ranks of (time inside / step time); a collective's time includes waiting for
the other rank (uneven expert loads), which is what the step pays for it. Steps during which
other processes used more than 0.1 core (`benchmarks/machine.py`) are dropped when at least 3
undisturbed steps remain (the table says how many), else all are used, marked noisy.
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
from dataclasses import dataclass
from itertools import cycle

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
from megatron.core.tensor_parallel import expert_mappings  # noqa: E402
from megatron.initialize import set_random_seed  # noqa: E402
from megatron.model import num_parameters  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.training.loop import TrainingLoop  # noqa: E402
from megatron.training.monitor import Timers  # noqa: E402
from megatron.training.training import build_engine  # noqa: E402

RANKS = 2
PARTS = ("all-to-all", "gather-scatter", "optimizer", "grouped_mm")
FIRST_LOSS_TOLERANCE = 1e-4  # relative: grouped_mm, the loop and the dispatchers sum apart


class PartClock:
    """Wall seconds, calls and input bytes inside the MoE dispatchers' collectives and the
    calls of torch's grouped matmul, through wrappers put in place of the originals where the
    MoE code looks them up at call time."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.calls = dict.fromkeys(PARTS, 0)
        self.bytes = dict.fromkeys(PARTS, 0)
        self._wrap(dist, "all_to_all_single", "all-to-all")  # (output, input, ...)
        self._wrap(expert_mappings, "all_gather_single", "gather-scatter")
        self._wrap(expert_mappings, "reduce_scatter_single", "gather-scatter")
        self._wrap(F, "grouped_mm", "grouped_mm", tensor_arg=0)

    def _wrap(self, owner: object, attribute: str, part: str, tensor_arg: int = 1) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the original's own
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1
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
    dispatcher: str = "alltoall"
    grouped: bool = False


def setups_for(top_ks: list[int], experts: int) -> list[Setup]:
    """dense-topK, moe-topK-grouped, -loop and -allgather for every K."""
    setups = []
    for k in top_ks:
        setups += [
            Setup(f"dense-top{k}", k, 1),
            Setup(f"moe-top{k}-grouped", k, experts, "alltoall", grouped=True),
            Setup(f"moe-top{k}-loop", k, experts, "alltoall", grouped=False),
            Setup(f"moe-top{k}-allgather", k, experts, "allgather", grouped=True),
        ]
    return setups


def megatron_flags(setup: Setup, shape: dict, seed: int) -> list[str]:
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
    }
    if setup.experts > 1:
        flags |= {
            "--num-experts": setup.experts,
            "--moe-router-topk": setup.top_k,
            "--expert-model-parallel-size": RANKS,
            "--moe-token-dispatcher-type": setup.dispatcher,
            "--moe-aux-loss-coeff": 0.01,
        }
    else:
        flags["--ffn-hidden-size"] = setup.top_k * 4 * h
    argv = [str(item) for pair in flags.items() for item in pair]
    return argv + (["--moe-grouped-gemm"] if setup.grouped else [])


def build(setup: Setup, shape: dict, seed: int) -> tuple[TrainingLoop, object, dict]:
    """The setup's training loop (plain engine), its data and its parameter counts."""
    with contextlib.redirect_stdout(io.StringIO()):  # the model-size report
        args = parse_args(megatron_flags(setup, shape, seed), world_size=RANKS)
        # What a run learns from its tokenizer, here from the shape.
        args = with_settled(
            args, padded_vocab_size=shape["vocab_size"], eod_token_id=shape["vocab_size"] - 1
        )
        set_random_seed(seed)
        engine = build_engine(pretrain_gpt.model_provider, args, pretrain_gpt.forward_step)
    config = ModelConfig.from_args(args)
    sizes = {
        "parameters": num_parameters(config),
        "active": num_parameters(config, active=True),
        "on each rank": sum(p.numel() for p in engine.module().parameters()),  # its experts
    }
    # Level 1: the step's 'optimizer' timer runs (what --timing-log-level 1 shows).
    loop = TrainingLoop(args, engine, Timers(1), None)
    generator = torch.Generator().manual_seed(seed + dist.get_rank())  # each rank its own data
    size = (shape["micro_batch_size"], shape["seq_length"] + 1)
    batches = [
        {"text": torch.randint(0, shape["vocab_size"], size, generator=generator)} for _ in range(4)
    ]
    return loop, cycle(batches), sizes


def worker(rank: int, setups: list[Setup], shape: dict, settings: dict, out_path: str) -> None:
    """One rank: build every setup, run the rounds; rank 0 writes all ranks' records."""
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    # The layout's groups, as initialize_megatron makes them for the MoE setups; a dense model
    # has no expert layer to use the expert-parallel group.
    parallel_state.initialize_model_parallel(expert_parallel_size=RANKS)
    clock = PartClock()
    built = {setup.name: build(setup, shape, settings["seed"]) for setup in setups}
    records: dict[str, list[dict]] = {setup.name: [] for setup in setups}
    for index in range(settings["warmup"] + settings["rounds"]):
        shift = index % len(setups)
        for setup in setups[shift:] + setups[:shift]:
            loop, data, _ = built[setup.name]
            optimizer_timer = loop.timers("optimizer", 1)
            dist.barrier()
            clock.reset()
            optimizer_timer.reset()
            busy, own, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
            result = loop.step(data)
            end = time.perf_counter()
            seconds = dict(clock.seconds, optimizer=optimizer_timer.elapsed())
            records[setup.name].append(
                {
                    "warmup": index < settings["warmup"],
                    "round": index,
                    "step": [start, end],
                    "own_cpu": time.process_time() - own,
                    "machine_cpu": machine_busy_seconds() - busy,
                    "seconds": seconds,
                    "calls": dict(clock.calls),
                    "bytes": dict(clock.bytes),
                    "losses": {name: float(value) for name, value in result.losses.items()},
                }
            )
    gathered: list = [None] * RANKS
    dist.all_gather_object(gathered, records)
    if rank == 0:
        sizes = {name: sizes for name, (_, _, sizes) in built.items()}
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
        OMP_NUM_THREADS="1",
    )
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "records.json")
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
    calls: dict[str, int]  # part -> calls in the last timed step, rank 0
    megabytes: dict[str, list[float]]  # part -> input MB in the last timed step, per rank
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
    last = timed[-1]
    return Row(
        setup=setup,
        sizes=sizes,
        steps=steps,
        shares={part: statistics.median(values) for part, values in shares.items()},
        calls=dict(last[0]["calls"]),
        # Per rank: the rows a rank receives, and so sends back, follow its experts' loads.
        megabytes={part: [r["bytes"][part] / 1e6 for r in last] for part in PARTS},
        first_losses=ranks[0][0]["losses"],
        kept=kept,
    )


def versus(base: Row | None, row: Row) -> str:
    """t(base) / t(row): median of the per-round ratios (bold), then the ratio of medians."""
    if base is None:
        return "-"
    paired = [base.steps[r] / t for r, t in row.steps.items() if r in base.steps]
    medians = f"{base.median / row.median:.2f}x"
    return f"**{statistics.median(paired):.2f}x**; {medians}" if paired else medians


def _megabytes(row: Row, part: str) -> str:
    return "/".join(f"{value:.2f}" for value in row.megabytes[part])


def print_table(rows: list[Row], tokens: int) -> None:
    """The markdown table: each row against the dense and the loop rows of its top-k."""
    by_name = {row.setup.name: row for row in rows}
    print(
        "| setup | parameters (on each rank) | active per token | step (median) "
        "| step (min-max) | tokens/s | vs dense (per round; medians) "
        "| vs loop (per round; medians) | all-to-all share | all-to-all calls, MB (rank 0/1) "
        "| all-gather + reduce-scatter share | all-gather + reduce-scatter calls, MB (rank 0/1) "
        "| optimizer step share | grouped_mm calls | undisturbed steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        k = row.setup.top_k
        loop = by_name.get(f"moe-top{k}-loop") if row.setup.experts > 1 else None
        times, sizes, shares = row.steps.values(), row.sizes, row.shares
        print(
            f"| {row.setup.name} | {sizes['parameters']:,} ({sizes['on each rank']:,}) "
            f"| {sizes['active']:,} | {format_ms(row.median)} "
            f"| {format_ms(min(times))}-{format_ms(max(times))} "
            f"| {tokens / row.median:,.0f} | {versus(by_name.get(f'dense-top{k}'), row)} "
            f"| {versus(loop, row)} | {shares['all-to-all']:.1%} "
            f"| {row.calls['all-to-all']}, {_megabytes(row, 'all-to-all')} "
            f"| {shares['gather-scatter']:.1%} "
            f"| {row.calls['gather-scatter']}, {_megabytes(row, 'gather-scatter')} "
            f"| {shares['optimizer']:.1%} | {row.calls['grouped_mm']} | {row.kept} |"
        )


def check_first_losses(rows: list[Row]) -> None:
    """Print whether the MoE setups of each top-k, built alike, agree on the first-step loss."""
    for k in sorted({row.setup.top_k for row in rows}):
        moe = [row for row in rows if row.setup.top_k == k and row.setup.experts > 1]
        losses = {row.setup.name: row.first_losses["lm loss"] for row in moe}
        reference = next(iter(losses.values()))
        agree = all(
            abs(value - reference) <= FIRST_LOSS_TOLERANCE * abs(reference)
            for value in losses.values()
        )
        listed = ", ".join(f"{name} {value:.6f}" for name, value in losses.items())
        verdict = "OK" if agree else f"DIFFER (beyond {FIRST_LOSS_TOLERANCE:g} relative)"
        print(f"first-step lm loss, top-{k}: {listed} -> {verdict}")


def parse_cli() -> argparse.Namespace:
    """The benchmark's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    parser.add_argument("--topk", nargs="+", type=int, default=[2], help="experts per token")
    add_model_shape_flags(
        parser,
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=256,
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
    if not all(1 <= k <= cli.experts for k in cli.topk):
        parser.error(f"--topk: each must be 1 to --experts {cli.experts}")
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
        f"{cli.vocab_size}, fp32, dropout 0, plain engine (DDP), data-parallel {RANKS}; MoE: "
        f"{cli.experts} experts in every layer over expert-parallel {RANKS}, dropless, aux "
        f"loss 0.01; {tokens} tokens per step; {cli.warmup} warm-up + {cli.rounds} timed rounds"
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
    check_first_losses(rows)
    print(
        "step = last rank's end - first rank's start; tokens/s = tokens per step / median step; "
        "vs dense / vs loop = t(dense-topK) / t(setup), t(moe-topK-loop) / t(setup), median "
        "over rounds; shares = time inside torch.distributed.all_to_all_single, "
        "expert_mappings' all-gather + reduce-scatter and the step's 'optimizer' timer over the "
        "step, mean of ranks; calls (rank 0) and input MB per step of the last timed step"
    )
    print_table(rows, tokens)


if __name__ == "__main__":
    main()
