"""Host-overhead meter: aten ops dispatched and host syncs per training iteration, per engine.

`benchmarks/host_overhead.py` prints the table; `tests/benchmarks/test_host_overhead.py` keeps
each path's count at or below its recorded figure.

- `OpCounter`: a `TorchDispatchMode` that counts every aten (and c10d) op reaching the Python
  dispatch key, by kind (`aten.add_`), forward and backward alike (the autograd engine runs a
  CPU backward on the calling thread, and carries the mode into any other). Composite ops
  (`linear`, `item`) are seen as what they decompose into (`t` + `addmm`,
  `_local_scalar_dense`): the ops a device would launch, each one host work. Used for eager
  steps: every op is then dispatched outside a compiled graph; the model's own ops are the
  same on every path, so the excess over the plain engine is the engine's.
- `ProfiledOps`: for steps under `--torch-compile` (`MeterShape.torch_compile`), the top-level
  aten/c10d ops of torch.profiler's events: what Python and the compiled graphs' wrappers
  dispatch (a graph's fused kernels are no ops; its extern matmuls count). Under it the plain
  engine's compiled layers are a few calls each, so the engines' own per-parameter work shows.
- `host syncs`: `aten._local_scalar_dense`, what `.item()`, `float(t)`, `bool(t)` and
  `.tolist()` on one element dispatch to: on a GPU each one waits for the device. Of them,
  `StepCounterReads` are foreach AdamW's reads of its CPU step counters, which a GPU run's
  fused AdamW does not make (`device_syncs`: the rest).
- `build_path`: one setup through the project's own code, as `benchmarks/deepspeed_overhead.py`
  builds them: `megatron.arguments.parse_args` on a flag list, seeded, then
  `megatron.training.build_engine` (what `setup_model_and_optimizer` returns the parts of),
  stepped by the engine's own `train_step`, one process over gloo.

The counts are exact for a given torch and DeepSpeed: the same flags give the same ops on
every run and every steady-state iteration (`count_iterations` records each). Each path is
measured in a process of its own (`measure_in_subprocess`): building one engine changes what
another dispatches (ZeRO-3's `zero.Init` replaces `torch.nn.functional.linear` for the whole
process: the plain engine then dispatches 22 more ops per iteration), as it never does in a
real run, which builds one.

    python -m benchmarks.op_meter ds-z1     # one path's measurement as one JSON line
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OP = "aten._local_scalar_dense"
"""The op every device-to-host scalar read dispatches to."""

PATH_FLAGS: dict[str, list[str]] = {
    "plain": [],
    "ds-z0": ["--deepspeed", "--no-pipeline-parallel", "--zero-stage", "0"],
    "ds-z1": ["--deepspeed", "--no-pipeline-parallel", "--zero-stage", "1"],
    "ds-z2": ["--deepspeed", "--no-pipeline-parallel", "--zero-stage", "2"],
    "ds-z3": ["--deepspeed", "--no-pipeline-parallel", "--zero-stage", "3"],
    # What `--deepspeed` without --no-pipeline-parallel runs: DeepSpeed's PipelineEngine at
    # PP = 1 (Megatron-DeepSpeed's example scripts), ZeRO-1 as they configure it.
    "ds-pipe": ["--deepspeed", "--zero-stage", "1"],
    # Megatron's schedules are chosen only at PP > 1 (two processes); here their engine at
    # PP = 1, set on the validated layout (`FORCED_ENGINE`): one process steps the whole model
    # through the schedule's runner and the plain engine's update.
    "mcore-pp1": [],
}
"""Each path's flags beyond the shared ones (`shape_flags`)."""

FORCED_ENGINE = {"mcore-pp1": "megatron_schedules"}
"""Paths whose engine is set on the layout after validation (no flags select it at PP = 1)."""

GPT2_EOD = 50256


