"""What MFU does a real run get? GPT-2 iterations through pretrain_gpt.py's own engine, one GPU.

    python benchmarks/gpu_throughput.py                          # 124M and 350M, eager + compile
    python benchmarks/gpu_throughput.py --model 124M --modes compile --engines plain nopipe pipe
    python benchmarks/gpu_throughput.py --device cpu --model tiny --iters 2 --warmup 1  # smoke run

Each measurement runs in its own process (clean memory peak, its own compile), started with
the flags a user's run has: Megatron's model and batch flags, `--bf16` (`--fp16` before
compute capability 8.0), `--deepspeed` with ZeRO-1, and the engine `pretrain_gpt.py` picks
from them: DeepSpeed's pipeline engine at PP=1 (`pipe`, the `--deepspeed` default, what
scripts/ds_pretrain_gpt2.sh runs), the plain DeepSpeed engine (`nopipe`,
`--no-pipeline-parallel`) or no DeepSpeed (`plain`). The model, optimizer and engine come
from `setup_model_and_optimizer(model_provider, args)`, and every iteration is one
`TrainingLoop.step`: gradient accumulation over `--global-batch-size / --micro-batch-size`
micro-batches (pinned host batches, as the data loader gives them), clipping, the LR
schedule. `--modes eager compile` runs each without and with `--torch-compile`.

The same-run baseline is nanoGPT's recipe at the same shape: its GPT-2 (the class in
benchmarks/train_step_benchmark.py; fp32 weights, loss included in the graph) under
`torch.compile`, bf16 autocast, fused AdamW, the same accumulation and clipping.

Reported per run: ms per iteration, tokens/s, model TFLOP/s (Megatron's FLOPs per token,
recomputation not counted), MFU against the device's dense bf16 peak from a table (or
`--peak-tflops`) and against a large bf16 GEMM measured here, peak memory, and the attention
kernel the profiler saw in one extra iteration. Targets (issue 18): GPT-2 124M, seq 1024, bf16,
one H100: at least 45% MFU through pretrain_gpt.py's engine, and ahead of the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = {  # layers, hidden, heads
    "tiny": (2, 128, 4),
    "124M": (12, 768, 12),
    "350M": (24, 1024, 16),
    "760M": (24, 1536, 16),
    "1.3B": (24, 2048, 16),
}
# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets. The
# first name found in torch.cuda.get_device_name() wins, so the specific ones come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("V100", 125.0),  # fp16: V100 has no bf16
)
TARGET_MFU = 0.45
RESULT = "RESULT "


INDUCTOR_VARIANTS = {
    "default": {},
    # CUDA graphs of the compiled forward and backward (torch.compile's "reduce-overhead").
    "cudagraphs": {"TORCHINDUCTOR_CUDAGRAPHS": "1"},
    # Autotuned matmul kernels (part of "max-autotune-no-cudagraphs"; minutes of compiling).
    "autotune-gemm": {"TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": "1"},
}
"""Issue 56's sweep of the compiled plain engine, set through inductor's own environment
variables in the measured process: `--inductor default cudagraphs autotune-gemm`."""


def parse_args() -> argparse.Namespace:
    """Command-line flags (Megatron's names where one exists)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["124M", "350M"], choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"])
    parser.add_argument("--engines", nargs="+", default=["pipe"], help="pipe, nopipe, plain")
    parser.add_argument("--no-baseline", action="store_true", help="skip the nanoGPT baseline")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="also plan each run with pretrain_gpt.py --dry-run: predicted vs measured peak",
    )
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=64, help="per iteration")
    parser.add_argument("--vocab-size", type=int, default=50304, help="padded vocabulary")
    parser.add_argument("--dropout", type=float, default=0.0, help="hidden and attention")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=3, help="untimed (compile) iterations")
    parser.add_argument(
        "--inductor",
        nargs="+",
        default=["default"],
        choices=list(INDUCTOR_VARIANTS),
        help="compiled runs under each of these inductor settings (INDUCTOR_VARIANTS)",
    )
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--run", nargs=3, metavar=("SIZE", "ENGINE", "MODE"), help=argparse.SUPPRESS
    )
    return parser.parse_args()


def synchronize(device: str) -> None:
    """Wait for the device's queued work."""
    if device == "cuda":
        torch.cuda.synchronize()


