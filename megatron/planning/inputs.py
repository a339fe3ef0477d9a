"""What a plan is computed from: the validated flags and DeepSpeed config, typed once.

`PlanInputs.from_args` reads the namespace `parse_args` returns (the same validation as a
real run) and DeepSpeed's own parse of the `zero_optimization` section, so bucket sizes and
thresholds have DeepSpeed's defaults and spellings. Nothing here starts a device.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron.config import ModelConfig
from megatron.deepspeed_facts import (
    ALLGATHER_BUCKET_SIZE,
    MAX_LIVE_PARAMETERS,
    MAX_REUSE_DISTANCE,
    PARAM_PERSISTENCE_THRESHOLD,
    PREFETCH_BUCKET_SIZE,
    REDUCE_BUCKET_SIZE,
    OptimizerWrapper,
    UnsupportedByDeepSpeed,
    optimizer_wrapper,
)
from megatron.layout import Engine
from megatron.settled_args import with_settled

# GPT-2's vocabulary size: the plan's vocabulary when the tokenizer's files are not here.
GPT2_VOCAB_SIZE = 50257


class PlanningError(ValueError):
    """The planner cannot plan this job; the message says why, naming the setting."""


PLANNER_ENGINES = {
    Engine.PLAIN: "plain",
    Engine.DEEPSPEED: "deepspeed",
    Engine.DEEPSPEED_PIPE: "deepspeed-pipeline",
    Engine.MEGATRON_SCHEDULES: "megatron-pipeline",
}
"""The planner's names for the engines (its tables and plan files use them)."""


@dataclass(frozen=True)
class ZeroSettings:
    """The `zero_optimization` values the memory and communication models read."""

    stage: int = 0
    reduce_bucket_size: int = REDUCE_BUCKET_SIZE
    """Elements per gradient reduction bucket (DeepSpeed's default 5e8)."""
    allgather_bucket_size: int = ALLGATHER_BUCKET_SIZE
    """Elements per parameter all-gather bucket after a ZeRO-1/2 step."""
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    param_persistence_threshold: int = PARAM_PERSISTENCE_THRESHOLD
    """ZeRO-3: parameters with fewer elements stay whole on every rank."""
    prefetch_bucket_size: int = PREFETCH_BUCKET_SIZE
    max_live_parameters: int = MAX_LIVE_PARAMETERS
    max_reuse_distance: int = MAX_REUSE_DISTANCE
    """ZeRO-3: a gathered parameter used again within this many elements stays gathered."""
    communication_bytes: int | None = None
    """`communication_data_type` of the config (bytes per element), None: the model's dtype."""
    offload_optimizer: bool = False
    """Optimizer states (and ZeRO's fp32 master weights) in host memory, not on the GPU."""
    offload_param: bool = False


