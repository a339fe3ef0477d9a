"""The "optimizer" and "scheduler" sections of a DeepSpeed config: accepted, never used.

Megatron-DeepSpeed hands `deepspeed.initialize` its own Adam and `OptimizerParamScheduler`,
so DeepSpeed ignores these sections; configs written for it (tutorials, templates) often carry
them. We do the same, but say so: one start-up line names the values in effect (the flags'),
and each value of the section that differs from its flag gets its own warning line.
"""

from __future__ import annotations

import argparse
from typing import Any

UNUSED_SECTIONS = ("optimizer", "scheduler")
_ADAM_TYPES = {"adam", "adamw", "fusedadam", "onebitadam", "zerooneadam", "cpuadam"}


def set_aside_unused_sections(args: argparse.Namespace, config: dict, source: str) -> list[str]:
    """Remove the sections from `config` (DeepSpeed gets none); the start-up lines about them.

    Run after validation: the flags' values (warm-up from --lr-warmup-fraction, ...) are final.
    """
    lines = []
    for name in UNUSED_SECTIONS:
        section = config.pop(name, None)
        if section is None:
            continue
        lines.append(
            f' > {source}: its "{name}" section is not used (as in Megatron-DeepSpeed, whose '
            f"own {_in_effect(args, name)} comes from the flags)"
        )
        params = section.get("params", {}) if isinstance(section, dict) else {}
        if not isinstance(params, dict):
            params = {}
        kind = section.get("type") if isinstance(section, dict) else None
        if name == "optimizer" and kind is not None and str(kind).lower() not in _ADAM_TYPES:
            lines.append(
                f' > warning: "optimizer.type" ({kind}) in {source} is not the optimizer in '
                f"effect: --optimizer {args.optimizer}"
            )
        comparisons = _OPTIMIZER_PARAMS if name == "optimizer" else _SCHEDULER_PARAMS
        for key, flag, ours in comparisons:
            if key in params and not _same(params[key], ours(args)):
                lines.append(
                    f' > warning: "{name}.params.{key}" ({params[key]}) in {source} differs '
                    f"from {flag} ({ours(args)}); {flag} is in effect"
                )
    return lines


def _in_effect(args: argparse.Namespace, name: str) -> str:
    if name == "optimizer":
        return (
            f"{args.optimizer} (lr {args.lr}, betas ({args.adam_beta1}, {args.adam_beta2}), "
            f"eps {args.adam_eps}, weight decay {args.weight_decay}, gradient clipping "
            f"{args.clip_grad})"
        )
    return (
        f"LR schedule ({args.lr_decay_style} from {args.lr} to {args.min_lr}, warm-up "
        f"{_warmup(args)}, decay over {_decay(args)})"
    )


def _warmup(args: argparse.Namespace) -> str:
    samples = getattr(args, "lr_warmup_samples", 0)
    return f"{samples} samples" if samples else f"{args.lr_warmup_iters or 0} iterations"


def _decay(args: argparse.Namespace) -> str:
    if getattr(args, "lr_decay_samples", None):
        return f"{args.lr_decay_samples} samples"
    return f"{args.lr_decay_iters or args.train_iters} iterations"


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        return len(theirs) == len(ours) and all(_same(a, b) for a, b in zip(theirs, ours))
    try:
        return float(theirs) == float(ours)
    except (TypeError, ValueError):
        return theirs == ours


_OPTIMIZER_PARAMS = (
    ("lr", "--lr", lambda args: args.lr),
    ("betas", "--adam-beta1/--adam-beta2", lambda args: (args.adam_beta1, args.adam_beta2)),
    ("eps", "--adam-eps", lambda args: args.adam_eps),
    ("weight_decay", "--weight-decay", lambda args: args.weight_decay),
    ("max_grad_norm", "--clip-grad", lambda args: args.clip_grad),
)
_SCHEDULER_PARAMS = (
    ("warmup_max_lr", "--lr", lambda args: args.lr),
    ("warmup_num_steps", "--lr-warmup-iters", lambda args: args.lr_warmup_iters or 0),
    ("total_num_steps", "--lr-decay-iters", lambda args: args.lr_decay_iters or args.train_iters),
)
