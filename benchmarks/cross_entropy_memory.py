"""Memory and time of the vocab-parallel cross entropy: chunked (ours) vs the fp32 one before it.

    python benchmarks/cross_entropy_memory.py                  # N = 8 x 1024 tokens
    python benchmarks/cross_entropy_memory.py --tokens 1024    # a quick run
    python benchmarks/cross_entropy_memory.py --sweep-chunk-mib 1 2 4 16 64

GPT-2's padded vocabulary (50304 ids), bf16 logits `[N, 50304]`, TP=1 (no process group),
label smoothing 0 unless `--label-smoothing`. The baseline, `_CrossEntropyBeforeIssue18`
below, is the implementation this project shipped until issue 18 (commit 80e867f), copied
as it was: it converts all the logits to fp32 and saves the fp32 softmax for backward. Ours
is `megatron.core.tensor_parallel.vocab_parallel_cross_entropy`. For each it measures:

(a) bytes saved for backward: every tensor the loss hands to autograd, recorded with
    `torch.autograd.graph.saved_tensors_hooks`, counted once per storage. Ours saves the
    logits themselves (no copy); in a model they would otherwise be freed after the
    forward, as the output layer's matmul does not keep its output, so they count.
(b) peak memory of one forward + backward, above the memory held before it, in a fresh
    subprocess per variant: after the logits and targets are allocated (and a small
    warm-up call has initialised torch's thread pools), the process's RSS high-water mark
    is reset by writing "5" to /proc/self/clear_refs; the peak is then VmHWM - VmRSS from
    /proc/self/status (the figure `getrusage(RUSAGE_SELF).ru_maxrss` also reports, once
    reset). On CPU this is reliable because glibc serves every allocation over 32 MB with
    mmap and unmaps it on free, so RSS follows the tensors alive (smaller blocks freed into
    the heap may stay resident, which can only overstate a peak); it includes the gradient
    of the logits (bf16, kept as `.grad`) for both. torch.profiler's memory view was not
    used: on CPU it records allocations per op, and a peak would mean replaying them.
(c) time of one forward + backward: median of `--repeats` rounds, the order alternating.

It also checks that both give the same loss and gradient (max |difference| printed).
`--sweep-chunk-mib` then times ours with other CPU chunk budgets (`CPU_CHUNK_BYTES`), the
measurement behind its default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import cpu_model  # noqa: E402  (benchmarks/machine.py)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import cross_entropy, vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    all_reduce_max_over_tensor_parallel,
    all_reduce_sum_over_tensor_parallel,
)

VARIANTS = ("old", "new")


class _CrossEntropyBeforeIssue18(torch.autograd.Function):
    """BASELINE: the cross entropy before issue 18 (commit 80e867f), kept only to measure."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing):
        logits = vocab_parallel_logits.float()
        logits_max = all_reduce_max_over_tensor_parallel(logits.max(dim=-1)[0])
        logits = logits - logits_max.unsqueeze(-1)

        partition_vocab = logits.size(-1)
        vocab_start = parallel_state.get_tensor_model_parallel_rank() * partition_vocab
        outside = (target < vocab_start) | (target >= vocab_start + partition_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = all_reduce_sum_over_tensor_parallel(predicted.masked_fill(outside, 0.0))

        exp_logits = logits.exp()
        sum_exp = all_reduce_sum_over_tensor_parallel(exp_logits.sum(dim=-1))
        loss = sum_exp.log() - predicted
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))

        vocab_size = partition_vocab * parallel_state.get_tensor_model_parallel_world_size()
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            log_probs = logits - sum_exp.log().unsqueeze(-1)
            mean_log_probs = all_reduce_sum_over_tensor_parallel(log_probs.sum(dim=-1)) / vocab_size
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax
        on_target = (~outside).float()
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
            grad.scatter_add_(
                -1, local_target.unsqueeze(-1), -(1.0 - smoothing) * on_target.unsqueeze(-1)
            )
            grad.sub_(smoothing / ctx.vocab_size)
        else:
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_target.unsqueeze(-1))
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None


def loss_of(variant: str, logits: torch.Tensor, target: torch.Tensor, smoothing: float):
    """Per-token fp32 loss `[N]` of `variant` ("old": the baseline, "new": ours)."""
    if variant == "old":
        return _CrossEntropyBeforeIssue18.apply(logits, target, smoothing)
    return vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)