@dataclass(frozen=True)
class MeterShape:
    """The launch-bound model and batch the meter steps."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    micro_batch_size: int = 2
    micro_batches: int = 4
    vocab_size: int = 512
    precision: str = "bf16"
    """bf16: DeepSpeed's bf16 parameters (BF16_Optimizer at ZeRO-1), the plain engine's fp32
    master weights under bf16 autocast; fp32 otherwise."""
    torch_compile: bool = False
    """`--torch-compile` (each transformer layer one graph); counted by `ProfiledOps`."""


class OpCounter(TorchDispatchMode):
    """Counts each op that reaches the Python dispatch key, by overload packet name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.views = 0
        """Ops whose schema returns an alias of an input (`view`, `detach`, `t`, `slice`):
        host work only, no device kernel."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        """Count, then run the op unchanged."""
        self.counts[str(func.overloadpacket)] += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))


@functools.cache
def _is_view(name: str) -> bool:
    """Whether the aten op `name` ("aten::view") returns an alias of an input."""
    namespace, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), op, None)
    overloads = packet.overloads() if packet is not None else []
    return bool(overloads) and getattr(packet, overloads[0]).is_view


class ProfiledOps:
    """Counts the ops dispatched outside compiled graphs from torch.profiler's events: every
    aten/c10d op not nested in another (a compiled graph is one event with its extern kernels,
    the matmuls, inside it; its fused kernels are no ops), plus every host sync.

    Composites count once (`aten::linear`, `aten::item`), unlike `OpCounter`'s decomposed
    ops, so the two counts are not comparable. `OpCounter` cannot count compiled steps: under
    an active dispatch mode the compiled layers ran op by op (the plain engine's count with
    `--torch-compile` was its eager one, 2,171).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.views = 0
        self.syncs = 0
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def __enter__(self) -> ProfiledOps:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.__exit__(*exc)
        for event in self._profile.events():
            if not event.name.startswith(("aten::", "c10d::")):
                continue
            if event.name == "aten::_local_scalar_dense":
                self.syncs += 1
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith(("aten::", "c10d::")):
                parent = parent.cpu_parent
            if parent is None:  # dispatched from Python or from a compiled graph's wrapper
                self.counts[event.name] += 1
                self.views += _is_view(event.name)


class StepCounterReads:
    """Counts AdamW's `.item()` reads of its per-parameter step counters.

    On CPU `adamw_kernel` picks the foreach kernel, whose counters are CPU tensors read twice
    per parameter and step (`_get_value` in `torch.optim.adam`, which AdamW runs): 2 x 28 of
    the plain engine's 57 syncs here. On a GPU it picks the fused kernel, which reads none
    (its counters stay on the device); so these are syncs of the CPU meter only, reported
    apart.
    """

    MODULES = ("torch.optim.adam",)

    def __init__(self) -> None:
        self.reads = 0
        self._originals: dict[str, object] = {}

    def __enter__(self) -> StepCounterReads:
        import importlib

        for name in self.MODULES:
            module = importlib.import_module(name)
            original = self._originals[name] = module._get_value

            def counted(value, original=original):  # noqa: ANN001, ANN202
                self.reads += isinstance(value, torch.Tensor) and not torch.jit.is_scripting()
                return original(value)

            module._get_value = counted
        return self

    def __exit__(self, *exc: object) -> None:
        import importlib

        for name, original in self._originals.items():
            importlib.import_module(name)._get_value = original


@dataclass
class PathMeasurement:
    """One path's figures: ops and syncs per iteration, op kinds, host times."""

    name: str
    engine: str
    optimizer: str
    ops_per_iteration: list[int] = field(default_factory=list)
    views_per_iteration: list[int] = field(default_factory=list)
    syncs_per_iteration: list[int] = field(default_factory=list)
    step_reads_per_iteration: list[int] = field(default_factory=list)
    """Of the syncs, AdamW's reads of its step counters (`StepCounterReads`)."""
    kinds: Counter[str] = field(default_factory=Counter)
    """The last counted iteration's ops by kind."""
    host_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def ops(self) -> int:
        """Ops in one steady-state iteration (the last counted)."""
        return self.ops_per_iteration[-1]

    @property
    def views(self) -> int:
        """Of `ops`, those that only alias an input (the rest would launch device work)."""
        return self.views_per_iteration[-1]

    @property
    def syncs(self) -> int:
        """Host syncs in one steady-state iteration (the last counted)."""
        return self.syncs_per_iteration[-1]

    @property
    def device_syncs(self) -> int:
        """Of `syncs`, those a GPU run would also make: all but AdamW's step-counter reads."""
        return self.syncs - self.step_reads_per_iteration[-1]

    @property
    def steady(self) -> bool:
        """Whether every counted iteration dispatched the same ops."""
        return len(set(self.ops_per_iteration)) == 1

    @property
    def host_ms(self) -> float:
        """Median host wall time of an uncounted iteration, in milliseconds."""
        return statistics.median(self.host_seconds) * 1e3


