"""Megatron-LM's FP8 flags (`--fp8-format`, `--fp8-recipe`, `--fp8-*`) and what runs them here.

Names, defaults and meanings are Megatron-LM's (megatron/core/transformer/transformer_config.py
`fp8*`, megatron/core/fp8_utils.py `get_fp8_recipe`); Megatron-DeepSpeed's `--fp8-e4m3` /
`--fp8-hybrid` are the same formats. The matmuls run through torchao (megatron.model.fp8):

- `--fp8-recipe tensorwise` (current scaling: Transformer Engine's Float8CurrentScaling) is
  built. Megatron-LM's default recipe, `delayed` (Transformer Engine's amax history), is not in
  torchao: a run that does not name a recipe (as Megatron-LM's Llama-3 FP8 script does not)
  runs tensorwise and says so at start-up; `--fp8-recipe delayed` typed out is refused, as
  are `blockwise`, `mxfp8` and `custom`.
- `--fp8-margin`, `--fp8-amax-history-len`, `--fp8-amax-compute-algo` and `--fp8-interval`
  belong to the delayed recipe: Megatron-LM ignores them under tensorwise, and so does this
  code (a start-up note names them).
- `--fp8-param-gather`: under FSDP2 sharding (`--use-distributed-optimizer`,
  `--use-torch-fsdp2`) each FP8 layer's weight is all-gathered in FP8, 1 byte an element
  (torchao's float8 all-gather, `megatron.model.fp8.cast_weights_before_all_gather`): cast
  from the fp32 master weight with the amax of the whole weight: in fp32 the same FP8 numbers
  as casting the gathered weight; under bf16 cast from the master itself rather than from its
  bf16 copy, so a few percent of them differ by one FP8 step. Elsewhere a note says the flag
  has nothing to do (DeepSpeed ZeRO-3 gathers its own way, in the run's precision).
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError

FORMATS = ("e4m3", "hybrid")
BUILT_RECIPES = ("tensorwise",)
MEGATRON_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
# Flags of the delayed recipe, with Megatron-LM's defaults.
DELAYED_ONLY = {
    "fp8_margin": ("--fp8-margin", 0),
    "fp8_interval": ("--fp8-interval", 1),
    "fp8_amax_history_len": ("--fp8-amax-history-len", 1),
    "fp8_amax_compute_algo": ("--fp8-amax-compute-algo", "most_recent"),
}
# torch._scaled_mm's (and Transformer Engine's) FP8 GEMMs take dimensions in multiples of 16.
FP8_DIM_MULTIPLE = 16


def add_fp8_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's FP8 flags, and Megatron-DeepSpeed's two older spellings."""
    group = parser.add_argument_group("FP8 matmuls (torchao float8 training)")
    group.add_argument(
        "--fp8-format",
        dest="fp8",
        choices=FORMATS,
        default=None,
        help="FP8 matmuls in the transformer layers' linear layers: e4m3 (every operand E4M3) "
        "or hybrid (E4M3 forward, E5M2 gradients). Needs torchao and, on GPUs, sm_89 or newer.",
    )
    group.add_argument(
        "--fp8-e4m3",
        action="store_const",
        dest="fp8",
        const="e4m3",
        help="Megatron-DeepSpeed's spelling of --fp8-format e4m3.",
    )
    group.add_argument(
        "--fp8-hybrid",
        action="store_const",
        dest="fp8",
        const="hybrid",
        help="Megatron-DeepSpeed's spelling of --fp8-format hybrid.",
    )
    group.add_argument(
        "--fp8-recipe",
        choices=MEGATRON_RECIPES,
        default=None,
        help="How FP8 scales are chosen. Built: tensorwise (one scale per tensor from its "
        "current amax). Default tensorwise (Megatron-LM's default, delayed, is not in torchao; "
        "a start-up note says so).",
    )
    group.add_argument(
        "--no-fp8-wgrad",
        action="store_false",
        dest="fp8_wgrad",
        help="Compute the weight gradients in the run's precision instead of FP8.",
    )
    group.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="All-gather weights in FP8 under FSDP2 sharding (--use-torch-fsdp2); elsewhere "
        "weights travel in the run's precision (the same FP8 numbers under tensorwise scaling).",
    )
    for dest, (flag, default) in DELAYED_ONLY.items():
        group.add_argument(
            flag,
            type=type(default),
            default=default,
            choices=("most_recent", "max") if dest == "fp8_amax_compute_algo" else None,
            help="The delayed recipe's setting (Megatron-LM ignores it under tensorwise "
            "scaling); accepted without effect.",
        )
    group.add_argument(
        "--first-last-layers-bf16",
        action="store_true",
        help="Keep the first and last transformer layers' matmuls in the run's precision "
        "(how many: --num-layers-at-start-in-bf16, --num-layers-at-end-in-bf16).",
    )
    group.add_argument(
        "--num-layers-at-start-in-bf16",
        type=int,
        default=1,
        help="With --first-last-layers-bf16: how many layers at the start stay out of FP8.",
    )
    group.add_argument(
        "--num-layers-at-end-in-bf16",
        type=int,
        default=1,
        help="With --first-last-layers-bf16: how many layers at the end stay out of FP8.",
    )


