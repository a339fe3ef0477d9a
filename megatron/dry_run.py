"""`--dry-run`: validate a job's flags as the run would, print its plan, and exit.

    python pretrain_gpt.py FLAGS --dry-run [--dry-run-world-size N] [--dry-run-device H100]
                                           [--dry-run-json plan.json]

No device, data file or process group is touched; under a launcher only global rank 0
prints. With a device named and a rank that does not fit, the changes that make it fit
(re-validated and re-planned as full command lines) follow the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence

from megatron.arguments import parse_args
from megatron.arguments.ds_config import load_deepspeed_config
from megatron.arguments.v1_flags import OLDER_SPELLINGS
from megatron.atomic_files import atomic_outputs
from megatron.planning.devices import Device, find_device
from megatron.planning.inputs import PlanInputs, PlanningError, with_vocabulary
from megatron.planning.plan import Plan, build_plan, format_plan
from megatron.planning.suggestions import (
    Change,
    apply_flags,
    batch_config,
    candidate_changes,
    merge_config,
)

# Suggestions printed at most; fewer changes first, then the faster predicted step.
MAX_SUGGESTIONS = 5
_GIB = 1024**3


class ChangeRefused(Exception):
    """A suggested change whose command line validation (or the planner) refuses."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EveryChangeRefused(Exception):
    """Every candidate change of a plan that does not fit was refused; `refusals` holds each
    change's description and the one-line reason."""

    def __init__(self, refusals: list[tuple[str, str]]) -> None:
        super().__init__(f"all {len(refusals)} candidate changes were refused")
        self.refusals = refusals


def dry_run_requested(argv: Sequence[str] | None) -> bool:
    """Whether the command line asks for `--dry-run`."""
    return "--dry-run" in (sys.argv[1:] if argv is None else argv)


def _device_type(device: Device | None) -> str:
    if device is not None:
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_from_args(args: argparse.Namespace, device: Device | None = None) -> Plan:
    """The plan of validated `args` (on `device`, else this machine's device type)."""
    args = with_vocabulary(args)  # the tokenizer's sizes, as a run learns them
    inputs = PlanInputs.from_args(args, _device_type(device))
    notes = list(getattr(args, "plan_notes", []))
    if device is None and inputs.device_type == "cpu":
        notes.append(
            "planned for this machine's CPU tensors (its kernels and dropout masks); name the "
            "job's GPU with --dry-run-device to plan for it"
        )
    return build_plan(inputs, device, notes=notes)


def _raw_config(args: argparse.Namespace) -> dict | None:
    if not args.deepspeed or args.deepspeed_config is None:
        return None
    return load_deepspeed_config(args.deepspeed_config)


def _flag_value(argv: list[str], flag: str, default: int) -> int:
    """The last value of `flag` in `argv` (either `--flag N` or `--flag=N`), else `default`."""
    value = default
    for index, token in enumerate(argv):
        if token == flag and index + 1 < len(argv):
            value = int(argv[index + 1])
        elif token.startswith(flag + "="):
            value = int(token.split("=", 1)[1])
    return value


def plan_with_changes(
    argv: list[str],
    changes: Sequence[Change],
    args: argparse.Namespace,
    device: Device | None,
    extra_args_provider: Callable | None = None,
    defaults: dict | None = None,
) -> tuple[list[str], dict, Plan]:
    """Apply `changes` to the command line of validated `args` (and to its DeepSpeed config
    file's keys), validate the result quietly, and plan it.

    Raises `ChangeRefused`, with validation's error line, when the changed command line does
    not validate (or the planner cannot plan it).
    """
    new_argv, patch = list(argv), {}
    for change in changes:
        new_argv = apply_flags(new_argv, change.flags, OLDER_SPELLINGS)
        patch = merge_config(patch, change.config)
    run_defaults = dict(defaults or {})
    raw_config = _raw_config(args)
    if raw_config is not None:
        micro = _flag_value(new_argv, "--micro-batch-size", args.micro_batch_size)
        tp = _flag_value(new_argv, "--tensor-model-parallel-size", args.tensor_model_parallel_size)
        pp = _flag_value(
            new_argv, "--pipeline-model-parallel-size", args.pipeline_model_parallel_size
        )
        split = args.ds_sequence_parallel_size * args.context_parallel_size
        data_parallel = max(1, args.world_size // (tp * pp * split))
        batch = batch_config(raw_config, micro, args.global_batch_size, data_parallel)
        patch = merge_config(patch, {k: v for k, v in batch.items() if raw_config[k] != v})
        run_defaults["deepspeed_config_dict"] = merge_config(copy.deepcopy(raw_config), patch)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):  # a refused candidate is not an error here
            changed_args = parse_args(new_argv, extra_args_provider, defaults=run_defaults)
    except SystemExit as stopped:
        if stopped.code != 2:  # the parser's refusal; anything else is not a refusal
            raise
        lines = errors.getvalue().strip().splitlines()
        raise ChangeRefused(lines[-1] if lines else "refused by validation") from None
    try:
        return new_argv, patch, plan_from_args(changed_args, device)
    except PlanningError as refused:
        raise ChangeRefused(f"error: {refused}") from None


