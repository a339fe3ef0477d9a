"""The DeepSpeed JSON config, reconciled with Megatron's flags so each fact is stated once.

DeepSpeed receives the dict built here (`deepspeed.initialize(config=...)`), never the file.
Every fact both sides can state (batch sizes, precision and loss scaling, gradient clipping,
ZeRO stage and tuning) follows one rule: a flag the user typed and a config key that disagree
are an `ArgumentError` naming the flag, the key, the file and both values; a fact stated on one
side only is copied to the other, so `args` (what we log and compute with) and DeepSpeed agree.
DeepSpeed's early `"zero_optimization": true|false` is read as stage 1 / 0. The
"activation_checkpointing" section is settled in `ds_activation_checkpointing.py`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections.abc import Callable
from typing import Any

from megatron.arguments.ds_activation_checkpointing import reconcile_activation_checkpointing
from megatron.arguments.errors import ArgumentError, flag_name

# DeepSpeed prints its own line every `steps_per_print` steps; our loop prints Megatron's. Its
# default (None) also stays quiet, but the pipeline engine's timer logging computes
# `global_steps % steps_per_print` unguarded, so a number that is never reached is the safe "off".
STEPS_PER_PRINT_NEVER = 2**31 - 1

_KINDS: dict[type, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda value: isinstance(value, bool), "true or false"),
    int: (lambda value: isinstance(value, int) and not isinstance(value, bool), "a whole number"),
    float: (
        lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
        "a number",
    ),
}


def load_deepspeed_config(path: str) -> dict:
    """Read the `--deepspeed_config` JSON file; errors name the file (and line, for bad JSON)."""
    where = f"--deepspeed_config {path}"
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file, object_pairs_hook=_unique_keys(where))
    except OSError as error:
        raise ArgumentError(f"{where}: cannot read the file ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ArgumentError(
            f"{where}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    except UnicodeDecodeError as error:
        raise ArgumentError(f"{where}: not UTF-8 text ({error.reason})") from None
    if not isinstance(config, dict):
        raise ArgumentError(f"{where}: the top level must be a JSON object {{...}}")
    return config


def _unique_keys(where: str) -> Callable[[list[tuple[str, Any]]], dict]:
    # json keeps the last of two equal keys silently; DeepSpeed's own loader rejects them, and it
    # never sees the file, so we do.
    def build(pairs: list[tuple[str, Any]]) -> dict:
        obj: dict = {}
        for key, value in pairs:
            if key in obj:
                raise ArgumentError(f'{where}: key "{key}" appears twice in one object')
            obj[key] = value
        return obj

    return build


def reconcile_deepspeed_config(
    args: argparse.Namespace,
    config: dict,
    explicit_flags: set[str],
    source: str | None = None,
) -> dict:
    """A new config for `deepspeed.initialize` that agrees with `args`; `args` takes its facts.

    `explicit_flags` holds the dest names of the flags the user typed; only those can contradict
    the config. `args.data_parallel_size` must be set. `source` names the config in errors
    (default: `--deepspeed_config PATH`).
    """
    if source is None:
        source = f"--deepspeed_config {args.deepspeed_config}"
    shared = _SharedFacts(args, copy.deepcopy(config), explicit_flags, source)
    _features_we_lack(shared)
    _batch(shared)
    _precision(shared)
    shared.share("clip_grad", "gradient_clipping", float)
    _zero(shared)
    shared.notes += reconcile_activation_checkpointing(args, shared.config, explicit_flags, source)
    # ZeRO accepts only the exact optimizer types DeepSpeed lists (torch.optim.Adam/AdamW pass,
    # any subclass fails an assert); we pass our own, so allow it unless the file says otherwise.
    shared.config.setdefault("zero_allow_untested_optimizer", True)
    shared.config.setdefault("steps_per_print", STEPS_PER_PRINT_NEVER)
    shared.config.setdefault("wall_clock_breakdown", False)
    args.deepspeed_config_notes = getattr(args, "deepspeed_config_notes", []) + shared.notes
    if getattr(args, "universal_checkpoint", False):
        # Megatron-DeepSpeed's flag: load a checkpoint converted by ds_to_universal.
        shared.config.setdefault("checkpoint", {})["load_universal"] = True
    return shared.config


def _same(value: Any) -> Any:
    return value


def _enabled(config: dict, *path: str) -> bool:
    for key in path:
        config = config.get(key) if isinstance(config, dict) else None
    return isinstance(config, dict) and bool(config.get("enabled", False))


def _features_we_lack(shared: _SharedFacts) -> None:
    """Sections Megatron-DeepSpeed's model code acts on: refused when on, set aside when off."""
    config, source = shared.config, shared.source
    if "curriculum_learning" in config and not _enabled(config, "curriculum_learning"):
        # Megatron-DeepSpeed's templates carry it disabled; DeepSpeed 0.19 rejects the legacy
        # top-level key whatever it says, so a disabled one is dropped (it does nothing).
        del config["curriculum_learning"]
        shared.notes.append(
            f' > {source}: its disabled "curriculum_learning" section is left out (DeepSpeed '
            "0.19 no longer accepts this legacy key)"
        )
    if _enabled(config, "curriculum_learning"):
        raise ArgumentError(
            f'{source}: "curriculum_learning" is enabled, but sequence-length curriculum '
            'learning is not built here; set its "enabled" to false'
        )
    if _enabled(config, "data_efficiency"):
        for feature in ("data_sampling", "data_routing"):
            if _enabled(config, "data_efficiency", feature):
                raise ArgumentError(
                    f'{source}: "data_efficiency.{feature}" is enabled, but DeepSpeed\'s '
                    f'data-efficiency library is not built here; set its "enabled" to false'
                )


