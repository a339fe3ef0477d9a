"""`python -m megatron.doctor`: what works in this environment, checked before training.

Each check is OK, WARN (an optional or GPU-only feature is missing; training still works) or
FAIL (something training needs is broken), with the fix when not OK; `--json` prints them as
a JSON list (for bug reports and CI). Exit status 1 when a check failed, else 0. Importing
this module is cheap: heavy imports happen inside the checks, which never raise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from megatron import __version__

OK, WARN, FAIL = "OK", "WARN", "FAIL"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The sha256 sums that dataset/download_vocab.sh verifies.
VOCAB_SHA256 = {
    "gpt2-vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "gpt2-merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
MIN_PYTHON = (3, 9)
GET_TORCH = "https://pytorch.org/get-started/locally/"


@dataclasses.dataclass
class CheckResult:
    """The outcome of one check: status is OK, WARN or FAIL; fix says what to do if not OK."""

    name: str
    status: str
    detail: str
    fix: str = ""


CHECKS: list[Callable[[], CheckResult]] = []  # every check, in report order


class _Skipped(Exception):
    """Raised by a check whose prerequisite (reported by another check) is missing."""


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _check(name: str) -> Callable[[Callable[[], CheckResult]], Callable[[], CheckResult]]:
    """Name a check, turn any exception it raises into a FAIL, and append it to CHECKS."""

    def decorate(function: Callable[[], CheckResult]) -> Callable[[], CheckResult]:
        @functools.wraps(function)
        def guarded() -> CheckResult:
            try:
                return function()
            except _Skipped as skipped:
                return CheckResult(name, WARN, f"skipped: {skipped}")
            except Exception as error:  # a check must never raise
                return CheckResult(name, FAIL, f"{type(error).__name__}: {_one_line(error)}")

        CHECKS.append(guarded)
        return guarded

    return decorate


def _import_torch() -> Any:
    """Import torch, or skip the calling check (the torch check reports the failure)."""
    try:
        import torch
    except ImportError as error:
        raise _Skipped(f"torch is not importable ({_one_line(error)})") from error
    return torch


def _optional(name: str, modules: Sequence[str], used_for: str, fix: str) -> CheckResult:
    """OK with versions when every module imports; WARN with the fix otherwise."""
    versions = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
            versions.append(f"{module_name} {getattr(module, '__version__', '(installed)')}")
        except Exception as error:  # a broken optional package is still only a warning
            return CheckResult(name, WARN, f"{_one_line(error)} (needed only {used_for})", fix)
    return CheckResult(name, OK, ", ".join(versions))


@_check("python")
def check_python() -> CheckResult:
    """The interpreter is Python 3.9 or newer."""
    detail = f"{platform.python_version()} ({sys.executable})"
    if sys.version_info[:2] >= MIN_PYTHON:
        return CheckResult("python", OK, detail)
    return CheckResult("python", FAIL, detail + ": needs Python >= 3.9", "use Python >= 3.9")


@_check("torch")
def check_torch() -> CheckResult:
    """torch imports; reports its version."""
    try:
        import torch
    except ImportError as error:
        fix = f"pip install torch==2.13.0 (CPU; as scripts/setup_env.sh), CUDA builds: {GET_TORCH}"
        return CheckResult("torch", FAIL, _one_line(error), fix)
    return CheckResult("torch", OK, torch.__version__)


@_check("cuda")
def check_cuda() -> CheckResult:
    """CUDA GPUs torch can use (their names and bf16 support); none is a WARN, not a FAIL."""
    torch = _import_torch()
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            build, fix = "CPU-only torch build", f"for GPUs, a CUDA build of torch: {GET_TORCH}"
        else:
            build = f"torch built for CUDA {torch.version.cuda}, but no GPU is visible"
            fix = "check nvidia-smi and CUDA_VISIBLE_DEVICES"
        detail = f"no CUDA GPU: training runs on CPU over gloo ({build})"
        return CheckResult("cuda", WARN, detail, fix)
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    gpus = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    detail = f"{gpus}; CUDA {torch.version.cuda}"
    if not torch.cuda.is_bf16_supported():
        return CheckResult("cuda", WARN, detail + "; no bf16", "use --fp16 instead of --bf16")
    return CheckResult("cuda", OK, detail + "; bf16 supported")


@_check("nccl")
def check_nccl() -> CheckResult:
    """The collective backends: NCCL on GPUs, gloo on CPUs."""
    torch = _import_torch()
    import torch.distributed as dist

    fix = f"install a torch build with distributed support: {GET_TORCH}"
    if not dist.is_available():
        return CheckResult("nccl", FAIL, "this torch build has no torch.distributed", fix)
    gloo = "gloo available" if dist.is_gloo_available() else "gloo missing"
    if not torch.cuda.is_available():
        if not dist.is_gloo_available():
            return CheckResult("nccl", FAIL, "no GPU and no gloo: no backend for CPU training", fix)
        return CheckResult("nccl", WARN, f"no GPU: NCCL unused, training uses gloo ({gloo})")
    if not dist.is_nccl_available():
        return CheckResult("nccl", FAIL, f"this torch build has no NCCL ({gloo})", fix)
    version = torch.cuda.nccl.version()
    version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return CheckResult("nccl", OK, f"NCCL {version}; {gloo}")


@_check("deepspeed")
def check_deepspeed() -> CheckResult:
    """DeepSpeed imports; reports its version, accelerator and communication backend."""
    try:
        import deepspeed
    except ImportError as error:
        return CheckResult("deepspeed", FAIL, _one_line(error), "pip install deepspeed")
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    detail = f"accelerator {accel._name}, backend {accel.communication_backend_name()}"
    return CheckResult("deepspeed", OK, f"{deepspeed.__version__}; {detail}")


def _extension(name: str, module_name: str) -> CheckResult:
    """A compiled extension of this package imports; FAIL naming how to build it if not."""
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or a broken build failing as it loads
        fix = "pip install -e . (from the repository root)"
        has_headers = os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
        if not (shutil.which("c++") or shutil.which("g++")) or not has_headers:
            fix += "; no C++ compiler or Python headers: apt-get install g++ python3-dev first"
        return CheckResult(name, FAIL, _one_line(error), fix)
    path = os.path.abspath(module.__file__ or module_name)
    if path.startswith(REPO_ROOT + os.sep):
        path = os.path.relpath(path, REPO_ROOT)
    return CheckResult(name, OK, path)


@_check("helpers")
def check_helpers() -> CheckResult:
    """The dataset index builders, `megatron.data.helpers` (pybind11, from helpers.cpp)."""
    return _extension("helpers", "megatron.data.helpers")


@_check("bpe_engine")
def check_bpe_engine() -> CheckResult:
    """The C++ GPT-2 BPE encoder, `megatron.tokenizer.bpe_engine` (from bpe_engine.cpp)."""
    return _extension("bpe_engine", "megatron.tokenizer.bpe_engine")


def _flash_kernel_runs(torch: Any) -> str:
    """'' when torch's SDPA flash kernel runs a tiny causal attention, else why not."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return "torch.nn.attention.sdpa_kernel needs torch >= 2.3"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "torch.backends.cuda.flash_sdp_enabled() is False"
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        query = torch.randn(1, 2, 16, 64, device="cuda", dtype=dtype)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(query, query, query, is_causal=True)
        torch.cuda.synchronize()
    except Exception as error:  # any failure means the kernel is unusable here
        return _one_line(error)
    return ""