def settle_fp8(args: argparse.Namespace) -> None:
    """Check the FP8 flags against each other and the model; fill `fp8_recipe`; add notes."""
    if args.fp8 is None:
        typed = _fp8_settings_typed(args)
        if typed:
            args.compat_notes.append(
                f" > note: {', '.join(typed)} without --fp8-format: no effect (as in Megatron-LM)"
            )
        return
    if args.fp8_recipe is None:
        args.fp8_recipe = "tensorwise"
        args.compat_notes.append(
            " > note: FP8 recipe tensorwise (current scaling, torchao): Megatron-LM's default "
            "--fp8-recipe delayed (Transformer Engine's amax history) is not built here"
        )
    elif args.fp8_recipe not in BUILT_RECIPES:
        raise ArgumentError(
            f"--fp8-recipe {args.fp8_recipe}: {_NOT_BUILT[args.fp8_recipe]}; "
            "use --fp8-recipe tensorwise"
        )
    ignored = [
        flag
        for dest, (flag, default) in DELAYED_ONLY.items()
        if getattr(args, dest, default) != default
    ]
    if ignored:
        args.compat_notes.append(
            f" > note: {', '.join(ignored)} set the delayed recipe's amax history; "
            "no effect under tensorwise scaling (Megatron-LM ignores them there too)"
        )
    if args.fp8_param_gather and args.layout.sharding == "none":
        gathered = (
            "DeepSpeed ZeRO-3 all-gathers the weights in the run's precision"
            if args.layout.zero_stage == 3
            else "no weights are all-gathered here"
        )
        args.compat_notes.append(
            f" > note: --fp8-param-gather: {gathered} (FP8 all-gather is torchao's under FSDP2 "
            "sharding: --use-distributed-optimizer or --use-torch-fsdp2); each matmul casts the "
            "weights to FP8"
        )
    _check_layers_in_bf16(args)
    _check_dimensions(args)


_NOT_BUILT = {
    "delayed": "delayed scaling (Transformer Engine's amax history) is not in torchao",
    "mxfp8": "MXFP8 (torchao's MX formats, Blackwell GPUs) is not wired here",
    "blockwise": "blockwise scaling (torchao's Triton prototype) is not wired here",
    "custom": "custom quantizer factories are Transformer Engine's",
}


def _fp8_settings_typed(args: argparse.Namespace) -> list[str]:
    """The FP8 settings given away from their defaults (they mean nothing without a format)."""
    settings = ["--fp8-recipe"] if args.fp8_recipe is not None else []
    if args.fp8_param_gather:
        settings.append("--fp8-param-gather")
    if not args.fp8_wgrad:
        settings.append("--no-fp8-wgrad")
    if args.first_last_layers_bf16:
        settings.append("--first-last-layers-bf16")
    return settings


def _check_layers_in_bf16(args: argparse.Namespace) -> None:
    if not args.first_last_layers_bf16:
        return
    start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
    if start < 0 or end < 0 or start + end > args.num_layers:
        raise ArgumentError(
            f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end}: "
            f"each at least 0, together at most --num-layers {args.num_layers}"
        )


def _check_dimensions(args: argparse.Namespace) -> None:
    """FP8 GEMMs take every dimension in multiples of 16 (on GPUs; checked everywhere, so a
    CPU run refuses what the GPU run would)."""
    tp = args.tensor_model_parallel_size
    kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    heads_width = args.num_attention_heads * kv_channels
    kv_width = args.num_key_value_heads * kv_channels
    widths = {
        "--hidden-size": args.hidden_size,
        "--ffn-hidden-size / --tensor-model-parallel-size": (
            args.ffn_hidden_size or 4 * args.hidden_size
        )
        // tp,
        "attention width (heads x --kv-channels) / --tensor-model-parallel-size": (
            heads_width // tp
        ),
        "query/key/value width / --tensor-model-parallel-size": (heads_width + 2 * kv_width) // tp,
    }
    tokens = args.seq_length * args.micro_batch_size // max(1, args.context_parallel_size)
    widths["--seq-length x --micro-batch-size / --context-parallel-size"] = tokens
    for name, value in widths.items():
        if value % FP8_DIM_MULTIPLE:
            raise ArgumentError(
                f"--fp8-format: {name} is {value}; FP8 matmuls need multiples of {FP8_DIM_MULTIPLE}"
            )