class _SharedFacts:
    """The config being built and the flags it is checked against, one `share` per fact."""

    def __init__(
        self, args: argparse.Namespace, config: dict, explicit_flags: set[str], source: str
    ) -> None:
        self.args, self.config, self.explicit, self.source = args, config, explicit_flags, source
        self.notes: list[str] = []  # start-up warnings (flags the config overrules)

    def section(self, name: str) -> dict:
        """The config's object `name` (created empty when absent)."""
        section = self.config.setdefault(name, {})
        if not isinstance(section, dict):
            raise ArgumentError(f'{self.source}: "{name}" must be a JSON object {{...}}')
        return section

    def share(
        self,
        dest: str,
        key: str,
        kind: type,
        to_config: Callable[[Any], Any] = _same,
        from_config: Callable[[Any], Any] = _same,
        config_wins: bool = False,
    ) -> None:
        """Flag `dest` and config `key` ("section.leaf" nests): disagreeing is an error if the
        flag was typed (a warning, the config's value in effect, if `config_wins`); otherwise
        the side that is silent takes the other's value."""
        section_name, _, leaf = key.rpartition(".")
        section = self.section(section_name) if section_name else self.config
        flag, flag_value = flag_name(self.args, dest), getattr(self.args, dest)
        if leaf not in section:
            section[leaf] = self._converted(flag, flag_value, to_config)
            return
        value = section[leaf]
        is_kind, kind_text = _KINDS[kind]
        if not is_kind(value):
            raise ArgumentError(f'{self.source}: "{key}" must be {kind_text}, not {value!r}')
        if dest in self.explicit and self._converted(flag, flag_value, to_config) != value:
            if config_wins:
                self.notes.append(
                    f' > warning: {flag} ({flag_value}) is not used under --deepspeed; "{key}" '
                    f"({json.dumps(value)}) in {self.source} is in effect, as in "
                    "Megatron-DeepSpeed"
                )
                setattr(self.args, dest, from_config(value))
                return
            raise ArgumentError(
                f'{flag} ({flag_value}) contradicts "{key}" ({json.dumps(value)}) in '
                f"{self.source}; state it in one place"
            )
        setattr(self.args, dest, from_config(value))

    @staticmethod
    def _converted(flag: str, value: Any, to_config: Callable[[Any], Any]) -> Any:
        try:
            return to_config(value)
        except ValueError as error:
            raise ArgumentError(f"{flag} ({value}) {error}") from None


