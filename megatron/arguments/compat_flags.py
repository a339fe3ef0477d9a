"""Megatron-DeepSpeed and Megatron-LM flags that have no effect here, or name features we lack.

Users bring command lines that work on Megatron-DeepSpeed. Every flag of its `arguments.py`
(and the Megatron-LM spellings users carry over) parses here, so a script never dies on
argparse's "unrecognized arguments". Each flag below is one of two kinds:

- inert: accepted and without effect, because what it tunes does not exist here (apex kernels,
  Megatron's own DDP and pipeline communication, GPU overlap knobs) or cannot change the
  result. Its help text says why; docs/arguments.md lists them all.
- refused: a feature we do not build (Tutel, DeepSpeed's FPDT, zero-bubble pipelines, other
  model families). Its value that means "off" (`--transformer-impl local`) is accepted; any
  other value is refused in one line naming the flag (`refuse_unsupported_flags`, run by
  validate_args).

Flags that have a meaning here are in `model_flags.py`, `run_flags.py`, `parallel_flags.py`
and `moe_flags.py`, Megatron-DeepSpeed's
other spellings of them as extra option strings there (`--override-opt_param-scheduler`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.arguments.errors import ArgumentError


def _bool(text: str) -> bool:
    """Megatron's `type=bool` flags take any word; read the usual spellings of false as False."""
    return text.strip().lower() not in ("0", "false", "no", "off", "")


# argparse keyword arguments per value kind of a flag.
_KINDS: dict[str, dict[str, Any]] = {
    "switch": {"action": "store_true"},
    "int": {"type": int},
    "float": {"type": float},
    "str": {"type": str},
    "bool": {"type": _bool},
    "ints": {"type": int, "nargs": "+"},
    "strs": {"type": str, "nargs": "*"},
}


@dataclass(frozen=True)
class CompatFlag:
    """One flag of theirs: how it parses, whether it is refused, and why."""

    option: str
    kind: str
    reason: str
    refused: bool
    # For refused flags: the value(s) that mean the feature is off, accepted without a word.
    accepts: Callable[[Any, argparse.Namespace], bool] | None = None

    @property
    def dest(self) -> str:
        """The namespace attribute (their dest with the leading dashes dropped)."""
        return self.option.lstrip("-").replace("-", "_")


def _inert(reason: str, *specs: str) -> list[CompatFlag]:
    """Flags `--name:kind` accepted without effect, for `reason`."""
    return [CompatFlag(*_split(spec), reason=reason, refused=False) for spec in specs]


def _refused(
    reason: str, *specs: str, accepts: Callable[[Any, argparse.Namespace], bool] | None = None
) -> list[CompatFlag]:
    """Flags `--name:kind` refused (unless `accepts` their value) because of `reason`."""
    return [
        CompatFlag(*_split(spec), reason=reason, refused=True, accepts=accepts) for spec in specs
    ]


def _split(spec: str) -> tuple[str, str]:
    option, _, kind = spec.partition(":")
    return option, kind or "switch"


def _equals(*values: Any) -> Callable[[Any, argparse.Namespace], bool]:
    return lambda value, args: value in values


