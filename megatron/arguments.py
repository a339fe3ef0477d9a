"""Megatron's command-line flags, DeepSpeed's config flags, and the checks between them.

`parse_args()` builds the parser from flag groups with Megatron-LM / Megatron-DeepSpeed names
and defaults, adds `deepspeed.add_config_arguments` (`--deepspeed`, `--deepspeed_config`),
and returns the namespace after `validate_args`, which also reconciles the DeepSpeed config
with the flags the user typed (`megatron.ds_config`). Library code never reads this namespace:
it is turned into typed configs (`megatron.config`) at the edge.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Sequence

from megatron.args_validation import ArgumentError, validate_args

__all__ = ["ArgumentError", "build_parser", "parse_args", "typed_flags", "validate_args"]


def _model_size(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model size")
    group.add_argument("--num-layers", type=int, default=None, help="Transformer layers.")
    group.add_argument("--hidden-size", type=int, default=None, help="Model width.")
    group.add_argument("--num-attention-heads", type=int, default=None, help="Attention heads.")
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width; 4h if unset.")
    group.add_argument("--kv-channels", type=int, default=None, help="Per-head width; h/heads.")
    group.add_argument("--seq-length", type=int, default=None, help="Tokens per sample.")
    group.add_argument(
        "--max-position-embeddings", type=int, default=None, help="Position table rows."
    )
    group.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this times the tensor-parallel size.",
    )
    group.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--apply-query-key-layer-scaling", action="store_true")
    group.add_argument("--openai-gelu", action="store_true")
    group.add_argument("--use-rotary-position-embeddings", action="store_true")
    group.add_argument("--rotary-percent", type=float, default=1.0)


def _regularization(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("regularization and optimizer")
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0, help="Max gradient norm; 0 = off.")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--optimizer", choices=["adam", "adamw"], default="adam")


def _training(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None)
    group.add_argument("--global-batch-size", type=int, default=None)
    group.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    group.add_argument("--train-iters", type=int, default=None)
    group.add_argument("--train-samples", type=int, default=None)
    group.add_argument("--exit-interval", type=int, default=None)
    group.add_argument("--exit-duration-in-mins", type=int, default=None)
    group.add_argument("--exit-signal-handler", action="store_true")
    group.add_argument(
        "--max-consecutive-skipped-iterations",
        type=int,
        default=100,
        help="Stop the run after this many iterations in a row were skipped (fp16 overflow, "
        "non-finite gradients) or had a NaN loss.",
    )
    group.add_argument("--checkpoint-activations", action="store_true")
    group.add_argument("--checkpoint-num-layers", type=int, default=1)
    group.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    group.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    group.add_argument("--recompute-num-layers", type=int, default=None)
    group.add_argument("--distribute-saved-activations", action="store_true")
    group.add_argument(
        "--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion"
    )
    group.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    group.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    group.add_argument("--use-flash-attn", action="store_true")
    group.add_argument("--use-flash-attn-v2", action="store_true")
    group.add_argument("--use-cpu-initialization", action="store_true")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--dataloader-type", choices=["single", "cyclic"], default=None)


def _learning_rate(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("learning rate")
    group.add_argument("--lr", type=float, default=None)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear"
    )
    group.add_argument("--lr-decay-iters", type=int, default=None)
    group.add_argument("--lr-decay-samples", type=int, default=None)
    group.add_argument("--lr-warmup-fraction", type=float, default=None)
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-samples", type=int, default=0)
    group.add_argument("--override-lr-scheduler", action="store_true")
    group.add_argument("--use-checkpoint-lr-scheduler", action="store_true")


def _mixed_precision(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixed precision")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--loss-scale", type=float, default=None, help="Static; dynamic if unset.")
    group.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    group.add_argument("--min-loss-scale", type=float, default=1.0)
    group.add_argument("--loss-scale-window", type=float, default=1000)
    group.add_argument("--hysteresis", type=int, default=2)


def _data(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data and tokenizer")
    group.add_argument("--data-path", nargs="*", default=None, help="PREFIX or W1 P1 W2 P2 ...")
    group.add_argument("--split", default="969, 30, 1")
    group.add_argument("--data-impl", choices=["mmap", "infer"], default="mmap")
    group.add_argument("--mmap-warmup", action="store_true")
    group.add_argument("--data-cache-path", default=None)
    group.add_argument("--num-workers", type=int, default=2)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer"])
    group.add_argument("--eod-mask-loss", action="store_true")
    group.add_argument("--reset-position-ids", action="store_true")
    group.add_argument("--reset-attention-mask", action="store_true")


def _checkpointing(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None)
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--no-save-optim", action="store_true")
    group.add_argument("--no-save-rng", action="store_true")
    group.add_argument("--load", default=None)
    group.add_argument("--no-load-optim", action="store_true")
    group.add_argument("--no-load-rng", action="store_true")
    group.add_argument("--finetune", action="store_true")
    group.add_argument(
        "--universal-checkpoint",
        action="store_true",
        help="Load a DeepSpeed universal checkpoint (made by deepspeed.checkpoint.ds_to_universal "
        "from a --deepspeed checkpoint), e.g. to resume on a different number of GPUs.",
    )


def _logging(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=100)
    group.add_argument("--tensorboard-dir", default=None)
    group.add_argument("--tensorboard-log-interval", type=int, default=1)
    group.add_argument("--log-timers-to-tensorboard", action="store_true")
    group.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)
    group.add_argument("--wandb-project", default=None)
    group.add_argument("--wandb-exp-name", default=None)
    group.add_argument("--wandb-save-dir", default=None)


def _distributed(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="Default: nccl when a GPU is present, gloo otherwise.",
    )
    group.add_argument("--no-pipeline-parallel", action="store_true")
    group.add_argument(
        "--local-rank",
        "--local_rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", "0")),
        dest="local_rank",
        help="Set by the launcher (deepspeed passes --local_rank, torchrun sets LOCAL_RANK).",
    )


def _deepspeed(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DeepSpeed")
    group.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None)
    group.add_argument("--deepspeed-activation-checkpointing", action="store_true")
    group.add_argument("--partition-activations", action="store_true")
    group.add_argument("--checkpoint-in-cpu", action="store_true")
    group.add_argument("--contigious-checkpointing", action="store_true")
    group.add_argument("--synchronize-each-layer", action="store_true")
    group.add_argument("--profile-backward", action="store_true")


FLAG_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    _model_size,
    _regularization,
    _training,
    _learning_rate,
    _mixed_precision,
    _data,
    _checkpointing,
    _logging,
    _distributed,
    _deepspeed,
)


def build_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.ArgumentParser:
    """The full parser: Megatron's groups, the caller's extras, then DeepSpeed's flags."""
    parser = argparse.ArgumentParser(
        description="Megatron-style GPT pretraining with DeepSpeed", allow_abbrev=False
    )
    for add_group in FLAG_GROUPS:
        add_group(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    import deepspeed

    return deepspeed.add_config_arguments(parser)


def typed_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """Dest names of the flags present in `argv` (so a default never contradicts the config)."""
    # Re-parse with every default suppressed: only the flags the user typed reach the namespace.
    bare = copy.deepcopy(parser)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    bare._defaults.clear()  # set_defaults() values too: they are not typed either
    return set(vars(bare.parse_args(argv)))


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], object] | None = None,
    world_size: int | None = None,
    defaults: dict | None = None,
) -> argparse.Namespace:
    """Parse and validate; bad combinations exit with `error: ...` naming the flags.

    `defaults` (Megatron's `args_defaults`) replace flag defaults; they do not count as typed.
    """
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return validate_args(args, world_size, typed_flags(parser, argv))
    except ArgumentError as error:
        parser.exit(2, f"error: {error}\n")