def _batch(shared: _SharedFacts) -> None:
    # DeepSpeed's rule: train_batch_size = micro x accumulation x data-parallel size. The config
    # may give any of the three; the result always has all three, and args the same numbers.
    args, source = shared.args, shared.source
    shared.share("micro_batch_size", "train_micro_batch_size_per_gpu", int)
    if args.micro_batch_size is None:
        raise ArgumentError(
            "missing required flag(s): --micro-batch-size "
            f'(or "train_micro_batch_size_per_gpu" in {source})'
        )
    shared.share("global_batch_size", "train_batch_size", int)
    accumulation = shared.config.get("gradient_accumulation_steps")
    if accumulation is not None and not _KINDS[int][0](accumulation):
        raise ArgumentError(
            f'{source}: "gradient_accumulation_steps" must be a whole number, not {accumulation!r}'
        )
    micro, dp = args.micro_batch_size, args.data_parallel_size
    if micro < 1 or (accumulation is not None and accumulation < 1):
        raise ArgumentError(
            f"--micro-batch-size/train_micro_batch_size_per_gpu ({micro}) and "
            f"gradient_accumulation_steps ({accumulation}) in {source} must be at least 1"
        )
    per_step = micro * dp
    global_batch = args.global_batch_size
    if global_batch is None:
        global_batch = per_step * (accumulation or 1)
    if accumulation is None:
        if global_batch % per_step != 0:
            raise ArgumentError(
                f"--global-batch-size/train_batch_size ({global_batch}) is not divisible by "
                f"--micro-batch-size/train_micro_batch_size_per_gpu ({micro}) x data-parallel "
                f"size ({dp}) = {per_step} ({source})"
            )
        accumulation = global_batch // per_step
    elif global_batch != per_step * accumulation:
        raise ArgumentError(
            f"{source}: DeepSpeed needs train_batch_size ({flag_name(args, 'global_batch_size')}) "
            f"= train_micro_batch_size_per_gpu ({flag_name(args, 'micro_batch_size')}) x "
            "gradient_accumulation_steps x data-parallel size, but "
            f"{global_batch} != {micro} x {accumulation} x {dp}"
        )
    args.global_batch_size, args.gradient_accumulation_steps = global_batch, accumulation
    shared.config["train_batch_size"] = global_batch
    shared.config["train_micro_batch_size_per_gpu"] = micro
    shared.config["gradient_accumulation_steps"] = accumulation


def _log2(scale: float) -> int:
    power = math.log2(scale) if scale > 0 else math.nan
    if not power.is_integer():
        raise ValueError(
            "is not a power of 2, and DeepSpeed takes the initial loss scale as "
            "fp16.initial_scale_power = log2(scale)"
        )
    return int(power)


def _whole(value: float) -> int:
    if not float(value).is_integer():
        raise ValueError("must be a whole number for DeepSpeed")
    return int(value)


def _precision(shared: _SharedFacts) -> None:
    args, config, source = shared.args, shared.config, shared.source
    # "bfloat16" is DeepSpeed's legacy spelling, read only when "bf16" is absent. Errors quote
    # the user's spelling; the result has one ("bf16"), which is what our own code reads.
    bf16 = "bfloat16" if "bfloat16" in config else "bf16"
    if bf16 == "bfloat16" and "bf16" in config:
        raise ArgumentError(f'{source}: give "bf16" or its legacy alias "bfloat16", not both')
    shared.share("fp16", "fp16.enabled", bool)
    shared.share("bf16", f"{bf16}.enabled", bool)
    config["bf16"] = config.pop(bf16)
    if args.fp16 and args.bf16:
        raise ArgumentError(
            f"fp16 and bf16 cannot both be enabled (--fp16/fp16.enabled and --bf16/{bf16}.enabled "
            f"in {source})"
        )
    if not args.fp16:
        return
    # Megatron's loss-scaling flags in DeepSpeed's terms (loss_scale 0 = dynamic). They fill
    # what the config leaves out; where it states a value, it wins: Megatron-DeepSpeed never
    # reads these flags under --deepspeed, so scripts pass ones the config contradicts
    # (universal_checkpointing/run_fp16.sh: --loss-scale 12 with a dynamic "loss_scale": 0).
    wins = {"config_wins": True}
    shared.share(
        "loss_scale", "fp16.loss_scale", float, lambda s: s or 0, lambda s: float(s) or None, **wins
    )
    shared.share(
        "initial_loss_scale", "fp16.initial_scale_power", int, _log2, lambda p: 2.0**p, **wins
    )
    shared.share("loss_scale_window", "fp16.loss_scale_window", int, _whole, **wins)
    shared.share("hysteresis", "fp16.hysteresis", int, **wins)
    shared.share("min_loss_scale", "fp16.min_loss_scale", int, _whole, **wins)


def _zero(shared: _SharedFacts) -> None:
    args, config = shared.args, shared.config
    if isinstance(config.get("zero_optimization"), bool):
        _early_zero_switch(shared, config["zero_optimization"])
    if args.zero_stage is None and "stage" not in shared.section("zero_optimization"):
        args.zero_stage = 0
    shared.share("zero_stage", "zero_optimization.stage", int)
    if args.zero_stage not in (0, 1, 2, 3):
        raise ArgumentError(
            f'{shared.source}: "zero_optimization.stage" must be 0, 1, 2 or 3, '
            f"not {args.zero_stage}"
        )
    _zero_tuning_flags(shared)