INERT: list[CompatFlag] = [
    *_inert(
        "apex's fused LayerNorm kernels; LayerNorm here is torch's",
        "--disable-mem-efficient-ln",
        "--no-persist-layer-norm",
    ),
    *_inert(
        "GPU overlap of tensor-parallel all-reduce and fused weight-gradient accumulation; "
        "the gradients are the same (Megatron-DeepSpeed turns the overlap off under "
        "--deepspeed too)",
        "--no-async-tensor-model-parallel-allreduce",
        "--no-gradient-accumulation-fusion",
    ),
    *_inert("an ONNX-export workaround; training is the same", "--onnx-safe:bool"),
    *_inert(
        "where the optimizer runs; move it with the DeepSpeed config's "
        "zero_optimization.offload_optimizer (the update is the same Adam)",
        "--cpu-optimizer",
        "--cpu_torch_adam",
        "--ds_fused_adam",
    ),
    *_inert(
        "Megatron's local DDP and its buffers; gradients accumulate and reduce in fp32 here "
        "anyway: torch DDP's are fp32, FSDP2 accumulates micro-batches in its fp32 "
        "reduce_dtype (bf16 only with --grad-reduce-in-bf16), and under --deepspeed the "
        "DeepSpeed config's data_types.grad_accum_dtype decides",
        "--accumulate-allreduce-grads-in-fp32",
        "--no-contiguous-buffers-in-local-ddp",
    ),
    *_inert(
        "Megatron's own pipeline communication; DeepSpeed's pipeline engine does its own",
        "--overlap-p2p-communication",
        "--no-scatter-gather-tensors-in-pipeline",
        "--use-ring-exchange-p2p",
    ),
    *_inert(
        "torch.cuda.empty_cache() calls against allocator fragmentation; results are the same",
        "--empty-unused-memory-level:int",
    ),
    *_inert(
        "a barrier before level-1 timers changes only what the timers measure",
        "--no-barrier-with-level-1-timing",
    ),
    *_inert(
        "read nowhere in Megatron-DeepSpeed; ZeRO is tuned in the DeepSpeed config",
        "--use-pin-memory",
        "--no-load-lr-state",
    ),
    *_inert(
        "where ZeRO-3 first places the parameters; use the DeepSpeed config's "
        "zero_optimization.offload_param",
        "--remote-device:str",
    ),
    *_inert(
        "memory-saving experiments of Megatron-DeepSpeed that its GPT model never reads",
        "--scattered-embeddings",
        "--split-transformers",
        "--memory-centric-tiled-linear",
        "--tile-factor:int",
    ),
    *_inert(
        "start-up speed only: weights are always initialized, then loaded",
        "--no-initialization",
    ),
    *_inert(
        "text-generation server limits, unused in pretraining",
        "--inference-batch-times-seqlen-threshold:int",
        "--max-tokens-to-oom:int",
    ),
    *_inert(
        "Megatron-LM's choice of its own implementation of the same GPT; there is one here",
        "--use-mcore-models",
        "--use-legacy-models",
    ),
    *_inert(
        "Megatron-LM's choice between its local layers and Transformer Engine's kernels for the "
        "same layers; torch's kernels run them here (FP8, Transformer Engine's other use, runs "
        "through torchao under --fp8-format)",
        "--transformer-impl:str",
    ),
    *_inert(
        "attention's softmax runs in fp32 here whatever the training precision (torch's SDPA "
        "and flash kernels accumulate in fp32)",
        "--attention-softmax-in-fp32",
    ),
    *_inert(
        "Megatron-LM's kernel-fusion switches; torch (and --torch-compile) choose the kernels "
        "here, and the results are the same",
        "--cross-entropy-loss-fusion",
        "--no-rope-fusion",
    ),
    *_inert(
        "Megatron-FSDP's buffer and NCCL-registration options; torch FSDP2, which runs "
        "--use-megatron-fsdp here, manages its own buffers",
        "--fsdp-double-buffer",
        "--fsdp-manual-registration",
        "--use-nccl-ub",
    ),
    *_inert(
        "torch FSDP2 sharding (--use-torch-fsdp2, --use-distributed-optimizer, "
        "--use-megatron-fsdp) always starts so here: the model is built on the meta device "
        "and each rank initializes only its own shards, with a whole build's weights bit for "
        "bit; without it (DDP, and DeepSpeed's engines, whose ZeRO-3 partitions the model "
        "once built) every rank builds the whole model",
        "--init-model-with-meta-device",
    ),
    *_inert(
        "the data loader builds no attention mask here (causal attention, or document ids "
        "under --reset-attention-mask)",
        "--no-create-attention-mask-in-dataloader",
    ),
    *_inert(
        "how .bin files are read (memory-mapped here); the tokens are the same",
        "--no-mmap-bin-files",
    ),
    *_inert(
        "Megatron-LM raises on a NaN loss or gradient unless this is given; here such a step is "
        "skipped and counted in the log line ('number of nan iterations') either way",
        "--no-check-for-nan-in-loss-and-grad",
    ),
    *_inert(
        "Megatron-LM's gate for its experimental features; each feature here has its own "
        "flag (and what is not built is refused by its own flag)",
        "--enable-experimental",
    ),
    *_inert(
        "Megatron-LM's attention kernel choice; torch's SDPA picks flash or memory-efficient "
        "kernels on GPUs (--use-flash-attn asks for flash attention explicitly)",
        "--attention-backend:str",
    ),
    *_inert(
        "ModelOpt's export choice of megatron-core's local attention over Transformer Engine's: "
        "one attention implementation here",
        "--export-force-local-attention",
    ),
]

