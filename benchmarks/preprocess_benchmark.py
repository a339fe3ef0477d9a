"""Benchmark: tools/preprocess_data.py against Megatron's pure-Python pipeline, same workers.

    python benchmarks/preprocess_benchmark.py --workers 2 --repeats 3

Builds the corpus (this Python's standard library source as JSON lines, CodeParrot style)
unless --input is given, then times both pipelines end to end as subprocesses, alternating
them `--repeats` times, checks their outputs are byte-identical, and prints the median
times, throughputs and the ratio, with a Markdown row for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import platform
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
WORK = os.path.join(REPO_ROOT, "benchmarks", "work")


def timed(command: list[str]) -> float:
    """Wall-clock seconds of one subprocess run (which must succeed)."""
    start = time.perf_counter()
    subprocess.run(
        command, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return time.perf_counter() - start


def main() -> None:
    """Run the comparison and print the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", help="JSON-lines corpus (default: the stdlib corpus)")
    parser.add_argument("--json-key", default="content")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(WORK, exist_ok=True)
    corpus = args.input or os.path.join(WORK, "stdlib.jsonl")
    if not os.path.exists(corpus):
        subprocess.run(
            [sys.executable, "tools/files_to_jsonl.py", "--output", corpus],
            cwd=REPO_ROOT,
            check=True,
        )
    size_mb = os.path.getsize(corpus) / 1e6
    common = [
        "--input",
        corpus,
        "--json-keys",
        args.json_key,
        "--append-eod",
        "--workers",
        str(args.workers),
    ]
    ours = [
        sys.executable,
        "tools/preprocess_data.py",
        *common,
        "--log-interval",
        "100000",
        "--output-prefix",
        os.path.join(WORK, "ours"),
    ]
    baseline = [
        sys.executable,
        "benchmarks/megatron_style_preprocess.py",
        *common,
        "--log-interval",
        "100000",
        "--output-prefix",
        os.path.join(WORK, "baseline"),
    ]
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for repeat in range(args.repeats):
        order = [("baseline", baseline), ("ours", ours)]
        for name, command in order if repeat % 2 == 0 else order[::-1]:
            times[name].append(timed(command))
            print(f"run {repeat + 1}/{args.repeats} {name}: {times[name][-1]:.2f} s", flush=True)
    for suffix in (".bin", ".idx"):
        a = os.path.join(WORK, f"ours_{args.json_key}_document{suffix}")
        b = os.path.join(WORK, f"baseline_{args.json_key}_document{suffix}")
        if not filecmp.cmp(a, b, shallow=False):
            sys.exit(f"outputs differ: {a} vs {b}")
    ours_s, base_s = statistics.median(times["ours"]), statistics.median(times["baseline"])
    ratio = base_s / ours_s
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(
        f"\ncorpus: {corpus} ({size_mb:.1f} MB), workers: {args.workers}, repeats: "
        f"{args.repeats}, outputs byte-identical"
    )
    print(
        f"baseline (Megatron pipeline, pure-Python BPE): {base_s:.2f} s "
        f"({size_mb / base_s:.2f} MB/s)"
    )
    print(
        f"ours (tools/preprocess_data.py):               {ours_s:.2f} s "
        f"({size_mb / ours_s:.2f} MB/s)"
    )
    print(f"ratio: {ratio:.1f}x faster")
    print(
        f"\n| preprocess_data, {size_mb:.1f} MB stdlib JSONL, --workers {args.workers} | "
        f"{base_s:.2f} s | {ours_s:.2f} s | **{ratio:.1f}x** | {machine} |"
    )


if __name__ == "__main__":
    main()
