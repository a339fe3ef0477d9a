"""Which engine runs which feature: one declarative table, checked against the settled layout.

Each `Feature` row names the flag that asks for it, when a run uses it, the engines that run
it and why the others do not. `refusal` turns the first row a run breaks into the one-line
refusal (naming the flag and the engine): refusals of the form "this engine (at this ZeRO
stage, with this sharding) cannot run this" are rows here, and the flag checks elsewhere raise
none conditioned on the engine (tests/arguments/test_refusals_in_the_table.py). The planner's
suggestions ask `engines_running` / `zero_stages_on` instead of re-encoding a rule, and
docs/arguments.md's "Engines and features" section is generated from the table
(`markdown_table`), so adding a feature means adding a row here.

A row reads the layout and the run's other features (`RunFeatures`: the MoE flags, the
optimizer, the checkpoint format, DeepSpeed's optimizer settings, ...). Validation checks the
rows in steps (`Step`), each once what its rows read is settled and where those refusals
always stood among the other flag checks, so a command line meets the same refusal first.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron.deepspeed_facts import (
    OptimizerWrapper,
    UnsupportedByDeepSpeed,
    optimizer_state_partitioned,
    optimizer_wrapper,
)
from megatron.layout import Engine, ParallelLayout

_ALL = frozenset(Engine)
_DEEPSPEED = frozenset({Engine.DEEPSPEED, Engine.DEEPSPEED_PIPE})
_NOT_DEEPSPEED = frozenset({Engine.PLAIN, Engine.MEGATRON_SCHEDULES})


class Step(enum.Enum):
    """When validation checks a row (`megatron.arguments.engine_refusals`)."""

    SHARDING = "sharding"
    """As soon as the sharding flags are settled (`settle_sharding`), before their own
    settings and the checkpoint flags are checked."""
    LAYOUT = "layout"
    """Once the layout is built (`validate_args`), before the MoE flags' own checks."""
    HOUSEKEEPING = "housekeeping"
    """With Megatron-LM's profiling and housekeeping flags (`check_housekeeping`)."""
    OPTIMIZER = "optimizer"
    """Last: once the DeepSpeed config's gradient accumulation dtype is settled, which picks
    DeepSpeed's optimizer wrapper."""


@dataclass(frozen=True)
class RunFeatures:
    """What a run asks for beyond its layout, as the rows read it (built from the validated
    flags by `megatron.arguments.engine_refusals.run_features`; the defaults ask for nothing)."""

    moe: str | None = None
    """The DeepSpeed-MoE flags as typed (e.g. "--num-experts 4"); None without its experts."""
    sharding_flag: str = "--use-distributed-optimizer"
    """The flag that asked for FSDP2 sharding (`--use-torch-fsdp2`, `--use-megatron-fsdp` or
    `--use-distributed-optimizer`)."""
    decoupled_lr: float | None = None
    """`--decoupled-lr`: the input and output layers' own learning rate."""
    per_token_loss: bool = False
    """`--calculate-per-token-loss`."""
    optimizer: str = "adam"
    ckpt_format: str | None = None
    """The checkpoint format written: "torch" or "torch_dist"."""
    ckpt_convert_format: str | None = None
    """`--ckpt-convert-format`: the format a conversion writes, or None."""
    grad_accum_dtype: str | None = None
    """DeepSpeed's `data_types.grad_accum_dtype` (None: the model's dtype)."""
    offload_optimizer: bool = False
    """DeepSpeed's `zero_optimization.offload_optimizer` puts the optimizer on a device."""
    zero3_reduce_scatter: bool = True
    """DeepSpeed's `zero_optimization.reduce_scatter` (its default: on)."""
    mtp_layers: int | None = None
    """`--mtp-num-layers`: multi-token prediction's modules, or None."""
    muon_flags_for_deepspeed: tuple[str, ...] = ()
    """The flags Megatron-LM's Muon needs to update as DeepSpeed's Muon does (empty: it
    already does)."""
    combined_1f1b: bool = False
    """`--overlap-moe-expert-parallel-comm`: Megatron-LM's combined 1F1B."""


@dataclass(frozen=True)
class Feature:
    """One row: a feature, the engines that run it, and the refusal on each other engine."""

    name: str
    flag: str
    """The flag that asks for the feature (the docs' column)."""
    used: Callable[[ParallelLayout, RunFeatures], bool]
    """Whether a run (its layout and other features) uses the feature."""
    engines: frozenset[Engine]
    refusals: dict[Engine, str] = field(default_factory=dict)
    """The one-line refusal on each engine that does not run it; `str.format` fields:
    `{flag}` (the flag with its value), `{pp}` (the pipeline size), `{moe}` (the MoE flags),
    `{sharding}` (the sharding flag), `{precision}`, `{wrapper}` (DeepSpeed's optimizer
    wrapper), `{where}` (precision, ZeRO stage and wrapper), `{needed}` (the Muon flags)."""
    step: Step = Step.LAYOUT
    """When validation checks the row."""


