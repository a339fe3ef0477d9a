"""FP8 against bf16 through pretrain_gpt.py: tokens/s and loss agreement, 1B-class LLaMA, one GPU.

    python benchmarks/fp8_throughput.py --data-path PREFIX   # real text, GPT-2 vocabulary
    python benchmarks/fp8_throughput.py                      # --mock-data (see the note below)
    python benchmarks/fp8_throughput.py --smoke              # CPU: tiny model, 6 steps, < 30 s
    python benchmarks/fp8_throughput.py --check              # FP8 here? (exit 3 with why not)

Launches `pretrain_gpt.py` twice, one after the other, with the same flags, data and seed:
`--bf16`, then `--bf16 --fp8-format hybrid` (torchao's tensorwise FP8 matmuls in the
transformer layers' linear layers, megatron/model/fp8.py). The model is LLaMA-3.2-1B's shape
(16 layers, hidden 2048, SwiGLU FFN 8192, 32 heads over 8 KV groups, RMSNorm, RoPE theta
500000, no biases, untied output layer; with the GPT-2 vocabulary 1.18B parameters, 7.26
GFLOPs per token), seq 2048, micro-batch = global batch 2, 200 iterations, the plain engine
under `--torch-compile` (how benchmarks/gpu_throughput.py gets its best numbers; torchao's FP8
casts are fused only when compiled). Each run's whole output goes to `--work-dir`.

From Megatron's iteration log lines (`parse_iteration_log`, one every `--log-interval`):
- tokens/s of each run in the steady state: consumed tokens over elapsed time of the intervals
  after `--warmup-iters` (the first holds the compile), and their ratio fp8 / bf16;
- the loss agreement: the relative difference |fp8 - bf16| / bf16 of each logged `lm loss`
  (an interval's mean), its maximum, and the final one over the last `--final-iters`
  iterations. The exit status is 1 when a run fails or the final difference exceeds
  `--loss-rtol`. Mock data (token i + 1 follows token i) drives the loss to nearly 0, where a
  relative difference means little: pass real text (scripts/gpu_check.sh does).

Sized for about 3 minutes on one H100 (an estimate, not yet measured): 200 x 4096 tokens x 7.26
GFLOPs = 6 PFLOP per run, about 17 s of steps in bf16 at 400 TFLOP/s (plus the fp32 AdamW
step), less in FP8; the rest is each run's start-up and cold compile (about 1 minute each).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO_ROOT)

from megatron.training.monitor import parse_iteration_log  # noqa: E402

LLAMA_1B = (  # LLaMA-3.2-1B's shape
    "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8"
)
TINY = (  # --smoke: the same architecture, small
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2"
)
LLAMA_ARCHITECTURE = (
    "--swiglu --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope "
    "--rotary-base 500000 --disable-bias-linear --untie-embeddings-and-output-weights "
    "--hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02"
)
RUNS = {"bf16": [], "fp8": ["--fp8-format", "hybrid"]}
NOT_HERE = 3  # --check's exit status where FP8 does not run on this machine
PARAMETERS = re.compile(r" > model: ([\d,]+) parameters")
ELAPSED = "elapsed time per iteration (ms)"


def parse_args() -> argparse.Namespace:
    """Command-line flags (pretrain_gpt.py's names where they are its flags)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-path", help="a tokenized prefix (GPT-2 vocabulary); else mock")
    parser.add_argument("--vocab-file", default=os.path.join(REPO_ROOT, "dataset/gpt2-vocab.json"))
    parser.add_argument("--merge-file", default=os.path.join(REPO_ROOT, "dataset/gpt2-merges.txt"))
    parser.add_argument("--train-iters", type=int, default=200)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--warmup-iters", type=int, default=20, help="left out of tokens/s")
    parser.add_argument("--final-iters", type=int, default=20, help="the final loss's window")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=2)
    parser.add_argument("--loss-rtol", type=float, default=0.02, help="final loss, fp8 vs bf16")
    parser.add_argument("--no-compile", action="store_true", help="eager (no --torch-compile)")
    parser.add_argument("--work-dir", help="where each run's output goes (default: a new temp)")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny model, 6 steps, eager")
    parser.add_argument("--check", action="store_true", help="only say whether FP8 runs here")
    args = parser.parse_args()
    if args.smoke:  # every size and count small; eager (a CPU compile takes minutes)
        args.train_iters, args.log_interval, args.warmup_iters, args.final_iters = 6, 1, 2, 2
        args.seq_length, args.micro_batch_size, args.global_batch_size = 128, 2, 2
        args.no_compile = True
    return args


def device() -> torch.device:
    """The device pretrain_gpt.py will train on: the first GPU, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def fp8_missing(where: torch.device) -> str | None:
    """None where FP8 training runs on `where`, else pretrain_gpt.py's one-line reason."""
    from megatron.model.fp8 import fp8_support

    reason = fp8_support(where)
    return f"--fp8-format hybrid: {reason}" if reason else None


