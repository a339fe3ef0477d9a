"""Benchmark: checkpoint save/load MB/s through `megatron.checkpointing` vs plain `torch.save`.

    python benchmarks/checkpoint_speed.py                  # GPT-2 124M, 3 rounds
    python benchmarks/checkpoint_speed.py --size 350M --rounds 5
    python benchmarks/checkpoint_speed.py --dir /mnt/fast/tmp --no-cold

One process, world size 1 over gloo (`megatron.initialize.initialize_distributed`, then
`parallel_state.initialize_model_parallel(1, 1)` and `set_random_seed`). The benchmark builds
`megatron.model.GPTModel` in fp32 (124M: 12 layers, hidden 768, 12 heads; 350M: 24 layers,
hidden 1024, 16 heads; vocabulary 50,304, 1,024 positions), AdamW from
`megatron.training.optimizer.build_optimizer(get_param_groups(model), ...)` and an
`OptimizerParamScheduler` (lr 6e-4, 2 warm-up iterations, cosine to 6e-5 over 10,000
iterations of 8 samples), then runs one real training step (forward and backward on one
sequence of 32 random tokens, `optimizer.step()`, `scheduler.step()`) so that AdamW holds its
two moments: the checkpoint is the weights plus `exp_avg` and `exp_avg_sq` (~1.5 GB at 124M).

The two ways of writing and reading the same state, timed in the same run:

- ours: `megatron.checkpointing.save_checkpoint(TrainState(iteration=1), target,
  scheduler, args)` with `args.deepspeed` False: the Megatron layout (nested `model` dict,
  `optimizer`, `opt_param_scheduler`, `args`, `rng_state` gathered over the data-parallel
  group, `train_state`), written under `iter_0000001.partial/`, the file fsynced, the staging
  directories fsynced, renamed, the parent fsynced, then the tracker file written atomically.
  Load: `megatron.checkpointing.load_checkpoint(target, args)` (trackers,
  `torch.load(weights_only=True)`, argument checks, flatten, `load_state_dict` of model,
  optimizer and scheduler, RNG restore).
- baseline: `torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
  path)`, then `os.fsync` of the file (timed separately, so the baseline is reported both
  with and without the fsync; ours always fsyncs). Load: `torch.load(path, weights_only=True)`,
  `model.load_state_dict`, `optimizer.load_state_dict`.

`--warmup` untimed rounds (the first write of 1.5 GB into memory the process never touched is
3x slower), then `--rounds` rounds, the order alternating (ours first, then baseline first,
...). In a round each method in turn saves, loads with its file in the page cache ("warm":
it was just written), then, unless `--no-cold`, loads again after asking the kernel to drop
the file's cached pages (`posix_fadvise(POSIX_FADV_DONTNEED)` on every file: it needs no root
and works on clean, i.e. fsynced, pages; the host of a VM may still cache the disk), and
deletes its files before the other method starts, so both start from the same page cache and
free memory. Before every load the model's weights are zeroed and the optimizer's state
cleared (untimed), and after it a float64 fingerprint of every weight and moment must equal
the one taken before saving, so a load that restored nothing cannot pass.

Bytes = the sizes of the files each way wrote (ours: the rank file and the tracker). MB/s =
bytes / wall time, 1 MB = 1e6 bytes; medians over the rounds; ratios ours / baseline of MB/s
(below 1: ours is slower). Then one more save and load of ours under cProfile, reporting the
cumulative time of the pieces of the path (serialization, fsyncs, renames, RNG gather, ...),
which says where any difference goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import cpu_model  # noqa: E402  (benchmarks/machine.py)

from megatron import checkpointing  # noqa: E402
from megatron.checkpointing import TrainState  # noqa: E402
from megatron.checkpointing.save_load import CheckpointTarget  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.initialize import initialize_distributed, set_random_seed  # noqa: E402
from megatron.model import GPTModel, num_parameters  # noqa: E402
from megatron.training.optimizer import build_optimizer, get_param_groups  # noqa: E402
from megatron.training.scheduler import OptimizerParamScheduler  # noqa: E402

VOCAB = 50304  # GPT-2's 50,257 padded to a multiple of 128
POSITIONS = 1024
GLOBAL_BATCH = 8  # samples per iteration, for the scheduler's sample counts
SIZES = {"124M": (12, 768, 12), "350M": (24, 1024, 16)}  # layers, hidden, heads
WORK_DIR = os.path.join(REPO_ROOT, "benchmarks", "work")

# (file name suffix, function name) -> label, for the cProfile breakdown of our save and load.
PROFILE_PIECES = {
    "save": [
        ("checkpointing/save_load.py", "save_checkpoint", "save_checkpoint (total)"),
        (
            "checkpointing/rng_state.py",
            "gather_rng_states",
            "  gather_rng_states (all_gather_object)",
        ),
        ("checkpointing/save_load.py", "_client_state", "  _client_state (args, counters)"),
        ("checkpointing/file_format.py", "nest_model_state", "  nest_model_state"),
        ("module.py", "state_dict", "  model.state_dict"),
        ("optimizer.py", "state_dict", "  optimizer.state_dict"),
        ("checkpointing/commit.py", "begin", "  checkpoint_commit.begin (staging dir)"),
        ("serialization.py", "save", "  torch.save (to page cache)"),
        ("atomic_files.py", "publish", "  atomic_files.publish (fsync + rename of the file)"),
        ("checkpointing/commit.py", "commit", "  checkpoint_commit.commit"),
        ("checkpointing/commit.py", "fsync_tree", "    fsync_tree (staging directories)"),
        ("checkpointing/commit.py", "write_tracker", "    write_tracker"),
    ],
    "load": [
        ("checkpointing/save_load.py", "load_checkpoint", "load_checkpoint (total)"),
        ("checkpointing/save_load.py", "find_checkpoint", "  find_checkpoint (trackers)"),
        ("serialization.py", "load", "  torch.load (weights_only)"),
        ("checkpointing/file_format.py", "flatten_model_state", "  flatten_model_state"),
        ("module.py", "load_state_dict", "  model.load_state_dict"),
        ("optimizer.py", "load_state_dict", "  optimizer.load_state_dict"),
        ("checkpointing/save_load.py", "check_checkpoint_args", "  check_checkpoint_args"),
        ("checkpointing/rng_state.py", "restore_rng_state", "  restore_rng_state"),
    ],
}


@dataclass
class Method:
    """One way of saving and loading, and what it measured (seconds per round)."""

    name: str
    save: Callable[[], float | None]
    """Writes the checkpoint; returns the seconds of a trailing fsync timed apart, if any."""
    load: Callable[[], None]
    files: Callable[[], list[str]]
    remove: Callable[[], None]
    save_times: list[float] = field(default_factory=list)
    save_cpu: list[float] = field(default_factory=list)
    fsync_times: list[float] = field(default_factory=list)
    load_times: dict[str, list[float]] = field(default_factory=lambda: {"warm": [], "cold": []})
    sizes: list[int] = field(default_factory=list)

    def clear(self) -> None:
        """Forget what the warm-up rounds measured."""
        for times in (self.save_times, self.save_cpu, self.fsync_times, self.sizes):
            times.clear()
        for times in self.load_times.values():
            times.clear()


# ---------------------------------------------------------------------------------------------
# The state: model, optimizer with Adam moments, scheduler.
# ---------------------------------------------------------------------------------------------


def initialize_world(seed: int) -> None:
    """torch.distributed over gloo, one process; Megatron's groups (TP = PP = 1); seeds."""
    with contextlib.redirect_stdout(io.StringIO()):
        initialize_distributed("gloo", local_rank=0, use_deepspeed=False)
        parallel_state.initialize_model_parallel(1, 1)
        set_random_seed(seed)


