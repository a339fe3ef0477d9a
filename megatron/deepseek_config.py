"""The DeepSeek-V2/V3 parts of the model's configuration: multi-latent attention (MLA) and
multi-token prediction (MTP), with megatron-core's defaults (`megatron.config.ModelConfig`
holds them; `megatron/arguments/mla_flags.py` and `mtp_flags.py` define the flags)."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    """Multi-latent attention (`--multi-latent-attention`; megatron-core's MLATransformerConfig
    defaults)."""

    q_lora_rank: int | None = None
    """Query latent width; None: queries projected from the hidden states directly."""
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    """Per head: the query/key channels without rotary positions."""
    qk_pos_emb_head_dim: int = 64
    """Per head: the rotary query/key channels (the key's shared by the heads)."""
    v_head_dim: int = 128
    rope_type: str = "yarn"
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def mla_config_from_args(args: Namespace) -> MLAConfig | None:
    """`--multi-latent-attention` and its flags, or None."""
    if not getattr(args, "multi_latent_attention", False):
        return None
    return MLAConfig(
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_type=getattr(args, "rope_type", None) or "yarn",
        rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim,
    )


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (`--mtp-num-layers`; megatron-core's `MultiTokenPredictionBlock`):
    module k (from 1) predicts the token k + 1 places ahead from the hidden state of module
    k - 1 (the model's for k = 1) and the embedding of the token k places ahead
    (`megatron/model/multi_token_prediction.py`)."""

    num_layers: int
    """The prediction depth D: modules, each one transformer layer (`--mtp-num-layers`)."""
    loss_scaling_factor: float = 0.1
    """The training loss adds factor / D x the sum of the modules' losses
    (`--mtp-loss-scaling-factor`)."""
    per_token_loss: bool = False
    """The training loss is a sum over tokens (`--calculate-per-token-loss`): the modules' losses
    join it as sums too, as megatron-core adds them."""

    def __post_init__(self) -> None:
        """Reject a depth below 1."""
        if self.num_layers < 1:
            raise ValueError(f"--mtp-num-layers {self.num_layers}: must be at least 1")


def mtp_config_from_args(args: Namespace) -> MTPConfig | None:
    """`--mtp-num-layers` and `--mtp-loss-scaling-factor`, or None without them."""
    depth = getattr(args, "mtp_num_layers", None)
    if not depth:
        return None
    return MTPConfig(
        num_layers=depth,
        loss_scaling_factor=args.mtp_loss_scaling_factor,
        per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
    )
