"""YaRN's rotary position scaling (megatron-core's `YarnRotaryEmbedding`), for standard attention
(`--position-embedding-type yarn`, gpt-oss's) and multi-latent attention (`--rope-type yarn`).

The fast-turning channels keep their frequencies, the slow ones are divided by the scaling
factor, with a linear ramp between; cos and sin are multiplied by the attention factor
mscale(mscale) / mscale(mscale_all_dim). `--enable-gpt-oss` settles Megatron-LM's gpt-oss
values (`gpt_oss_yarn`, as its ModelOpt builder sets them).
"""

from __future__ import annotations

import math
from argparse import Namespace
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class YarnConfig:
    """YaRN's settings (megatron-core's `yarn_*` config fields, their defaults)."""

    scaling_factor: float = 1.0
    """The context extension factor (`--rotary-scaling-factor`)."""
    original_max_position_embeddings: int = 4096
    """The context the frequencies were trained for (`--yarn-original-max-position-embeddings`)."""
    beta_fast: float = 32.0
    """Rotations bounding the channels kept as they are (`--yarn-beta-fast`)."""
    beta_slow: float = 1.0
    """Rotations bounding the channels fully interpolated (`--yarn-beta-slow`)."""
    mscale: float = 1.0
    """The attention factor's coefficient on cos and sin (`--mscale`)."""
    mscale_all_dim: float = 0.0
    """The attention factor's divisor coefficient (`--mscale-all-dim`)."""
    round_to_int: bool = True
    """Round the ramp's ends to whole channels (`--yarn-correction-range-round-to-int`;
    Hugging Face's `truncate`)."""

    def attention_factor(self) -> float:
        """The factor on the rotary cos and sin."""
        return yarn_mscale(self.scaling_factor, self.mscale) / yarn_mscale(
            self.scaling_factor, self.mscale_all_dim
        )

    def inverse_frequencies(self, dim: int, base: float) -> torch.Tensor:
        """The rotary frequencies [dim / 2] of `dim` rotated channels."""
        return yarn_inverse_frequencies(dim, base, self)


def gpt_oss_yarn() -> YarnConfig:
    """What `--enable-gpt-oss` sets (Megatron-LM's `megatron/post_training/model_builder.py`)."""
    return YarnConfig(
        scaling_factor=32.0,
        original_max_position_embeddings=131072,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        round_to_int=False,
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `scale`-times the original (1 at scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(dim: int, base: float, yarn: YarnConfig) -> torch.Tensor:
    """YaRN's rotary frequencies [dim / 2]: the original ones for the fast-turning channels,
    divided by the scaling factor for the slow ones, a linear ramp between (megatron-core's
    YarnRotaryEmbedding; the original frequencies at factor 1)."""
    import torch  # (the configs import without it)

    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolated = 1.0 / base**exponents
    interpolated = 1.0 / (yarn.scaling_factor * base**exponents)

    def correction_dim(rotations: float) -> float:
        turns = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as megatron-core: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the original frequency
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_config_from_args(args: Namespace) -> YarnConfig | None:
    """`--position-embedding-type yarn` and its flags (`--enable-gpt-oss` sets them during
    validation); None without them."""
    if getattr(args, "position_embedding_type", None) != "yarn":
        return None
    get = lambda name, default: (  # noqa: E731
        default if getattr(args, name, None) is None else getattr(args, name)
    )
    return YarnConfig(
        scaling_factor=get("rotary_scaling_factor", 1.0),
        original_max_position_embeddings=get("yarn_original_max_position_embeddings", 4096),
        beta_fast=get("yarn_beta_fast", 32.0),
        beta_slow=get("yarn_beta_slow", 1.0),
        mscale=get("mscale", 1.0),
        mscale_all_dim=get("mscale_all_dim", 0.0),
        round_to_int=get("yarn_correction_range_round_to_int", True),
    )