def build_state(
    config: ModelConfig, seed: int
) -> tuple[GPTModel, torch.optim.Optimizer, OptimizerParamScheduler]:
    """The fp32 model, AdamW after one real step, and the scheduler."""
    model = GPTModel(config)
    optimizer = build_optimizer(
        get_param_groups(model), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=6e-4,
        min_lr=6e-5,
        lr_warmup_steps=2 * GLOBAL_BATCH,
        lr_decay_steps=10_000 * GLOBAL_BATCH,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=10_000 * GLOBAL_BATCH,
        wd_incr_style="constant",
        default_increment=GLOBAL_BATCH,
    )
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (1, 33), generator=generator)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)  # a checkpoint holds no gradients
    return model, optimizer, scheduler


def checkpoint_args(config: ModelConfig, directory: str) -> argparse.Namespace:
    """What `save_checkpoint` / `load_checkpoint` read from the flags."""
    return argparse.Namespace(
        deepspeed=False,
        save=directory,
        load=directory,
        no_save_optim=False,
        no_save_rng=False,
        finetune=False,
        no_load_optim=False,
        no_load_rng=False,
        universal_checkpoint=False,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=4 * config.hidden_size,
        kv_channels=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        position_embedding_type=config.position_embedding_type,
        padded_vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """float64 sums of every weight and every optimizer state tensor, in a fixed order."""
    sums = [p.detach().double().sum().item() for p in model.parameters()]
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in sorted(optimizer.state[param].items()):
                if key != "step":
                    sums.append(value.double().sum().item())
    return sums


def forget_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Zero the weights and drop the optimizer state, so a load has to restore both."""
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    optimizer.state.clear()


# ---------------------------------------------------------------------------------------------
# The two methods.
# ---------------------------------------------------------------------------------------------


def ours(
    model: GPTModel,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    args: argparse.Namespace,
) -> Method:
    """`megatron.checkpointing.save_checkpoint` / `load_checkpoint`, Megatron layout."""

    # What the plain engine hands the checkpoint code (Megatron's per-rank files).
    target = CheckpointTarget(model, optimizer, scheduler, deepspeed_files=False)

    def save() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            checkpointing.save_checkpoint(TrainState(iteration=1), target, args)

    def load() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            state = checkpointing.load_checkpoint(target, args)
        if state.iteration != 1:
            raise SystemExit(f"ours: loaded iteration {state.iteration}, expected 1")

    def files() -> list[str]:
        return [os.path.join(root, name) for root, _, names in os.walk(args.save) for name in names]

    def remove() -> None:
        shutil.rmtree(args.save)
        os.makedirs(args.save)

    return Method("ours", save, load, files, remove)


def baseline(model: GPTModel, optimizer: torch.optim.Optimizer, path: str) -> Method:
    """`torch.save` of the two state dicts, fsynced; `torch.load(weights_only=True)`."""

    def save() -> float:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        start = time.perf_counter()
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        return time.perf_counter() - start

    def load() -> None:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def remove() -> None:
        os.remove(path)

    return Method("baseline", save, load, lambda: [path], remove)


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------


def evict(paths: list[str]) -> None:
    """Ask the kernel to drop the files' (clean) pages from the page cache."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def timed_load(
    method: Method,
    kind: str,
    model: GPTModel,
    optimizer: torch.optim.Optimizer,
    reference: list[float],
) -> None:
    """Forget the state, load it back (timed), check the fingerprint."""
    forget_state(model, optimizer)
    start = time.perf_counter()
    method.load()
    method.load_times[kind].append(time.perf_counter() - start)
    if fingerprint(model, optimizer) != reference:
        raise SystemExit(f"{method.name}: the {kind} load did not restore the saved state")


