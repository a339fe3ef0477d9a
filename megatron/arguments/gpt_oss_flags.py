"""Megatron-LM's flags for gpt-oss's architecture, and their checks: attention sinks
(`--softmax-type`), alternating sliding-window layers (`--window-attn-skip-freq` with
`--window-size`), the clamped quick-GeGLU (`--quick-geglu`, `--glu-linear-offset`,
`--activation-func-clamp-value`), YaRN rotary positions for standard attention
(`--position-embedding-type yarn` and the `--yarn-*` flags; `--rotary-scaling-factor`,
`--mscale` and `--mscale-all-dim` are shared with multi-latent attention, `mla_flags.py`) and
`--enable-gpt-oss` (Megatron-LM's ModelOpt builder's gpt-oss YaRN values,
`megatron.yarn_config.gpt_oss_yarn`). The model reads them from `ModelConfig`.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError
from megatron.arguments.routed_moe_flags import moe_layer_pattern
from megatron.yarn_config import gpt_oss_yarn


def add_gpt_oss_flags(parser: argparse.ArgumentParser) -> None:
    """gpt-oss's attention, activation and YaRN flags (Megatron-LM's names and defaults)."""
    group = parser.add_argument_group("gpt-oss attention and activation (Megatron-LM)")
    add = group.add_argument
    add(
        "--softmax-type",
        choices=["vanilla", "off-by-one", "learnable"],
        default="vanilla",
        help="Attention sinks: off-by-one adds a zero logit beside every query's scores, "
        "learnable a learned logit per head (gpt-oss's sinks; megatron-core's softmax_offset).",
    )
    add(
        "--window-attn-skip-freq",
        type=moe_layer_pattern,
        default=None,
        help="With --window-size, the layers that attend to the whole sequence: N (layer "
        'numbers divisible by N) or a list pattern such as "[1,0]*6" (1 = windowed).',
    )
    add(
        "--quick-geglu",
        action="store_true",
        help="The MLP's activation is quick-GeGLU: gate * sigmoid(1.702 gate) * up (gpt-oss's).",
    )
    add(
        "--glu-linear-offset",
        type=float,
        default=0.0,
        help="Added to the linear half of a gated activation: act(gate) * (up + offset).",
    )
    add(
        "--activation-func-clamp-value",
        type=float,
        default=None,
        help="Clamp a gated activation's gate to at most v and its linear half to [-v, v].",
    )
    add(
        "--enable-gpt-oss",
        action="store_true",
        help="gpt-oss's YaRN positions as Megatron-LM's ModelOpt builder sets them: "
        "--position-embedding-type yarn, factor 32, original context 131072, beta 32 / 1, "
        "mscale 1 / 0, no rounding of the ramp.",
    )
    add(
        "--yarn-original-max-position-embeddings",
        type=int,
        default=None,
        help="YaRN: the context the rotary frequencies were trained for (default 4096).",
    )
    add("--yarn-beta-fast", type=float, default=None, help="YaRN's beta fast (default 32).")
    add("--yarn-beta-slow", type=float, default=None, help="YaRN's beta slow (default 1).")
    add(
        "--yarn-correction-range-round-to-int",
        action="store_true",
        default=None,
        help="Round YaRN's ramp ends to whole channels (the default).",
    )
    add(
        "--no-yarn-correction-range-round-to-int",
        action="store_false",
        dest="yarn_correction_range_round_to_int",
        help="Do not round YaRN's ramp ends (Hugging Face's truncate: false, gpt-oss's).",
    )


def settle_gpt_oss(args: argparse.Namespace) -> None:
    """`--enable-gpt-oss`'s values, before the position embeddings are settled."""
    if not getattr(args, "enable_gpt_oss", False):
        return
    # As Megatron-LM's builder: these override the command line's.
    yarn = gpt_oss_yarn()
    args.position_embedding_type = "yarn"
    args.rotary_scaling_factor = yarn.scaling_factor
    args.yarn_original_max_position_embeddings = yarn.original_max_position_embeddings
    args.yarn_beta_fast, args.yarn_beta_slow = yarn.beta_fast, yarn.beta_slow
    args.mscale, args.mscale_all_dim = yarn.mscale, yarn.mscale_all_dim
    args.yarn_correction_range_round_to_int = yarn.round_to_int


def check_gpt_oss(args: argparse.Namespace) -> None:
    """Refuse, in one line each, what these flags cannot run with."""
    sinks = getattr(args, "softmax_type", "vanilla") != "vanilla"
    flag = f"--softmax-type {getattr(args, 'softmax_type', None)}"
    if sinks and getattr(args, "multi_latent_attention", False):
        raise ArgumentError(f"{flag} is built for standard attention, not --multi-latent-attention")
    if sinks and (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ArgumentError(
            f"{flag} with --context-parallel-size > 1 is not built here (the sink joins the "
            "softmax over the whole sequence, which the ring merges in parts)"
        )
    if sinks and (getattr(args, "ds_sequence_parallel_size", 1) or 1) > 1:
        raise ArgumentError(
            f"{flag} with DeepSpeed-Ulysses (--ds-sequence-parallel-size) is not built here"
        )
    if getattr(args, "quick_geglu", False) and getattr(args, "swiglu", False):
        raise ArgumentError("--quick-geglu and --swiglu are two activations: give one")
    gated = getattr(args, "quick_geglu", False) or getattr(args, "swiglu", False)
    for name in ("glu_linear_offset", "activation_func_clamp_value"):
        value = getattr(args, name, None)
        if value and not gated:
            raise ArgumentError(
                f"--{name.replace('_', '-')} {value} applies to a gated activation: add "
                "--quick-geglu or --swiglu"
            )
    clamp = getattr(args, "activation_func_clamp_value", None)
    if clamp is not None and clamp <= 0:
        raise ArgumentError(f"--activation-func-clamp-value {clamp}: must be positive")
    pattern = getattr(args, "window_attn_skip_freq", None)
    if isinstance(pattern, int) and pattern < 1:
        raise ArgumentError(f"--window-attn-skip-freq {pattern}: must be at least 1")
    if isinstance(pattern, list) and (
        len(pattern) != args.num_layers or any(value not in (0, 1) for value in pattern)
    ):
        raise ArgumentError(
            f"--window-attn-skip-freq: the pattern has {len(pattern)} entries, --num-layers is "
            f"{args.num_layers}; each entry 1 (windowed) or 0 (whole sequence)"
        )