def run_flags(args: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py's flags shared by both runs (the FP8 run adds RUNS['fp8'])."""
    flags = f"{TINY if args.smoke else LLAMA_1B} {LLAMA_ARCHITECTURE}".split()
    flags += (
        f"--seq-length {args.seq_length} --max-position-embeddings {args.seq_length} "
        f"--micro-batch-size {args.micro_batch_size} --global-batch-size {args.global_batch_size} "
        f"--train-iters {args.train_iters} --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine "
        f"--lr-warmup-iters {max(1, args.train_iters // 10)} --weight-decay 0.1 --clip-grad 1.0 "
        f"--adam-beta2 0.95 --bf16 --seed 1234 --log-interval {args.log_interval} --eval-iters 0"
    ).split()
    if args.data_path:
        flags += ["--data-path", args.data_path, "--split", "98,1,1"]
        flags += ["--tokenizer-type", "GPT2BPETokenizer"]
        flags += ["--vocab-file", args.vocab_file, "--merge-file", args.merge_file]
    else:
        vocab = 1024 if args.smoke else 50304
        flags += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]
    if args.smoke:
        flags += ["--distributed-backend", "gloo"]
    if not args.no_compile:
        flags.append("--torch-compile")
    return flags


def launch(name: str, flags: list[str], args: argparse.Namespace, log_path: str) -> dict:
    """Run pretrain_gpt.py to the end, its output into `log_path`, echoing each iteration line
    in short; returns {'rc', 'seconds', 'records' (the parsed lines), 'parameters'}."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.smoke:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    command = [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *flags]
    records, parameters, tail = [], None, []
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for raw in process.stdout:
            line = raw.decode(errors="replace")
            log.write(line)
            tail = (tail + [line.rstrip()])[-25:]
            match = PARAMETERS.search(line)
            if match:
                parameters = int(match.group(1).replace(",", ""))
            try:
                fields = parse_iteration_log(line)
            except ValueError:
                continue
            records.append(fields)
            print(
                f"  {name} iteration {fields['iteration']:4d}: lm loss "
                f"{fields.get('lm loss', float('nan')):.4f}, "
                f"{fields[ELAPSED]:.1f} ms/iter",
                flush=True,
            )
        rc = process.wait()
    seconds = time.perf_counter() - start
    if rc != 0:
        print(f"  {name}: FAILED (exit {rc}); its last output:\n    " + "\n    ".join(tail))
    return {"rc": rc, "seconds": seconds, "records": records, "parameters": parameters}


def steady_state(records: list[dict], warmup_iters: int) -> dict:
    """Tokens/s, ms per iteration and the log line's TFLOP/s over the intervals after warm-up."""
    tokens = seconds = tflop = 0.0
    iterations, first = 0, None
    previous = {"iteration": 0, "consumed tokens": 0}
    for fields in records:
        if previous["iteration"] >= warmup_iters:
            count = fields["iteration"] - previous["iteration"]
            interval = fields[ELAPSED] * count / 1e3
            tokens += fields["consumed tokens"] - previous["consumed tokens"]
            seconds += interval
            tflop += fields["TFLOPs"] * interval
            iterations += count
            first = first or previous["iteration"] + 1
        previous = fields
    if not seconds:
        return {}
    return {
        "tokens_per_s": tokens / seconds,
        "ms_per_iter": seconds * 1e3 / iterations,
        "tflops": tflop / seconds,
        "iterations": f"{first}-{records[-1]['iteration']}",
    }


def final_loss(records: list[dict], final_iters: int) -> float:
    """The mean lm loss of the last `final_iters` iterations (interval means, weighted)."""
    last = records[-1]["iteration"]
    total = weight = 0.0
    previous = 0
    for fields in records:
        iterations = fields["iteration"] - max(previous, last - final_iters)
        if iterations > 0:
            total += fields["lm loss"] * iterations
            weight += iterations
        previous = fields["iteration"]
    return total / weight


def loss_table(bf16: list[dict], fp8: list[dict]) -> tuple[list[tuple], str | None]:
    """(iteration, bf16 loss, fp8 loss, relative difference, bf16 ms, fp8 ms) per logged
    interval; or the reason the two logs cannot be compared."""
    if [r["iteration"] for r in bf16] != [r["iteration"] for r in fp8]:
        return [], "the runs logged different iterations"
    if [r["consumed tokens"] for r in bf16] != [r["consumed tokens"] for r in fp8]:
        return [], "the runs consumed different token counts"
    rows = []
    for ours, theirs in zip(bf16, fp8):
        if "lm loss" not in ours or "lm loss" not in theirs:
            return [], f"no lm loss at iteration {ours['iteration']} (NaN or all skipped)"
        base, other = ours["lm loss"], theirs["lm loss"]
        speeds = (ours[ELAPSED], theirs[ELAPSED])
        rows.append((ours["iteration"], base, other, abs(other - base) / base, *speeds))
    return rows, None