def run_round(
    methods: list[Method],
    cold: bool,
    model: GPTModel,
    optimizer: torch.optim.Optimizer,
    reference: list[float],
) -> None:
    """Each method in turn: save, load warm, drop its pages and load cold, delete its files.

    One method's files are gone before the next one saves, so both start from the same page
    cache and free memory (with both files cached, the second save of a 350M round ran into
    memory reclaim and took 3x longer, whichever method it was).
    """
    for method in methods:
        start, cpu_start = time.perf_counter(), time.process_time()
        fsync = method.save()
        method.save_times.append(time.perf_counter() - start)
        method.save_cpu.append(time.process_time() - cpu_start)
        if fsync is not None:
            method.fsync_times.append(fsync)
        method.sizes.append(sum(os.path.getsize(path) for path in method.files()))
        timed_load(method, "warm", model, optimizer, reference)
        if cold:
            evict(method.files())
            timed_load(method, "cold", model, optimizer, reference)
        method.remove()


def profile_ours(method: Method, model: GPTModel, optimizer: torch.optim.Optimizer) -> None:
    """One save and one (warm) load of ours under cProfile: cumulative time per piece."""
    for kind, call in (("save", method.save), ("load", method.load)):
        if kind == "load":
            forget_state(model, optimizer)
        profiler = cProfile.Profile()
        profiler.enable()
        call()
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # (file, line, function) -> (cc, nc, tt, ct, ...)
        print(f"  our {kind}, cumulative seconds (cProfile, one call):")
        for suffix, function, label in PROFILE_PIECES[kind]:
            seconds = sum(
                value[3]
                for (path, _, name), value in stats.items()
                if name == function and path.endswith(suffix)
            )
            print(f"    {label:<58} {seconds:7.3f} s")
    method.remove()


# ---------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------


def print_header(directory: str) -> None:
    """Command, versions, CPU, load and the file system written to, for RESULTS.md."""
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}"
    )
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"cpu: {cpu_model()}, {os.cpu_count()} logical cores visible, {platform.machine()}; "
        f"load average at start {load}"
    )
    usage = shutil.disk_usage(directory)
    print(f"writing to {directory} ({usage.free / 1e9:.0f} GB free)")


def _mbps(size: int, seconds: float) -> float:
    return size / seconds / 1e6


