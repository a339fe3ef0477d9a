"""Benchmark: one fp32 training step of our GPTModel (TP=1) against a nanoGPT-style GPT-2.

    python benchmarks/train_step_benchmark.py                  # the defaults below
    python benchmarks/train_step_benchmark.py --iters 20 --profile
    python benchmarks/train_step_benchmark.py --num-layers 1 --seq-length 128 --iters 3

A training step is zero_grad + forward + loss.mean() + backward + torch.optim.AdamW step.
The baseline is a plain single-file PyTorch GPT-2 written below in nanoGPT's style (one class
per block, fused c_attn, SDPA causal attention, GELU tanh, lm_head tied to wte,
F.cross_entropy) with exactly the shape of ours: pre-LN, learned positions, biases on every
linear and layer norm, layer norm eps 1e-5. Defaults: GPT-2 small width but 4 layers,
--hidden-size 768 --num-attention-heads 12 --seq-length 512 --micro-batch-size 4
--vocab-size 50304 (2,048 tokens and 861 GFLOP a step), dropout 0.0 for both models
(--dropout sets the hidden and attention dropout of both to the same value), 1 warm-up and
6 timed steps per model: about 3 minutes on an idle 2-core machine, more when it is shared.

Both models get the same optimizer: AdamW (lr 6e-4, betas 0.9/0.95, eps 1e-8), weight decay
0.1 on the 2-D weights (embeddings and linear weights) only, `fused=True` when this torch
supports it on the CPU, else `foreach=True`.

Before timing, the baseline receives a copy of our weights (our per-head interleaved QKV rows
[heads, 3, head_dim] reordered into nanoGPT's [3, heads, head_dim]) and the benchmark checks
that the parameter counts agree and that both losses agree to 1e-4 on the same batch, before
and after one AdamW step of each (with dropout 0). Then `--warmup` steps of each, then
`--iters` timed rounds, each running both models one step, the order flipping every round
(ours, baseline; baseline, ours; ...) so that machine noise hits both alike. It prints the
median and min step time, tokens/s and achieved GFLOP/s (Megatron's model FLOPs, from
`megatron.model.flops_per_token`) of each, the process CPU time per step (less sensitive to
other processes than wall time), the ratio ours / baseline and a verdict against the target
(ours at most 5% slower, by median wall time). `--profile` then prints torch.profiler's
busiest ops for one step of each. The header (command, torch, threads, CPU) makes the output
pasteable into benchmarks/RESULTS.md.

`--torch-compile` adds two more models to the same interleaved rounds: ours with
`--torch-compile` (each layer compiled; the embedding, logits and cross entropy stay eager) and
the baseline under `torch.compile(model)` as nanoGPT compiles it (the whole model, loss
included). Both start from the same weights and pass the same loss checks. It then prints
compiled/eager for ours and ours-compiled/baseline-compiled, with two verdicts: compiled no
slower than eager, and within 5% of the compiled baseline. Compilation happens in the warm-up
steps (use --warmup 2 or more: the first step compiles the forward, the backward and, for the
optimizer, nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from machine import cpu_model  # noqa: E402  (benchmarks/machine.py)

from megatron.config import ModelConfig  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.model import GPTModel, flops_per_token, num_parameters  # noqa: E402

TARGET_SLOWDOWN = 0.05
LOSS_TOLERANCE = 1e-4


# ---------------------------------------------------------------------------------------------
# The baseline: a plain nanoGPT-style GPT-2.
# ---------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Fused q/k/v projection, SDPA causal attention, output projection, residual dropout."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = heads
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        b, s, h = x.size()
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """h -> 4h -> GELU (tanh) -> h, then dropout."""

    def __init__(self, hidden: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, ffn)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(ffn, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, ffn, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """wte + wpe -> dropout -> blocks -> ln_f -> lm_head (tied to wte) -> cross entropy."""

    def __init__(self, config: ModelConfig, dropout: float) -> None:
        super().__init__()
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.wpe = nn.Embedding(config.max_position_embeddings, h)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(
            Block(
                h,
                config.num_attention_heads,
                config.ffn_hidden_size,
                dropout,
                config.layernorm_epsilon,
            )
            for _ in range(config.num_layers)
        )
        self.ln_f = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy loss of [b, s] ids against [b, s] targets."""
        _, s = idx.size()
        pos = torch.arange(s, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------------------------------------
# Weight copying, optimizer, one step.
# ---------------------------------------------------------------------------------------------


def copy_ours_into_baseline(ours: GPTModel, baseline: GPT, config: ModelConfig) -> None:
    """Copy every parameter of our model into the baseline, reordering the QKV rows.

    Our `query_key_value` rows are per-head interleaved, [heads, 3 (q, k, v), head_dim];
    nanoGPT's `c_attn` rows are [3, heads, head_dim].
    """
    heads, head_dim = config.num_attention_heads, config.kv_channels

    def qkv(tensor: torch.Tensor) -> torch.Tensor:
        rest = tensor.shape[1:]
        return tensor.view(heads, 3, head_dim, *rest).transpose(0, 1).reshape(tensor.shape)

    src = dict(ours.named_parameters())
    lm = "language_model."
    mapping = {
        "wte.weight": src[lm + "embedding.word_embeddings.weight"],
        "wpe.weight": src[lm + "embedding.position_embeddings.weight"],
        "ln_f.weight": src[lm + "encoder.final_layernorm.weight"],
        "ln_f.bias": src[lm + "encoder.final_layernorm.bias"],
    }
    names = {
        "ln_1": "input_layernorm",
        "attn.c_attn": "self_attention.query_key_value",
        "attn.c_proj": "self_attention.dense",
        "ln_2": "post_attention_layernorm",
        "mlp.c_fc": "mlp.dense_h_to_4h",
        "mlp.c_proj": "mlp.dense_4h_to_h",
    }
    for i in range(config.num_layers):
        for theirs, our_name in names.items():
            for kind in ("weight", "bias"):
                tensor = src[f"{lm}encoder.layers.{i}.{our_name}.{kind}"]
                mapping[f"h.{i}.{theirs}.{kind}"] = (
                    qkv(tensor) if theirs == "attn.c_attn" else tensor
                )
    dst = dict(baseline.named_parameters())  # the tied lm_head.weight is listed once, as wte
    if set(dst) != set(mapping):
        raise RuntimeError(f"parameter names differ: {sorted(set(dst) ^ set(mapping))}")
    with torch.no_grad():
        for name, param in dst.items():
            if param.shape != mapping[name].shape:
                raise RuntimeError(f"{name}: {tuple(param.shape)} vs {tuple(mapping[name].shape)}")
            param.copy_(mapping[name])


def adamw_implementation() -> dict:
    """`{"fused": True}` when fused AdamW runs on CPU tensors here, else `{"foreach": True}`."""
    try:
        param = nn.Parameter(torch.zeros(4))
        param.grad = torch.ones(4)
        torch.optim.AdamW([param], fused=True).step()
        return {"fused": True}
    except (RuntimeError, TypeError, ValueError):
        return {"foreach": True}


def make_optimizer(model: nn.Module, implementation: dict) -> torch.optim.AdamW:
    """AdamW with weight decay 0.1 on 2-D parameters (embeddings, linear weights) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, **implementation)


def our_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss of our GPTModel (it returns the per-token loss [b, s])."""
    return model(tokens, labels=labels).mean()


def baseline_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss of the nanoGPT-style baseline."""
    return model(tokens, labels)


def train_step(model, optimizer, loss_fn, tokens, labels) -> float:
    """One forward + backward + AdamW step; returns the loss before the update."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, tokens, labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def timed_step(model, optimizer, loss_fn, tokens, labels) -> tuple[float, float]:
    """Wall-clock seconds and process CPU seconds (all threads) of one `train_step`."""
    start, cpu_start = time.perf_counter(), time.process_time()
    train_step(model, optimizer, loss_fn, tokens, labels)
    return time.perf_counter() - start, time.process_time() - cpu_start


def profile_step(name, model, optimizer, loss_fn, tokens, labels, rows: int = 20) -> None:
    """Run one step under torch.profiler and print the ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, optimizer, loss_fn, tokens, labels)
    print(f"--- torch.profiler, one step of {name} (self CPU time) ---")
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50
    )
    print(table)


# ---------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------


def print_header() -> None:
    """The command line and the machine, for pasting into RESULTS.md."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()} (interop {torch.get_num_interop_threads()})"
    )
    print(
        f"cpu: {cpu_model()}, {os.cpu_count()} logical cores visible, "
        f"torch CPU capability {capability}, {platform.machine()}"
    )