def report(args: argparse.Namespace, results: dict[str, dict], where: torch.device) -> bool:
    """Print the tables and verdicts of two finished runs; True when their losses agree."""
    bf16, fp8 = results["bf16"], results["fp8"]
    if not bf16["records"] or not fp8["records"]:
        print("fp8 vs bf16: FAILED, a run logged no iteration")
        return False
    rows, problem = loss_table(bf16["records"], fp8["records"])
    if problem:
        print(f"fp8 vs bf16: FAILED, {problem}")
        return False
    print(
        "\n| iteration | bf16 lm loss | fp8 lm loss | relative difference | bf16 ms/iter "
        "| fp8 ms/iter |\n|---|---|---|---|---|---|"
    )
    for iteration, base, other, difference, base_ms, other_ms in rows:
        print(
            f"| {iteration} | {base:.4f} | {other:.4f} | {difference:.3%} | {base_ms:.1f} "
            f"| {other_ms:.1f} |"
        )
    speeds = {
        name: steady_state(run["records"], args.warmup_iters) for name, run in results.items()
    }
    print("\n| run | ms/iter | tokens/s | TFLOP/s (log line) | wall s (start-up and compile too) |")
    print("|---|---|---|---|---|")
    for name, run in results.items():
        speed = speeds[name]
        if speed:
            print(
                f"| {name} | {speed['ms_per_iter']:.1f} | {speed['tokens_per_s']:,.0f} "
                f"| {speed['tflops']:.1f} | {run['seconds']:.0f} |"
            )
    if speeds["bf16"] and speeds["fp8"]:
        ratio = speeds["fp8"]["tokens_per_s"] / speeds["bf16"]["tokens_per_s"]
        note = "; a CPU smoke run: not a speed figure" if where.type == "cpu" else ""
        print(
            f"\nfp8 / bf16 tokens/s: {ratio:.3f}x (steady state: iterations "
            f"{speeds['bf16']['iterations']}{note})"
        )
    worst = max(rows, key=lambda row: row[3])
    finals = [final_loss(run["records"], args.final_iters) for run in (bf16, fp8)]
    final = abs(finals[1] - finals[0]) / finals[0]
    verdict = "OK" if final <= args.loss_rtol else "DIFFER"
    print(
        f"loss agreement: max relative difference {worst[3]:.3%} (iteration {worst[0]}), "
        f"final {final:.3%} (mean of the last {args.final_iters} iterations: bf16 "
        f"{finals[0]:.4f}, fp8 {finals[1]:.4f}) -> {verdict} (final within {args.loss_rtol:.0%})"
    )
    return verdict == "OK"


def main() -> None:
    """`--check`, or both runs, then the report; exit 1 unless both finished and agree."""
    args = parse_args()
    where = torch.device("cpu") if args.smoke else device()
    missing = fp8_missing(where)
    if args.check:
        print(missing or f"FP8 training runs here ({where})")
        sys.exit(NOT_HERE if missing else 0)
    if where.type != "cuda" and not args.smoke:
        sys.exit("error: no CUDA GPU here (use --smoke for a CPU smoke run)")
    if missing:
        sys.exit(f"error: {missing}")
    work = args.work_dir or tempfile.mkdtemp(prefix="fp8_throughput.")
    os.makedirs(work, exist_ok=True)
    flags = run_flags(args)
    import torchao

    name = torch.cuda.get_device_name(where) if where.type == "cuda" else "CPU"
    print(f"$ python {' '.join(sys.argv)}")
    print(
        f"device: {name} | torch {torch.__version__} | CUDA {torch.version.cuda} | torchao "
        f"{torchao.__version__} | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    print(f"data: {args.data_path or '--mock-data'}; run logs in {work}")
    print(
        f"bf16: python pretrain_gpt.py {' '.join(flags)}\nfp8:  the same + {' '.join(RUNS['fp8'])}"
    )
    results = {}
    for run, extra in RUNS.items():
        results[run] = launch(run, flags + extra, args, os.path.join(work, f"{run}.log"))
        if results[run]["rc"] != 0:  # the other run would only spend the time
            sys.exit(f"fp8 vs bf16: FAILED, the {run} run did not finish (its output above)")
    parameters = results["bf16"]["parameters"]
    tokens = args.global_batch_size * args.seq_length
    print(
        f"\nmodel: {f'{parameters:,}' if parameters else 'unknown'} parameters, "
        f"{args.train_iters} iterations of {tokens:,} tokens, "
        f"{'eager' if args.no_compile else '--torch-compile'}"
    )
    sys.exit(0 if report(args, results, where) else 1)


if __name__ == "__main__":
    main()
