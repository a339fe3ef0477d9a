"""`--dry-run`: validate a job's flags as the run would, print its plan, and exit.

    python pretrain_gpt.py FLAGS --dry-run [--dry-run-world-size N] [--dry-run-device H100]
                                           [--dry-run-json plan.json]

No device, data file or process group is touched; under a launcher only global rank 0
prints. With a device named and a rank that does not fit, the changes that make it fit
(re-validated and re-planned as full command lines) follow the plan.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence

from megatron.arguments import parse_args
from megatron.arguments.ds_config import load_deepspeed_config
from megatron.atomic_files import atomic_outputs
from megatron.planning.devices import Device, find_device
from megatron.planning.inputs import PlanInputs
from megatron.planning.plan import Plan, build_plan, format_plan
from megatron.planning.suggestions import Change, apply_flags, candidate_changes, merge_config

# Suggestions printed at most; fewer changes first, then the faster predicted step.
MAX_SUGGESTIONS = 5
_GIB = 1024**3


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


def plan_with_changes(
    argv: list[str],
    changes: Sequence[Change],
    raw_config: dict | None,
    device: Device | None,
    extra_args_provider: Callable | None = None,
    defaults: dict | None = None,
) -> tuple[list[str], dict, Plan]:
    """Apply `changes` to the command line (and config), validate it, and plan it.

    Raises SystemExit when the changed command line does not validate.
    """
    new_argv, patch = list(argv), {}
    for change in changes:
        new_argv = apply_flags(new_argv, change.flags)
        patch = merge_config(patch, change.config)
    run_defaults = dict(defaults or {})
    if raw_config is not None:
        run_defaults["deepspeed_config_dict"] = merge_config(copy.deepcopy(raw_config), patch)
    args = parse_args(new_argv, extra_args_provider, defaults=run_defaults)
    return new_argv, patch, plan_from_args(args, device)


def suggest(
    argv: list[str],
    args: argparse.Namespace,
    plan: Plan,
    extra_args_provider: Callable | None = None,
    defaults: dict | None = None,
) -> list[dict]:
    """The fitting changes of a plan that does not fit: each with its command line, config
    keys and predicted peak; single changes first, pairs only when no single one fits."""
    raw_config = _raw_config(args)
    candidates = candidate_changes(plan.inputs, args, raw_config)
    found: list[dict] = []
    for size in (1, 2):
        for combination in itertools.combinations(candidates, size):
            if (
                size == 2
                and combination[0].description.split()[0] == (combination[1].description.split()[0])
            ):
                continue  # two settings of the same knob
            try:
                new_argv, patch, changed = plan_with_changes(
                    argv, combination, raw_config, plan.device, extra_args_provider, defaults
                )
            except SystemExit:
                continue  # the changed line is refused (the error named why): not a suggestion
            if changed.fits:
                found.append(
                    {
                        "change": " + ".join(change.description for change in combination),
                        "flags": " ".join(_flag_edits(change, argv) for change in combination),
                        "argv": new_argv,
                        "config": patch,
                        "peak_bytes": changed.peak_bytes,
                        "step_seconds": changed.estimate.step_s,
                        "mfu": changed.estimate.mfu,
                    }
                )
        if found:
            break
    found.sort(key=lambda item: item["step_seconds"])
    return found[:MAX_SUGGESTIONS]


def _flag_edits(change: Change, argv: list[str]) -> str:
    """The flags a change sets, and those it removes from `argv`."""
    edits = []
    for flag, value in change.flags.items():
        if value is False:
            if any(token == flag or token.startswith(flag + "=") for token in argv):
                edits.append(f"without {flag}")
        else:
            edits.append(flag if value is None else f"{flag} {value}")
    return " ".join(edits)


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
    plan = plan_from_args(args, device)
    print(format_plan(plan), flush=True)
    result = plan.as_json()
    if device is not None and not plan.fits:
        suggestions = suggest(argv, args, plan, extra_args_provider, defaults)
        print(format_suggestions(suggestions, device), flush=True)
        result["suggestions"] = suggestions
    if args.dry_run_json:
        with atomic_outputs(args.dry_run_json) as (partial,):
            with open(partial, "w", encoding="utf-8") as file:
                file.write(json.dumps(result, indent=1) + "\n")
        print(f"  plan written to {args.dry_run_json}", flush=True)
    return plan


def predicted_peak_bytes(args: argparse.Namespace, device_type: str) -> list[int]:
    """Each pipeline stage's predicted peak per rank, for a real run's start-up line and its
    memory report (the plan of the run's own flags on its own device type)."""
    plan = build_plan(PlanInputs.from_args(args, device_type))
    return [role.memory.peak_bytes for role in plan.roles]


def predicted_peak_line(peaks: list[int]) -> str:
    """The start-up line of a real run: each pipeline stage's predicted peak per rank."""
    stages = ", ".join(f"stage {stage} {peak / 2**20:,.0f} MB" for stage, peak in enumerate(peaks))
    return f" > predicted peak memory per rank (tensors; --dry-run for the breakdown): {stages}"