def _deepspeed_optimizer(layout: ParallelLayout, run: RunFeatures) -> OptimizerWrapper | None:
    """The optimizer wrapper DeepSpeed runs (None off DeepSpeed); raises
    `UnsupportedByDeepSpeed` where DeepSpeed refuses the precision mix itself."""
    if not layout.engine.uses_deepspeed:
        return None
    return optimizer_wrapper(
        layout.precision,
        layout.zero_stage,
        pipeline_engine=layout.engine is Engine.DEEPSPEED_PIPE,
        grad_accum_dtype=run.grad_accum_dtype,
        offload_optimizer=run.offload_optimizer,
    )


def _accepted_optimizer(layout: ParallelLayout, run: RunFeatures) -> OptimizerWrapper | None:
    """`_deepspeed_optimizer`, None where DeepSpeed refuses the run itself, in its own words."""
    try:
        return _deepspeed_optimizer(layout, run)
    except UnsupportedByDeepSpeed:
        return None


def _partitioned_muon(layout: ParallelLayout, run: RunFeatures) -> bool:
    """Muon where DeepSpeed's wrapper partitions the optimizer state (ZeRO 1-3 and its
    BF16_Optimizer): DeepSpeed's own Muon runs there, not ours."""
    if run.optimizer != "muon":
        return False
    wrapper = _deepspeed_optimizer(layout, run)
    return wrapper is not None and optimizer_state_partitioned(wrapper)


def _writes_torch_dist(run: RunFeatures) -> bool:
    return "torch_dist" in (run.ckpt_format, run.ckpt_convert_format)


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
_SHARDING_WITH_DEEPSPEED = (
    "{flag} with --deepspeed: DeepSpeed shards with ZeRO (--zero-stage 1-3); drop {flag}, or "
    "drop --deepspeed for torch FSDP2"
)
_DECOUPLED_LR_ON_DEEPSPEED = (
    "{flag} with --deepspeed: a learning rate of the input and output layers' own runs on the "
    "plain engine and Megatron's schedules here"
)
_PER_TOKEN_LOSS_ON_DEEPSPEED = (
    "{flag} with --deepspeed: the per-token normalisation divides the reduced gradients by "
    "the global batch's token count, which DeepSpeed's engine does not expose before its "
    "step; it runs on the plain engine and Megatron's schedules (drop --deepspeed)"
)
_MUON_TORCH_DIST_ON_DEEPSPEED = (
    "{flag} {ckpt} torch_dist with --deepspeed: the DeepSpeed torch_dist writer saves "
    "Adam's moments only; use {ckpt} torch"
)
_MUON_EXPERTS_ON_DEEPSPEED = (
    "{flag} at {where} with Megatron-LM's MoE: DeepSpeed's Muon would orthogonalize the "
    "stacked experts transposed; use fp32 ZeRO-0 or drop --deepspeed"
)
_MUON_ON_BF16_OPTIMIZER = (
    "{flag} at {where}: DeepSpeed's BF16_Optimizer runs Muon only without a model-parallel "
    "unit, which both its engines pass; use ZeRO-2, or ZeRO-0 with --no-pipeline-parallel"
)
_MUON_ZERO3_REDUCE_SCATTER = (
    "{flag} at {where}: DeepSpeed's ZeRO-3 runs Muon only with "
    '"zero_optimization": {{"reduce_scatter": false}} in --deepspeed_config'
)
_MUON_FLAGS_ON_DEEPSPEED = (
    "{flag} at {where} runs DeepSpeed's Muon, whose update is Megatron-LM's only with "
    "{needed}; add them, or use fp32 ZeRO-0 or drop --deepspeed (Megatron-LM's Muon with any "
    "--muon-* flags)"
)
_TORCH_DIST_HALF_AT_ZERO0 = (
    "{flag} with --deepspeed {precision} at ZeRO stage 0: DeepSpeed's {wrapper} keeps its fp32 "
    "copies where its per-parameter accessors do not reach; use ZeRO stage 1-3 (or fp32)"
)

