"""Benchmark: step time and bubble of Megatron's pipeline schedules (1F1B, interleaved) on CPU.

    python benchmarks/pipeline_schedules.py                  # 8 layers, h 256; m = 4 and 8
    python benchmarks/pipeline_schedules.py --quick          # smoke run, well under a minute
    python benchmarks/pipeline_schedules.py --vocab-size 50304 --layouts pp2

One GPT, one global batch of m micro-batches, trained by the project's own step
(`megatron.arguments.parse_args` on one flag list, `setup_model_and_optimizer(
pretrain_gpt.model_provider, args)`, then `train_step_plain` or `train_step_megatron_schedules` as
`TrainingLoop.step` calls them) in four layouts, each in fresh gloo processes:

- pp1:   1 process, no pipeline (`GPTModel`, `train_step_plain`): the baseline, always run;
- dp2:   2 data-parallel processes (DDP), m/2 micro-batches each: the other use of 2 cores;
- pp2:   `--pipeline-model-parallel-size 2`: Megatron's 1F1B;
- pp2v2: the same with `--virtual-pipeline-model-parallel-size 2`: interleaved 1F1B.

Threads: every process runs 1 torch thread. On the 2-core machine this was written for, 2
ranks give each stage one core, so the fair reference is 1 process on 1 core: pp1 is the
per-core baseline, and a perfect 2-stage pipeline takes half its forward-backward time (pp1
with 2 threads would measure intra-op scaling of small matmuls; 2 ranks x 2 threads would
oversubscribe). dp2 answers the other question: is pipelining 2 cores better than data
parallelism on them (same processes, cores and global batch)?

Every layout starts from the same weights (each rank builds the dense `GPTModel` from `--seed`
and loads it, or its chunks' part through `chunk_state_dict`), so the first step's loss must
agree everywhere: checked to 1e-4 (fp32, dropout 0, fixed synthetic batches).

`--warmup` untimed steps, then `--steps` timed ones, each after a barrier outside the timing;
times are `time.perf_counter` (CLOCK_MONOTONIC, one clock for all processes). Per step:
- step time: last rank's end - first rank's start of the whole training step;
- span: the same for the step's "forward-backward" region (the step functions' own timers);
- compute of rank r: wall time inside its chunks' forward (module pre/post hooks) and inside
  autograd's backward through them (a hook on each chunk output starts the clock when its
  gradient arrives, a callback queued on the autograd engine stops it when that backward
  call returns). Send/recv, waits, the loss reduction and the schedule's Python are not.

Measured bubble = mean over ranks of 1 - compute_r / span. With equal stages and free
communication it is what the schedule predicts, `bubble_fraction(PP, V, m)` = (PP - 1) /
(V m + PP - 1); on pp1 it reads near 0, which checks the method. It also holds unequal
stages (the last owns the output layer and the loss: hence `--vocab-size 1024`; with GPT-2's
50,304 the head costs more than these 8 layers), communication and the schedule's
bookkeeping. A second figure needs no hooks: span vs ideal = 1 - (pp1's span / processes) /
span, what is lost against a perfect split of the baseline over the cores; it also counts
compute slowed by two processes sharing caches and memory.

A shared machine: per step, the CPU time all processes used (/proc/stat, hypervisor steal
included) minus what the layout's own ranks used (`time.process_time`, gloo's threads
included) is what others took. A step where others averaged more than 0.1 core was disturbed
(on either core: pp1's one process also slows when the other core is busy, through the shared
cache and memory); the statistics use the undisturbed steps when there are at least 3 (the
table says how many), else all, marked noisy. Steps: median and min-max; ratio = median step /
pp1's at the same m (below 1: faster). `--repeats N` runs the layout sequence N times,
alternating its order, and pools the steps, so slow drifts of the load spread over all layouts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import cycle

import torch
import torch.distributed as dist

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import (  # noqa: E402  (benchmarks/machine.py)
    OTHERS_MAX_CORES,
    add_model_shape_flags,
    cpu_model,
    load_average,
    machine_busy_seconds,
    model_shape,
    other_cores,
)
from worlds import start_world  # noqa: E402  (benchmarks/worlds.py)

import pretrain_gpt  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.checkpointing.shards import chunk_state_dict  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel.layout import bubble_fraction  # noqa: E402
from megatron.core.pipeline_parallel.schedules import initialize_tied_embedding  # noqa: E402
from megatron.initialize import set_random_seed  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.training import setup_model_and_optimizer  # noqa: E402
from megatron.training.engines import PipelineBatch  # noqa: E402
from megatron.training.megatron_schedules_step import train_step_megatron_schedules  # noqa: E402
from megatron.training.step import train_step_plain  # noqa: E402

LOSS_TOLERANCE = 1e-4
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")


@dataclass(frozen=True)
class Layout:
    """How the model is spread over processes."""

    name: str
    title: str
    pp: int = 1
    virtual: int = 1
    dp: int = 1

    @property
    def processes(self) -> int:
        """Ranks (one core each on a 2-core machine)."""
        return self.pp * self.dp


LAYOUTS = {
    "pp1": Layout("pp1", "PP=1 (1 process, baseline)"),
    "dp2": Layout("dp2", "DP=2 (2 processes, no pipeline)", dp=2),
    "pp2": Layout("pp2", "PP=2, 1F1B", pp=2),
    "pp2v2": Layout("pp2v2", "PP=2 x V=2, interleaved 1F1B", pp=2, virtual=2),
}


class ComputeClock:
    """Wall seconds in `modules`' forward and in autograd's backward through them."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.wall = self._start = 0.0  # the caller zeroes `wall` before each step
        for module in modules:
            module.register_forward_pre_hook(self._forward_start)
            module.register_forward_hook(self._forward_end)

    def _add(self, start: float) -> None:
        self.wall += time.perf_counter() - start

    def _forward_start(self, module: torch.nn.Module, inputs: tuple) -> None:
        self._start = time.perf_counter()

    def _forward_end(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._add(self._start)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._backward_start)

    def _backward_start(self, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        # Runs when this backward call (the stage's, or the micro-batch's) has finished.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._add(start))


class SpanTimers:
    """Stands in for `megatron.training.monitor.Timers`: each timer's last start and end."""

    def __init__(self) -> None:
        self.spans: dict[str, list[float]] = {}
        self._name = ""

    def __call__(self, name: str, log_level: int | None = None) -> SpanTimers:
        """The timer `name` (every level records)."""
        self._name = name
        return self

    def start(self) -> None:
        """Open the current timer."""
        self.spans[self._name] = [time.perf_counter(), float("nan")]

    def stop(self) -> None:
        """Close the current timer."""
        self.spans[self._name][1] = time.perf_counter()


def megatron_flags(shape: dict, layout: Layout, microbatches: int, seed: int) -> list[str]:
    """The command line of one layout; the global batch is `microbatches` micro-batches."""
    flags = {f"--{name.replace('_', '-')}": shape[name] for name in MODEL_FLAGS}
    flags |= {
        "--max-position-embeddings": shape["seq_length"],
        "--global-batch-size": shape["micro_batch_size"] * microbatches,
        "--pipeline-model-parallel-size": layout.pp,
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
    if layout.virtual > 1:
        flags["--virtual-pipeline-model-parallel-size"] = layout.virtual
    return [str(item) for pair in flags.items() for item in pair]


def load_dense_weights(model: torch.nn.Module, args: argparse.Namespace, layout: Layout) -> None:
    """Give this rank's model (or chunks) the weights of the dense GPT built from `--seed`."""
    torch.manual_seed(args.seed)
    dense = GPTModel(ModelConfig.from_args(args)).state_dict()
    if layout.pp == 1:
        model.load_state_dict(dense)
        return
    rank = parallel_state.get_pipeline_model_parallel_rank()
    for index, chunk in enumerate(model):
        chunk.load_state_dict(
            chunk_state_dict(dense, args.num_layers, layout.pp, layout.virtual, rank, index)
        )
    initialize_tied_embedding(model)  # the last stage's head copy of the word embeddings


def time_layout(layout: Layout, shape: dict, microbatches: int, settings: dict) -> list[dict]:
    """Build one layout at `microbatches`, warm up, time the steps: this rank's records."""
    argv = megatron_flags(shape, layout, microbatches, settings["seed"])
    with contextlib.redirect_stdout(io.StringIO()):  # the model-size report
        args = parse_args(argv, world_size=layout.processes)
        # What a run learns from its tokenizer, here from the shape.
        args = with_settled(
            args, padded_vocab_size=shape["vocab_size"], eod_token_id=shape["vocab_size"] - 1
        )
        set_random_seed(settings["seed"])
        pipeline_batch = PipelineBatch(pretrain_gpt.get_batch_pipe, pretrain_gpt.loss_func)
        trainer, _, _ = setup_model_and_optimizer(
            pretrain_gpt.model_provider, args, pretrain_gpt.forward_step, pipeline_batch
        )
    model = trainer.model.module if layout.dp > 1 else trainer.model  # under DDP
    load_dense_weights(model, args, layout)
    clock = ComputeClock(list(model) if layout.pp > 1 else [model])
    generator = torch.Generator().manual_seed(settings["seed"])
    size = (shape["micro_batch_size"], shape["seq_length"] + 1)
    batches = [
        {"text": torch.randint(0, shape["vocab_size"], size, generator=generator)}
        for _ in range(microbatches)
    ]
    share = microbatches // layout.dp  # dp2: the global batch split between the ranks
    first = parallel_state.get_data_parallel_rank() * share
    data = cycle(batches[first : first + share])
    records = []
    for index in range(settings["warmup"] + settings["steps"]):
        timers = SpanTimers()
        dist.barrier()
        clock.wall = 0.0
        busy, own, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
        if layout.pp > 1:
            result = train_step_megatron_schedules(data, trainer, args, None, timers)
        else:
            result = train_step_plain(pretrain_gpt.forward_step, data, trainer, args, None, timers)
        records.append(
            {
                "warmup": index < settings["warmup"],
                "step": [start, time.perf_counter()],
                "span": timers.spans["forward-backward"],
                "compute": clock.wall,
                "own_cpu": time.process_time() - own,
                "machine_cpu": machine_busy_seconds() - busy,
                "loss": result.losses.get("lm loss"),
            }
        )
    return records


def worker(rank: int, layout: Layout, shape: dict, settings: dict, out_path: str) -> None:
    """One rank of a layout, every micro-batch count; rank 0 writes all ranks' records."""
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(layout.processes))
    dist.init_process_group("gloo", rank=rank, world_size=layout.processes)
    try:
        parallel_state.initialize_model_parallel(1, layout.pp)
        results = {}
        for microbatches in settings["microbatches"]:
            mine = time_layout(layout, shape, microbatches, settings)
            results[microbatches] = [None] * layout.processes
            dist.all_gather_object(results[microbatches], mine)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as file:
                json.dump(results, file)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_layout(layout: Layout, shape: dict, settings: dict) -> dict[int, list[list[dict]]]:
    """Spawn the layout's ranks: {micro-batches: per-rank records}."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",  # CPU only, also on a GPU machine
        OMP_NUM_THREADS="1",
    )
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "records.json")
        env = {"MASTER_PORT": str(port)}  # the fork server keeps the first world's environment
        start_world(worker, (layout, shape, settings, out_path), layout.processes, env)
        with open(out_path, encoding="utf-8") as file:
            return {int(m): ranks for m, ranks in json.load(file).items()}


@dataclass
class Row:
    """One layout at one micro-batch count, over its timed steps (seconds)."""

    layout: Layout
    microbatches: int
    steps: list[float]
    span: float  # median
    compute: list[float]  # median per rank
    bubble_per_rank: list[float]  # median per rank
    others: float  # cores other processes used, median over the timed steps
    first_loss: float
    kept: str  # "undisturbed steps / timed steps" (the statistics use the undisturbed ones)

    @property
    def median(self) -> float:
        """Median step time."""
        return statistics.median(self.steps)

    @property
    def bubble(self) -> float:
        """Measured bubble: the mean over ranks."""
        return statistics.mean(self.bubble_per_rank)

    @property
    def predicted(self) -> float:
        """The schedule's bubble, `bubble_fraction` (0 without a pipeline)."""
        if self.layout.pp == 1:
            return 0.0
        return bubble_fraction(self.layout.pp, self.layout.virtual, self.microbatches)


def summarize(layout: Layout, microbatches: int, ranks: list[list[dict]]) -> Row:
    """Step times, spans, compute and bubbles of one layout from all ranks' records."""
    per_step = list(zip(*ranks))  # per step: every rank's record
    timed = [step for step in per_step if not step[0]["warmup"]]
    others = [other_cores(step) for step in timed]
    quiet = [step for step, cores in zip(timed, others) if not cores > OTHERS_MAX_CORES]
    kept = f"{len(quiet)}/{len(timed)}" if len(quiet) >= 3 else f"all {len(timed)} (noisy)"
    timed = quiet if len(quiet) >= 3 else timed
    steps, spans, bubbles = [], [], []
    for step in timed:
        steps.append(max(r["step"][1] for r in step) - min(r["step"][0] for r in step))
        spans.append(max(r["span"][1] for r in step) - min(r["span"][0] for r in step))
        bubbles.append([1 - r["compute"] / spans[-1] for r in step])
    return Row(
        layout=layout,
        microbatches=microbatches,
        steps=steps,
        span=statistics.median(spans),
        compute=[statistics.median(r["compute"] for r in rank) for rank in zip(*timed)],
        bubble_per_rank=[statistics.median(b) for b in zip(*bubbles)],
        others=statistics.median(others),
        first_loss=per_step[0][0]["loss"],
        kept=kept,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def print_table(rows: list[Row]) -> None:
    """The markdown table; ratios against pp1 at the same micro-batch count."""
    base = {row.microbatches: row for row in rows if row.layout.name == "pp1"}
    print(
        "| layout | processes | micro-batches | step (median) | step (min-max) | ratio to PP=1 "
        "| forward-backward span | compute per rank | predicted bubble "
        "| measured bubble (mean; per rank) | span vs ideal | undisturbed steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        pp1, processes = base[row.microbatches], row.layout.processes
        per_rank = ", ".join(f"{b:.1%}" for b in row.bubble_per_rank)
        print(
            f"| {row.layout.title} | {processes} | {row.microbatches} | {_ms(row.median)} "
            f"| {_ms(min(row.steps))}-{_ms(max(row.steps))} | **{row.median / pp1.median:.3f}** "
            f"| {_ms(row.span)} | {' / '.join(_ms(c) for c in row.compute)} "
            f"| {row.predicted:.1%} | {row.bubble:.1%} ({per_rank}) "
            f"| {1 - pp1.span / processes / row.span:.1%} | {row.kept} |"
        )


def check_losses(rows: list[Row]) -> None:
    """The first step's loss must agree across layouts (same weights, same batches)."""
    for count in sorted({row.microbatches for row in rows}):
        losses = {row.layout.name: row.first_loss for row in rows if row.microbatches == count}
        spread = max(losses.values()) - min(losses.values())
        print(
            f"first-step loss, m={count}: "
            + ", ".join(f"{name} {loss:.6f}" for name, loss in losses.items())
            + f"; max |diff| {spread:.1e} -> {'OK' if spread <= LOSS_TOLERANCE else 'DIFFER'}"
        )
        if spread > LOSS_TOLERANCE:
            raise SystemExit("the layouts' first-step losses differ: they are not comparable")


def parse_cli() -> argparse.Namespace:
    """The benchmark's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    add_model_shape_flags(
        parser,
        num_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        seq_length=128,
        micro_batch_size=4,
        vocab_size=1024,
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layout and m")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per layout and m")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the layout sequence")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 4 layers, h 64, seq 32, m = 4, 3 steps"
    )
    cli = parser.parse_args()
    if cli.quick:
        cli.num_layers, cli.hidden_size, cli.seq_length = 4, 64, 32
        cli.micro_batch_size, cli.vocab_size, cli.microbatches = 2, 256, [4]
        cli.warmup, cli.steps, cli.repeats = 1, 3, 1
    cli.layouts = list(dict.fromkeys(["pp1", *cli.layouts]))  # the baseline always runs
    if min(cli.warmup, cli.steps, cli.repeats) < 1:
        parser.error("--warmup, --steps and --repeats must be at least 1")
    if any(m < 2 or m % 2 for m in cli.microbatches):
        parser.error("--microbatches: even counts (dp2 splits them; interleaving needs PP | m)")
    if cli.num_layers % 4:
        parser.error("--num-layers must be a multiple of 4 (PP=2 x V=2 chunks)")
    return cli


def main() -> None:
    """Run every layout (the repeats pooled), check the losses, print the table."""
    cli = parse_cli()
    shape = model_shape(cli)
    settings = {key: getattr(cli, key) for key in ("microbatches", "warmup", "steps", "seed")}
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, gloo, 1 torch thread "
        f"per process; cpu: {cpu_model()}, {os.cpu_count()} logical cores, "
        f"{platform.machine()}; load average at start {load_average()}"
    )
    print(
        f"model: {cli.num_layers} layers, hidden {cli.hidden_size}, {cli.num_attention_heads} "
        f"heads, seq {cli.seq_length}, micro-batch {cli.micro_batch_size}, vocab "
        f"{cli.vocab_size}, fp32, dropout 0; micro-batches per step {cli.microbatches}; "
        f"{cli.warmup} warm-up + {cli.steps} timed steps per layout and m, x{cli.repeats}"
    )
    pooled: dict[tuple[str, int], list[list[dict]]] = {}
    for repeat in range(cli.repeats):
        for name in cli.layouts if repeat % 2 == 0 else cli.layouts[::-1]:
            layout, began = LAYOUTS[name], time.perf_counter()
            for count, ranks in run_layout(layout, shape, settings).items():
                row = summarize(layout, count, ranks)
                print(
                    f"  {layout.title}, m={count}: steps {', '.join(_ms(t) for t in row.steps)}"
                    f"; measured bubble {row.bubble:.1%} (predicted {row.predicted:.1%}); "
                    f"other processes {row.others:.2f} cores, undisturbed steps {row.kept}",
                    flush=True,
                )
                if (name, count) not in pooled:
                    pooled[(name, count)] = ranks
                    continue
                for kept, new in zip(pooled[(name, count)], ranks):  # later repeats: timed only
                    kept += [record for record in new if not record["warmup"]]
            print(
                f"  ({name}: {time.perf_counter() - began:.0f} s, load {load_average()})",
                flush=True,
            )
    rows = [
        summarize(LAYOUTS[name], count, pooled[(name, count)])
        for count in cli.microbatches
        for name in cli.layouts
    ]
    print(f"load average at the end {load_average()}")
    check_losses(rows)
    print(
        "step = last rank's end - first rank's start of a training step; span = the same for "
        "its forward-backward; compute = inside the chunks' forward and backward; measured "
        "bubble = 1 - compute / span per rank; predicted = (PP-1)/(V m + PP-1); span vs ideal "
        "= 1 - (PP=1 span / processes) / span; ratio = median step / PP=1's"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