@dataclass
class Path:
    """One built setup: its engine, its data and what was measured."""

    name: str
    engine: object
    global_batch_size: int
    data: Iterator[dict]
    measurement: PathMeasurement

    def step(self) -> float:
        """One training iteration; its lm loss."""
        from megatron.training.monitor import Timers

        result = self.engine.train_step(self.data, self.global_batch_size, Timers(0))
        return float(result.losses["lm loss"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize_world() -> None:
    """torch.distributed over gloo with one process, then Megatron's groups (TP = PP = 1)."""
    import deepspeed

    from megatron.core import parallel_state
    from megatron.deepspeed_facts import skip_deepspeed_cpu_inference_comm

    if torch.distributed.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    skip_deepspeed_cpu_inference_comm()  # as our runs start DeepSpeed
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(1, 1)


def shape_flags(shape: MeterShape, seed: int) -> list[str]:
    """The command line every path shares."""
    flags = {
        "--num-layers": shape.num_layers,
        "--hidden-size": shape.hidden_size,
        "--num-attention-heads": shape.num_attention_heads,
        "--seq-length": shape.seq_length,
        "--max-position-embeddings": shape.seq_length,
        "--micro-batch-size": shape.micro_batch_size,
        "--global-batch-size": shape.micro_batch_size * shape.micro_batches,
        "--train-iters": 10_000,
        "--lr": 6e-4,
        "--min-lr": 6e-5,
        "--lr-decay-style": "cosine",
        "--lr-warmup-iters": 2,
        "--weight-decay": 0.1,
        "--clip-grad": 1.0,
        "--hidden-dropout": 0.1,
        "--attention-dropout": 0.1,
        "--seed": seed,
        "--distributed-backend": "gloo",
    }
    argv = [str(item) for pair in flags.items() for item in pair]
    argv += ["--bf16"] if shape.precision == "bf16" else []
    return argv + (["--torch-compile"] if shape.torch_compile else [])


def synthetic_batches(shape: MeterShape, count: int, seed: int) -> list[dict]:
    """`count` micro-batches {"text": [micro, seq + 1]} of uniform random token ids."""
    generator = torch.Generator().manual_seed(seed)
    size = (shape.micro_batch_size, shape.seq_length + 1)
    return [
        {"text": torch.randint(0, shape.vocab_size, size, generator=generator)}
        for _ in range(count)
    ]


def _cycle(batches: list[dict]) -> Iterator[dict]:
    while True:
        yield from batches


def build_path(name: str, shape: MeterShape, seed: int = 1234) -> Path:
    """Parse the path's flags, seed, and build its engine with the project's `build_engine`."""
    import pretrain_gpt
    from megatron.arguments import parse_args
    from megatron.initialize import set_random_seed
    from megatron.layout import Engine
    from megatron.settled_args import with_settled
    from megatron.training.engines import PipelineBatch
    from megatron.training.training import build_engine

    if name not in PATH_FLAGS:
        raise ValueError(f"unknown path {name!r}: one of {', '.join(PATH_FLAGS)}")
    argv = shape_flags(shape, seed) + PATH_FLAGS[name]
    with contextlib.redirect_stdout(io.StringIO()):  # the LR-style line, the model-size report
        args = parse_args(argv, world_size=1)
        vocab = shape.vocab_size
        args = with_settled(args, padded_vocab_size=vocab, eod_token_id=min(GPT2_EOD, vocab - 1))
        if name in FORCED_ENGINE:
            layout = dataclasses.replace(args.layout, engine=Engine(FORCED_ENGINE[name]))
            args = with_settled(args, layout=layout)
        set_random_seed(seed)  # the same initial weights on every path
        engine = build_engine(
            pretrain_gpt.model_provider,
            args,
            pretrain_gpt.forward_step,
            PipelineBatch(batch_fn=pretrain_gpt.get_batch_pipe, loss_func=pretrain_gpt.loss_func),
        )
    optimizer = getattr(engine.model, "optimizer", engine.optimizer)
    measurement = PathMeasurement(
        name, args.layout.engine.value, f"{type(engine.model).__name__}/{type(optimizer).__name__}"
    )
    batches = synthetic_batches(shape, 2 * shape.micro_batches, seed)
    return Path(name, engine, args.global_batch_size, _cycle(batches), measurement)


def warm_up(path: Path, iterations: int, seed: int = 1234) -> None:
    """Run `iterations` iterations from the same dropout seed as every path; record losses."""
    from megatron.initialize import set_random_seed

    set_random_seed(seed + 1)  # the same dropout masks on every path, iteration for iteration
    for _ in range(iterations):
        path.measurement.losses.append(path.step())


def count_iterations(path: Path, iterations: int, profiled: bool = False) -> None:
    """Run `iterations` iterations under `OpCounter` (`ProfiledOps` if `profiled`); record
    each one's ops and syncs."""
    for _ in range(iterations):
        counter = ProfiledOps() if profiled else OpCounter()
        with counter, StepCounterReads() as step_reads:
            path.measurement.losses.append(path.step())
        syncs = counter.syncs if profiled else counter.counts[SYNC_OP]
        path.measurement.step_reads_per_iteration.append(step_reads.reads)
        path.measurement.ops_per_iteration.append(sum(counter.counts.values()))
        path.measurement.views_per_iteration.append(counter.views)
        path.measurement.syncs_per_iteration.append(syncs)
        path.measurement.kinds = counter.counts


def time_iterations(path: Path, iterations: int) -> None:
    """Run `iterations` uncounted iterations; record each one's host wall time."""
    for _ in range(iterations):
        start = time.perf_counter()
        path.measurement.losses.append(path.step())
        path.measurement.host_seconds.append(time.perf_counter() - start)


def excess_kinds(path: PathMeasurement, base: PathMeasurement, rows: int) -> list[tuple]:
    """The op kinds `path` dispatches more of than `base`: (kind, path's, base's), most first."""
    extra = Counter(path.kinds)
    extra.subtract(base.kinds)
    top = [(kind, n) for kind, n in extra.most_common() if n > 0][:rows]
    return [(kind, path.kinds[kind], base.kinds[kind]) for kind, _ in top]


def measure(
    name: str, shape: MeterShape, warmup: int, count: int, rounds: int, seed: int = 1234
) -> PathMeasurement:
    """Build `name` in this process, warm up, count `count` iterations, time `rounds`."""
    initialize_world()
    path = build_path(name, shape, seed)
    warm_up(path, warmup, seed)
    count_iterations(path, count, profiled=shape.torch_compile)
    time_iterations(path, rounds)
    return path.measurement


REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))


