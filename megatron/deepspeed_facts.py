"""What DeepSpeed does with a job's precision, ZeRO stage and engine, read from its source.

One place for the facts that the planner (and the checkpoint, loop and argument code that
still spell them out themselves) needs about DeepSpeed's runtime: which optimizer wrapper
`deepspeed.initialize` puts around the client optimizer, whether that wrapper partitions the
optimizer state over the data-parallel ranks, when gradients are reduced, and the default
bucket sizes. Each fact names the DeepSpeed file and function it was read from, in the
version `DEEPSPEED_VERSION_READ`; a plan's notes name that version too.

Also the one start-up setting these facts call for: `skip_deepspeed_cpu_inference_comm`.

Importing this module imports no DeepSpeed (and nothing of megatron): the planner runs
without a device, and the facts are checked against a real `deepspeed.initialize` in
tests/planning/test_deepspeed_facts.py.
"""

from __future__ import annotations

import enum
from typing import Any

DEEPSPEED_VERSION_READ = "0.19.8"
"""The DeepSpeed release these facts were read from (deepspeed/git_version_info.py)."""

_PRECISIONS = ("fp32", "bf16", "fp16")


class UnsupportedByDeepSpeed(ValueError):
    """A combination DeepSpeed itself refuses at `deepspeed.initialize`."""


class OptimizerWrapper(enum.Enum):
    """The object `engine.optimizer` is, by class name (`engine._configure_optimizer`)."""

    CLIENT = "client"
    """No wrapper: the client optimizer steps the parameters themselves (fp32 ZeRO-0)."""
    FP16_UNFUSED = "FP16_UnfusedOptimizer"
    """runtime/fp16/unfused_optimizer.py: a whole fp32 copy of every parameter, its Adam state
    whole on every rank; gradients stay in the model's half dtype until the step."""
    FP16_FUSED = "FP16_Optimizer"
    """runtime/fp16/fused_optimizer.py: the same state, flattened; only when the client
    optimizer is DeepSpeed's or apex's FusedAdam."""
    BF16 = "BF16_Optimizer"
    """runtime/bf16_optimizer.py: a whole-model gradient accumulation buffer, fp32 master
    weights and Adam state partitioned over the data-parallel ranks."""
    ZERO = "DeepSpeedZeroOptimizer"
    """runtime/zero/stage_1_and_2.py: ZeRO stage 1 or 2."""
    ZERO3 = "DeepSpeedZeroOptimizer_Stage3"
    """runtime/zero/stage3.py."""


def optimizer_wrapper(
    precision: str,
    zero_stage: int,
    pipeline_engine: bool,
    grad_accum_dtype: str | None = None,
    offload_optimizer: bool = False,
    fused_client_optimizer: bool = False,
) -> OptimizerWrapper:
    """The wrapper DeepSpeed runs for `precision` (`fp32`, `bf16`, `fp16`) at `zero_stage`,
    on its pipeline engine (`PipelineEngine`, whatever the pipeline size) or its plain one.

    `grad_accum_dtype` is the config's `data_types.grad_accum_dtype` (None: the model's
    dtype); `fused_client_optimizer`: the client optimizer is a FusedAdam (ours is
    torch.optim.AdamW, so never here). Raises `UnsupportedByDeepSpeed` where DeepSpeed does.
    """
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, not {precision!r}")
    accumulation = grad_accum_dtype or precision
    # engine.py get_data_types(): the model dtype from fp16/bf16.enabled, the accumulation
    # dtype from data_types.grad_accum_dtype (default: the model dtype).
    # engine.py _do_optimizer_sanity_check(), in its order:
    if zero_stage > 0:
        # "model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32 and
        # zero_optimization_stage() == 1 and not zero_cpu_offload()" -> BFLOAT16.
        if precision == "bf16" and accumulation == "fp32" and zero_stage == 1:
            if not offload_optimizer:
                return OptimizerWrapper.BF16
        # -> ZERO_OPTIMIZATION; _configure_zero_optimizer() picks the class by stage.
        return OptimizerWrapper.ZERO3 if zero_stage == 3 else OptimizerWrapper.ZERO
    if accumulation != precision:
        # "raise NotImplementedError(f'unsupported mix of {model_dtype=} and
        # {grad_accum_dtype=}')" at ZeRO-0.
        raise UnsupportedByDeepSpeed(
            f"DeepSpeed {DEEPSPEED_VERSION_READ} at ZeRO stage 0 accumulates {precision} "
            f"gradients in {precision} only (data_types.grad_accum_dtype {accumulation})"
        )
    if precision == "fp32":
        return OptimizerWrapper.CLIENT  # "if model_dtype == torch.float32: return None"
    if precision == "bf16" and pipeline_engine:
        # "if model_dtype == torch.bfloat16 and self.pipeline_parallelism: return BFLOAT16";
        # pipeline_parallelism = isinstance(model, PipelineModule) (DeepSpeedEngine.__init__).
        return OptimizerWrapper.BF16
    # "return FP16 if model_dtype == torch.float16 else DDP_BFLOAT16": both go through
    # _configure_fp16_optimizer(), which runs FP16_Optimizer for a FusedAdam client
    # ("use_fused_optimizer = isinstance(optimizer, fused_opts)"), else FP16_UnfusedOptimizer.
    return OptimizerWrapper.FP16_FUSED if fused_client_optimizer else OptimizerWrapper.FP16_UNFUSED