def make_inputs(tokens: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits `[N, vocab]` (~N(0, 2), no fp32 temporary) and target ids `[N]`."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, vocab, dtype=torch.bfloat16)
    logits.normal_(0.0, 2.0, generator=generator)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    return logits.requires_grad_(), target


def forward_backward(variant: str, logits: torch.Tensor, target: torch.Tensor, smoothing: float):
    """One forward + backward with a mean over tokens; returns the detached loss `[N]`."""
    logits.grad = None
    loss = loss_of(variant, logits, target, smoothing)
    loss.mean().backward()
    return loss.detach()


def saved_bytes(variant: str, logits: torch.Tensor, target: torch.Tensor, smoothing: float):
    """Bytes the loss saves for backward (each storage once), and how many of them are fp32."""
    storages: dict[int, tuple[int, torch.dtype]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(), tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(variant, logits, target, smoothing)
    del loss
    total = sum(nbytes for nbytes, _ in storages.values())
    fp32 = sum(nbytes for nbytes, dtype in storages.values() if dtype == torch.float32)
    return total, fp32


def _status_kib() -> dict[str, int]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if line.startswith("Vm"))
    return {key: int(value.split()[0]) for key, value in fields.items()}


def measure_peak(variant: str, tokens: int, vocab: int, smoothing: float) -> dict:
    """In this (fresh) process: peak RSS above the held memory during one forward + backward."""
    small_logits, small_target = make_inputs(8, vocab, seed=1)
    forward_backward(variant, small_logits, small_target, smoothing)  # thread pools, caches
    logits, target = make_inputs(tokens, vocab)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM (and ru_maxrss) to the current RSS
    before = _status_kib()
    forward_backward(variant, logits, target, smoothing)
    after = _status_kib()
    return {"peak_bytes": (after["VmHWM"] - before["VmRSS"]) * 1024}


def peak_in_subprocess(variant: str, args: argparse.Namespace) -> int:
    """Run `measure_peak` in a new interpreter so neither variant sees the other's pages."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--measure-peak",
        variant,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--label-smoothing",
        str(args.label_smoothing),
        "--threads",
        str(args.threads),
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])["peak_bytes"]


def time_rounds(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per forward + backward of each variant, `args.repeats` rounds, order alternating."""
    logits, target = make_inputs(args.tokens, args.vocab)
    forward_backward("new", logits, target, args.label_smoothing)  # warm-up
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.repeats):
        order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            start = time.perf_counter()
            forward_backward(variant, logits, target, args.label_smoothing)
            times[variant].append(time.perf_counter() - start)
    return times


def sweep_chunk_budgets(args: argparse.Namespace) -> dict[int, float]:
    """Median seconds of our forward + backward for each CPU chunk budget in MiB."""
    logits, target = make_inputs(args.tokens, args.vocab)
    default = cross_entropy.CPU_CHUNK_BYTES
    times: dict[int, list[float]] = {mib: [] for mib in args.sweep_chunk_mib}
    try:
        for _ in range(args.repeats):
            for mib in args.sweep_chunk_mib:
                cross_entropy.CPU_CHUNK_BYTES = mib * 2**20
                start = time.perf_counter()
                forward_backward("new", logits, target, args.label_smoothing)
                times[mib].append(time.perf_counter() - start)
    finally:
        cross_entropy.CPU_CHUNK_BYTES = default
    return {mib: statistics.median(seconds) for mib, seconds in times.items()}


def check_agreement(args: argparse.Namespace) -> tuple[float, float]:
    """Max |loss difference| and max |gradient difference| between the two variants."""
    logits, target = make_inputs(args.tokens, args.vocab)
    old_loss = forward_backward("old", logits, target, args.label_smoothing)
    old_grad = logits.grad
    new_loss = forward_backward("new", logits, target, args.label_smoothing)
    loss_diff = float((old_loss - new_loss).abs().max())
    grad_diff = float((old_grad.float() - logits.grad.float()).abs().max())
    return loss_diff, grad_diff


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 1024, help="N, tokens per micro-batch")
    parser.add_argument("--vocab", type=int, default=50304, help="padded vocabulary size")
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sweep-chunk-mib", type=int, nargs="*", default=[], metavar="MIB")
    parser.add_argument("--measure-peak", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure_peak:
        result = measure_peak(args.measure_peak, args.tokens, args.vocab, args.label_smoothing)
        print(json.dumps(result))
        return

    print("command: python benchmarks/cross_entropy_memory.py " + " ".join(sys.argv[1:]))
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, threads {args.threads}"
        f", cpu {cpu_model()} ({os.cpu_count()} cores), load average {os.getloadavg()}"
    )
    logits_bytes = args.tokens * args.vocab * 2
    print(
        f"logits [{args.tokens}, {args.vocab}] bf16 ({_mb(logits_bytes)}), TP=1, "
        f"label smoothing {args.label_smoothing}; old = before issue 18 (baseline), new = ours"
    )
    loss_diff, grad_diff = check_agreement(args)
    print(f"agreement: max |loss old - new| {loss_diff:.2e}, max |grad old - new| {grad_diff:.2e}")

    logits, target = make_inputs(args.tokens, args.vocab)
    saved = {v: saved_bytes(v, logits, target, args.label_smoothing) for v in VARIANTS}
    del logits, target
    peaks = {variant: peak_in_subprocess(variant, args) for variant in VARIANTS}
    times = time_rounds(args)
    median = {variant: statistics.median(times[variant]) for variant in VARIANTS}
    for variant in VARIANTS:
        rounds = ", ".join(f"{t:.2f}" for t in times[variant])
        print(f"{variant} forward+backward seconds per round: {rounds}")

    print("| what | old (baseline) | new (ours) | new / old |")
    print("|---|---|---|---|")
    rows = [
        ("saved for backward, all", saved["old"][0], saved["new"][0], _mb),
        ("saved for backward, fp32", saved["old"][1], saved["new"][1], _mb),
        ("peak memory of forward + backward", peaks["old"], peaks["new"], _mb),
        ("forward + backward, median", median["old"], median["new"], lambda s: f"{s:.2f} s"),
    ]
    for name, old, new, show in rows:
        print(f"| {name} | {show(old)} | {show(new)} | {new / old:.3f} |")
    if args.sweep_chunk_mib:
        default_mib = cross_entropy.CPU_CHUNK_BYTES / 2**20
        print(f"ours by CPU chunk budget (default {default_mib:g} MiB), median forward+backward:")
        print("| CPU chunk budget | tokens per chunk | seconds | vs old |")
        print("|---|---|---|---|")
        for mib, seconds in sweep_chunk_budgets(args).items():
            tokens = max(1, mib * 2**20 // (4 * args.vocab))
            print(f"| {mib} MiB | {tokens} | {seconds:.2f} | {seconds / median['old']:.3f} |")


if __name__ == "__main__":
    main()
