"""Benchmark: training steps/s through the DeepSpeed engine (ZeRO-0, ZeRO-1) vs the plain path.

    python benchmarks/deepspeed_overhead.py                      # tiny + small, accumulation 1, 4
    python benchmarks/deepspeed_overhead.py --quick              # smoke run: tiny only, 3 rounds
    python benchmarks/deepspeed_overhead.py --shapes tiny --grad-accum 1 --rounds 20 --profile
    python benchmarks/deepspeed_overhead.py --num-layers 2 --hidden-size 64 --seq-length 64

One process, world size 1 over gloo. For every shape and gradient-accumulation count the
benchmark builds three setups of the same GPT through the project's own code, each from the
same seed: `megatron.arguments.parse_args` on one flag list, then
`megatron.training.setup_model_and_optimizer(pretrain_gpt.model_provider, args)`:

- plain:  no `--deepspeed`: a `PlainTrainer` (GuardedAdamW clips and checks the gradients),
  stepped by `megatron.training.step.train_step_plain`;
- ds-z0:  `--deepspeed --no-pipeline-parallel` with a config file holding only
  `{"zero_optimization": {"stage": 0}}`: a `DeepSpeedEngine` around the same GuardedAdamW,
  stepped by `train_step_deepspeed`;
- ds-z1:  the same with stage 1: DeepSpeed's ZeRO-1 optimizer around torch's AdamW (DeepSpeed
  clips and checks the gradients itself).

Every other fact comes from the same flags for all three (the config file states nothing
else, `megatron.arguments.ds_config` copies the rest from the flags): fp32, hidden and
attention dropout 0.1 as in real training, `--clip-grad 1.0`, Adam (decoupled weight decay
0.1, betas 0.9/0.95), lr 6e-4 with 2 warm-up iterations and a cosine decay to 6e-5 over
10,000 iterations, `--global-batch-size` = micro-batch x accumulation.
`pretrain_gpt.forward_step` reads the micro-batches from an iterator over the same fixed
synthetic batches (`{"text": LongTensor [micro, seq + 1]}`, uniform random ids, vocabulary
50,304 = GPT-2's 50,257 padded to 128).

Sanity first: each setup runs `--warmup` steps (not timed) from the same dropout seed on the
same batches; the first-step losses must agree to 1e-4 (else the process exits: the setups
would not be comparable) and the later ones are printed with their gradient norms.

Then `--rounds` timed rounds, each running one training step (one global batch: accumulation
x micro-batches, forward, backward, optimizer step, LR schedule) of every setup, the order
rotating every round (plain, ds-z0, ds-z1; ds-z0, ds-z1, plain; ...) so machine noise hits all
three alike. Reported per setup: median and min wall time per step, steps/s, process CPU time
per step, the extra milliseconds per step against plain (median of the per-round differences)
and the overhead against plain, `steps/s(plain) / steps/s(DS) - 1`: from the median step
times, as the median of the per-round ratios (the verdict uses this one: it pairs steps that
ran seconds apart, so slow drifts of the machine's load cancel), from the min step times
(other processes only ever add time, so on a shared machine the min is the least disturbed)
and as the median of the per-round ratios of process CPU time. The target is an overhead of
at most 10%; a miss is printed, not an error (targets live in benchmarks, not tests).
`--profile` then prints torch.profiler's busiest ops for one step of each setup of the last
configuration. Shapes (vocabulary 50,304 unless `--vocab-size`):

- tiny:  2 layers, hidden 128, 4 heads, seq 128, micro-batch 4 (6.9M parameters, 512 tokens a
  micro-batch): the least compute per step, so a fixed per-step cost shows the most;
- small: 4 layers, hidden 256, 4 heads, seq 128, micro-batch 4 (16.1M parameters, 512 tokens).

`--num-layers/--hidden-size/--num-attention-heads/--seq-length/--micro-batch-size` replace the
shapes by one "custom" shape (unset ones from tiny); `--vocab-size` changes the vocabulary.

On a shared machine use `--threads 1`: with torch's default of one thread per core, every
parallel region waits for its slowest thread, so another process on either core stalls the
whole step (steps of the same setup then vary by 10x); one thread varies far less.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import cpu_model  # noqa: E402  (benchmarks/machine.py)
from op_meter import initialize_world  # noqa: E402  (benchmarks/op_meter.py)

import pretrain_gpt  # noqa: E402
from megatron.arguments import parse_args  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.initialize import set_random_seed  # noqa: E402
from megatron.model import flops_per_token, num_parameters  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.training import setup_model_and_optimizer  # noqa: E402
from megatron.training.step import StepResult, train_step_deepspeed, train_step_plain  # noqa: E402

TARGET_OVERHEAD = 0.10
LOSS_TOLERANCE = 1e-4
SETUPS = ("plain", "ds-z0", "ds-z1")
ZERO_STAGE = {"plain": None, "ds-z0": 0, "ds-z1": 1}
GPT2_EOD = 50256  # <|endoftext|> in GPT-2's vocabulary


@dataclass(frozen=True)
class Shape:
    """One model and micro-batch shape."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int

    def describe(self, vocab: int) -> str:
        """One line: layers, width, heads, sequence, micro-batch, vocabulary."""
        return (
            f"{self.name}: {self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_attention_heads} heads, seq {self.seq_length}, "
            f"micro-batch {self.micro_batch_size}, vocab {vocab}"
        )