@_check("flash_attn")
def check_flash_attention() -> CheckResult:
    """Whether `--use-flash-attn` can run: torch's SDPA flash kernel or the flash_attn package."""
    torch = _import_torch()
    from megatron.model.attention import flash_attn_2_version

    version = flash_attn_2_version()
    package = (
        f"flash_attn {version}"
        if version
        else "flash_attn 2 not installed (optional; FlashAttention 4's flash_attn.cute is not it)"
    )
    if not torch.cuda.is_available():
        message = "no GPU: attention uses SDPA's CPU kernels; --use-flash-attn needs a GPU"
        return CheckResult("flash_attn", WARN, message)
    from megatron.model.attention import flash_attention_status

    available, how = flash_attention_status()
    failure = _flash_kernel_runs(torch)
    kernel = "a tiny test ran" if not failure else f"torch SDPA flash kernel failed: {failure}"
    if not available or (failure and how != "flash_attn package"):
        detail = f"--use-flash-attn cannot run ({how if not available else failure}); {package}"
        fix = "train without --use-flash-attn (SDPA picks another kernel)"
        return CheckResult("flash_attn", WARN, detail, fix)
    return CheckResult("flash_attn", OK, f"--use-flash-attn uses the {how} ({kernel}); {package}")


@_check("tiktoken")
def check_tiktoken() -> CheckResult:
    """tiktoken, used by --tokenizer-type TikTokenizer and benchmarks/bpe_engine_speed.py (our
    GPT-2 tokenizer is native C++)."""
    fix = "pip install tiktoken (or pip install -e '.[tiktoken]')"
    used_for = "by --tokenizer-type TikTokenizer and benchmarks/bpe_engine_speed.py"
    return _optional("tiktoken", ["tiktoken"], used_for, fix)


