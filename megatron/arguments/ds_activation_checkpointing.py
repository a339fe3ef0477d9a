"""The DeepSpeed config's "activation_checkpointing" section, applied as Megatron-LM v1 applied it.

With `--deepspeed-activation-checkpointing`, Megatron-LM v1 called
`deepspeed.checkpointing.configure(mpu, deepspeed_config=..., num_checkpoints=args.num_layers)`:
the section's values, with `--num-layers` checkpoints. Megatron-DeepSpeed passes its flags
instead (`--partition-activations`, `--checkpoint-in-cpu`, ...). Both work here, as `configure`
combines them: a flag the user typed wins over the section's value, a flag not typed takes it.
The settings in effect end up in those flags' fields of `args` (which `initialize_megatron`
hands to `configure`) and in the section DeepSpeed gets, so the two agree. Without
`--deepspeed-activation-checkpointing` the section has no effect, as in v1 and
Megatron-DeepSpeed, and is left out of the config; start-up says so.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError, flag_name

SECTION = "activation_checkpointing"
# DeepSpeed's switches and the dest of the Megatron-DeepSpeed flag for each ("number_checkpoints"
# is --num-layers, as in v1).
SWITCHES = {
    "partition_activations": "partition_activations",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "contiguous_memory_optimization": "contigious_checkpointing",
    "synchronize_checkpoint_boundary": "synchronize_each_layer",
    "profile": "profile_backward",
}


def reconcile_activation_checkpointing(
    args: argparse.Namespace, config: dict, explicit_flags: set[str], source: str
) -> list[str]:
    """Settle `config`'s section with the flags (both end up saying the same); start-up notes."""
    section = config.get(SECTION)
    if section is not None and not isinstance(section, dict):
        raise ArgumentError(f'{source}: "{SECTION}" must be a JSON object {{...}}')
    if not getattr(args, "deepspeed_activation_checkpointing", False):
        if section is None:
            return []
        del config[SECTION]
        return [
            f' > {source}: its "{SECTION}" section is not used without '
            "--deepspeed-activation-checkpointing (as in Megatron-LM v1 and Megatron-DeepSpeed)"
        ]
    section, notes = section or {}, []
    for key in SWITCHES:
        note = _take_switch(args, section, key, explicit_flags, source)
        notes += [note] if note else []
    number = section.get("number_checkpoints")
    if number is not None and number != args.num_layers:
        notes.append(
            f' > warning: "{SECTION}.number_checkpoints" ({number}) in {source} is not used: '
            f"DeepSpeed gets --num-layers ({args.num_layers}), as in Megatron-LM v1"
        )
    _check_combination(args, explicit_flags, source)
    config[SECTION] = deepspeed_checkpointing_settings(args)
    return notes


def _take_switch(
    args: argparse.Namespace, section: dict, key: str, explicit_flags: set[str], source: str
) -> str | None:
    """Settle one switch into args; a warning when a typed flag overrules the section."""
    dest, value = SWITCHES[key], section.get(key)
    if value is None:  # absent (or null, which DeepSpeed reads as off): the flag decides
        return None
    if not isinstance(value, bool):
        raise ArgumentError(f'{source}: "{SECTION}.{key}" must be true or false, not {value!r}')
    if getattr(args, dest, False) and dest in explicit_flags:
        if value:
            return None
        return (
            f' > warning: {flag_name(args, dest)} overrides "{SECTION}.{key}" (false) in {source}; '
            "the typed flag is in effect"
        )
    setattr(args, dest, value)
    return None


def _check_combination(args: argparse.Namespace, explicit_flags: set[str], source: str) -> None:
    """Settings DeepSpeed asserts on, or that give wrong gradients, named in one line."""

    def origin(key: str) -> str:
        dest = SWITCHES[key]
        return flag_name(args, dest) if dest in explicit_flags else f'"{SECTION}.{key}" in {source}'

    if args.contigious_checkpointing and not args.partition_activations:
        raise ArgumentError(
            f"{origin('contiguous_memory_optimization')} needs partitioned activations "
            f'(--partition-activations or "{SECTION}.partition_activations": true in {source})'
        )
    if args.partition_activations and getattr(args, "sequence_parallel", False):
        raise ArgumentError(
            f"{origin('partition_activations')} cannot be combined with --sequence-parallel: "
            "sequence-parallel activations are already split"
        )


def deepspeed_checkpointing_settings(args: argparse.Namespace) -> dict:
    """The settings `deepspeed.checkpointing.configure` gets, under DeepSpeed's key names."""
    return {
        "partition_activations": bool(args.partition_activations),
        "cpu_checkpointing": bool(args.checkpoint_in_cpu),
        "contiguous_memory_optimization": bool(args.contigious_checkpointing),
        "number_checkpoints": args.num_layers,
        "synchronize_checkpoint_boundary": bool(args.synchronize_each_layer),
        "profile": bool(args.profile_backward),
    }


def activation_checkpointing_line(args: argparse.Namespace) -> str:
    """The start-up line: the DeepSpeed activation-checkpointing settings in effect."""
    settings = deepspeed_checkpointing_settings(args).items()
    return " > DeepSpeed activation checkpointing: " + ", ".join(
        f"{key}={value}" for key, value in settings
    )