SHAPES = {
    "tiny": Shape("tiny", 2, 128, 4, 128, 4),
    "small": Shape("small", 4, 256, 4, 128, 4),
}


@dataclass
class Setup:
    """One built training setup: its step function and what it measured."""

    name: str
    step: Callable[[], StepResult]
    engine: object
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Building the three setups through the project's own code.
# ---------------------------------------------------------------------------------------------


def megatron_flags(shape: Shape, accumulation: int, seed: int) -> list[str]:
    """The command line all three setups share."""
    flags = {
        "--num-layers": shape.num_layers,
        "--hidden-size": shape.hidden_size,
        "--num-attention-heads": shape.num_attention_heads,
        "--seq-length": shape.seq_length,
        "--max-position-embeddings": shape.seq_length,
        "--micro-batch-size": shape.micro_batch_size,
        "--global-batch-size": shape.micro_batch_size * accumulation,
        "--train-iters": 10_000,
        "--lr": 6e-4,
        "--min-lr": 6e-5,
        "--lr-decay-style": "cosine",
        "--lr-warmup-iters": 2,
        "--weight-decay": 0.1,
        "--adam-beta1": 0.9,
        "--adam-beta2": 0.95,
        "--clip-grad": 1.0,
        "--hidden-dropout": 0.1,
        "--attention-dropout": 0.1,
        "--seed": seed,
        "--distributed-backend": "gloo",
    }
    return [str(item) for pair in flags.items() for item in pair]


def build_setup(
    name: str,
    shape: Shape,
    accumulation: int,
    vocab: int,
    seed: int,
    batches: list[dict],
    config_dir: str,
) -> Setup:
    """Parse the flags, seed, and build one setup with `setup_model_and_optimizer`."""
    argv = megatron_flags(shape, accumulation, seed)
    stage = ZERO_STAGE[name]
    if stage is not None:
        path = os.path.join(config_dir, f"ds_zero{stage}.json")
        with open(path, "w", encoding="utf-8") as file:
            json.dump({"zero_optimization": {"stage": stage}}, file)
        argv += ["--deepspeed", "--deepspeed_config", path, "--no-pipeline-parallel"]
    with contextlib.redirect_stdout(io.StringIO()):  # the LR-style line, the model-size report
        args = parse_args(argv, world_size=1)
        # What a run learns from its tokenizer, here from the shape.
        args = with_settled(args, padded_vocab_size=vocab, eod_token_id=min(GPT2_EOD, vocab - 1))
        set_random_seed(seed)  # the same initial weights for all three
        model, _, _ = setup_model_and_optimizer(pretrain_gpt.model_provider, args)
    data = cycle(batches)
    train_step = train_step_plain if stage is None else train_step_deepspeed

    def step() -> StepResult:
        return train_step(pretrain_gpt.forward_step, data, model, args)

    return Setup(name, step, model)


def cycle(batches: list[dict]) -> Iterator[dict]:
    """The fixed synthetic micro-batches, forever."""
    while True:
        yield from batches


