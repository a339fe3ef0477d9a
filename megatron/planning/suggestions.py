"""Changes that shrink a rank's peak: ZeRO stage or FSDP2 sharding, recomputation,
micro-batch, TP, PP.

Each `Change` is what a user would edit: flags to set (or remove) on the command line and,
when the DeepSpeed config file holds the same setting, the keys to change there, so the
flags and the config still agree. `candidate_changes` lists those that apply to a job;
the dry run plans each (and pairs of them when no single one fits) and prints those that fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.compatibility import engines_running, zero_stages_on
from megatron.layout import Engine
from megatron.planning.inputs import PLANNER_ENGINES, PlanInputs

# Tensor parallelism beyond one node's GPUs crosses the network on every layer.
MAX_TENSOR_PARALLEL = 8


@dataclass(frozen=True)
class Change:
    """One edit of the job: `flags` (value None: a switch to add; False: a flag to remove)
    and `config` (top-level or nested keys of the DeepSpeed config to set)."""

    description: str
    knob: str
    """What it turns (`zero`: ZeRO or FSDP2 sharding, `recompute`, `micro-batch`, `tp`,
    `pp`): one change per knob."""
    flags: dict[str, str | None | bool]
    config: dict = field(default_factory=dict)


def _config_has(config: dict | None, *keys: str) -> bool:
    node = config or {}
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


# The plain engine's sharding strategies (megatron.arguments.sharding_flags), least first.
_FSDP_STRATEGIES = (
    ("optim_grads", "--use-distributed-optimizer"),
    ("optim_grads_params", "--use-torch-fsdp2"),
)


def _fsdp_changes(inputs: PlanInputs) -> list[Change]:
    """torch FSDP2's strategies beyond the job's own, where the compatibility table runs
    sharded data parallelism on its engine (never with experts)."""
    engine = next(kind for kind, name in PLANNER_ENGINES.items() if name == inputs.engine)
    rows = ["sharded data parallelism (torch FSDP2)"]
    if inputs.model.moe is not None:
        rows.append("sharded data parallelism of DeepSpeed-MoE layers")
    runs = all(engine in engines_running(row) for row in rows)
    if not runs or inputs.zero_group == 1:
        return []
    names = [name for name, _ in _FSDP_STRATEGIES]
    current = names.index(inputs.sharding) + 1 if inputs.fsdp else 0
    return [
        Change(
            f"FSDP2 {name} ({flag})",
            "zero",
            # The stronger flag alone: --use-torch-fsdp2 wins over --use-distributed-optimizer.
            {flag: None, **{other: False for _, other in _FSDP_STRATEGIES if other != flag}},
        )
        for name, flag in _FSDP_STRATEGIES[current:]
    ]


def _zero_changes(inputs: PlanInputs, raw_config: dict | None) -> list[Change]:
    changes = _fsdp_changes(inputs)
    stages = [stage for stage in range(4) if stage > inputs.zero.stage]
    if inputs.engine == "deepspeed-pipeline" and inputs.pp > 1:
        stages = [stage for stage in stages if stage in zero_stages_on(Engine.DEEPSPEED_PIPE)]
    if inputs.deepspeed:
        for stage in stages:
            # At PP=1, ZeRO 2-3 run on DeepSpeed's plain engine: validation switches to it.
            flags: dict[str, str | None | bool] = {"--zero-stage": str(stage)}
            config = {"zero_optimization": {"stage": stage}}
            changes.append(
                Change(
                    f"ZeRO stage {stage}",
                    "zero",
                    flags,
                    config if _config_has(raw_config, "zero_optimization", "stage") else {},
                )
            )
    elif inputs.pp == 1 and not inputs.fsdp:
        for stage in (1, 2, 3):
            changes.append(
                Change(
                    f"DeepSpeed ZeRO stage {stage}",
                    "zero",
                    {
                        "--deepspeed": None,
                        "--no-pipeline-parallel": None,
                        "--zero-stage": str(stage),
                    },
                )
            )
    return changes


def _recompute_changes(inputs: PlanInputs) -> list[Change]:
    granularity = inputs.model.recompute_granularity
    changes = []
    if granularity is None:
        changes.append(
            Change("selective recomputation", "recompute", {"--recompute-activations": None})
        )
    if granularity != "full":
        changes.append(
            Change(
                "full recomputation",
                "recompute",
                {
                    "--recompute-activations": False,
                    "--recompute-granularity": "full",
                    "--recompute-method": "uniform",
                    "--recompute-num-layers": "1",
                },
            )
        )
    return changes


def candidate_changes(
    inputs: PlanInputs, global_batch_size: int, raw_config: dict | None
) -> list[Change]:
    """Every single change that could lower this job's peak, keeping its global batch and
    its model (the DeepSpeed config's batch keys follow the flags: `batch_config`)."""
    changes = _zero_changes(inputs, raw_config) + _recompute_changes(inputs)
    global_batch = str(global_batch_size)
    b, m = inputs.micro_batch, inputs.micro_batches
    if b > 1 and b % 2 == 0:
        changes.append(
            Change(
                f"micro-batch {b // 2} with {2 * m} accumulation steps",
                "micro-batch",
                {"--micro-batch-size": str(b // 2), "--global-batch-size": global_batch},
            )
        )
    config, world = inputs.model, inputs.world_size
    per_replica = inputs.tp * inputs.pp * inputs.split
    tp = 2 * inputs.tp
    if (
        inputs.sp == 1
        and tp <= MAX_TENSOR_PARALLEL
        and config.num_attention_heads % tp == 0
        and config.num_key_value_heads % tp == 0
        and world % (per_replica * 2) == 0
        and inputs.dp >= 2
    ):
        changes.append(
            Change(
                f"tensor parallel {tp} with sequence parallelism",
                "tp",
                {
                    "--tensor-model-parallel-size": str(tp),
                    "--sequence-parallel": None,
                    "--global-batch-size": global_batch,
                },
            )
        )
    pp = 2 * inputs.pp
    pipeline_ok = inputs.engine != "deepspeed" or inputs.zero.stage in zero_stages_on(
        Engine.DEEPSPEED_PIPE
    )
    if (
        inputs.sp == 1
        and pipeline_ok
        and config.num_layers % (pp * inputs.virtual) == 0
        and world % (per_replica * 2) == 0
        and inputs.dp >= 2
    ):
        flags: dict[str, str | None | bool] = {
            "--pipeline-model-parallel-size": str(pp),
            "--global-batch-size": global_batch,
        }
        if inputs.engine == "deepspeed":
            flags["--no-pipeline-parallel"] = False  # DeepSpeed's pipeline engine runs PP
        changes.append(Change(f"pipeline parallel {pp}", "pp", flags))
    return changes


def batch_config(raw_config: dict, micro_batch: int, global_batch: int, data_parallel: int) -> dict:
    """The config's batch keys (those it has) for a changed micro-batch or data-parallel
    size at the same global batch, so they agree with the flags."""
    wanted = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": global_batch // (micro_batch * data_parallel),
        "train_batch_size": global_batch,
    }
    return {key: value for key, value in wanted.items() if _config_has(raw_config, key)}


def apply_flags(
    argv: list[str],
    flags: dict[str, str | None | bool],
    spellings: dict[str, tuple[str, ...]] | None = None,
) -> list[str]:
    """`argv` with each flag of `flags` removed (with its value) then set as asked;
    `spellings`: other flags for the same setting, removed with it."""
    result = list(argv)
    removals: dict[str, str | None | bool] = {}
    for flag in flags:
        for other in (spellings or {}).get(flag, ()):
            if other not in flags:
                removals[other] = False
    for flag, value in {**removals, **flags}.items():
        kept = []
        skip_value = False
        for token in result:
            if skip_value:
                skip_value = False
                if not token.startswith("--"):
                    continue
            if token == flag:
                skip_value = True
                continue
            if token.startswith(flag + "="):
                continue
            kept.append(token)
        result = kept
        if value is None:
            result.append(flag)
        elif value is not False:
            result += [flag, str(value)]
    return result


def merge_config(config: dict, patch: dict) -> dict:
    """A copy of `config` with `patch`'s keys set (nested dicts merged)."""
    merged = dict(config)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = value
    return merged