def summarize(
    name: str, times: list[float], cpu_times: list[float], tokens: int, flops: float
) -> dict:
    """Print one model's timing line; return its median and min wall time."""
    median, best = statistics.median(times), min(times)
    print(
        f"{name:<9} median {median * 1e3:8.1f} ms  min {best * 1e3:8.1f} ms  "
        f"{tokens / median:7,.0f} tokens/s  {flops / median / 1e9:6.1f} GFLOP/s  "
        f"(CPU time median {statistics.median(cpu_times):.2f} s/step, n={len(times)})"
    )
    return {"median": median, "min": best, "cpu": statistics.median(cpu_times)}


def check_agreement(runs: dict, tokens, labels, dropout: float) -> None:
    """Same weights, same batch: every model gives the same loss, also after one AdamW step
    each (with dropout 0; this checks the backward and the optimizer's parameter groups)."""
    check_mode = "train mode" if dropout == 0.0 else "eval mode (dropout off)"
    for model, _, _ in runs.values():
        model.train(dropout == 0.0)
    with torch.no_grad():
        before = {name: fn(m, tokens, labels).item() for name, (m, _, fn) in runs.items()}
    for model, _, _ in runs.values():
        model.train()
    after = None
    if dropout == 0.0:
        for model, optimizer, loss_fn in runs.values():
            train_step(model, optimizer, loss_fn, tokens, labels)
        with torch.no_grad():
            after = {name: fn(m, tokens, labels).item() for name, (m, _, fn) in runs.items()}
    worst = 0.0
    for label, losses in (("same weights and batch, " + check_mode, before), ("after", after)):
        if losses is None:
            print("loss check after one AdamW step: skipped (dropout > 0 draws different masks)")
            continue
        diff = max(losses.values()) - min(losses.values())
        worst = max(worst, diff)
        shown = ", ".join(f"{name} {loss:.6f}" for name, loss in losses.items())
        if label == "after":
            label = "after one AdamW step each"
        print(
            f"loss check ({label}): {shown}, largest |diff| {diff:.2e} "
            f"-> {'OK' if diff <= LOSS_TOLERANCE else 'FAIL'} (tolerance {LOSS_TOLERANCE:g})"
        )
    if not math.isfinite(worst) or worst > LOSS_TOLERANCE:
        raise SystemExit("the models disagree: the comparison is not apples to apples")