@dataclass(frozen=True)
class PlanInputs:
    """One training job as the planner sees it: model shape, layout, precision, engine."""

    model: ModelConfig
    world_size: int
    tp: int
    pp: int
    dp: int
    sp: int
    """DeepSpeed-Ulysses sequence-parallel size (`--ds-sequence-parallel-size`)."""
    cp: int
    """Context-parallel size (`--context-parallel-size`); the per-layer ways its attention
    exchanges keys and values are the model's `cp_comm_types` (`cp_comm_type`)."""
    ep: int
    virtual: int
    """Model chunks per pipeline rank (interleaved 1F1B), else 1."""
    micro_batch: int
    seq_length: int
    micro_batches: int
    """Micro-batches per iteration on each data-parallel rank (gradient accumulation)."""
    precision: str
    """`fp32`, `bf16` or `fp16`."""
    engine: str
    """`plain` (DDP or FSDP2, see `sharding`), `megatron-pipeline`, `deepspeed` or
    `deepspeed-pipeline`."""
    zero: ZeroSettings
    grad_accum_dtype: str
    """The dtype micro-batch gradients are summed in (`fp32`, `bf16`, `fp16`)."""
    device_type: str
    """`cuda` or `cpu`: where the run's tensors live (decides the attention kernels)."""
    sharding: str = "none"
    """The plain engine's sharded data parallelism (torch FSDP2; the layout's `sharding`):
    `none` (DDP), `optim_grads` (`--use-distributed-optimizer`) or `optim_grads_params`
    (`--use-torch-fsdp2`)."""
    grad_reduce_dtype: str = "fp32"
    """FSDP2's `reduce_dtype`: `fp32`, or `bf16` with `--grad-reduce-in-bf16`."""
    checkpoint_format: str = "torch"
    """`--ckpt-format` as validation settled it (`torch` or `torch_dist`)."""
    checkpoints: bool = False
    """Whether the run saves or loads checkpoints (`--save` or `--load`)."""
    compute_capability: tuple[int, int] | None = None
    """The GPU's (major, minor), for the runtime's rules the plan asks (`--moe-grouped-gemm`'s
    `moe_experts.grouped_mm_runs`): the named device's (`--dry-run-device`, set by
    `build_plan`), else this machine's where CUDA is already up (a run's own plan). None on
    CPU, and for a GPU a dry run does not know (it starts no device), which the plan takes
    for Hopper's (`routed_moe.UNKNOWN_GPU_CAPABILITY`)."""

    @property
    def fsdp(self) -> bool:
        """Whether torch FSDP2 shards the plain engine's model over the data x context ranks."""
        return self.sharding != "none"

    @property
    def split(self) -> int:
        """Ranks that split each sequence (Ulysses or context parallel; never both), else 1."""
        return self.sp * self.cp

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence on one rank: s / (Ulysses or context-parallel size)."""
        return self.seq_length // self.split

    @property
    def zero_group(self) -> int:
        """Ranks ZeRO partitions over (and gradients are summed over): data parallel x the
        sequence split (Ulysses' or context parallelism's)."""
        return self.dp * self.split

    def cp_comm_type(self, layer_number: int) -> str:
        """How context-parallel attention exchanges keys and values in layer `layer_number`
        (1-based): `p2p`, `allgather` or `a2a` (`--cp-comm-type`, one or one per layer)."""
        types = self.model.cp_comm_types
        return types[(layer_number - 1) % len(types)]

    @property
    def deepspeed(self) -> bool:
        """Whether DeepSpeed's engine (either form) runs the step."""
        return self.engine.startswith("deepspeed")

    @property
    def wrapper(self) -> OptimizerWrapper | None:
        """The optimizer wrapper DeepSpeed runs for this job (None without DeepSpeed)."""
        if not self.deepspeed:
            return None
        try:
            return optimizer_wrapper(
                self.precision,
                self.zero.stage,
                self.engine == "deepspeed-pipeline",
                self.grad_accum_dtype,
                offload_optimizer=self.zero.offload_optimizer,
            )
        except UnsupportedByDeepSpeed as refused:
            raise PlanningError(f"{refused}: deepspeed.initialize would refuse it") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace, device_type: str) -> PlanInputs:
        """The plan's view of validated `args` on a machine with `device_type` tensors."""
        config = ModelConfig.from_args(with_vocabulary(args))
        zero = _zero_settings(args)
        engine = PLANNER_ENGINES[args.layout.engine]
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        return cls(
            model=config,
            world_size=args.world_size,
            tp=args.tensor_model_parallel_size,
            pp=args.pipeline_model_parallel_size,
            dp=args.data_parallel_size,
            sp=getattr(args, "ds_sequence_parallel_size", 1) or 1,
            cp=args.layout.context_parallel,
            ep=args.layout.expert_parallel,
            virtual=getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
            micro_batch=args.micro_batch_size,
            seq_length=args.seq_length,
            micro_batches=args.gradient_accumulation_steps,
            precision=precision,
            engine=engine,
            zero=zero,
            grad_accum_dtype=_grad_accum_dtype(args, precision),
            device_type=device_type,
            sharding=args.layout.sharding,
            grad_reduce_dtype="bf16" if getattr(args, "grad_reduce_in_bf16", False) else "fp32",
            checkpoint_format=getattr(args, "ckpt_format", "torch") or "torch",
            checkpoints=bool(getattr(args, "save", None) or getattr(args, "load", None)),
            compute_capability=_started_gpu_capability(device_type),
        )


