"""Megatron-LM's multi-latent attention flags (DeepSeek-V2/V3's MLA), with its defaults.

`megatron.deepseek_config.mla_config_from_args` turns them into the model's `MLAConfig`;
`megatron/model/multi_latent_attention.py` says what each shape means. `--rope-type` is a
compatibility flag (`compat_flags.py`): yarn, MLA's default, needs `--multi-latent-attention`.
"""

from __future__ import annotations

import argparse

from megatron.arguments.errors import ArgumentError


def add_mla_flags(parser: argparse.ArgumentParser) -> None:
    """--multi-latent-attention and its shapes and YaRN scaling."""
    group = parser.add_argument_group("multi-latent attention")
    group.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="DeepSeek-V2/V3's multi-latent attention in every layer: queries through a "
        "low-rank latent (--q-lora-rank), keys and values through a shared one "
        "(--kv-lora-rank), decoupled rotary channels (--qk-pos-emb-head-dim), YaRN "
        "positions by default (--rope-type). Megatron-LM's parameter names.",
    )
    group.add_argument(
        "--q-lora-rank",
        type=int,
        default=None,
        help="Width of the query latent; unset: queries projected from the hidden states "
        "directly (DeepSeek-V2-Lite).",
    )
    group.add_argument(
        "--kv-lora-rank", type=int, default=32, help="Width of the shared key/value latent."
    )
    group.add_argument(
        "--qk-head-dim",
        type=int,
        default=128,
        help="Query/key channels per head without rotary positions.",
    )
    group.add_argument(
        "--qk-pos-emb-head-dim",
        type=int,
        default=64,
        help="Rotary query/key channels per head (the key's shared by all heads).",
    )
    group.add_argument(
        "--v-head-dim", type=int, default=128, help="Value channels per attention head."
    )
    group.add_argument(
        "--rotary-scaling-factor",
        type=float,
        default=1.0,
        help="YaRN's context extension factor (--position-embedding-type yarn, MLA's "
        "--rope-type yarn; 1: plain rope).",
    )
    group.add_argument(
        "--mscale",
        type=float,
        default=1.0,
        help="YaRN's attention-factor coefficient on the rotary cos/sin (with "
        "--rotary-scaling-factor above 1).",
    )
    group.add_argument(
        "--mscale-all-dim",
        type=float,
        default=0.0,
        help="YaRN's coefficient for the softmax scale and the cos/sin divisor (DeepSeek-V3: 1).",
    )


def check_mla(args: argparse.Namespace) -> None:
    """--multi-latent-attention: a key and a value per head from the shared latent, and
    shapes that exist."""
    if not getattr(args, "multi_latent_attention", False):
        return
    if args.num_key_value_heads != args.num_attention_heads:
        raise ArgumentError(
            "--multi-latent-attention derives a key and a value per head from its shared "
            "latent: --group-query-attention / --num-key-value-heads do not apply"
        )
    for flag in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(args, flag) < 1:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.qk_pos_emb_head_dim % 2:
        raise ArgumentError(
            f"--qk-pos-emb-head-dim ({args.qk_pos_emb_head_dim}) must be even: its channels "
            "rotate in pairs"
        )
    if args.q_lora_rank is not None and args.q_lora_rank < 1:
        raise ArgumentError("--q-lora-rank must be at least 1 (or unset: no query latent)")
