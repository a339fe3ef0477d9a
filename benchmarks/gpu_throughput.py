"""Training throughput and MFU of our GPT-2 on one GPU, in bf16, through DeepSpeed.

    python benchmarks/gpu_throughput.py --model 124M 350M --seq-length 1024 --micro-batch-size 8

For each model size it builds `GPTModel` (bf16 parameters, SDPA attention, which picks the
flash kernel on Ampere or newer), wraps it in `deepspeed.initialize` with bf16 and ZeRO-1 as
a real run does, and times full training steps (forward, backward, optimizer step). It
prints tokens/s, achieved TFLOP/s (model FLOPs from `megatron.model.flops_per_token`,
recomputation excluded) and MFU against the GPU's dense bf16 peak (989 TFLOP/s for H100 and
H200 SXM; pass --peak-tflops for other GPUs). A same-run baseline is the identical model in
plain PyTorch with `torch.optim.AdamW(fused=True)`, so the ratio shows what the DeepSpeed
path costs or gains. `--profile` then prints torch.profiler's top ops for 3 steps of each.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))

from megatron.config import ModelConfig  # noqa: E402
from megatron.model import GPTModel, flops_per_token, num_parameters  # noqa: E402

SIZES = {
    "124M": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
    "350M": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "760M": dict(num_layers=24, hidden_size=1536, num_attention_heads=16),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def parse_args() -> argparse.Namespace:
    """Command-line flags (Megatron names where one exists)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["124M", "350M"], choices=sorted(SIZES))
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then profile 3 steps of each path (torch.profiler: top ops by GPU and CPU time)",
    )
    return parser.parse_args()


def peak_tflops(requested: float | None) -> float:
    """The dense bf16 peak of this GPU, from the flag or a known device name."""
    if requested:
        return requested
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops")


def time_steps(step, iters: int, warmup: int) -> list[float]:
    """Seconds per call of `step()` after `warmup` calls, synchronizing the GPU."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def profile_steps(path: str, step, rows: int = 15) -> None:
    """Run 3 steps under torch.profiler; print the ops with the most GPU and CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_cuda_time_total", "cpu_time_total"):
        print(f"--- torch.profiler, 3 steps of the {path} path, by {key} ---")
        print(averages.table(sort_by=key, row_limit=rows, max_name_column_width=60))


def build_model(size: str, args: argparse.Namespace) -> tuple[ModelConfig, GPTModel]:
    """A bf16 GPTModel of the named size on the GPU (dropout as GPT-2: 0.1)."""
    config = ModelConfig(
        **SIZES[size],
        vocab_size=args.vocab_size,
        max_position_embeddings=args.seq_length,
        params_dtype="bfloat16",
    )
    torch.manual_seed(1234)
    with torch.device("cuda"):
        return config, GPTModel(config)


def deepspeed_steps(model: GPTModel, batch: torch.Tensor, args: argparse.Namespace):
    """A training-step closure through a DeepSpeed engine (bf16, ZeRO-1, clip 1.0)."""
    import deepspeed

    from megatron.core import parallel_state

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        mpu=parallel_state.mpu,
        config={
            "train_micro_batch_size_per_gpu": args.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1},
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
        },
    )

    def step():
        loss = engine(batch, labels=batch).mean()
        engine.backward(loss)
        engine.step()

    return step


def torch_steps(model: GPTModel, batch: torch.Tensor):
    """The same step in plain PyTorch (bf16 weights, fused AdamW): the same-run baseline."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def step():
        loss = model(batch, labels=batch).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    """Measure and print one block per model size."""
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    import deepspeed
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    peak = peak_tflops(args.peak_tflops)
    print(f"$ python {' '.join(sys.argv)}")
    print(
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"deepspeed {deepspeed.__version__} | CUDA {torch.version.cuda} | "
        f"python {platform.python_version()} | peak bf16 {peak:.0f} TFLOP/s"
    )
    tokens = args.micro_batch_size * args.seq_length
    for size in args.model:
        results = {}
        for path in ("deepspeed", "torch"):
            config, model = build_model(size, args)
            batch = torch.randint(0, 50257, (args.micro_batch_size, args.seq_length), device="cuda")
            step = (
                deepspeed_steps(model, batch, args)
                if path == "deepspeed"
                else torch_steps(model, batch)
            )
            times = time_steps(step, args.iters, args.warmup)
            results[path] = statistics.median(times)
            if args.profile:
                profile_steps(path, step)
            del model, step
            torch.cuda.empty_cache()
        flops = flops_per_token(config, args.seq_length) * tokens
        print(
            f"GPT-2 {size}: {num_parameters(config):,} parameters, "
            f"seq {args.seq_length}, micro-batch {args.micro_batch_size}, bf16"
        )
        for path, seconds in results.items():
            tflops = flops / seconds / 1e12
            print(
                f"  {path:9s}: {seconds * 1e3:8.1f} ms/step  {tokens / seconds:10,.0f} tokens/s  "
                f"{tflops:6.1f} TFLOP/s  MFU {tflops / peak:6.1%}"
            )
        ratio = results["torch"] / results["deepspeed"]
        print(f"  deepspeed path speed vs plain torch: {ratio:.3f}x")
        print(f"  peak memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        torch.cuda.reset_peak_memory_stats()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