def synthetic_batches(shape: Shape, vocab: int, count: int, seed: int) -> list[dict]:
    """`count` micro-batches {"text": [micro, seq + 1]} of uniform random token ids."""
    generator = torch.Generator().manual_seed(seed)
    size = (shape.micro_batch_size, shape.seq_length + 1)
    return [{"text": torch.randint(0, vocab, size, generator=generator)} for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# Sanity, timing, profile.
# ---------------------------------------------------------------------------------------------


def _norm(value: object) -> float:
    return float("nan") if value is None else float(value)


def sanity_and_warmup(setups: list[Setup], steps: int, seed: int) -> None:
    """Run `steps` untimed steps of each setup from the same dropout seed; compare losses."""
    results: dict[str, list[StepResult]] = {}
    for setup in setups:
        set_random_seed(seed + 1)  # the same dropout masks, step for step
        results[setup.name] = [setup.step() for _ in range(steps)]
    for index in range(steps):
        losses = {name: r[index].losses["lm loss"] for name, r in results.items()}
        diff = max(losses.values()) - min(losses.values())
        verdict = "OK" if diff <= LOSS_TOLERANCE else "DIFFER"
        print(
            f"  step {index + 1}: "
            + ", ".join(
                f"{name} loss {losses[name]:.6f} grad norm {_norm(r[index].grad_norm):.4f}"
                for name, r in results.items()
            )
            + f"; max |diff| {diff:.1e} -> {verdict}"
        )
        if index == 0 and not diff <= LOSS_TOLERANCE:
            raise SystemExit("the first-step losses differ: the setups are not comparable")
    skipped = [name for name, r in results.items() if any(step.skipped for step in r)]
    if skipped:
        print(f"  WARNING: skipped optimizer steps in {', '.join(skipped)}")


def time_rounds(setups: list[Setup], rounds: int) -> None:
    """Interleaved rounds, the order rotating; per-round DS/plain ratios printed."""
    for index in range(rounds):
        shift = index % len(setups)
        order = setups[shift:] + setups[:shift]
        for setup in order:
            start, cpu_start = time.perf_counter(), time.process_time()
            setup.step()
            setup.times.append(time.perf_counter() - start)
            setup.cpu_times.append(time.process_time() - cpu_start)
        plain = setups[0].times[-1]
        print(
            f"  round {index + 1}/{rounds} ({', '.join(s.name for s in order)}): "
            + ", ".join(f"{s.name} {s.times[-1] * 1e3:.0f} ms" for s in setups)
            + "; overhead "
            + ", ".join(f"{s.name} {s.times[-1] / plain - 1:+.1%}" for s in setups[1:]),
            flush=True,
        )


def profile_step(setup: Setup, rows: int) -> None:
    """One step under torch.profiler: the ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        setup.step()
    print(f"--- torch.profiler, one step of {setup.name} (self CPU time) ---")
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60
        )
    )


# ---------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------


def print_header() -> None:
    """Command, versions, threads, CPU and load, for pasting into RESULTS.md."""
    import deepspeed

    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, deepspeed "
        f"{deepspeed.__version__}, threads {torch.get_num_threads()} "
        f"(interop {torch.get_num_interop_threads()})"
    )
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"cpu: {cpu_model()}, {os.cpu_count()} logical cores visible, {platform.machine()}; "
        f"load average at start {load}"
    )


@dataclass
class Row:
    """One line of the final table."""

    shape: str
    accumulation: int
    setup: str
    median: float
    best: float
    cpu: float
    extra_ms: float | None
    overhead_of_medians: float | None
    overhead_paired: float | None
    overhead_min: float | None
    overhead_cpu: float | None


def summarize(shape: Shape, accumulation: int, setups: list[Setup]) -> list[Row]:
    """Median/min step time and both overhead figures of each setup."""
    plain = setups[0]

    def paired(setup: Setup, ratio: Callable[[float, float], float], cpu: bool = False):
        if setup is plain:
            return None
        ours, base = (setup.cpu_times, plain.cpu_times) if cpu else (setup.times, plain.times)
        return statistics.median(ratio(t, p) for t, p in zip(ours, base))

    rows = []
    for setup in setups:
        median = statistics.median(setup.times)
        rows.append(
            Row(
                shape=shape.name,
                accumulation=accumulation,
                setup=setup.name,
                median=median,
                best=min(setup.times),
                cpu=statistics.median(setup.cpu_times),
                extra_ms=paired(setup, lambda t, p: (t - p) * 1e3),
                overhead_of_medians=None
                if setup is plain
                else median / statistics.median(plain.times) - 1,
                overhead_paired=paired(setup, lambda t, p: t / p - 1),
                overhead_min=None if setup is plain else min(setup.times) / min(plain.times) - 1,
                overhead_cpu=paired(setup, lambda t, p: t / p - 1, cpu=True),
            )
        )
    return rows


def print_table(rows: list[Row]) -> bool:
    """The markdown table and the verdict per DS setup; True if every overhead met the target."""
    print(
        "| shape | accum | setup | median step | min step | steps/s | CPU s/step "
        "| extra ms/step | overhead (medians) | overhead (per-round) | overhead (mins) "
        "| overhead (CPU time) | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_pass = True
    for row in rows:
        if row.overhead_paired is None:
            overheads, verdict = "baseline | | | | ", ""
        else:
            ok = row.overhead_paired <= TARGET_OVERHEAD
            all_pass &= ok
            verdict = "PASS" if ok else "over target"
            overheads = (
                f"{row.extra_ms:+.0f} | {row.overhead_of_medians:+.1%} "
                f"| **{row.overhead_paired:+.1%}** | {row.overhead_min:+.1%} "
                f"| {row.overhead_cpu:+.1%}"
            )
        print(
            f"| {row.shape} | {row.accumulation} | {row.setup} | {_ms(row.median)} "
            f"| {_ms(row.best)} | {1 / row.median:.2f} | {row.cpu:.3f} | {overheads} "
            f"| {verdict} |"
        )
    return all_pass


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------


def parse_cli() -> argparse.Namespace:
    """The benchmark's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "small"])
    parser.add_argument("--num-layers", type=int, default=None, help="custom shape")
    parser.add_argument("--hidden-size", type=int, default=None, help="custom shape")
    parser.add_argument("--num-attention-heads", type=int, default=None, help="custom shape")
    parser.add_argument("--seq-length", type=int, default=None, help="custom shape")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="custom shape")
    parser.add_argument("--vocab-size", type=int, default=50304, help="padded vocabulary")
    parser.add_argument(
        "--grad-accum", nargs="+", type=int, default=[1, 4], help="accumulation counts to run"
    )
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per setup")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per setup (the sanity check)"
    )
    parser.add_argument("--threads", type=int, default=None, help="default: torch's choice")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny only, 1 warm-up step, 3 rounds"
    )
    parser.add_argument(
        "--profile", action="store_true", help="then profile one step of each setup"
    )
    cli = parser.parse_args()
    custom = {
        key: getattr(cli, key)
        for key in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "micro_batch_size",
        )
        if getattr(cli, key) is not None
    }
    if custom:
        cli.shape_list = [dataclasses.replace(SHAPES["tiny"], name="custom", **custom)]
    else:
        cli.shape_list = [SHAPES[name] for name in dict.fromkeys(cli.shapes)]
    if cli.quick:
        cli.shape_list = cli.shape_list[:1] if custom else [SHAPES["tiny"]]
        cli.warmup, cli.rounds = 1, 3
    if cli.warmup < 1 or cli.rounds < 1 or min(cli.grad_accum) < 1:
        parser.error("--warmup, --rounds and --grad-accum must be at least 1")
    return cli