REFUSED: list[CompatFlag] = [
    *_refused(
        "Tutel's MoE kernels are not built here; DeepSpeed-MoE's own dispatch runs the experts",
        "--use-tutel",
    ),
    *_refused(
        "Megatron-LM's SwitchMLP is not built here; use --num-experts (DeepSpeed-MoE)",
        "--num-experts-switch:int",
    ),
    *_refused(
        "DeepSpeed's FPDT (chunked, offloaded Ulysses) is not built here; "
        "--ds-sequence-parallel-size alone runs DeepSpeed-Ulysses",
        "--ds-sequence-parallel-fpdt",
        "--ds-sequence-parallel-fpdt-chunk-size:int",
        "--ds-sequence-parallel-fpdt-offloading",
    ),
    *_refused(
        "Ulysses attention at --ds-sequence-parallel-size 1 is not built here (it only adds "
        "all-to-alls over one rank); set --ds-sequence-parallel-size above 1",
        "--force-ds-sequence-parallel",
    ),
    *_refused(
        "the zero-bubble pipeline schedule is not built here; DeepSpeed's 1F1B schedule is",
        "--enable-zbh1-pipeline",
        "--enable-zbh1-exact-semantics",
    ),
    *_refused(
        "this GPT variant is not built here (GPT-2 and LLaMA architectures only)",
        "--squared-relu",
        "--apply-residual-connection-post-layernorm",
        "--embedding-weights-in-fp32",
        "--fp32-residual-connection",
        "--fp16-lm-cross-entropy",
        "--init-method-xavier-uniform",
    ),
    *_refused(
        "NullTokenizer's pad id (labels equal to it left out of the loss) is not built here "
        "(-1, no pad id, is accepted)",
        "--null-tokenizer-pad-id:int",
        accepts=_equals(-1),
    ),
    *_refused(
        "Megatron-LM's step-wise batch-size schedule is not built here (Megatron-LM itself "
        "refuses it beside --global-batch-size, 'Cannot specify both', and a script that "
        "expands it unquoted splits it into several words); --rampup-batch-size START "
        "INCREMENT SAMPLES ramps the global batch, or drop the flag for a constant "
        "--global-batch-size",
        "--step-batch-size-schedule:strs",
    ),
    *_refused(
        "HFTokenizer loads a local tokenizer without running code from it",
        "--trust-remote-code",
    ),
    *_refused(
        "the T5/BERT span-masking sentinels are not built here (0 is accepted)",
        "--vocab-extra-ids:int",
        accepts=_equals(0),
    ),
    *_refused(
        "Transformer Engine's FP8 attention is not built here (FP8 runs the linear layers' "
        "matmuls: --fp8-format)",
        "--fp8-dot-product-attention",
        "--fp8-multi-head-attention",
    ),
    *_refused(
        "--rope-type is multi-latent attention's spelling (with --multi-latent-attention); "
        "standard attention takes YaRN as --position-embedding-type yarn",
        "--rope-type:str",
        accepts=lambda value, args: (
            value in (None, "rope")
            or (value == "yarn" and getattr(args, "multi_latent_attention", False))
        ),
    ),
    *_refused(
        "Megatron's DDP implementations are not used here (local and torch are accepted: "
        "data parallelism is DeepSpeed's engine or torch DDP); for FSDP use "
        "--use-torch-fsdp2 (torch FSDP2)",
        "--DDP-impl:str",
        accepts=_equals("local", "torch"),
    ),
    *_refused(
        "embedding-only pipeline stages and encoder-decoder (T5) pipeline splits are not built "
        "here; every stage holds an equal share of the GPT's layers",
        "--standalone-embedding-stage",
        "--pipeline-model-parallel-split-rank:int",
    ),
    *_refused(
        "DeepSpeed's data-efficiency library (curriculum learning, random-LTD, forced index "
        "files) is not built here",
        "--random-ltd",
        "--data-efficiency-curriculum-learning",
        "--train-data-exact-num-epochs:int",
        "--return-data-index",
        "--train-idx-path:str",
        "--train-desc-path:str",
        "--train-doc-idx-path:str",
        "--train-sample-idx-path:str",
        "--train-shuffle-idx-path:str",
    ),
    *_refused(
        "is not supported here yet",
        "--load-tag:str",
        "--skip-train",
        "--data-parallel-random-init",
        "--aml-data-download-path:str",
        "--use-dataset-only:bool",
        "--lazy-mpu-init:bool",
        "--adlr-autoresume",
        "--adlr-autoresume-interval:int",
        "--ds-inference",
        "--inference",
    ),
    *_refused(
        "knowledge distillation and Mixture-of-Students are not built here",
        "--num-layers-teacher:int",
        "--num-experts-teacher:ints",
        "--hidden-size-teacher:int",
        "--num-attention-heads-teacher:int",
        "--mos",
        "--kd",
        "--kd-alpha-ce:float",
        "--kd-beta-ce:float",
        "--kd-temp:float",
        "--reset-iteration",
        "--load-teacher:str",
    ),
    *_refused(
        "encoder-decoder (T5) and BERT models are not built here; this is GPT pretraining",
        "--decoder-num-layers:int",
        "--decoder-seq-length:int",
        "--bert-no-binary-head",
        "--mask-prob:float",
        "--short-seq-prob:float",
        "--output-bert-embeddings",
        "--bert-embedder-type:str",
    ),
    *_refused(
        "biencoder/ICT/REALM retrieval models are not built here",
        "--retriever-seq-length:int",
        "--sample-rate:float",
        "--ict-head-size:int",
        "--biencoder-projection-dim:int",
        "--biencoder-shared-query-context-model",
        "--ict-load:str",
        "--bert-load:str",
        "--titles-data-path:str",
        "--query-in-block-prob:float",
        "--use-one-sent-docs",
        "--evidence-data-path:str",
        "--retriever-report-topk-accuracies:ints",
        "--retriever-score-scaling",
        "--block-data-path:str",
        "--embedding-path:str",
        "--indexer-batch-size:int",
        "--indexer-log-interval:int",
    ),
    *_refused(
        "Retro is not built here",
        "--retro-workdir:str",
        "--retro-add-retriever",
        "--retro-cyclic-train-iters:int",
        "--retro-encoder-layers:int",
        "--retro-encoder-hidden-dropout:float",
        "--retro-encoder-attention-dropout:float",
        "--retro-num-neighbors:int",
        "--retro-num-retrieved-chunks:int",
        "--retro-return-doc-ids",
    ),
    *_refused(
        "vision models are not built here",
        "--num-classes:int",
        "--img-h:int",
        "--img-w:int",
        "--num-channels:int",
        "--patch-dim:int",
        "--classes-fraction:float",
        "--data-per-class-fraction:float",
        "--no-data-sharding",
        "--head-lr-mult:float",
        "--vision-pretraining",
        "--vision-pretraining-type:str",
        "--vision-backbone-type:str",
        "--swin-backbone-type:str",
        "--mask-type:str",
        "--mask-factor:float",
        "--iter-per-epoch:int",
        "--dino-local-img-size:int",
        "--dino-local-crops-number:int",
        "--dino-head-hidden-size:int",
        "--dino-bottleneck-size:int",
        "--dino-freeze-last-layer:float",
        "--dino-norm-last-layer",
        "--dino-warmup-teacher-temp:float",
        "--dino-teacher-temp:float",
        "--dino-warmup-teacher-temp-epochs:int",
    ),
]


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    """Two groups: their flags accepted without effect, and those naming features we lack."""
    groups = (
        (INERT, "Megatron-DeepSpeed / Megatron-LM flags accepted without effect"),
        (REFUSED, "Megatron-DeepSpeed / Megatron-LM features not built here"),
    )
    for flags, title in groups:
        group = parser.add_argument_group(title)
        for flag in flags:
            prefix = "Refused" if flag.refused else "Accepted without effect"
            group.add_argument(
                flag.option,
                dest=flag.dest,
                default=None,
                help=f"{prefix}: {flag.reason}.",
                **_KINDS[flag.kind],
            )


def refuse_unsupported_flags(args: argparse.Namespace, typed: set[str] | None) -> None:
    """One line naming the first flag of a feature we lack that the command line turned on."""
    for flag in REFUSED:
        value = getattr(args, flag.dest, None)
        if value is None or value is False or (typed is not None and flag.dest not in typed):
            continue
        if flag.accepts is not None and flag.accepts(value, args):
            continue
        shown = flag.option if value is True else f"{flag.option} {_shown(value)}"
        if flag.reason.startswith("is not"):
            raise ArgumentError(f"{shown}: this flag {flag.reason}")
        raise ArgumentError(f"{shown}: {flag.reason}")


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