FEATURES: tuple[Feature, ...] = (
    Feature(
        name="ZeRO stage 1",
        flag="--zero-stage",
        used=lambda layout, run: layout.zero_stage == 1,
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
        used=lambda layout, run: layout.zero_stage >= 2,
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
        used=lambda layout, run: layout.pipelined,
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
        used=lambda layout, run: layout.virtual_pipeline > 1,
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
        used=lambda layout, run: layout.ulysses_enabled,
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
        used=lambda layout, run: layout.context_parallel_enabled,
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
        name="multi-token prediction",
        flag="--mtp-num-layers",
        used=lambda layout, run: run.mtp_layers is not None,
        engines=frozenset({Engine.PLAIN, Engine.DEEPSPEED, Engine.MEGATRON_SCHEDULES}),
        refusals={
            Engine.DEEPSPEED_PIPE: (
                "{flag} does not run on DeepSpeed's pipeline engine (its last stage receives "
                "hidden states only, not the token ids multi-token prediction embeds): add "
                "--no-pipeline-parallel, or drop --deepspeed for Megatron's pipeline schedules"
            ),
        },
    ),
    Feature(
        name="Mixture-of-Experts (DeepSpeed-MoE layers)",
        flag="--num-experts",
        used=lambda layout, run: run.moe is not None,
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
        used=lambda layout, run: run.moe is not None and layout.expert_parallel > 1,
        engines=frozenset({Engine.DEEPSPEED}),
        refusals={
            engine: (
                "{flag} needs --deepspeed --no-pipeline-parallel: without DeepSpeed's engine "
                "nothing reduces expert gradients over the ranks holding the same experts; use "
                "--moe-expert-parallel-size 1"
            )
            for engine in _NOT_DEEPSPEED
        },
    ),
    Feature(
        name="Mixture-of-Experts with tensor parallelism",
        flag="--tensor-model-parallel-size",
        used=lambda layout, run: run.moe is not None and layout.tensor_parallel > 1,
        engines=frozenset({Engine.DEEPSPEED}),
        refusals={
            engine: (
                "{moe} with {flag} needs --deepspeed --no-pipeline-parallel: each "
                "tensor-parallel rank's experts take 1/TP of the tokens, and only DeepSpeed's "
                "engine sums their gradients over those ranks"
            )
            for engine in _NOT_DEEPSPEED
        },
    ),
    Feature(
        name="Mixture-of-Experts (Megatron-LM's MoE layers)",
        flag="--num-experts",
        used=lambda layout, run: layout.moe == "megatron",
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
        used=lambda layout, run: layout.moe == "megatron" and layout.expert_parallel > 1,
        engines=_NOT_DEEPSPEED,
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
        used=lambda layout, run: layout.sharding != "none",
        engines=_NOT_DEEPSPEED,
        refusals={engine: _SHARDING_WITH_DEEPSPEED for engine in _DEEPSPEED},
        step=Step.SHARDING,
    ),
    # DeepSpeed's engine shards an MoE model with ZeRO; FSDP2 does not shard expert layers.
    Feature(
        name="sharded data parallelism of DeepSpeed-MoE layers",
        flag="--num-experts",
        used=lambda layout, run: run.moe is not None and layout.sharding != "none",
        engines=frozenset({Engine.DEEPSPEED}),
        refusals={
            engine: (
                "{sharding} with {flag}: FSDP2 over expert layers is not built here; use "
                "--deepspeed --no-pipeline-parallel with ZeRO"
            )
            for engine in _NOT_DEEPSPEED
        },
    ),
    Feature(
        name="tensor parallelism",
        flag="--tensor-model-parallel-size",
        used=lambda layout, run: layout.tensor_parallel > 1,
        engines=_ALL,
    ),
    Feature(
        name="Megatron sequence parallelism",
        flag="--sequence-parallel",
        used=lambda layout, run: layout.sequence_parallel,
        engines=_ALL,
    ),
    # DeepSpeed's optimizer wrappers rebuild the param groups without the learning-rate keys.
    Feature(
        name="decoupled learning rate (input and output layers)",
        flag="--decoupled-lr",
        used=lambda layout, run: run.decoupled_lr is not None,
        engines=_NOT_DEEPSPEED,
        refusals={engine: _DECOUPLED_LR_ON_DEEPSPEED for engine in _DEEPSPEED},
        step=Step.HOUSEKEEPING,
    ),
    # DeepSpeed's engine averages the gradients over micro-batches and ranks inside its step;
    # the division by the global batch's token count has no place there.
    Feature(
        name="per-token loss normalisation",
        flag="--calculate-per-token-loss",
        used=lambda layout, run: run.per_token_loss,
        engines=_NOT_DEEPSPEED,
        refusals={engine: _PER_TOKEN_LOSS_ON_DEEPSPEED for engine in _DEEPSPEED},
        step=Step.HOUSEKEEPING,
    ),
    # Megatron-LM's Muon (megatron.training.muon) runs whole on the plain engine and Megatron's
    # schedules, and on DeepSpeed where its wrapper hands whole parameters to the client
    # optimizer (fp32 ZeRO-0; bf16 ZeRO-0 without the pipeline engine). Where the wrapper
    # partitions the optimizer state, DeepSpeed 0.19.8's own Muon (runtime/zero/muon) runs;
    # the rows below refuse it where it cannot run or would not update as ours does.
    Feature(
        name="Muon with torch_dist checkpoints",
        flag="--optimizer",
        used=lambda layout, run: run.optimizer == "muon" and _writes_torch_dist(run),
        engines=_NOT_DEEPSPEED,
        refusals={engine: _MUON_TORCH_DIST_ON_DEEPSPEED for engine in _DEEPSPEED},
        step=Step.OPTIMIZER,
    ),
    # DeepSpeed's Muon orthogonalizes a 3-D tensor as a batch of its [in, out] slices: the
    # transposes of megatron-core's expert matrices, which shape_scaling tells apart.
    Feature(
        name="Muon with Megatron-LM's MoE, where DeepSpeed partitions the optimizer state",
        flag="--optimizer",
        used=lambda layout, run: layout.moe == "megatron" and _partitioned_muon(layout, run),
        engines=_NOT_DEEPSPEED,
        refusals={engine: _MUON_EXPERTS_ON_DEEPSPEED for engine in _DEEPSPEED},
        step=Step.OPTIMIZER,
    ),
    # bf16_optimizer.py: "BF16 Muon currently requires FP32 accumulation, dense DP and eager
    # execution" (no mpu: both engines pass one).
    Feature(
        name="Muon in bf16, where DeepSpeed runs its BF16_Optimizer",
        flag="--optimizer",
        used=lambda layout, run: (
            _partitioned_muon(layout, run)
            and _deepspeed_optimizer(layout, run) is OptimizerWrapper.BF16
        ),
        engines=_NOT_DEEPSPEED,
        refusals={engine: _MUON_ON_BF16_OPTIMIZER for engine in _DEEPSPEED},
        step=Step.OPTIMIZER,
    ),
    Feature(
        name="Muon, where DeepSpeed's ZeRO-3 reduce-scatters gradients",
        flag="--optimizer",
        used=lambda layout, run: (
            _partitioned_muon(layout, run) and layout.zero_stage == 3 and run.zero3_reduce_scatter
        ),
        engines=_NOT_DEEPSPEED,
        refusals={engine: _MUON_ZERO3_REDUCE_SCATTER for engine in _DEEPSPEED},
        step=Step.OPTIMIZER,
    ),
    Feature(
        name="Muon with Megatron-LM's flags, where DeepSpeed partitions the optimizer state",
        flag="--optimizer",
        used=lambda layout, run: (
            _partitioned_muon(layout, run) and bool(run.muon_flags_for_deepspeed)
        ),
        engines=_NOT_DEEPSPEED,
        refusals={engine: _MUON_FLAGS_ON_DEEPSPEED for engine in _DEEPSPEED},
        step=Step.OPTIMIZER,
    ),
    Feature(
        name="Megatron-LM's combined 1F1B (expert all-to-all hidden behind compute)",
        flag="--overlap-moe-expert-parallel-comm",
        used=lambda layout, run: run.combined_1f1b,
        engines=frozenset({Engine.PLAIN}),
        refusals={
            Engine.MEGATRON_SCHEDULES: (
                "{flag} with --pipeline-model-parallel-size {pp}: the combined 1F1B is built "
                "for PP = 1 here (Megatron-LM's interleaves it into the pipeline schedule)"
            ),
            **dict.fromkeys(
                _DEEPSPEED,
                "{flag} with --deepspeed: the combined 1F1B runs each micro-batch's backward "
                "beside the next forward, which DeepSpeed's engine does not; drop --deepspeed",
            ),
        },
    ),
    Feature(
        name="torch_dist checkpoints",
        flag="--ckpt-format",
        used=lambda layout, run: _writes_torch_dist(run),
        engines=frozenset({Engine.PLAIN, Engine.DEEPSPEED, Engine.MEGATRON_SCHEDULES}),
        refusals={
            Engine.DEEPSPEED_PIPE: (
                "{flag} with DeepSpeed's pipeline engine: not built; add --no-pipeline-parallel "
                "(PP = 1), or run the pipeline without --deepspeed (Megatron's schedules)"
            ),
        },
        step=Step.OPTIMIZER,
    ),
    # DeepSpeed's fp16 wrappers (also bf16's at ZeRO-0 on its plain engine) keep the fp32
    # master weights and Adam state outside DeepSpeed's per-parameter accessors.
    Feature(
        name="torch_dist checkpoints in fp16/bf16 at ZeRO stage 0",
        flag="--ckpt-format",
        used=lambda layout, run: (
            _writes_torch_dist(run)
            and _accepted_optimizer(layout, run)
            in (OptimizerWrapper.FP16_UNFUSED, OptimizerWrapper.FP16_FUSED)
        ),
        engines=_NOT_DEEPSPEED,
        refusals={engine: _TORCH_DIST_HALF_AT_ZERO0 for engine in _DEEPSPEED},
        step=Step.OPTIMIZER,
    ),
)