def with_vocabulary(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with `padded_vocab_size` added (a new namespace), as a real run adds it.

    A dry run needs no files: with the tokenizer's files here (or with NullTokenizer, which
    reads none) the tokenizer is built (as the run would); without them `--vocab-size` is
    taken where given (a published model's command line names its vocabulary so), else
    GPT-2's 50,257 tokens are assumed; the plan says which.
    """
    if getattr(args, "padded_vocab_size", None):
        return args
    from megatron.tokenizer.tokenizer import tokenizer_with_sizes, vocab_size_with_padding

    files = [getattr(args, name, None) for name in ("vocab_file", "tokenizer_model")]
    fileless = getattr(args, "tokenizer_type", None) == "NullTokenizer"
    if fileless or any(path and os.path.exists(path) for path in files):
        _, sizes = tokenizer_with_sizes(args, verbose=False)  # no start-up lines: a plan
        return with_settled(args, **sizes)
    given = getattr(args, "vocab_size", None)
    if given:
        note = f"vocabulary: the tokenizer's files are not here; --vocab-size {given:,} tokens"
    else:
        note = (
            f"vocabulary: the tokenizer's files are not here; assumed GPT-2's "
            f"{GPT2_VOCAB_SIZE:,} tokens"
        )
    padded = vocab_size_with_padding(
        given or GPT2_VOCAB_SIZE,
        getattr(args, "make_vocab_size_divisible_by", 128),
        args.tensor_model_parallel_size,
        verbose=False,
    )
    return with_settled(
        args, plan_notes=[*getattr(args, "plan_notes", []), note], padded_vocab_size=padded
    )


def _zero_settings(args: argparse.Namespace) -> ZeroSettings:
    """DeepSpeed's own parse of the config's `zero_optimization` (its defaults, its aliases)."""
    if not args.deepspeed:
        return ZeroSettings()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    section = dict((args.deepspeed_config_dict or {}).get("zero_optimization") or {})
    section["stage"] = args.zero_stage
    parsed = DeepSpeedZeroConfig(**section)

    def offloaded(part: object) -> bool:
        """Whether an offload section sends its tensors to host memory (or NVMe)."""
        device = getattr(part, "device", None)
        return part is not None and str(getattr(device, "value", device)) in ("cpu", "nvme")

    return ZeroSettings(
        stage=args.zero_stage,
        reduce_bucket_size=int(parsed.reduce_bucket_size),
        allgather_bucket_size=int(parsed.allgather_bucket_size),
        overlap_comm=bool(parsed.overlap_comm),
        contiguous_gradients=bool(parsed.contiguous_gradients),
        param_persistence_threshold=int(parsed.param_persistence_threshold),
        prefetch_bucket_size=int(parsed.prefetch_bucket_size),
        max_live_parameters=int(parsed.max_live_parameters),
        max_reuse_distance=int(parsed.max_reuse_distance),
        communication_bytes=_communication_bytes(
            args.deepspeed_config_dict or {}, getattr(args, "ds_sequence_parallel_size", 1) or 1
        ),
        offload_optimizer=offloaded(parsed.offload_optimizer),
        offload_param=offloaded(parsed.offload_param),
    )


def _communication_bytes(config: dict, sequence_parallel: int) -> int | None:
    """Bytes per element of the config's `communication_data_type`, if it sets one; under
    DeepSpeed-Ulysses `seq_parallel_communication_data_type` (DeepSpeed's default fp32)."""
    wanted = config.get("communication_data_type")
    if sequence_parallel > 1:
        wanted = config.get("seq_parallel_communication_data_type", "fp32")
    if wanted is None:
        return None
    return 4 if str(wanted).lower() in ("fp32", "float32", "float", "torch.float32") else 2


def _grad_accum_dtype(args: argparse.Namespace, precision: str) -> str:
    if not args.deepspeed or precision == "fp32":
        return "fp32"  # the plain path keeps fp32 parameters and gradients under autocast
    # As megatron.arguments.ds_config.gradient_accumulation_dtype reads the reconciled config.
    types = (args.deepspeed_config_dict or {}).get("data_types") or {}
    fp32 = types.get("grad_accum_dtype") in ("fp32", "float32", "float", "torch.float32")
    return "fp32" if fp32 else precision


def _started_gpu_capability(device_type: str) -> tuple[int, int] | None:
    """This machine's GPU's compute capability where CUDA is already up (a run planning
    itself); None on CPU, and where CUDA is not started: a dry run starts no device."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_initialized():
        return None
    return torch.cuda.get_device_capability()