def half_precision(device: str) -> str:
    """bf16, or fp16 on GPUs older than compute capability 8.0 (as the launch scripts pick)."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 8:
        return "fp16"
    return "bf16"


def peak_tflops(requested: float | None, device: str) -> tuple[float | None, str]:
    """The device's dense bf16 peak and where it came from (None when unknown)."""
    if requested:
        return requested, "--peak-tflops"
    if device != "cuda":
        return None, "no table entry for a CPU"
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value, f"table: {key}"
    return None, f"{name!r} not in the table (pass --peak-tflops)"


def gemm_tflops(device: str) -> float:
    """TFLOP/s of a large half-precision matmul here: the ceiling the model's GEMMs can reach."""
    n = 8192 if device == "cuda" else 1024
    dtype = torch.bfloat16 if half_precision(device) == "bf16" else torch.float16
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    repeats = 20 if device == "cuda" else 3
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def batches(args: argparse.Namespace, device: str):
    """Endless {'text': [micro-batch, seq + 1]} int64 token batches in pinned host memory."""
    generator = torch.Generator().manual_seed(1234)
    shape = (args.micro_batch_size, args.seq_length + 1)
    pool = [torch.randint(0, 50257, shape, generator=generator) for _ in range(4)]
    if device == "cuda":
        pool = [tensor.pin_memory() for tensor in pool]
    while True:
        for tensor in pool:
            yield {"text": tensor}


def megatron_flags(size: str, engine: str, mode: str, args, ds_config: str) -> list[str]:
    """The command line of a real pretrain_gpt.py run of this shape."""
    layers, hidden, heads = SIZES[size]
    flags = (
        f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} "
        f"--seq-length {args.seq_length} --max-position-embeddings {args.seq_length} "
        f"--micro-batch-size {args.micro_batch_size} --global-batch-size {args.global_batch_size} "
        "--train-iters 1000000 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine "
        "--lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 "
        f"--hidden-dropout {args.dropout} --attention-dropout {args.dropout} "
        f"--{half_precision(args.device)} --seed 1234 --log-interval 1000000 "
        f"--distributed-backend {'nccl' if args.device == 'cuda' else 'gloo'}"
    ).split()
    if engine != "plain":
        flags += ["--deepspeed", "--deepspeed_config", ds_config, "--zero-stage", "1"]
    if engine == "nopipe":
        flags.append("--no-pipeline-parallel")
    if mode == "compile":
        flags.append("--torch-compile")
    return flags


def attention_kernel(step, device: str) -> str:
    """The attention kernels the profiler sees in one more iteration (by kernel name)."""
    if device != "cuda":
        return "sdpa (CPU)"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    averages = prof.key_averages()
    if os.environ.get("BENCH_PROFILE_FILE"):  # where the profiled iteration's kernels go
        with open(os.environ["BENCH_PROFILE_FILE"], "a") as file:
            file.write(f"\n### {' '.join(sys.argv[-3:])}\n")
            file.write(averages.table(sort_by="self_device_time_total", row_limit=25) + "\n")
    names = [event.key.lower() for event in averages]
    # Each kind: kernel-name fragments that must all appear in one kernel's name.
    kinds = {
        "flash": [("flash",)],
        "memory-efficient": [("efficient_attention",), ("mem_eff",), ("fmha", "cutlass")],
        "cudnn": [("cudnn", "sdpa")],
    }
    found = [
        kind
        for kind, patterns in kinds.items()
        if any(all(part in name for part in parts) for parts in patterns for name in names)
    ]
    return "+".join(found) or "math (no fused attention kernel seen)"