def _early_zero_switch(shared: _SharedFacts, enabled: bool) -> None:
    """DeepSpeed's first form, `"zero_optimization": true|false`, in today's words.

    DeepSpeed 0.19 still reads it (`read_zero_config_deprecated`): true is ZeRO stage 1, with
    the top-level "allgather_size" as its allgather_bucket_size; false is stage 0.
    """
    config = shared.config
    section: dict[str, Any] = {"stage": 1 if enabled else 0}
    if enabled and "allgather_size" in config:
        section["allgather_bucket_size"] = config.pop("allgather_size")
    config["zero_optimization"] = section
    shared.notes.append(
        f' > {shared.source}: "zero_optimization": {json.dumps(enabled)} (DeepSpeed\'s early '
        f'form) is read as "zero_optimization": {json.dumps(section)}, as DeepSpeed reads it'
    )


# Megatron-LM v1.1.5's ZeRO flags and the zero_optimization keys they state.
_ZERO_TUNING_FLAGS = (
    ("zero_reduce_bucket_size", "reduce_bucket_size", int),
    ("zero_allgather_bucket_size", "allgather_bucket_size", int),
    ("zero_contigious_gradients", "contiguous_gradients", bool),
    ("zero_reduce_scatter", "reduce_scatter", bool),
)


def _zero_tuning_flags(shared: _SharedFacts) -> None:
    """The flags fill the keys the config leaves out (DeepSpeed ignores them at stage 0)."""
    section = shared.section("zero_optimization")
    for dest, leaf, kind in _ZERO_TUNING_FLAGS:
        flag, value = flag_name(shared.args, dest), getattr(shared.args, dest, None)
        if kind is int and value is not None and value < 1:
            raise ArgumentError(f"{flag} ({value}) must be at least 1")
        if value is None and leaf not in section:
            continue
        if kind is bool:
            shared.share(dest, f"zero_optimization.{leaf}", bool)
            continue
        # DeepSpeed takes sizes written as 5e8 (JSON numbers with an exponent are floats).
        size = section.get(leaf)
        if leaf in section and not (_KINDS[float][0](size) and float(size).is_integer()):
            raise ArgumentError(
                f'{shared.source}: "zero_optimization.{leaf}" must be a whole number of '
                f"elements, not {size!r}"
            )
        shared.share(dest, f"zero_optimization.{leaf}", float, from_config=int)


def settle_gradient_accumulation_dtype(args: argparse.Namespace, config: dict, source: str) -> None:
    """bf16 under DeepSpeed: accumulate micro-batch gradients in fp32 wherever DeepSpeed can.

    Megatron-DeepSpeed's bf16 configs set `"data_types": {"grad_accum_dtype": "fp32"}`: summed
    in bf16 (8 significant bits), the gradients of 64 micro-batches are off by ~2% (measured in
    tests/training/test_mixed_precision.py). What DeepSpeed 0.19 does with the key:
    - ZeRO 1-3 (either engine): "fp32" accumulates in fp32 (ZeRO-1 through its
      BF16_Optimizer), so we fill it when the config is silent;
    - ZeRO 0: bf16 (and fp16) gradients accumulate in the model's dtype only, and DeepSpeed
      refuses "fp32" with a traceback ("unsupported mix", `megatron.deepspeed_facts.
      optimizer_wrapper`); we refuse it in one line naming the way out, ZeRO-1.
    """
    if not (args.bf16 or args.fp16):
        return
    half = "bf16" if args.bf16 else "fp16"
    types = config.get("data_types", {})
    if not isinstance(types, dict):
        raise ArgumentError(f'{source}: "data_types" must be a JSON object {{...}}')
    wanted = types.get("grad_accum_dtype")
    if args.zero_stage > 0:
        if wanted is None and args.bf16:
            config["data_types"] = {**types, "grad_accum_dtype": "fp32"}
        return
    if wanted in _FP32_NAMES:
        raise ArgumentError(
            f'"data_types.grad_accum_dtype": "{wanted}" in {source} with {half} needs ZeRO '
            f"stage 1-3 (DeepSpeed accumulates {half} gradients in {half} only at stage 0): use "
            "--zero-stage 1, or remove the key"
        )


# DeepSpeed's spellings of fp32 (deepspeed.runtime.config.DtypeEnum.fp32).
_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


def gradient_accumulation_dtype(args: argparse.Namespace) -> str:
    """The dtype DeepSpeed accumulates micro-batch gradients in, for the start-up line."""
    if not (args.bf16 or args.fp16):
        return "fp32"
    types = args.deepspeed_config_dict.get("data_types") or {}
    wanted = types.get("grad_accum_dtype")
    return "fp32" if wanted in _FP32_NAMES else "bf16" if args.bf16 else "fp16"