# The flag with its value, as the refusal names it.
_FLAG_VALUES: dict[str, Callable[[ParallelLayout, RunFeatures], str]] = {
    "--zero-stage": lambda layout, run: f"--zero-stage {layout.zero_stage}",
    "--pipeline-model-parallel-size": lambda layout, run: (
        f"--pipeline-model-parallel-size {layout.pipeline_parallel}"
    ),
    "--virtual-pipeline-model-parallel-size": lambda layout, run: (
        f"--virtual-pipeline-model-parallel-size {layout.virtual_pipeline}"
    ),
    "--ds-sequence-parallel-size": lambda layout, run: (
        f"--ds-sequence-parallel-size {layout.ulysses}"
    ),
    "--context-parallel-size": lambda layout, run: (
        f"--context-parallel-size {layout.context_parallel}"
    ),
    "--use-distributed-optimizer": lambda layout, run: run.sharding_flag,
    "--num-experts": lambda layout, run: run.moe or "--num-experts",
    "--mtp-num-layers": lambda layout, run: f"--mtp-num-layers {run.mtp_layers}",
    "--moe-expert-parallel-size": lambda layout, run: (
        f"--moe-expert-parallel-size {layout.expert_parallel}"
    ),
    "--expert-model-parallel-size": lambda layout, run: (
        f"--expert-model-parallel-size {layout.expert_parallel}"
    ),
    "--tensor-model-parallel-size": lambda layout, run: (
        f"--tensor-model-parallel-size {layout.tensor_parallel}"
    ),
    "--decoupled-lr": lambda layout, run: f"--decoupled-lr {run.decoupled_lr}",
    "--optimizer": lambda layout, run: f"--optimizer {run.optimizer}",
    "--ckpt-format": lambda layout, run: (
        "--ckpt-format torch_dist"
        if run.ckpt_format == "torch_dist"
        else "--ckpt-convert-format torch_dist"
    ),
}