def print_table(methods: list[Method]) -> None:
    """Median seconds and MB/s per operation, the ratios ours / baseline."""
    mine, base = methods
    rows = [("save", mine.save_times, base.save_times)]
    no_fsync = [t - f for t, f in zip(base.save_times, base.fsync_times)]
    rows.append(("save (baseline without its fsync)", mine.save_times, no_fsync))
    for kind in ("warm", "cold"):
        if mine.load_times[kind]:
            label = "load, page cache warm" if kind == "warm" else "load, pages dropped (cold)"
            rows.append((label, mine.load_times[kind], base.load_times[kind]))
    size_ours, size_base = statistics.median(mine.sizes), statistics.median(base.sizes)
    print(
        f"bytes written: ours {size_ours:,.0f} ({size_ours / 1e6:,.1f} MB), "
        f"baseline {size_base:,.0f} ({size_base / 1e6:,.1f} MB)"
    )
    print(
        "| operation | ours median | ours MB/s | baseline median | baseline MB/s "
        "| ours / baseline (MB/s) | per-round ratios |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, ours_times, base_times in rows:
        t_ours, t_base = statistics.median(ours_times), statistics.median(base_times)
        speed_ours, speed_base = _mbps(size_ours, t_ours), _mbps(size_base, t_base)
        per_round = ", ".join(
            f"{_mbps(size_ours, a) / _mbps(size_base, b):.2f}"
            for a, b in zip(ours_times, base_times)
        )
        print(
            f"| {label} | {t_ours:.2f} s | {speed_ours:,.0f} | {t_base:.2f} s | {speed_base:,.0f} "
            f"| **{speed_ours / speed_base:.2f}** | {per_round} |"
        )
    fsync, base_save = statistics.median(base.fsync_times), statistics.median(base.save_times)
    cpu_ours, cpu_base = statistics.median(mine.save_cpu), statistics.median(base.save_cpu)
    print(
        f"baseline fsync alone: median {fsync:.2f} s of its {base_save:.2f} s save; process CPU "
        f"time per save (median): ours {cpu_ours:.2f} s, baseline {cpu_base:.2f} s"
    )


# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------


def parse_cli() -> argparse.Namespace:
    """The benchmark's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="124M")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first (the first write of 1.5 GB into fresh memory is slow)",
    )
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temp dir in benchmarks/work/)"
    )
    parser.add_argument(
        "--no-cold", action="store_true", help="skip the loads after dropping cached pages"
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="skip the cProfile breakdown of ours"
    )
    parser.add_argument("--seed", type=int, default=1234)
    cli = parser.parse_args()
    if cli.rounds < 1 or cli.warmup < 0:
        parser.error("--rounds must be at least 1, --warmup at least 0")
    return cli


def main() -> None:
    """Build the state, time both methods in interleaved rounds, print the table."""
    cli = parse_cli()
    if cli.dir is None:
        os.makedirs(WORK_DIR, exist_ok=True)
    root = tempfile.mkdtemp(prefix="checkpoint_speed-", dir=cli.dir or WORK_DIR)
    try:
        print_header(root)
        initialize_world(cli.seed)
        layers, hidden, heads = SIZES[cli.size]
        config = ModelConfig(
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            vocab_size=VOCAB,
            max_position_embeddings=POSITIONS,
        )
        print(
            f"model {cli.size}: {layers} layers, hidden {hidden}, {heads} heads, vocab {VOCAB}, "
            f"{POSITIONS} positions, fp32, {num_parameters(config):,} parameters; AdamW after "
            "one step (exp_avg, exp_avg_sq); world size 1 (gloo)"
        )
        model, optimizer, scheduler = build_state(config, cli.seed)
        reference = fingerprint(model, optimizer)
        args = checkpoint_args(config, os.path.join(root, "ours"))
        os.makedirs(args.save)
        methods = [
            ours(model, optimizer, scheduler, args),
            baseline(model, optimizer, os.path.join(root, "baseline.pt")),
        ]
        print(
            f"{cli.warmup} untimed warm-up round(s), then {cli.rounds} rounds, order alternating; "
            "each method in turn: save, load from the page cache"
            + ("" if cli.no_cold else ", load after dropping the file's pages")
            + ", delete"
        )
        for _ in range(cli.warmup):
            run_round(methods, not cli.no_cold, model, optimizer, reference)
        for method in methods:
            method.clear()
        for index in range(cli.rounds):
            order = methods if index % 2 == 0 else methods[::-1]
            run_round(order, not cli.no_cold, model, optimizer, reference)
            print(
                f"  round {index + 1}/{cli.rounds} ({', '.join(m.name for m in order)}): "
                + "; ".join(
                    f"{m.name} save {m.save_times[-1]:.2f} s, load "
                    + ", ".join(f"{k} {t[-1]:.2f} s" for k, t in m.load_times.items() if t)
                    for m in methods
                ),
                flush=True,
            )
        load = " ".join(f"{value:.2f}" for value in os.getloadavg())
        print(f"load average at the end {load}")
        print(
            "MB/s = bytes written / median wall time (1 MB = 1e6 bytes); both saves end with "
            "the file fsynced (ours also fsyncs its directories and writes a tracker); loads "
            "restore model + optimizer (ours also scheduler and RNG) and are checked"
        )
        print_table(methods)
        if not cli.no_profile:
            profile_ours(methods[0], model, optimizer)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
