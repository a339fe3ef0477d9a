"""Benchmark: how long training stands still per save, `torch` vs `torch_dist`, sync vs async.

    python benchmarks/checkpoint_formats.py                       # GPT-2 350M, 1 and 2 ranks
    python benchmarks/checkpoint_formats.py --size 124M --ranks 1

Real `pretrain_gpt.py` runs (fp32, seq 128, micro-batch 1, dropout 0, mock-free: the stdlib
corpus of tests/conftest is built if missing), each training 4 iterations and saving at 2 and
4 into a fresh directory: `--ckpt-format torch`, `--ckpt-format torch_dist`, and `torch_dist
--async-save`, at 1 rank and at 2 ranks (TP=2, torchrun, gloo). The stall is what the run
itself logs after each save, as Megatron-LM does: `save-checkpoint` (max over ranks, ms,
barriers before and after), the time training waited; for async saves that is the staging
copy, and the write's own duration is the "written in the background in Xs" line. Size: the
iteration-2 directory on disk. Load: a second launch of the same command line resuming from
iteration 4, its "model, optimizer and scheduler ready in" time minus that of the first run
(the load, as the rest of the set-up is the same). Ratios against the synchronous `torch` save
measured in the same invocation.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.machine import describe_machine  # noqa: E402
from tests.conftest import MERGE_FILE, VOCAB_FILE  # noqa: E402
from tests.pretrain_runs import free_port  # noqa: E402

SIZES = {"124M": (12, 768, 12), "350M": (24, 1024, 16)}
CASES = {
    "torch": ["--ckpt-format", "torch"],
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "torch_dist async": ["--ckpt-format", "torch_dist", "--async-save"],
}
STALL = re.compile(r"save-checkpoint \.+: \(([\d.]+), ([\d.]+)\)")
BACKGROUND = re.compile(r"written in the background in ([\d.]+)s")
READY = re.compile(r"model, optimizer and scheduler ready in ([\d.]+)s")


def _flags(size: str, data: str, save: str, ranks: int) -> list[str]:
    layers, hidden, heads = SIZES[size]
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads), "--seq-length", "128",
        "--max-position-embeddings", "1024", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "4", "--lr", "1e-4",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--split", "100,0,0",
        "--eval-iters", "0", "--log-interval", "1", "--data-path", data,
        "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE,
        "--save", save, "--load", save, "--save-interval", "2",
        "--tensor-model-parallel-size", str(ranks),
    ]  # fmt: skip


def _launch(ranks: int, flags: list[str]) -> str:
    script = os.path.join(REPO, "pretrain_gpt.py")
    if ranks == 1:
        command = [sys.executable, script, *flags]
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        command = [
            torchrun,
            f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}",
            script,
            *flags,
        ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(max(1, 2 // ranks)))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _size(directory: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(directory)
        for name in names
    )


def measure(size: str, ranks: int, case: str, data: str, scratch: str) -> dict:
    """One case: stalls of its two saves, background write times, size, load time."""
    save = tempfile.mkdtemp(dir=scratch)
    flags = _flags(size, data, save, ranks) + CASES[case]
    first = _launch(ranks, flags)
    stalls = [float(high) for _, high in STALL.findall(first)]
    written = [float(seconds) for seconds in BACKGROUND.findall(first)]
    size_bytes = _size(os.path.join(save, "iter_0000002"))
    resumed = _launch(ranks, flags)  # resumes at 4: loads, trains nothing more
    load = float(READY.search(resumed).group(1)) - float(READY.search(first).group(1))
    shutil.rmtree(save)
    return dict(stalls=stalls, written=written, bytes=size_bytes, load=load)


def main() -> None:
    """Measure every case at each rank count; print the table for RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="350M")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dir", default=os.path.join(REPO, "benchmarks", "work"))
    parser.add_argument("--data", default=None, help="a Megatron dataset prefix (default: built)")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="checkpoint_formats-", dir=args.dir)
    data = args.data
    if data is None:
        from tests.pretrain_runs import build_stdlib_dataset

        os.makedirs(os.path.join(scratch, "data"))
        data = build_stdlib_dataset(os.path.join(scratch, "data"))
    print(f"command: python benchmarks/checkpoint_formats.py {' '.join(sys.argv[1:])}")
    print(describe_machine(f"{' and '.join(map(str, args.ranks))} rank(s), TP = ranks"))
    print(f"model {size_line(args.size)}; writing to {scratch}")
    print("| ranks | format | stall per save (ms) | vs torch | background write (s) | size MB "
          "| load (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        baseline = None
        for case in CASES:
            found = measure(args.size, ranks, case, data, scratch)
            stall = statistics.median(found["stalls"])
            baseline = baseline or stall
            written = ", ".join(f"{s:.1f}" for s in found["written"]) or "-"
            each = ", ".join(f"{s:,.0f}" for s in found["stalls"])
            print(
                f"| {ranks} | {case} | {stall:,.0f} ({each}) | **{stall / baseline:.2f}** "
                f"| {written} | {found['bytes'] / 1e6:,.0f} | {found['load']:.1f} |",
                flush=True,
            )
    shutil.rmtree(scratch)


def size_line(size: str) -> str:
    """The model's shape in words."""
    layers, hidden, heads = SIZES[size]
    return f"GPT-2 {size}: {layers} layers, hidden {hidden}, {heads} heads, fp32, AdamW"


if __name__ == "__main__":
    main()