class IncompatibleLayout(ValueError):
    """A layout uses a feature its engine does not run (the message is the one-line refusal)."""


def refusal(
    layout: ParallelLayout, run: RunFeatures | None = None, step: Step | None = None
) -> str | None:
    """The one-line refusal for the first feature a run (`layout` and `run`, which defaults to
    asking for nothing beyond the layout) uses that its engine does not run, among the rows
    validation checks at `step` (None: every row); None when the engine runs them all.
    Raises `UnsupportedByDeepSpeed` where a Muon row meets a precision mix DeepSpeed refuses."""
    run = RunFeatures() if run is None else run
    for feature in FEATURES:
        if step is not None and feature.step is not step:
            continue
        if not feature.used(layout, run) or layout.engine in feature.engines:
            continue
        template = feature.refusals.get(
            layout.engine, f"{{flag}}: {feature.name} does not run on {layout.engine.description}"
        )
        value = _FLAG_VALUES.get(feature.flag)
        flag = feature.flag if value is None else value(layout, run)
        wrapper = _accepted_optimizer(layout, run)
        return template.format(
            flag=flag,
            pp=layout.pipeline_parallel,
            moe=run.moe,
            sharding=run.sharding_flag,
            precision=layout.precision,
            wrapper=None if wrapper is None else wrapper.value,
            where=(
                None
                if wrapper is None
                else f"{layout.precision} ZeRO-{layout.zero_stage} ({wrapper.value})"
            ),
            needed=" ".join(run.muon_flags_for_deepspeed),
            ckpt="--ckpt-format" if run.ckpt_format == "torch_dist" else "--ckpt-convert-format",
        )
    return None


def check_compatibility(layout: ParallelLayout, run: RunFeatures | None = None) -> None:
    """Raise `IncompatibleLayout` with `refusal`'s line when there is one."""
    line = refusal(layout, run)
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