def suggest(
    argv: list[str],
    args: argparse.Namespace,
    plan: Plan,
    extra_args_provider: Callable | None = None,
    defaults: dict | None = None,
) -> list[dict]:
    """The fitting changes of a plan that does not fit: each with its command line, config
    keys and predicted peak; single changes first, pairs only when no single one fits.

    Raises `EveryChangeRefused` (with each change's reason) when validation refuses every
    candidate: an empty list means the candidates were planned and none fits.
    """
    candidates = candidate_changes(plan.inputs, args.global_batch_size, _raw_config(args))
    found: list[dict] = []
    refusals: list[tuple[str, str]] = []
    tried = 0
    for size in (1, 2):
        for combination in itertools.combinations(candidates, size):
            if len({change.knob for change in combination}) < size:
                continue  # two settings of the same knob
            tried += 1
            description = " + ".join(change.description for change in combination)
            try:
                new_argv, patch, changed = plan_with_changes(
                    argv, combination, args, plan.device, extra_args_provider, defaults
                )
            except ChangeRefused as refused:
                refusals.append((description, refused.reason))
                continue  # the changed line is refused: not a suggestion
            if changed.fits:
                found.append(
                    {
                        "change": description,
                        "flags": _flag_edits(combination, argv),
                        "argv": new_argv,
                        "config": patch,
                        "peak_bytes": changed.peak_bytes,
                        "step_seconds": changed.estimate.step_s,
                        "mfu": changed.estimate.mfu,
                    }
                )
        if found:
            break
    if tried and len(refusals) == tried:
        raise EveryChangeRefused(refusals)
    found.sort(key=lambda item: item["step_seconds"])
    return found[:MAX_SUGGESTIONS]


def _flag_edits(changes: Sequence[Change], argv: list[str]) -> str:
    """What the changes do to `argv`: the flags they set (once each, not those already
    there) and those they remove."""
    edits: dict[str, str] = {}
    for change in changes:
        for flag, value in change.flags.items():
            present = any(token == flag or token.startswith(flag + "=") for token in argv)
            if value is False:
                if present:
                    edits[flag] = f"without {flag}"
            elif value is None:
                if not present:
                    edits[flag] = flag
            else:
                edits[flag] = f"{flag} {value}"
    return " ".join(edits.values())


def format_refusals(refused: EveryChangeRefused, device: Device) -> str:
    """What is printed when validation refused every candidate change."""
    lines = [f"  no suggestion to fit {device.name}: every candidate change was refused:"]
    lines += [f"    {change}: {reason}" for change, reason in refused.refusals]
    return "\n".join(lines)


def format_suggestions(suggestions: list[dict], device: Device) -> str:
    """The suggestions as printed after a plan that does not fit."""
    if not suggestions:
        return (
            f"  no single change or pair of changes fits {device.name}: raise the tensor or "
            "pipeline parallel size with more GPUs, or shorten the sequence"
        )
    lines = [f"  to fit {device.name}, change (predicted peak per rank, step time, MFU):"]
    for item in suggestions:
        config = (
            f"; in the DeepSpeed config: {json.dumps(item['config'])}" if item["config"] else ""
        )
        lines.append(
            f"    {item['change']}: {item['peak_bytes'] / _GIB:.2f} GiB, "
            f"{item['step_seconds']:.3f} s, MFU {item['mfu']:.1%}  "
            f"[{item['flags']}{config}]"
        )
    return "\n".join(lines)


def run_dry_run(
    argv: Sequence[str] | None = None,
    extra_args_provider: Callable | None = None,
    defaults: dict | None = None,
) -> Plan | None:
    """Validate, plan, print (global rank 0 only), write `--dry-run-json`; no training."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, extra_args_provider, defaults=defaults)
    if int(os.environ.get("RANK", "0")) != 0:
        return None  # one plan per job, from rank 0, as the run's start-up lines
    try:
        device = find_device(args.dry_run_device) if args.dry_run_device else None
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    try:
        plan = plan_from_args(args, device)
    except PlanningError as refused:
        raise SystemExit(f"error: {refused}") from None
    print(format_plan(plan), flush=True)
    result = plan.as_json()
    if device is not None and not plan.fits:
        try:
            suggestions = suggest(argv, args, plan, extra_args_provider, defaults)
            print(format_suggestions(suggestions, device), flush=True)
        except EveryChangeRefused as refused:
            suggestions = []
            print(format_refusals(refused, device), flush=True)
            result["refused_changes"] = [
                {"change": change, "reason": reason} for change, reason in refused.refusals
            ]
        result["suggestions"] = suggestions
    if args.dry_run_json:
        with atomic_outputs(args.dry_run_json) as (partial,):
            with open(partial, "w", encoding="utf-8") as file:
                file.write(json.dumps(result, indent=1) + "\n")
        print(f"  plan written to {args.dry_run_json}", flush=True)
    return plan


def predicted_peak_bytes(args: argparse.Namespace, device_type: str) -> list[int] | None:
    """Each pipeline stage's predicted peak per rank, for a real run's start-up line and its
    memory report (the plan of the run's own flags on its own device type); None when the
    planner refuses this run (`PlanningError`), which must not stop training. Any other
    exception is a planner bug, and surfaces."""
    try:
        plan = build_plan(PlanInputs.from_args(args, device_type))
    except PlanningError:
        return None
    return [role.memory.peak_bytes for role in plan.roles]


def predicted_peak_line(peaks: list[int] | None) -> str:
    """The start-up line of a real run: each pipeline stage's predicted peak per rank."""
    if peaks is None:
        return " > predicted peak memory per rank: not available for this run (see --dry-run)"
    stages = ", ".join(f"stage {stage} {peak / 2**20:,.0f} MB" for stage, peak in enumerate(peaks))
    return f" > predicted peak memory per rank (tensors; --dry-run for the breakdown): {stages}"