@_check("gpt2 vocab")
def check_vocab() -> CheckResult:
    """The vendored GPT-2 vocabulary and merges files in dataset/, with their sha256 sums."""
    dataset = os.path.join(REPO_ROOT, "dataset")
    if not os.path.isfile(os.path.join(REPO_ROOT, "pyproject.toml")):
        detail = f"not a source checkout ({REPO_ROOT}): pass --vocab-file and --merge-file"
        return CheckResult("gpt2 vocab", WARN, detail)
    fix = "bash dataset/download_vocab.sh"
    for file_name, expected in VOCAB_SHA256.items():
        path = os.path.join(dataset, file_name)
        if not os.path.isfile(path):
            return CheckResult("gpt2 vocab", FAIL, f"dataset/{file_name} is missing", fix)
        with open(path, "rb") as file:
            if hashlib.sha256(file.read()).hexdigest() != expected:
                detail = f"dataset/{file_name} does not match its sha256 (corrupt?)"
                return CheckResult("gpt2 vocab", FAIL, detail, fix)
    return CheckResult("gpt2 vocab", OK, "dataset/" + ", dataset/".join(VOCAB_SHA256))


@_check("hf export")
def check_hf() -> CheckResult:
    """transformers and safetensors, for tools/checkpoint/convert_{to,from}_hf.py."""
    modules, fix = ["transformers", "safetensors"], "pip install -e .[hf]"
    return _optional("hf export", modules, "by the Hugging Face converters", fix)


@_check("wandb")
def check_wandb() -> CheckResult:
    """wandb, for --wandb-project."""
    return _optional("wandb", ["wandb"], "for --wandb-project", "pip install -e .[wandb]")


@_check("tensorboard")
def check_tensorboard() -> CheckResult:
    """tensorboard, for --tensorboard-dir."""
    fix = "pip install tensorboard"
    return _optional("tensorboard", ["tensorboard"], "for --tensorboard-dir", fix)


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what a check prints (DeepSpeed logs to stdout) to stderr, keeping stdout clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def format_result(result: CheckResult, name_width: int = 14) -> str:
    """One aligned report line: status, name, detail and the fix if there is one."""
    line = f"  {result.status:<5} {result.name:<{name_width}} {result.detail}"
    return line + (f"  -> fix: {result.fix}" if result.fix else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report (or JSON with --json); return 1 if any check failed, else 0."""
    parser = argparse.ArgumentParser(prog="python -m megatron.doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if not args.json:
        print(f"megatron doctor {__version__}: checking the environment in {REPO_ROOT}")
    results = []
    for check in CHECKS:
        with _stdout_to_stderr():
            results.append(check())
        if not args.json:
            print(format_result(results[-1]), flush=True)
    failed = sum(result.status == FAIL for result in results)
    warned = sum(result.status == WARN for result in results)
    if args.json:
        print(json.dumps([dataclasses.asdict(result) for result in results], indent=2))
    elif failed:
        print(f"{failed} required check{'s' * (failed != 1)} failed; see the fixes above")
    else:
        print(f"all required checks passed ({warned} warning{'s' * (warned != 1)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
