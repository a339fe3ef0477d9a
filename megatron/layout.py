"""The run's parallel layout and engine: one frozen object, settled once after validation.

`ParallelLayout` holds every size (tensor, context, pipeline and virtual pipeline, data,
expert, DeepSpeed-Ulysses), whether Megatron's sequence parallelism is on, the ZeRO stage, the
precision and the `Engine` that trains the model. `megatron.arguments.validate_args` builds
it (`args.layout`) after every flag is checked; code past validation reads it by name
(`layout.engine is Engine.MEGATRON_SCHEDULES`, `layout.engine.uses_deepspeed`) instead of
re-deriving the engine from the flags. torchtitan's `ParallelDims` is the model.

Which engine runs is decided here, in `choose_engine`, and nowhere else:

- `PLAIN`: torch DDP over the data-parallel group (no `--deepspeed`, PP = 1);
- `DEEPSPEED`: DeepSpeed's engine (`--deepspeed --no-pipeline-parallel`, or ZeRO-2/3);
- `DEEPSPEED_PIPE`: DeepSpeed's `PipelineEngine` (`--deepspeed` otherwise, also at PP = 1,
  as Megatron-DeepSpeed runs it);
- `MEGATRON_SCHEDULES`: Megatron's 1F1B / interleaved schedules on
  torch.distributed.pipelining (PP > 1 without `--deepspeed`).
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass


class Engine(enum.Enum):
    """Which engine trains the model (see the module docstring)."""

    PLAIN = "plain"
    DEEPSPEED = "deepspeed"
    DEEPSPEED_PIPE = "deepspeed_pipe"
    MEGATRON_SCHEDULES = "megatron_schedules"

    @property
    def uses_deepspeed(self) -> bool:
        """Whether `deepspeed.initialize` wraps the model (DeepSpeed's config, ZeRO, files)."""
        return self in (Engine.DEEPSPEED, Engine.DEEPSPEED_PIPE)

    @property
    def cuts_stages(self) -> bool:
        """Whether the model is built as pipeline stages (also DeepSpeed's at PP = 1)."""
        return self in (Engine.DEEPSPEED_PIPE, Engine.MEGATRON_SCHEDULES)

    @property
    def description(self) -> str:
        """The engine as a user reads it in an error line."""
        return _DESCRIPTIONS[self]

    def sequence_split_gradient_scale(self, split: int, zero_stage: int) -> int:
        """The factor on the gradient of each rank's part of the per-token losses when `split`
        ranks share each sequence (context parallelism or DeepSpeed-Ulysses): `split` where
        this engine's gradient reduction averages over the split ranks, whose parts must add
        up (DDP and Megatron's schedules over data x context ranks; DeepSpeed's ZeRO-3
        reduce-scatter over sequence x data ranks), 1 where it sums them (DeepSpeed's ZeRO 0-2
        over its sequence-data-parallel group)."""
        if split == 1 or (self.uses_deepspeed and zero_stage != 3):
            return 1
        return split


_DESCRIPTIONS = {
    Engine.PLAIN: "the plain torch engine (DDP; no --deepspeed)",
    Engine.DEEPSPEED: "DeepSpeed's engine (--deepspeed --no-pipeline-parallel)",
    Engine.DEEPSPEED_PIPE: "DeepSpeed's pipeline engine (--deepspeed)",
    Engine.MEGATRON_SCHEDULES: (
        "Megatron's pipeline schedules (--pipeline-model-parallel-size > 1 without --deepspeed)"
    ),
}


def choose_engine(
    deepspeed: bool, no_pipeline_parallel: bool, pipeline_size: int, zero_stage: int
) -> Engine:
    """The engine a command line runs, as Megatron-DeepSpeed decides it: with `--deepspeed`,
    DeepSpeed's pipeline engine unless `--no-pipeline-parallel` or (at PP = 1) ZeRO-2/3, which
    that engine does not run; without it, Megatron's schedules when PP > 1."""
    if not deepspeed:
        return Engine.MEGATRON_SCHEDULES if pipeline_size > 1 else Engine.PLAIN
    if not no_pipeline_parallel and (pipeline_size > 1 or zero_stage < 2):
        return Engine.DEEPSPEED_PIPE
    return Engine.DEEPSPEED


def engine_of(args: argparse.Namespace) -> Engine:
    """`choose_engine` for a namespace (during validation, before `args.layout` exists)."""
    return choose_engine(
        bool(getattr(args, "deepspeed", False)),
        bool(getattr(args, "no_pipeline_parallel", False)),
        args.pipeline_model_parallel_size,
        getattr(args, "zero_stage", None) or 0,
    )


def _moe_kind(args: argparse.Namespace) -> str:
    if getattr(args, "routed_moe", False):
        return "megatron"
    counts = getattr(args, "num_experts", None) or [1]
    return "deepspeed" if any(count > 1 for count in counts) else "none"


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes, sharding, precision and engine of one run; frozen once validated.

    world = tensor x context x pipeline x data x ulysses (context and Ulysses never both);
    expert-parallel ranks are a subset of the data-parallel ones (DeepSpeed-MoE).
    """

    engine: Engine
    world_size: int
    tensor_parallel: int
    sequence_parallel: bool
    """Megatron's sequence parallelism (activations split over the tensor-parallel ranks)."""
    pipeline_parallel: int
    virtual_pipeline: int
    """Model chunks per pipeline rank (1 without the interleaved schedule)."""
    data_parallel: int
    expert_parallel: int
    ulysses: int
    """DeepSpeed-Ulysses' sequence-parallel size (all-to-all attention); 1 when off."""
    zero_stage: int
    precision: str
    """"fp32", "fp16" or "bf16": what the model computes in."""
    context_parallel: int = 1
    """Context-parallel size (`--context-parallel-size`: ring attention and its kin); 1 when
    off."""
    moe: str = "none"
    """Which Mixture-of-Experts: "none", "deepspeed" (DeepSpeed-MoE, Megatron-DeepSpeed's
    flags) or "megatron" (Megatron-LM's MoE, `megatron.model.moe_layer`)."""
    sharding: str = "none"
    """Sharded data parallelism without DeepSpeed (torch FSDP2): "none" (DDP), "optim_grads"
    (ZeRO-2 pattern: `--use-distributed-optimizer`) or "optim_grads_params" (ZeRO-3 pattern:
    `--use-torch-fsdp2`); see `megatron.arguments.sharding_flags`."""

    def __post_init__(self) -> None:
        product = self.tensor_parallel * self.pipeline_parallel * self.data_parallel
        if product * self.sequence_split != self.world_size:
            raise ValueError(
                f"layout sizes TP {self.tensor_parallel} x CP {self.context_parallel} x "
                f"PP {self.pipeline_parallel} x DP {self.data_parallel} x Ulysses "
                f"{self.ulysses} != world {self.world_size}"
            )
        if self.ulysses > 1 and self.context_parallel > 1:
            raise ValueError("layout: context parallelism and Ulysses both split the sequence")
        if self.sharding not in ("none", "optim_grads", "optim_grads_params"):
            raise ValueError(f"layout sharding {self.sharding!r}")
        if self.precision not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"layout precision {self.precision!r}: fp32, fp16 or bf16")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelLayout:
        """The layout of validated flags (`validate_args` calls this once, as its last step)."""
        return cls(
            engine=engine_of(args),
            world_size=args.world_size,
            tensor_parallel=args.tensor_model_parallel_size,
            sequence_parallel=bool(args.sequence_parallel),
            pipeline_parallel=args.pipeline_model_parallel_size,
            virtual_pipeline=args.virtual_pipeline_model_parallel_size or 1,
            data_parallel=args.data_parallel_size,
            expert_parallel=(
                args.expert_model_parallel_size
                if getattr(args, "routed_moe", False)
                else getattr(args, "moe_expert_parallel_size", 1) or 1
            ),
            moe=_moe_kind(args),
            ulysses=getattr(args, "ds_sequence_parallel_size", 1) or 1,
            context_parallel=getattr(args, "context_parallel_size", 1) or 1,
            sharding=getattr(args, "data_parallel_sharding", "none"),
            zero_stage=getattr(args, "zero_stage", None) or 0,
            precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        )

    @property
    def pipelined(self) -> bool:
        """More than one pipeline stage."""
        return self.pipeline_parallel > 1

    @property
    def ulysses_enabled(self) -> bool:
        """DeepSpeed-Ulysses splits the sequence over `ulysses` ranks."""
        return self.ulysses > 1

    @property
    def context_parallel_enabled(self) -> bool:
        """Context parallelism splits the sequence over `context_parallel` ranks."""
        return self.context_parallel > 1

    @property
    def sequence_split(self) -> int:
        """Ranks that split each sample's tokens (context-parallel or Ulysses), else 1."""
        return self.ulysses * self.context_parallel

    @property
    def sequence_split_gradient_scale(self) -> int:
        """This run's `Engine.sequence_split_gradient_scale` (`ModelConfig` takes it)."""
        return self.engine.sequence_split_gradient_scale(self.sequence_split, self.zero_stage)

    @property
    def optimizer_sharded_ranks(self) -> int:
        """Ranks the optimizer state is spread over under ZeRO: data x context (or Ulysses)."""
        return self.data_parallel * self.sequence_split

    def describe(self) -> str:
        """One line: the sizes and the engine, as the start-up log shows them."""
        parts = [f"TP {self.tensor_parallel}" + (" (SP)" if self.sequence_parallel else "")]
        if self.context_parallel > 1:
            parts.append(f"CP {self.context_parallel}")
        parts.append(f"PP {self.pipeline_parallel}")
        if self.virtual_pipeline > 1:
            parts.append(f"VPP {self.virtual_pipeline}")
        parts.append(f"DP {self.data_parallel}")
        if self.expert_parallel > 1:
            parts.append(f"EP {self.expert_parallel}")
        if self.ulysses > 1:
            parts.append(f"Ulysses {self.ulysses}")
        zero = f", ZeRO-{self.zero_stage}" if self.engine.uses_deepspeed else ""
        if self.sharding != "none":
            zero = f", FSDP2 {self.sharding}"
        return f"{' x '.join(parts)}, {self.precision}{zero} on {self.engine.value}"
