"""Megatron-LM's multi-token prediction flags (DeepSeek-V3's MTP), with its defaults.

`megatron.deepseek_config.mtp_config_from_args` turns them into the model's `MTPConfig`;
`megatron/model/multi_token_prediction.py` says what the modules compute.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError


def add_mtp_flags(parser: argparse.ArgumentParser) -> None:
    """--mtp-num-layers and --mtp-loss-scaling-factor."""
    group = parser.add_argument_group("multi-token prediction")
    group.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="Multi-token prediction depth D (DeepSeek-V3: 1): D sequential modules after the "
        "last layer, module k predicting the token k + 1 places ahead from module k - 1's "
        "hidden states and the next token's embedding (one transformer layer each, the "
        "model's output layer shared); their losses are logged as 'mtp_k loss'.",
    )
    group.add_argument(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="The training loss adds this / D x the sum of the MTP modules' losses.",
    )


def settle_mtp(args: argparse.Namespace) -> None:
    """Reject what multi-token prediction does not run with (which engines run it is a row of
    `megatron.compatibility`'s table)."""
    depth = getattr(args, "mtp_num_layers", None)
    if depth is None:
        return
    if depth < 1:
        raise ArgumentError(f"--mtp-num-layers {depth}: must be at least 1 (or unset)")
    for flag in ("context_parallel_size", "ds_sequence_parallel_size"):
        if (getattr(args, flag, None) or 1) > 1:
            raise ArgumentError(
                f"--mtp-num-layers with --{flag.replace('_', '-')} above 1 is not built here "
                "yet (the shifted tokens would cross the ranks' sequence chunks)"
            )
    learned_positions = not getattr(args, "use_rotary_position_embeddings", False) and getattr(
        args, "add_position_embedding", True
    )
    if learned_positions and args.pipeline_model_parallel_size > 1:
        raise ArgumentError(
            "--mtp-num-layers with learned absolute position embeddings and "
            "--pipeline-model-parallel-size above 1 is not built here (the last stage holds "
            "a copy of the word embeddings only): use --position-embedding-type rope"
        )
    if getattr(args, "num_experts", None) and not getattr(args, "routed_moe", False):
        if any(count > 1 for count in args.num_experts):
            raise ArgumentError(
                "--mtp-num-layers with DeepSpeed-MoE layers is not built here (Megatron-LM's "
                "MoE flags, --moe-router-topk and the rest, run with it)"
            )