def compare(stats: dict, times: dict, name: str, reference: str, slack: float, what: str) -> None:
    """Print `name`'s step time over `reference`'s and the verdict (at most `slack` slower)."""
    ratio = stats[name]["median"] / stats[reference]["median"]
    ratio_min = stats[name]["min"] / stats[reference]["min"]
    paired = statistics.median(a / b for a, b in zip(times[name], times[reference]))
    cpu_ratio = stats[name]["cpu"] / stats[reference]["cpu"]
    print(
        f"ratio {name}/{reference} (step time): median {ratio:.3f}, min {ratio_min:.3f}, "
        f"median of per-round ratios {paired:.3f}; CPU time (median) {cpu_ratio:.3f}"
    )
    percent = abs(ratio - 1.0) * 100
    direction = "slower" if ratio > 1.0 else "faster"
    verdict = "PASS" if ratio <= 1.0 + slack else "FAIL"
    target = f"within {slack:.0%}" if slack else "no slower"
    print(
        f"verdict: {name} is {percent:.1f}% {direction} than {what} (target: {target}) -> {verdict}"
    )


def main() -> None:
    """Parse the flags, check both models agree, time them interleaved, print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4h")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument(
        "--max-position-embeddings", type=int, default=None, help="default --seq-length"
    )
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=50304, help="padded vocabulary")
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="hidden and attention dropout of both models (default 0.0)",
    )
    parser.add_argument("--iters", type=int, default=6, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's choice")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--profile", action="store_true", help="then profile one step of each (torch.profiler)"
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="also time ours with --torch-compile and the baseline under torch.compile",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_header()

    config = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
    )
    b, s = args.micro_batch_size, args.seq_length
    tokens_per_step = b * s
    flops_per_step = flops_per_token(config, s) * tokens_per_step
    print(
        f"shape: layers {config.num_layers}, hidden {config.hidden_size}, heads "
        f"{config.num_attention_heads}, ffn {config.ffn_hidden_size}, seq {s}, micro-batch {b}, "
        f"vocab {config.vocab_size}, dropout {args.dropout}, fp32, activation "
        f"{config.activation}, eps {config.layernorm_epsilon}"
    )

    model_parallel_cuda_manual_seed(args.seed)
    ours = GPTModel(config).train()
    baseline = GPT(config, args.dropout).train()
    copy_ours_into_baseline(ours, baseline, config)
    models = {"ours": (ours, our_loss), "baseline": (baseline, baseline_loss)}
    if args.torch_compile:
        ours_compiled = GPTModel(dataclasses.replace(config, torch_compile=True)).train()
        ours_compiled.load_state_dict(ours.state_dict())
        baseline_compiled = GPT(config, args.dropout).train()
        copy_ours_into_baseline(ours, baseline_compiled, config)
        models["ours-compiled"] = (ours_compiled, our_loss)
        models["base-compiled"] = (torch.compile(baseline_compiled), baseline_loss)

    n_ours = sum(p.numel() for p in ours.parameters())
    n_base = sum(p.numel() for p in baseline.parameters())
    n_formula = num_parameters(config)
    print(
        f"parameters: ours {n_ours:,}, baseline {n_base:,}, megatron.model.num_parameters "
        f"{n_formula:,} -> {'same' if n_ours == n_base == n_formula else 'DIFFERENT'}"
    )
    if not n_ours == n_base == n_formula:
        raise SystemExit("parameter counts differ: the comparison is not apples to apples")

    generator = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, config.vocab_size, (b, s + 1), generator=generator)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    implementation = adamw_implementation()
    print(f"optimizer: torch.optim.AdamW({implementation}), lr 6e-4, wd 0.1 on 2-D weights")
    runs = {
        name: (model, make_optimizer(model, implementation), loss_fn)
        for name, (model, loss_fn) in models.items()
    }
    check_agreement(runs, tokens, labels, args.dropout)

    print(
        f"timing: {args.warmup} warm-up + {args.iters} timed steps per model, "
        f"{tokens_per_step:,} tokens/step, {flops_per_step / 1e9:.1f} GFLOP/step "
        f"(flops_per_token {flops_per_token(config, s) / 1e6:.1f} MFLOP), interleaved rounds"
    )
    for _ in range(args.warmup):
        for model, optimizer, loss_fn in runs.values():
            train_step(model, optimizer, loss_fn, tokens, labels)
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu_times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_index in range(args.iters):
        # Each round starts with the next model, so machine noise hits them all alike.
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            wall, cpu = timed_step(*runs[name], tokens, labels)
            times[name].append(wall)
            cpu_times[name].append(cpu)
        print(
            f"  round {round_index + 1}/{args.iters} ({' then '.join(order)}): "
            + ", ".join(f"{name} {times[name][-1] * 1e3:.1f} ms" for name in runs),
            flush=True,
        )

    stats = {
        name: summarize(name, times[name], cpu_times[name], tokens_per_step, flops_per_step)
        for name in runs
    }
    compare(stats, times, "ours", "baseline", TARGET_SLOWDOWN, "the nanoGPT-style baseline")
    if args.torch_compile:
        compare(stats, times, "ours-compiled", "ours", 0.0, "ours eager")
        compare(
            stats, times, "ours-compiled", "base-compiled", TARGET_SLOWDOWN, "compiled baseline"
        )
    if args.profile:
        for name, run in runs.items():
            profile_step(name, *run, tokens, labels)


if __name__ == "__main__":
    main()