def main() -> None:
    """Build the three setups per configuration, check them, time them, print the table."""
    cli = parse_cli()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    print_header()
    initialize_world()
    print(
        "same flags for all setups: fp32, dropout 0.1, --clip-grad 1.0, Adam wd 0.1, lr 6e-4 "
        "(2 warm-up iterations, cosine to 6e-5 over 10,000), world size 1 (gloo)"
    )
    rows: list[Row] = []
    setups: list[Setup] = []
    with tempfile.TemporaryDirectory() as config_dir:
        for shape in cli.shape_list:
            config = ModelConfig(
                num_layers=shape.num_layers,
                hidden_size=shape.hidden_size,
                num_attention_heads=shape.num_attention_heads,
                vocab_size=cli.vocab_size,
                max_position_embeddings=shape.seq_length,
            )
            tokens = shape.micro_batch_size * shape.seq_length
            gflop = flops_per_token(config, shape.seq_length) * tokens / 1e9
            print(
                f"\n== {shape.describe(cli.vocab_size)}: {num_parameters(config):,} parameters, "
                f"{tokens:,} tokens and {gflop:.1f} GFLOP per micro-batch"
            )
            batches = synthetic_batches(shape, cli.vocab_size, 8, cli.seed)
            for accumulation in cli.grad_accum:
                setups = []
                gc.collect()
                setups = [
                    build_setup(
                        name, shape, accumulation, cli.vocab_size, cli.seed, batches, config_dir
                    )
                    for name in SETUPS
                ]
                print(
                    f"-- {shape.name}, gradient accumulation {accumulation}: "
                    f"{cli.warmup} warm-up step(s) (sanity), {cli.rounds} timed rounds"
                )
                print("  optimizers: " + ", ".join(_optimizer_name(s) for s in setups))
                sanity_and_warmup(setups, cli.warmup, cli.seed)
                time_rounds(setups, cli.rounds)
                rows += summarize(shape, accumulation, setups)
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"\nload average at the end {load}")
    print(
        f"overhead = steps/s(plain) / steps/s(DS) - 1: from the median step times, as the median "
        f"of the {cli.rounds} per-round ratios (the verdict; target <= {TARGET_OVERHEAD:.0%}), "
        "from the min step times, and as the per-round median of process CPU time; "
        "extra ms/step = per-round median of t(DS) - t(plain)"
    )
    all_pass = print_table(rows)
    print(
        "verdict: "
        + ("every DeepSpeed setup within" if all_pass else "some DeepSpeed setup over")
        + f" the {TARGET_OVERHEAD:.0%} overhead target -> {'PASS' if all_pass else 'over target'}"
    )
    if cli.profile:
        for setup in setups:
            profile_step(setup, rows=25)


def _optimizer_name(setup: Setup) -> str:
    engine = setup.engine
    optimizer = getattr(engine, "optimizer", None)
    return f"{setup.name} {type(engine).__name__}/{type(optimizer).__name__}"


if __name__ == "__main__":
    main()