def deepspeed_optimizer_wrapper(args: Any) -> OptimizerWrapper:
    """The optimizer wrapper DeepSpeed runs for a validated run's `args`: its settled layout
    and its reconciled config's accumulation dtype and optimizer offload."""
    config = args.deepspeed_config_dict or {}
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return optimizer_wrapper(
        args.layout.precision,
        args.layout.zero_stage,
        pipeline_engine=args.layout.engine.value == "deepspeed_pipe",
        grad_accum_dtype=(config.get("data_types") or {}).get("grad_accum_dtype"),
        offload_optimizer=offload.get("device", "none") not in (None, "none"),
    )


def optimizer_state_partitioned(wrapper: OptimizerWrapper) -> bool:
    """Whether each data-parallel rank holds only its slice of the fp32 master weights and Adam
    state (a checkpoint of it resumes at the same data x sequence-parallel size only)."""
    # bf16_optimizer.py _setup_for_real_optimizer(): "partition_size = ... // real_dp_world_size"
    # and the fp32 partition is the optimizer's parameter; stage_1_and_2.py and stage3.py
    # partition by construction. The fp16 wrappers clone every parameter to fp32
    # (unfused_optimizer.py __init__: "p.clone().float().detach()").
    return wrapper in (OptimizerWrapper.BF16, OptimizerWrapper.ZERO, OptimizerWrapper.ZERO3)


def guards_steps(wrapper: OptimizerWrapper) -> bool:
    """Whether DeepSpeed's wrapper computes the gradient norm, clips and skips a non-finite
    step itself (every wrapper does; the bare client optimizer of fp32 ZeRO-0 does not)."""
    # fp16/unfused_optimizer.py step(): overflow_checker.check(), get_weight_norm;
    # bf16_optimizer.py step(): is_invalid_grad_norm -> skip; stage_1_and_2.py step().
    return wrapper is not OptimizerWrapper.CLIENT


def gradients_reduced_each_micro_batch(zero_stage: int) -> bool:
    """Whether gradients are reduced after every micro-batch's backward (ZeRO 2-3), not once
    at the accumulation boundary (ZeRO 0-1)."""
    # engine.py allreduce_gradients(): "ZeRO stage >= 2 communicates during non gradient
    # accumulation boundaries as well"; else "Communicate only at gradient accumulation
    # boundaries".
    return zero_stage >= 2


def effective_overlap_comm(zero_stage: int, configured: bool | None, pipeline_engine: bool) -> bool:
    """Whether ZeRO reduces gradient buckets on a side stream during the backward.

    `configured`: `zero_optimization.overlap_comm` as written (None when absent).
    """
    if zero_stage == 0:
        return False  # no ZeRO optimizer: the engine reduces after the backward
    # zero/config.py overlap_comm_valid(): "if self.overlap_comm is None: self.overlap_comm =
    # self.stage == ZeroStageEnum.weights".
    overlap = zero_stage == 3 if configured is None else configured
    # engine.py _configure_zero_optimizer(): "Pipeline parallelism does not support overlapped
    # communication, will be disabled." (stages 1-2 under a PipelineModule).
    if pipeline_engine and zero_stage in (1, 2):
        return False
    return overlap


PIPELINE_ENGINE_ZERO_STAGES = (0, 1)
"""pipe/engine.py PipelineEngine.__init__: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
parallelism"."""

ENGINE_ALLREDUCE_BUCKET = 500_000_000
"""Elements per flat gradient all-reduce of ZeRO-0 and BF16_Optimizer: engine.py
MEMORY_OPT_ALLREDUCE_SIZE, the bucket of allreduce_gradients() and pipe/engine.py
_exec_reduce_grads(); no config key sets it. allreduce_no_retain() closes a bucket once it
holds *more* than this many elements, and flattens (copies) it only when it holds more than one
tensor (torch's flatten of a single tensor is a view)."""

REDUCE_BUCKET_SIZE = 500_000_000
"""zero/config.py DeepSpeedZeroConfig.reduce_bucket_size: elements of ZeRO 1-2's gradient
bucket (`torch.empty(reduce_bucket_size)` in stage_1_and_2.py setup_buckets()) and of ZeRO-3's."""

ALLGATHER_BUCKET_SIZE = 500_000_000
"""zero/config.py allgather_bucket_size: ZeRO 1-2's and BF16_Optimizer's weight all-gather."""

PREFETCH_BUCKET_SIZE = 50_000_000
"""zero/config.py prefetch_bucket_size (stage3_prefetch_bucket_size)."""

PARAM_PERSISTENCE_THRESHOLD = 100_000
"""zero/config.py param_persistence_threshold: ZeRO-3 keeps smaller tensors whole."""

MAX_LIVE_PARAMETERS = 1_000_000_000
"""zero/config.py max_live_parameters (stage3_max_live_parameters)."""

MAX_REUSE_DISTANCE = 1_000_000_000
"""zero/config.py max_reuse_distance (stage3_max_reuse_distance)."""


def skip_deepspeed_cpu_inference_comm() -> None:
    """Keep `deepspeed.init_distributed` from building its CPU shared-memory all-reduce op.

    On DeepSpeed's CPU accelerator every process's `init_distributed` JIT-loads that op (used
    only by `inference_all_reduce`, which training never calls): a ninja run under a file lock
    in ~/.cache/torch_extensions, a full 23 s rebuild whenever another ninja last touched the
    build directory, and a 69 MB /dev/shm buffer per rank that nothing unlinks. A process killed
    while it holds the build lock leaves the lock behind, and every later DeepSpeed start on the
    machine then waits on it forever. Without the op, DeepSpeed uses the process group's
    all-reduce, as it does wherever the op cannot be built. No effect off the CPU accelerator.
    """
    from deepspeed import ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # DeepSpeed probes this dict once and keeps it, so the edit holds for the process.
        ops.__compatible_ops__["deepspeed_shm_comm"] = False