def time_iterations(step, args: argparse.Namespace) -> dict:
    """Warm-up, then the median seconds per iteration and the peak memory."""
    for _ in range(args.warmup):
        step()
    synchronize(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        synchronize(args.device)
        times.append(time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    return {"seconds": statistics.median(times), "peak_gib": memory}


def run_ours(size: str, engine: str, mode: str, args: argparse.Namespace) -> dict:
    """One measurement through pretrain_gpt.py's engine (in this process)."""
    from megatron.initialize import initialize_megatron
    from megatron.settled_args import with_settled
    from megatron.training.engines import PipelineBatch
    from megatron.training.loop import TrainingLoop
    from megatron.training.monitor import Timers
    from megatron.training.training import build_engine
    from pretrain_gpt import forward_step, get_batch_pipe, loss_func, model_provider

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as config:
        json.dump({"zero_optimization": {"stage": 1}, "steps_per_print": 10**9}, config)
    megatron_args = initialize_megatron(argv=megatron_flags(size, engine, mode, args, config.name))
    # What build_tokenizer sets in a real run (GPT-2's vocabulary, padded).
    megatron_args = with_settled(
        megatron_args, padded_vocab_size=args.vocab_size, eod_token_id=50256
    )
    pipeline_batch = PipelineBatch(batch_fn=get_batch_pipe, loss_func=loss_func)
    engine = build_engine(model_provider, megatron_args, forward_step, pipeline_batch)
    loop = TrainingLoop(megatron_args, engine, Timers(0), None)
    data = batches(args, args.device)

    def step() -> None:
        loop.step(data)

    result = time_iterations(step, args)
    result["attention"] = attention_kernel(step, args.device)
    return result


def model_config(size: str, args: argparse.Namespace):
    """The `ModelConfig` of GPT-2 `size` at the benchmark's sequence length and vocabulary."""
    from megatron.config import ModelConfig

    layers, hidden, heads = SIZES[size]
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.seq_length,
    )


def run_baseline(size: str, args: argparse.Namespace) -> dict:
    """nanoGPT's recipe at the same shape: compiled, bf16 autocast, fused AdamW (this process)."""
    from train_step_benchmark import GPT

    config = model_config(size, args)
    torch.manual_seed(1234)
    model = torch.compile(GPT(config, args.dropout).to(args.device).train())
    fused = {"fused": True} if args.device == "cuda" else {}
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused
    )
    dtype = torch.bfloat16 if half_precision(args.device) == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(enabled=dtype == torch.float16)
    accumulation = args.global_batch_size // args.micro_batch_size
    data = batches(args, args.device)

    def step() -> None:
        for _ in range(accumulation):
            text = next(data)["text"].to(args.device, non_blocking=True)
            with torch.autocast(args.device, dtype=dtype):
                loss = model(text[:, :-1].contiguous(), text[:, 1:].contiguous()) / accumulation
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    result = time_iterations(step, args)
    result["attention"] = attention_kernel(step, args.device)
    return result


def child(args: argparse.Namespace) -> None:
    """`--run SIZE ENGINE MODE`: measure one run and print it as a RESULT line."""
    size, engine, mode = args.run
    if engine == "baseline":
        result = run_baseline(size, args)
    else:
        result = run_ours(size, engine, mode, args)
    print(RESULT + json.dumps(result), flush=True)


