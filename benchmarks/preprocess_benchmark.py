"""Benchmark: tools/preprocess_data.py against Megatron's pipeline, same tokenizer and workers.

    python benchmarks/preprocess_benchmark.py --workers 2 --repeats 3
    python benchmarks/preprocess_benchmark.py --tokenizer-type Llama2Tokenizer

Builds the corpus (this Python's standard library source as JSON lines, CodeParrot style)
unless --input is given, then times both pipelines end to end as subprocesses, alternating
them `--repeats` times, checks their outputs are byte-identical, and prints the median
times, throughputs (MB/s, documents/s) and the ratio, with a Markdown row for
benchmarks/RESULTS.md. The baseline is `benchmarks/megatron_style_preprocess.py`.

--tokenizer-type GPTSentencePieceTokenizer, Llama2Tokenizer and HFTokenizer read
--tokenizer-model; without it the benchmark trains one on a quarter of the corpus first
(untimed, cached under benchmarks/work/): a LLaMA-style SentencePiece BPE or a byte-level
BPE tokenizer.json, --vocab-size tokens (default 32000, LLaMA 2's).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO_ROOT)
WORK = os.path.join(REPO_ROOT, "benchmarks", "work")
TOKENIZER_TYPES = [
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HFTokenizer",
]


def timed(command: list[str]) -> tuple[float, float]:
    """Wall-clock and CPU (user + system, workers included) seconds of one subprocess run.

    CPU time is the steadier figure on a shared machine, where other jobs stretch wall time.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        command, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def trained_tokenizer(kind: str, corpus: str, key: str, vocab_size: int) -> str:
    """A tokenizer for `kind` trained on every 4th document of `corpus` (cached in WORK)."""
    from tests.tokenizer.trained_tokenizers import train_hf_bpe, train_sentencepiece

    hf = kind == "HFTokenizer"
    folder = os.path.join(WORK, f"{'hf_bpe' if hf else 'spm'}_{vocab_size}")
    path = os.path.join(folder, "bpe.json" if hf else "spm.model")
    if os.path.exists(path):
        return path
    with open(corpus, encoding="utf-8") as lines:
        texts = [json.loads(line)[key] for index, line in enumerate(lines) if index % 4 == 0]
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    start = time.perf_counter()
    trained = (
        train_hf_bpe(texts, folder, vocab_size)[0]
        if hf
        else train_sentencepiece(texts, folder, vocab_size)
    )
    print(f"trained {trained} in {time.perf_counter() - start:.1f} s", flush=True)
    return trained


def main() -> None:
    """Run the comparison and print the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", help="JSON-lines corpus (default: the stdlib corpus)")
    parser.add_argument("--json-key", default="content")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="default: train one on the corpus")
    parser.add_argument("--vocab-size", type=int, default=32000, help="of a trained tokenizer")
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
    with open(corpus, "rb") as lines:
        documents = sum(1 for line in lines if line.strip())
    tokenizer = ["--tokenizer-type", args.tokenizer_type]
    if args.tokenizer_type != "GPT2BPETokenizer":
        model = args.tokenizer_model or trained_tokenizer(
            args.tokenizer_type, corpus, args.json_key, args.vocab_size
        )
        tokenizer += ["--tokenizer-model", model]
    common = [
        *tokenizer,
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
    cpu_times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for repeat in range(args.repeats):
        order = [("baseline", baseline), ("ours", ours)]
        for name, command in order if repeat % 2 == 0 else order[::-1]:
            wall, cpu = timed(command)
            times[name].append(wall)
            cpu_times[name].append(cpu)
            print(
                f"run {repeat + 1}/{args.repeats} {name}: {wall:.2f} s (CPU {cpu:.2f} s)",
                flush=True,
            )
    for suffix in (".bin", ".idx"):
        a = os.path.join(WORK, f"ours_{args.json_key}_document{suffix}")
        b = os.path.join(WORK, f"baseline_{args.json_key}_document{suffix}")
        if not filecmp.cmp(a, b, shallow=False):
            sys.exit(f"outputs differ: {a} vs {b}")
    ours_s, base_s = statistics.median(times["ours"]), statistics.median(times["baseline"])
    ours_cpu, base_cpu = (statistics.median(cpu_times[name]) for name in ("ours", "baseline"))
    ratio = base_s / ours_s
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(
        f"\ncorpus: {corpus} ({size_mb:.1f} MB, {documents} documents), tokenizer: "
        f"{' '.join(tokenizer)}, workers: {args.workers}, repeats: {args.repeats}, "
        "outputs byte-identical"
    )

    def speed(seconds: float) -> str:
        return f"{seconds:.2f} s ({size_mb / seconds:.2f} MB/s, {documents / seconds:.0f} docs/s)"

    print(f"baseline (Megatron pipeline): {speed(base_s)}")
    print(f"ours (tools/preprocess_data.py): {speed(ours_s)}")
    print(
        f"ratio: {ratio:.2f}x faster (CPU time: {base_cpu:.2f} s vs {ours_cpu:.2f} s, "
        f"{base_cpu / ours_cpu:.2f}x)"
    )
    print(
        f"\n| preprocess_data {args.tokenizer_type}, {size_mb:.1f} MB stdlib JSONL, --workers "
        f"{args.workers} | {speed(base_s)}, CPU {base_cpu:.1f} s | {speed(ours_s)}, CPU "
        f"{ours_cpu:.1f} s | **{ratio:.2f}x** (CPU {base_cpu / ours_cpu:.2f}x) | {machine} |"
    )


if __name__ == "__main__":
    main()
