"""Which engine runs which feature: one declarative table, checked against the settled layout.

Each `Feature` row names the flag that asks for it, when a layout uses it, the engines that
run it and why the others do not. `check_compatibility` turns the first row a layout breaks
into the one-line refusal (naming the flag and the engine); the planner's suggestions ask
`engines_running` / `zero_stages_on` instead of re-encoding a rule, and docs/arguments.md's
"Engines and features" section is generated from the table (`markdown_table`), so adding a
feature means adding a row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megatron.layout import Engine, ParallelLayout

_ALL = frozenset(Engine)
_DEEPSPEED = frozenset({Engine.DEEPSPEED, Engine.DEEPSPEED_PIPE})


@dataclass(frozen=True)
class Feature:
    """One row: a feature, the engines that run it, and the refusal on each other engine."""

    name: str
    flag: str
    """The flag that asks for the feature (the docs' column)."""
    used: Callable[[ParallelLayout, str | None], bool]
    """Whether a layout uses the feature (the second argument: the MoE flags, or None)."""
    engines: frozenset[Engine]
    refusals: dict[Engine, str] = field(default_factory=dict)
    """The one-line refusal on each engine that does not run it; `str.format` fields:
    `{flag}` (the flag with its value), `{pp}` (the pipeline size), `{moe}` (the MoE flags)."""


def _zero_flag(layout: ParallelLayout, moe: str | None) -> str:
    return f"--zero-stage {layout.zero_stage}"


_ZERO_NEEDS_DEEPSPEED = (
    "{flag} needs --deepspeed (ZeRO is DeepSpeed's; the plain-torch path is DDP)"
)
_MOE_NEEDS_DEEPSPEED = (
    "{flag}: Mixture-of-Experts runs on DeepSpeed's engine (DeepSpeed-MoE, as in "
    "Megatron-DeepSpeed); add --deepspeed --deepspeed_config FILE --no-pipeline-parallel"
)
_ULYSSES_NEEDS_DEEPSPEED = (
    "{flag} needs --deepspeed: DeepSpeed's engine sums the gradients over the "
    "sequence-parallel ranks (DeepSpeed-Ulysses)"
)

FEATURES: tuple[Feature, ...] = (
    Feature(
        name="ZeRO stage 1",
        flag="--zero-stage",
        used=lambda layout, moe: layout.zero_stage == 1,
        engines=_DEEPSPEED,
        refusals={
            Engine.PLAIN: _ZERO_NEEDS_DEEPSPEED,
            Engine.MEGATRON_SCHEDULES: _ZERO_NEEDS_DEEPSPEED,
        },
    ),
    # DeepSpeed's pipeline engine runs ZeRO 0-1 (megatron.deepspeed_facts.
    # PIPELINE_ENGINE_ZERO_STAGES, read from its source; tests/training/test_engines.py).
    Feature(
        name="ZeRO stages 2-3",
        flag="--zero-stage",
        used=lambda layout, moe: layout.zero_stage >= 2,
        engines=frozenset({Engine.DEEPSPEED}),
        refusals={
            Engine.PLAIN: _ZERO_NEEDS_DEEPSPEED,
            Engine.MEGATRON_SCHEDULES: _ZERO_NEEDS_DEEPSPEED,
            Engine.DEEPSPEED_PIPE: (
                "{flag} cannot be combined with --pipeline-model-parallel-size {pp}: "
                "DeepSpeed's pipeline engine supports ZeRO stages 0 and 1; for ZeRO-2/3-style "
                "sharding with pipelines drop --deepspeed and add --use-distributed-optimizer "
                "or --use-torch-fsdp2 (torch FSDP2 under Megatron's schedules)"
            ),
        },
    ),
    Feature(
        name="pipeline parallelism (PP > 1)",
        flag="--pipeline-model-parallel-size",
        used=lambda layout, moe: layout.pipelined,
        engines=frozenset({Engine.DEEPSPEED_PIPE, Engine.MEGATRON_SCHEDULES}),
        refusals={
            Engine.DEEPSPEED: (
                "--no-pipeline-parallel with {flag} under --deepspeed: DeepSpeed's engine is "
                "not driven by Megatron's schedules here; drop --no-pipeline-parallel for "
                "DeepSpeed's pipeline engine (ZeRO 0-1), or drop --deepspeed for Megatron's "
                "schedules (with --use-distributed-optimizer or --use-torch-fsdp2 for "
                "ZeRO-2/3-style sharding on torch FSDP2)"
            ),
        },
    ),
    Feature(
        name="interleaved schedule (virtual pipeline stages)",
        flag="--virtual-pipeline-model-parallel-size",
        used=lambda layout, moe: layout.virtual_pipeline > 1,
        engines=frozenset({Engine.MEGATRON_SCHEDULES}),
        refusals={
            Engine.DEEPSPEED_PIPE: (
                "{flag}: the interleaved schedule is Megatron's, run without --deepspeed "
                "(DeepSpeed's pipeline engine has none)"
            ),
        },
    ),
    Feature(
        name="DeepSpeed-Ulysses sequence parallelism",
        flag="--ds-sequence-parallel-size",
        used=lambda layout, moe: layout.ulysses_enabled,
        engines=frozenset({Engine.DEEPSPEED}),
        refusals={
            Engine.PLAIN: _ULYSSES_NEEDS_DEEPSPEED,
            Engine.MEGATRON_SCHEDULES: _ULYSSES_NEEDS_DEEPSPEED,
            Engine.DEEPSPEED_PIPE: (
                "{flag} needs --no-pipeline-parallel: DeepSpeed's pipeline engine reduces "
                "gradients over the data-parallel ranks only, not the sequence-parallel ones"
            ),
        },
    ),
    Feature(
        name="context parallelism",
        flag="--context-parallel-size",
        used=lambda layout, moe: layout.context_parallel_enabled,
        engines=frozenset({Engine.PLAIN, Engine.DEEPSPEED, Engine.MEGATRON_SCHEDULES}),
        refusals={
            Engine.DEEPSPEED_PIPE: (
                "{flag} needs --no-pipeline-parallel under --deepspeed (DeepSpeed's pipeline "
                "engine reduces gradients over the data-parallel ranks only, not the context "
                "ones), or no --deepspeed for Megatron's schedules at PP above 1"
            ),
        },
    ),
    Feature(
        name="Mixture-of-Experts (DeepSpeed-MoE layers)",
        flag="--num-experts",
        used=lambda layout, moe: moe is not None,
        engines=frozenset({Engine.PLAIN, Engine.DEEPSPEED, Engine.MEGATRON_SCHEDULES}),
        refusals={
            Engine.DEEPSPEED_PIPE: (
                "{flag} needs --no-pipeline-parallel (DeepSpeed's engine), or no --deepspeed "
                "(plain torch; Megatron's pipeline schedules at PP above 1): DeepSpeed's "
                "pipeline engine neither scales nor reports the MoE loss of its stages"
            ),
        },
    ),
    Feature(
        name="expert parallelism (EP > 1)",
        flag="--moe-expert-parallel-size",
        used=lambda layout, moe: moe is not None and layout.expert_parallel > 1,
        engines=frozenset({Engine.DEEPSPEED}),
        refusals={
            engine: (
                "{flag} needs --deepspeed --no-pipeline-parallel: without DeepSpeed's engine "
                "nothing reduces expert gradients over the ranks holding the same experts; use "
                "--moe-expert-parallel-size 1"
            )
            for engine in (Engine.PLAIN, Engine.MEGATRON_SCHEDULES)
        },
    ),
    Feature(
        name="Mixture-of-Experts with tensor parallelism",
        flag="--tensor-model-parallel-size",
        used=lambda layout, moe: moe is not None and layout.tensor_parallel > 1,
        engines=frozenset({Engine.DEEPSPEED}),
        refusals={
            engine: (
                "{moe} with {flag} needs --deepspeed --no-pipeline-parallel: each "
                "tensor-parallel rank's experts take 1/TP of the tokens, and only DeepSpeed's "
                "engine sums their gradients over those ranks"
            )
            for engine in (Engine.PLAIN, Engine.MEGATRON_SCHEDULES)
        },
    ),
    Feature(
        name="Mixture-of-Experts (Megatron-LM's MoE layers)",
        flag="--num-experts",
        used=lambda layout, moe: layout.moe == "megatron",
        engines=frozenset({Engine.PLAIN, Engine.DEEPSPEED, Engine.MEGATRON_SCHEDULES}),
        refusals={
            Engine.DEEPSPEED_PIPE: (
                "{flag} with Megatron-LM's MoE flags needs --no-pipeline-parallel (DeepSpeed's "
                "engine), or no --deepspeed (plain torch; Megatron's pipeline schedules at PP "
                "above 1): DeepSpeed's pipeline engine neither scales nor reports the MoE "
                "losses of its stages"
            ),
        },
    ),
    Feature(
        name="Megatron-LM expert parallelism (EP > 1)",
        flag="--expert-model-parallel-size",
        used=lambda layout, moe: layout.moe == "megatron" and layout.expert_parallel > 1,
        engines=frozenset({Engine.PLAIN, Engine.MEGATRON_SCHEDULES}),
        refusals={
            engine: (
                "{flag} needs no --deepspeed (plain torch, or Megatron's schedules at PP above "
                "1): DeepSpeed's engine averages every gradient over all data-parallel ranks, "
                "expert ones too"
            )
            for engine in _DEEPSPEED
        },
    ),
    Feature(
        name="sharded data parallelism (torch FSDP2)",
        flag="--use-distributed-optimizer",
        used=lambda layout, moe: layout.sharding != "none",
        engines=frozenset({Engine.PLAIN, Engine.MEGATRON_SCHEDULES}),
    ),
    Feature(
        name="tensor parallelism",
        flag="--tensor-model-parallel-size",
        used=lambda layout, moe: layout.tensor_parallel > 1,
        engines=_ALL,
    ),
    Feature(
        name="Megatron sequence parallelism",
        flag="--sequence-parallel",
        used=lambda layout, moe: layout.sequence_parallel,
        engines=_ALL,
    ),
)

_SHARDING_FLAGS = {
    "none": "--use-distributed-optimizer",
    "optim_grads": "--use-distributed-optimizer (FSDP2 optim_grads)",
    "optim_grads_params": "--use-torch-fsdp2 (FSDP2 optim_grads_params)",
}

# The flag with its value, as the refusal names it.
_FLAG_VALUES: dict[str, Callable[[ParallelLayout, str | None], str]] = {
    "--zero-stage": _zero_flag,
    "--pipeline-model-parallel-size": lambda layout, moe: (
        f"--pipeline-model-parallel-size {layout.pipeline_parallel}"
    ),
    "--virtual-pipeline-model-parallel-size": lambda layout, moe: (
        f"--virtual-pipeline-model-parallel-size {layout.virtual_pipeline}"
    ),
    "--ds-sequence-parallel-size": lambda layout, moe: (
        f"--ds-sequence-parallel-size {layout.ulysses}"
    ),
    "--context-parallel-size": lambda layout, moe: (
        f"--context-parallel-size {layout.context_parallel}"
    ),
    "--use-distributed-optimizer": lambda layout, moe: _SHARDING_FLAGS[layout.sharding],
    "--num-experts": lambda layout, moe: moe or "--num-experts",
    "--moe-expert-parallel-size": lambda layout, moe: (
        f"--moe-expert-parallel-size {layout.expert_parallel}"
    ),
    "--expert-model-parallel-size": lambda layout, moe: (
        f"--expert-model-parallel-size {layout.expert_parallel}"
    ),
    "--tensor-model-parallel-size": lambda layout, moe: (
        f"--tensor-model-parallel-size {layout.tensor_parallel}"
    ),
}


class IncompatibleLayout(ValueError):
    """A layout uses a feature its engine does not run (the message is the one-line refusal)."""


def refusal(layout: ParallelLayout, moe: str | None = None) -> str | None:
    """The one-line refusal for the first feature `layout` uses that its engine does not run
    (`moe`: the MoE flags, e.g. "--num-experts 4", when the model has experts); None when the
    engine runs everything the layout asks for."""
    for feature in FEATURES:
        if not feature.used(layout, moe) or layout.engine in feature.engines:
            continue
        template = feature.refusals.get(
            layout.engine, f"{{flag}}: {feature.name} does not run on {layout.engine.description}"
        )
        value = _FLAG_VALUES.get(feature.flag)
        flag = feature.flag if value is None else value(layout, moe)
        return template.format(flag=flag, pp=layout.pipeline_parallel, moe=moe)
    return None


def check_compatibility(layout: ParallelLayout, moe: str | None = None) -> None:
    """Raise `IncompatibleLayout` with `refusal`'s line when there is one."""
    line = refusal(layout, moe)
    if line is not None:
        raise IncompatibleLayout(line)


def engines_running(name: str) -> frozenset[Engine]:
    """The engines that run the feature called `name` (a row of `FEATURES`)."""
    for feature in FEATURES:
        if feature.name == name:
            return feature.engines
    raise KeyError(f"no feature {name!r} in megatron.compatibility.FEATURES")


def zero_stages_on(engine: Engine) -> tuple[int, ...]:
    """The ZeRO stages `engine` runs (0 always; what the planner may suggest)."""
    stages = [0]
    if engine in engines_running("ZeRO stage 1"):
        stages.append(1)
    if engine in engines_running("ZeRO stages 2-3"):
        stages += [2, 3]
    return tuple(stages)


def markdown_table() -> str:
    """The table as docs/arguments.md shows it: a row per feature, a column per engine."""
    engines = list(Engine)
    lines = [
        "| feature | flag | " + " | ".join(f"`{engine.value}`" for engine in engines) + " |",
        "|---|---|" + "---|" * len(engines),
    ]
    for feature in FEATURES:
        flag = feature.flag
        marks = " | ".join("yes" if engine in feature.engines else "-" for engine in engines)
        lines.append(f"| {feature.name} | {flag} | {marks} |")
    return "\n".join(lines)
