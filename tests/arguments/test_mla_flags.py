"""Megatron-LM's multi-latent attention flags (issue 57): their meanings and one-line refusals."""

from __future__ import annotations

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.config import MLAConfig, mla_config_from_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --train-iters 10 --lr 1e-3 --micro-batch-size 2 --mock-data"
).split()
DEEPSEEK_V3 = (
    "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
    "--qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 "
    "--mscale-all-dim 1.0 --qk-layernorm --position-embedding-type rope"
)
"""The MLA flags of Megatron-LM's DeepSeek-V3 recipe (examples/megatron_fsdp)."""


def validated(extra: str = "", world_size: int = 1):
    """The validated namespace of BASE + `extra`; ArgumentError escapes."""
    argv = BASE + extra.split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_the_deepseek_v3_recipes_flags_mean_its_attention() -> None:
    """Its shapes, YaRN by default (Megatron-LM's MLA default rope type)."""
    config = mla_config_from_args(validated(DEEPSEEK_V3))
    assert config == MLAConfig(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        rope_type="yarn",
        rotary_scaling_factor=40.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )


def test_defaults_are_megatron_lms_and_rope_type_rope_is_plain_rope() -> None:
    """No query latent, kv latent 32, heads 128 + 64 rotary, values 128; off by default."""
    assert mla_config_from_args(validated()) is None
    config = mla_config_from_args(validated("--multi-latent-attention --rope-type rope"))
    assert config == MLAConfig(rope_type="rope")
    assert config.q_lora_rank is None and config.kv_lora_rank == 32


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--rope-type yarn", "--rope-type"),
        ("--multi-latent-attention --group-query-attention --num-query-groups 2", "latent"),
        ("--multi-latent-attention --num-key-value-heads 2", "--num-key-value-heads"),
        ("--multi-latent-attention --qk-pos-emb-head-dim 7", "--qk-pos-emb-head-dim (7)"),
        ("--multi-latent-attention --q-lora-rank 0", "--q-lora-rank"),
    ],
)
def test_what_cannot_run_stops_in_one_line(extra: str, message: str) -> None:
    """YaRN without MLA, grouped keys/values with it, impossible shapes: one line each."""
    with pytest.raises(ArgumentError) as error:
        validated(extra)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_sequence_splits_take_mla() -> None:
    """Context parallelism and Ulysses run MLA (tests/core/test_context_parallel.py); MTP
    still stops at them (tests/arguments/test_mtp_flags.py)."""
    for split in (
        "--context-parallel-size 2",
        "--ds-sequence-parallel-size 2 --deepspeed --no-pipeline-parallel",
    ):
        args = validated(f"--multi-latent-attention {split}", world_size=2)
        assert args.multi_latent_attention