def measure(
    size: str, engine: str, mode: str, args: argparse.Namespace, settings: dict | None = None
) -> dict | None:
    """Run one measurement in a fresh process (with the environment `settings` added); its
    result, or None (with its output shown)."""
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env.update(settings or {})
    env.setdefault("MASTER_PORT", "29531")
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    command = [
        sys.executable,
        os.path.abspath(__file__),
        *sys.argv[1:],
        "--run",
        size,
        engine,
        mode,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    print(f"  {engine} {mode}: FAILED (exit {done.returncode}); its last output:")
    print("    " + "\n    ".join((done.stdout + done.stderr).splitlines()[-25:]))
    return None


def planned(size: str, engine: str, mode: str, args: argparse.Namespace) -> dict | None:
    """`pretrain_gpt.py FLAGS --dry-run` of the same run: its predicted peak bytes and step."""
    with tempfile.TemporaryDirectory() as work:
        config, plan = os.path.join(work, "ds.json"), os.path.join(work, "plan.json")
        with open(config, "w") as file:
            json.dump({"zero_optimization": {"stage": 1}}, file)
        flags = megatron_flags(size, engine, mode, args, config)
        flags += ["--dry-run", "--dry-run-world-size", "1", "--dry-run-json", plan]
        command = [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *flags]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
        if done.returncode != 0 or not os.path.exists(plan):
            print(f"  plan {engine} {mode}: FAILED (exit {done.returncode})")
            print("    " + "\n    ".join((done.stdout + done.stderr).splitlines()[-10:]))
            return None
        with open(plan) as file:
            return json.load(file)


def report_plan(label: str, plan: dict, result: dict) -> None:
    """The planner's peak memory beside torch.cuda.max_memory_allocated of the run."""
    predicted = plan["peak_bytes"] / 2**30
    measured = result["peak_gib"]
    ratio = f"{predicted / measured:.3f}" if measured else "n/a"
    moment = plan["ranks"][0]["memory"]["peak_at"]
    print(
        f"    planner ({label}): predicted peak {predicted:.2f} GiB at {moment}, measured "
        f"max_memory_allocated {measured if measured is not None else float('nan'):.2f} GiB, "
        f"ratio {ratio}"
    )


def report(label: str, result: dict, tokens: int, flops: float, peak, gemm: float) -> float:
    """Print one result line; return its MFU (or the fraction of the GEMM ceiling on a CPU)."""
    seconds = result["seconds"]
    tflops = flops / seconds / 1e12
    mfu = tflops / peak if peak else None
    memory = f"{result['peak_gib']:5.1f} GiB" if result["peak_gib"] is not None else "    n/a"
    print(
        f"  {label:<36} {seconds * 1e3:9.1f} {tokens / seconds:11,.0f} {tflops:8.1f} "
        f"{f'{mfu:6.1%}' if mfu is not None else '   n/a'} {tflops / gemm:7.1%} {memory}  "
        f"{result['attention']}"
    )
    return mfu if mfu is not None else tflops / gemm


def main() -> None:
    """Measure each size: ours per engine and mode, then the baseline; print the verdicts."""
    args = parse_args()
    if args.run:
        return child(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here (use --device cpu for a smoke run)")
    from megatron.model import flops_per_token, num_parameters

    peak, source = peak_tflops(args.peak_tflops, args.device)
    gemm = gemm_tflops(args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU"
    print(f"$ python {' '.join(sys.argv)}")
    print(
        f"device: {name} | torch {torch.__version__} | CUDA {torch.version.cuda} | python "
        f"{platform.python_version()} | peak bf16: {peak or 'unknown'} TFLOP/s ({source}) | "
        f"measured {half_precision(args.device)} GEMM: {gemm:.0f} TFLOP/s"
    )
    for size in args.model:
        config = model_config(size, args)
        tokens = args.global_batch_size * args.seq_length
        flops = flops_per_token(config, args.seq_length) * tokens
        print(
            f"\nGPT-2 {size}: {num_parameters(config):,} parameters, seq {args.seq_length}, "
            f"micro-batch {args.micro_batch_size}, global batch {args.global_batch_size} "
            f"({args.global_batch_size // args.micro_batch_size} micro-batches), "
            f"{half_precision(args.device)}, dropout {args.dropout}"
        )
        print(
            f"  {'run':<36} {'ms/iter':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} "
            f"{'of GEMM':>7} {'peak mem':>9}  attention"
        )
        mfus = {}
        runs = [
            (engine, mode, variant)
            for engine in args.engines
            for mode in args.modes
            for variant in (args.inductor if mode == "compile" else ["default"])
        ]
        for engine, mode, variant in runs:
            result = measure(size, engine, mode, args, INDUCTOR_VARIANTS[variant])
            if result:
                label = f"ours {mode} ({engine})"
                if variant != "default":
                    label = f"ours {mode} ({engine}, {variant})"
                mfus[label] = report(label, result, tokens, flops, peak, gemm)
                plan = planned(size, engine, mode, args) if args.plan else None
                if plan:
                    report_plan(label, plan, result)
        if not args.no_baseline:
            result = measure(size, "baseline", "compile", args)
            if result:
                mfus["baseline"] = report(
                    "nanoGPT compiled baseline", result, tokens, flops, peak, gemm
                )
        verdicts(size, mfus, peak)


ENGINE_TARGETS = {"nopipe": 0.95, "pipe": 0.9}
"""Issue 56: DeepSpeed's engine (ZeRO-1, --no-pipeline-parallel) and its pipeline engine at
PP=1, as a fraction of the plain engine's throughput in the same run and mode."""


def verdicts(size: str, mfus: dict[str, float], peak: float | None) -> None:
    """Our best run against the baseline, and (124M, known peak) against the MFU target."""
    ours = {label: mfu for label, mfu in mfus.items() if label != "baseline"}
    if not ours:
        return
    best = max(ours, key=ours.get)
    if "baseline" in mfus:
        ratio = ours[best] / mfus["baseline"]
        print(
            f"  best: {best}, {ratio:.3f}x the baseline's throughput -> "
            f"{'ahead' if ratio >= 1.0 else 'BEHIND'}"
        )
    if size == "124M" and peak:
        verdict = "PASS" if ours[best] >= TARGET_MFU else "FAIL"
        print(f"  target: MFU >= {TARGET_MFU:.0%} for 124M -> {ours[best]:.1%} {verdict}")
    for mode in ("compile", "eager"):
        plain = ours.get(f"ours {mode} (plain)")
        for engine, target in ENGINE_TARGETS.items():
            label = f"ours {mode} ({engine})"
            if plain and label in ours:
                ratio = ours[label] / plain
                verdict = "PASS" if ratio >= target else "FAIL"
                print(f"  {label}: {ratio:.3f}x the plain engine (target >= {target}x) {verdict}")


if __name__ == "__main__":
    main()