def measure_in_subprocess(
    name: str,
    shape: MeterShape,
    warmup: int,
    count: int,
    rounds: int,
    seed: int = 1234,
    threads: int = 1,
    timeout: float = 300,
) -> PathMeasurement:
    """`measure` in a fresh process (`python -m benchmarks.op_meter`): nothing another
    path's build changed in torch or DeepSpeed reaches this one."""
    command = [sys.executable, "-m", "benchmarks.op_meter", name]
    command += ["--warmup", str(warmup), "--count", str(count), "--rounds", str(rounds)]
    command += ["--seed", str(seed), "--threads", str(threads)]
    command += ["--shape", json.dumps(dataclasses.asdict(shape))]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = done.stderr[-2000:]
        raise RuntimeError(f"measuring {name} failed (exit {done.returncode}): {tail}")
    record = json.loads(lines[-1])
    record["kinds"] = Counter(record["kinds"])
    return PathMeasurement(**record)


def _main() -> None:
    """Measure one path in this process and print it as one JSON line."""
    import logging
    import warnings

    parser = argparse.ArgumentParser(description="one path's host-overhead measurement")
    parser.add_argument("path", choices=list(PATH_FLAGS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", default="{}", help="MeterShape fields as JSON")
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated calls
    shape = MeterShape(**json.loads(cli.shape))
    result = measure(cli.path, shape, cli.warmup, cli.count, cli.rounds, cli.seed)
    record = {item.name: getattr(result, item.name) for item in dataclasses.fields(result)}
    print(json.dumps({**record, "kinds": dict(result.kinds)}), flush=True)


if __name__ == "__main__":
    _main()
