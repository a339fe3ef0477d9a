"""Causal attention kernels over one rank's heads, and rotary position embeddings.

Three interchangeable backends compute softmax(q k^T / sqrt(d)) v with the causal mask:
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention`, which picks flash or
  memory-efficient kernels on GPU and a fused C++ kernel on CPU (the default);
- `flash`: the `flash_attn` package when installed, else SDPA restricted to its flash
  backend; fails at construction when no flash kernel can run;
- `unfused`: Megatron's explicit math (baddbmm, fp32 softmax with query-key layer scaling,
  masked fill, dropout), which the others are tested against.

Attention dropout drops whole-head probabilities on tensor-parallel ranks that hold
different heads, so it draws from the model-parallel RNG stream (see `random.py`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import new_split_parameter
from megatron.core.tensor_parallel.mappings import (
    inverse_order,
    sequence_order_of_context_parallel_parts,
)
from megatron.model.attention_sinks import (
    cpu_flash_sink_attention,
    dense_sink_attention,
    flex_sink_attention,
)
from megatron.model.document_mask import (
    DocumentMask,
    flex_attention_with,
    kernel_for,
    varlen_attention,
)
from megatron.model.utils import init_method_normal, run_eagerly_when_compiled
from megatron.yarn_config import YarnConfig


def flash_attn_2_version() -> str | None:
    """The installed flash_attn 2's version, or None: absent, unusable, or FlashAttention 4 alone.

    FlashAttention 4 installs `flash_attn.cute` with no `flash_attn/__init__.py`, which makes
    `flash_attn` a namespace package without `flash_attn_func`; a flash_attn built for another
    torch or CUDA fails on import. Either way SDPA's flash kernel is used instead.
    """
    spec = importlib.util.find_spec("flash_attn")
    if spec is None or spec.origin in (None, "namespace"):
        return None
    try:
        module = importlib.import_module("flash_attn")
    except (ImportError, OSError):
        return None
    if not callable(getattr(module, "flash_attn_func", None)):
        return None
    return str(getattr(module, "__version__", "unknown version"))


def flash_attention_status() -> tuple[bool, str]:
    """Whether flash attention can run here, and which implementation (or why not)."""
    if not torch.cuda.is_available():
        return False, "flash attention needs a CUDA GPU; this machine has none"
    if flash_attn_2_version() is not None:
        return True, "flash_attn package"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"torch's flash kernel needs compute capability >= 8.0, GPU has {major}.x"
    return True, "torch SDPA flash backend"


class CoreAttention(nn.Module):
    """[b, np, s, hn] query, [b, nkv, s, hn] key/value -> [s, b, np * hn] context, causal.

    With fewer key/value heads than query heads (grouped-query attention) query head i reads
    key/value head i // (np / nkv); SDPA and flash_attn do that without copying them.
    """

    def __init__(
        self, config: ModelConfig, layer_number: int, heads_per_partition: int | None = None
    ) -> None:
        """`heads_per_partition`: this rank's query heads (what attention sinks need)."""
        super().__init__()
        self.backend = config.attention_backend
        self.dropout_p = config.attention_dropout
        self.sequence_parallel = config.sequence_parallel
        self.layer_number = max(1, layer_number)
        self.scale = 1.0 / math.sqrt(config.kv_channels)
        self.apply_query_key_layer_scaling = config.apply_query_key_layer_scaling
        if self.backend == "flash":
            available, detail = flash_attention_status()
            if not available:
                raise RuntimeError(f"--use-flash-attn: {detail}")
            self.use_flash_attn_package = detail == "flash_attn package"
        # --softmax-type: a logit per head beside the scores (`attention_sinks.py`), learned
        # (megatron-core's `softmax_offset`, split over TP ranks by head) or 0 (off-by-one).
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "learnable":
            self.softmax_offset = new_split_parameter(
                (config.num_attention_heads,),
                0,
                init_method_normal(config.init_method_std),
                config.torch_dtype,
                config.use_cpu_initialization,
            )
        elif config.softmax_type == "off-by-one":
            zeros = torch.zeros(heads_per_partition, dtype=config.torch_dtype)
            self.register_buffer("softmax_offset", zeros, persistent=False)

    def _dropout_rng(self) -> contextlib.AbstractContextManager:
        # Under sequence parallelism the whole layer already runs on the model-parallel stream.
        if self.sequence_parallel or not self.training or self.dropout_p == 0.0:
            return contextlib.nullcontext()
        return get_cuda_rng_tracker().fork()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | DocumentMask | None,
        causal: bool = True,
    ) -> torch.Tensor:
        """`mask`: bool [b|1, 1, sq, sk] with True = may not attend, packed documents and a
        sliding window as a `DocumentMask` (sq == sk), or None for no mask.

        Without a mask, `causal` (the default; needs sq == sk) applies the causal mask, and
        `causal=False` lets every query see every key (one new token over a key/value cache).
        """
        dropout_p = self.dropout_p if self.training else 0.0
        if self.softmax_offset is not None:
            with self._dropout_rng():
                context = self._with_sinks(query, key, value, mask, dropout_p, causal)
            return _to_sequence_first(context)
        if isinstance(mask, DocumentMask):
            kernel = kernel_for(self.backend, query.device, dropout_p)
            if kernel == "dense":
                mask = mask.dense(query.size(2), key.size(2), query.device)
        with self._dropout_rng():
            if isinstance(mask, DocumentMask):
                context = self._documents(query, key, value, mask, kernel, dropout_p)
            elif self.backend == "unfused":
                context = self._unfused(query, key, value, mask, dropout_p, causal)
            elif (
                self.backend == "flash" and self.use_flash_attn_package and mask is None and causal
            ):
                context = self._flash_attn_package(query, key, value, dropout_p)
            else:
                context = self._sdpa(query, key, value, mask, dropout_p, causal)
        return _to_sequence_first(context)

    def _with_sinks(self, query, key, value, mask, dropout_p, causal):
        """The attention with sinks, on the kernel `sink_kernel_for` picks."""
        sinks, scale = self.softmax_offset, self.scale
        kernel = sink_kernel_for(self.backend, query.device, dropout_p)
        if kernel == "flex" and (mask is None and causal or isinstance(mask, DocumentMask)):
            documents = mask if isinstance(mask, DocumentMask) else DocumentMask(None)
            return flex_sink_attention(documents, query, key, value, sinks, scale)
        if kernel == "cpu_flash" and isinstance(mask, DocumentMask):
            attend = functools.partial(_cpu_flash_band, sinks=sinks)
            return varlen_attention(mask, query, key, value, scale, 0.0, attend)
        if kernel == "cpu_flash":
            allowed = None if mask is None else ~mask
            return cpu_flash_sink_attention(query, key, value, sinks, scale, allowed, causal)
        if isinstance(mask, DocumentMask):
            mask = mask.dense(query.size(2), key.size(2), query.device)
        return dense_sink_attention(query, key, value, sinks, scale, mask, causal, dropout_p)

    def _sdpa(self, query, key, value, mask, dropout_p, causal):
        kwargs = dict(dropout_p=dropout_p, scale=self.scale)
        if key.size(1) != query.size(1):
            kwargs["enable_gqa"] = True
        if mask is None:
            kwargs["is_causal"] = causal
        else:
            kwargs["attn_mask"] = ~mask  # SDPA's bool mask marks what may be attended
        if self.backend != "flash":
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # CUDA's flash kernel takes no mask (context parallelism's all-gathered keys bring
        # one): there the memory-efficient kernel, also fused and linear in memory, runs it.
        backends = [SDPBackend.FLASH_ATTENTION]
        if mask is not None:
            backends.append(SDPBackend.EFFICIENT_ATTENTION)
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(query, key, value, **kwargs)

    def _documents(self, query, key, value, mask, kernel, dropout_p):
        if kernel == "flex":
            return flex_attention_with(mask, query, key, value, self.scale)
        return varlen_attention(mask, query, key, value, self.scale, dropout_p)

    def _flash_attn_package(self, query, key, value, dropout_p):
        from flash_attn import flash_attn_func

        # flash_attn wants [b, s, np, hn].
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = flash_attn_func(q, k, v, dropout_p, softmax_scale=self.scale, causal=True)
        return out.transpose(1, 2)

    def _unfused(self, query, key, value, mask, dropout_p, causal):
        b, np_, sq, hn = query.shape
        if key.size(1) != np_:  # grouped-query: each key/value head serves np / nkv queries
            key, value = (t.repeat_interleave(np_ // key.size(1), dim=1) for t in (key, value))
        sk = key.size(2)
        coeff = float(self.layer_number) if self.apply_query_key_layer_scaling else 1.0
        # [b * np, sq, sk]; dividing by coeff here and multiplying back in fp32 keeps fp16 finite.
        scores = torch.baddbmm(
            torch.empty(b * np_, sq, sk, dtype=query.dtype, device=query.device),
            query.reshape(b * np_, sq, hn),
            key.reshape(b * np_, sk, hn).transpose(1, 2),
            beta=0.0,
            alpha=self.scale / coeff,
        ).view(b, np_, sq, sk)
        if mask is None and causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.float() * coeff
        if mask is not None:
            scores = scores.masked_fill(mask, -10000.0)
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
        return torch.matmul(probs, value)  # [b, np, s, hn]


def _to_sequence_first(context: torch.Tensor) -> torch.Tensor:
    """[b, np, s, hn] -> [s, b, np * hn]."""
    b, np_, s, hn = context.shape
    return context.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def sink_kernel_for(backend: str, device: torch.device, dropout_p: float) -> str:
    """`dense`, `cpu_flash` or `flex`: the kernel of attention with sinks (`attention_sinks.py`)
    for the core's backend, device and dropout. Dropout and the `unfused` backend take the
    explicit math, which alone drops probabilities; else torch's CPU flash kernel on CPUs,
    FlexAttention on GPUs."""
    if backend == "unfused" or dropout_p > 0.0:
        return "dense"
    return "cpu_flash" if device.type == "cpu" else "flex"


def _cpu_flash_band(query, key, value, band, sinks, scale):  # noqa: ANN001, ANN202
    """One document's attention with sinks (`varlen_attention`'s `attend`)."""
    return cpu_flash_sink_attention(query, key, value, sinks, scale, band, band is None)


class UlyssesAttention(nn.Module):
    """DeepSpeed-Ulysses around `CoreAttention`: [s/S, b, n, hn] q/k/v -> [s/S, b, np * hn].

    DeepSpeed's `DistributedAttention` turns each rank's sequence part of every head into the
    whole sequence of 1/S of the heads (one all-to-all each for q, k and v), the core attends
    over the full sequence with the full causal mask, and a last all-to-all turns the context
    back. Query and key/value heads split alike, so under grouped-query attention a rank's
    query heads find their key/value heads on the same rank (both divisible by S).
    """

    def __init__(
        self, core: CoreAttention, group: object, recompute: bool, context_parallel: bool = False
    ) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        # Scatter the heads (dim 2) and gather the sequence (dim 0) of [s, b, n, hn]. Over the
        # context-parallel group (`--cp-comm-type a2a`) the gathered chunks are the ranks'
        # load-balanced ones, put in sequence order around the core.
        self.distributed = DistributedAttention(
            _HeadSplitCore(core, recompute, context_parallel), group, scatter_idx=2, gather_idx=0
        )
        # DeepSpeed's all-to-alls run eagerly inside a compiled layer (graph breaks around them).
        run_eagerly_when_compiled(self, "forward")

    def forward(self, query, key, value, mask: torch.Tensor | None) -> torch.Tensor:
        """`mask`: as `CoreAttention`'s, over the full sequence ([b|1, 1, s, s] or None)."""
        context = self.distributed(query, key, value, 1, None, mask)  # [s/S, b, np, hn]
        return context.flatten(2)


class _HeadSplitCore(nn.Module):
    """The attention `DistributedAttention` calls: [s, b, n/S, hn] in, [s, b, np/S, hn] out."""

    def __init__(self, core: CoreAttention, recompute: bool, context_parallel: bool) -> None:
        super().__init__()
        self.core = core
        self.recompute = recompute
        self.context_parallel = context_parallel

    def forward(self, query, key, value, mask) -> torch.Tensor:
        s, b, heads, hn = query.shape
        if self.context_parallel:
            natural = sequence_order_of_context_parallel_parts(s, query.device)
            query, key, value = (t.index_select(0, natural) for t in (query, key, value))
            context = self._attend(query, key, value, mask)  # [s, b, np/S, hn], natural order
            return context.index_select(0, inverse_order(natural))
        return self._attend(query, key, value, mask)

    def _attend(self, query, key, value, mask) -> torch.Tensor:
        s, b, heads = query.shape[:3]
        hn = value.size(-1)  # the context's head width (MLA's values are narrower)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
        if self.recompute and self.training:
            # Selective recomputation: the core again in the backward, not the all-to-alls.
            context = checkpoint(self.core, False, query, key, value, mask)
        else:
            context = self.core(query, key, value, mask)  # [s, b, np/S * hn]
        return context.view(s, b, heads, hn)


class RotaryEmbedding(nn.Module):
    """Rotary position angles for the first `rotary_percent` of each head's channels; with
    `yarn`, YaRN's frequencies and the `factor` its cos and sin are scaled by."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        base: float = 10000.0,
        yarn: YarnConfig | None = None,
    ) -> None:
        super().__init__()
        self.dim = int(kv_channels * rotary_percent)
        if self.dim % 2 != 0 or self.dim == 0:
            raise ValueError(
                f"--rotary-percent {rotary_percent} of --kv-channels {kv_channels} gives "
                f"{self.dim} rotary channels; it must be a positive even number"
            )
        if yarn is None:
            exponents = torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim
            inv_freq, self.factor = 1.0 / (base**exponents), 1.0
        else:
            inv_freq = yarn.inverse_frequencies(self.dim, base)
            self.factor = yarn.attention_factor()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_length: int, offset: int = 0) -> torch.Tensor:
        """Angles [s, 1, 1, dim] for positions offset..offset+s-1."""
        return self.at(torch.arange(offset, offset + seq_length, device=self.inv_freq.device))

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """Angles [s, 1, 1, dim] for the given positions [s] (any order: a rank's part of the
        sequence under context parallelism)."""
        freqs = torch.outer(positions.to(self.inv_freq.device, torch.float32), self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def apply_rotary_pos_emb(
    tensor: torch.Tensor, angles: torch.Tensor, factor: float = 1.0
) -> torch.Tensor:
    """Rotate the first `angles.size(-1)` channels of [s, b, np, hn] by the angles, cos and sin
    times `factor` (YaRN's attention factor)."""
    dim = angles.size(-1)
    rotated, passed = tensor[..., :dim], tensor[..., dim:]
    first, second = rotated.chunk(2, dim=-1)
    half_turned = torch.cat((-second, first), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    cos, sin = cos.to(tensor.dtype), sin.to(tensor.dtype)
    return torch.cat((rotated * cos + half_turned * sin, passed), dim=-1)
