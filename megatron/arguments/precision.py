"""What --fp16 / --bf16 mean on each path, whether this machine can run them, and the line
that says so at start-up.

- Plain path (no `--deepspeed`): fp32 parameters are the master weights (AdamW and its state
  in fp32); forward and backward run under `torch.autocast` in the half type; gradients
  arrive and accumulate in fp32; fp16 scales the loss (Megatron's dynamic or static scaler).
- DeepSpeed: half-precision parameters; DeepSpeed's optimizer wrapper keeps fp32 master
  weights; bf16 gradients accumulate in fp32 where DeepSpeed can (`ds_config`), fp16 ones in
  fp16 under DeepSpeed's loss scaler.
"""

from __future__ import annotations

import argparse
import math

from megatron.arguments.ds_config import gradient_accumulation_dtype
from megatron.arguments.errors import ArgumentError


def check_flash_attention_precision(args: argparse.Namespace) -> None:
    """--use-flash-attn runs fp16/bf16 kernels only: in fp32 it is an error naming the fix."""
    flag = _flash_flag(args)
    if flag and not (args.fp16 or args.bf16):
        raise ArgumentError(
            f"{flag} needs --bf16 or --fp16 (flash attention kernels compute in half "
            "precision); drop it for fp32, where SDPA picks the fastest fp32 kernel itself"
        )


def check_precision_on_this_machine(args: argparse.Namespace) -> None:
    """Refuse, in one line, a precision or kernel this machine's devices cannot run."""
    flag = _flash_flag(args)
    if flag:
        from megatron.model.attention import flash_attention_status

        available, detail = flash_attention_status()
        if not available:
            raise ArgumentError(
                f"{flag}: {detail}; drop the flag (the default SDPA attention picks flash "
                "kernels by itself where they exist)"
            )
    if getattr(args, "fp8", None) is not None:
        _check_fp8_here(args)
    if not args.deepspeed or not (args.fp16 or args.bf16):
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    half, supported = (
        ("fp16", accelerator.is_fp16_supported())
        if args.fp16
        else ("bf16", accelerator.is_bf16_supported())
    )
    if not supported:
        other = "--bf16" if args.fp16 else "fp32"
        raise ArgumentError(
            f"--{half} with --deepspeed: DeepSpeed's {accelerator.device_name()} accelerator "
            f"does not support {half} here; use {other} with DeepSpeed, or drop --deepspeed "
            f"(the plain path runs --{half} under torch.autocast on any device)"
        )


def _check_fp8_here(args: argparse.Namespace) -> None:
    """FP8 needs torchao and, on GPUs, FP8 tensor cores: stop in one line where they are not."""
    import torch

    from megatron.model.fp8 import fp8_support

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    reason = fp8_support(device)
    if reason is not None:
        raise ArgumentError(f"--fp8-format {args.fp8}: {reason}")


def _flash_flag(args: argparse.Namespace) -> str | None:
    for dest in ("use_flash_attn_v2", "use_flash_attn"):
        if getattr(args, dest, False):
            return "--" + dest.replace("_", "-")
    return None


def precision_summary(args: argparse.Namespace, tf32: bool = False) -> str:
    """The start-up line: parameters, master weights, compute, gradient accumulation, scaling.

    `tf32`: fp32 matmuls run in TF32 on this GPU (set by `initialize_megatron`).
    """
    half = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    fp32_compute = "fp32 (TF32 matmuls)" if tf32 else "fp32"
    if half is None:
        parts = ["parameters fp32", f"compute {fp32_compute}", "gradient accumulation fp32"]
    elif args.deepspeed:
        parts = [
            f"parameters {half}",
            "master weights fp32 (DeepSpeed's optimizer)",
            f"compute {half}",
            f"gradient accumulation {gradient_accumulation_dtype(args)}",
        ]
    else:
        parts = [
            "parameters fp32 = master weights (AdamW state fp32)",
            f"compute {half} (torch.autocast)",
            "gradient accumulation fp32",
        ]
    parts.append(f"loss scaling {_loss_scaling(args)}")
    fp8 = getattr(args, "fp8", None)
    if fp8 is not None:
        wgrad = "" if getattr(args, "fp8_wgrad", True) else ", weight gradients in high precision"
        parts.append(
            f"FP8 matmuls {fp8} {args.fp8_recipe} (torchao) in the transformer layers' linear "
            f"layers{wgrad}"
        )
    return " > precision: " + ", ".join(parts)


def precision_warnings(args: argparse.Namespace) -> list[str]:
    """Start-up warnings about precision the run will lose (each one line)."""
    accumulation = getattr(args, "gradient_accumulation_steps", 1) or 1
    if not (args.deepspeed and args.bf16 and args.zero_stage == 0 and accumulation > 1):
        return []
    return [
        f" > warning: DeepSpeed ZeRO-0 sums the {accumulation} micro-batches' bf16 gradients in "
        "bf16 (8 significant bits; DeepSpeed 0.19 has no fp32 accumulation at stage 0); "
        "--zero-stage 1 accumulates them in fp32 at no cost in memory on one data-parallel rank"
    ]


def _loss_scaling(args: argparse.Namespace) -> str:
    if not args.fp16:
        return "none"
    if args.loss_scale:
        return f"static {args.loss_scale:g}"
    return (
        f"dynamic from {_scale(args.initial_loss_scale)} (window {args.loss_scale_window:g}, "
        f"hysteresis {args.hysteresis}, min {_scale(args.min_loss_scale)})"
    )


def _scale(value: float) -> str:
    """2^32 rather than 4.29497e+09: loss scales are powers of two, and read as such."""
    power = math.log2(value) if value > 0 else math.nan
    return f"2^{int(power)}" if power.is_integer() and power > 10 else f"{value:g}"
