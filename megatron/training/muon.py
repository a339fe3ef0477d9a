"""Megatron-LM's Muon (`--optimizer muon`): orthogonalized momentum for the hidden matrices,
AdamW for every other parameter, behind one optimizer object.

Which parameters get Muon is Megatron-LM's rule (megatron/core/optimizer/emerging_optimizers.py,
`_is_muon_excluded`): the 2-D weights other than the word embeddings and the output layer (the
parameters it tags `is_embedding_or_output_parameter`). Biases, norms, the embeddings, the
output layer and any other tensor that is not 2-D get AdamW with `--adam-*` (Megatron-LM's
`--muon-scalar-optimizer adam`). Megatron-LM's MoE experts, stacked here as [E, in, out], get
Muon per expert on the [out, in] matrix megatron-core keeps for each (its orientation decides
`shape_scaling`). Both halves take `--lr` on the same schedule and `--weight-decay`,
decoupled.

The update of one Muon matrix p with gradient g (emerging_optimizers' `OrthogonalizedOptimizer`
and Megatron-LM's `TensorParallelMuon`, which `--optimizer muon` builds there):

    p <- p (1 - lr wd)                                     decoupled weight decay
    m <- m + (1 - momentum) (g - m)                        --muon-momentum (an EMA)
    u <- g + momentum (m - g) if --muon-nesterov else m
    p <- p - lr NS(u) scale(rows, cols) --muon-extra-scale-factor

`NS` is `--muon-num-ns-steps` Newton-Schulz steps with the coefficients of
`--muon-coefficient-type`, in bf16 under `--muon-fp32-matmul-prec medium` (fp32 otherwise);
`scale` is `--muon-scale-mode`. torch's `torch.optim.Muon` has this momentum, weight decay and
state (`momentum_buffer`), which `Muon` below inherits, but one fixed coefficient triple
(Megatron-LM's `simple`), bf16 only, and two scales (`original` is `shape_scaling`,
`match_rms_adamw` is `spectral` x 0.2): Megatron-LM's defaults (quintic, spectral x 1) are not
among them, so `Muon.step` computes Megatron-LM's orthogonalization itself.
Unless `--muon-no-split-qkv`, a fused query/key/value weight is orthogonalized as its query,
key and value blocks apart. Under tensor parallelism `--muon-tp-mode` says how a split
matrix is orthogonalized: `duplicated` gathers it whole on every tensor-parallel rank,
`distributed` sums the Newton-Schulz Gram matrices over the ranks instead (both give the
whole matrix's update), `blockwise` orthogonalizes each rank's shard as a matrix of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    all_reduce_sum_over_tensor_parallel,
    gather_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

# Newton-Schulz (a, b, c) per step: emerging_optimizers' muon_utils._COEFFICIENT_SETS, which
# Megatron-LM's --muon-coefficient-type names.
NS_COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    "cubic5": (
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ),
}
# Sets that keep their last step once exhausted; the others start over.
_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("duplicated", "distributed", "blockwise")
FP32_MATMUL_PRECISIONS = ("low", "medium", "high")


@dataclass(frozen=True)
class MuonConfig:
    """Megatron-LM's `--muon-*` settings (their defaults are the flags')."""

    momentum: float = 0.9
    """--muon-momentum: the EMA coefficient of the momentum buffer."""
    nesterov: bool = False
    """--muon-nesterov: orthogonalize g + momentum (m - g) instead of m."""
    coefficient_type: str = "quintic"
    """--muon-coefficient-type: a key of `NS_COEFFICIENTS`."""
    num_ns_steps: int = 5
    """--muon-num-ns-steps."""
    scale_mode: str = "spectral"
    """--muon-scale-mode: sqrt(max(rows, cols)), sqrt(rows / cols) or sqrt(max(1, rows / cols))."""
    extra_scale_factor: float = 1.0
    """--muon-extra-scale-factor: a further factor on every update."""
    fp32_matmul_prec: str = "medium"
    """--muon-fp32-matmul-prec: torch's float32 matmul precision for the iteration; `medium`
    runs it in bf16; torch ignores `low` (the process's precision, fp32 unless set)."""
    tp_mode: str = "duplicated"
    """--muon-tp-mode (see the module docstring)."""
    qkv_split: tuple[int, int, int] | None = None
    """Rows of one query group's query, key and value blocks in the fused QKV weight
    ([groups, g x hn + 2 hn, h]); None: orthogonalized whole (--muon-no-split-qkv)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MuonConfig:
        """The settings of validated flags."""
        heads = args.num_attention_heads
        groups = getattr(args, "num_key_value_heads", None) or heads
        channels = getattr(args, "kv_channels", None) or args.hidden_size // heads
        return cls(
            momentum=args.muon_momentum,
            nesterov=args.muon_nesterov,
            coefficient_type=args.muon_coefficient_type,
            num_ns_steps=args.muon_num_ns_steps,
            scale_mode=args.muon_scale_mode,
            extra_scale_factor=args.muon_extra_scale_factor,
            fp32_matmul_prec=args.muon_fp32_matmul_prec,
            tp_mode=args.muon_tp_mode,
            qkv_split=(
                (heads // groups * channels, channels, channels) if args.muon_split_qkv else None
            ),
        )


def ns_coefficients(coefficient_type: str, steps: int) -> Iterator[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` Newton-Schulz steps."""
    if coefficient_type not in NS_COEFFICIENTS:
        raise ValueError(
            f"--muon-coefficient-type {coefficient_type!r}: choose one of {tuple(NS_COEFFICIENTS)}"
        )
    sets = NS_COEFFICIENTS[coefficient_type]
    if coefficient_type == "cubic5" and steps != len(sets):
        raise ValueError(f"--muon-coefficient-type cubic5 is 5 steps; --muon-num-ns-steps {steps}")
    if coefficient_type in _REPEAT_LAST:
        return itertools.islice(itertools.chain(sets, itertools.repeat(sets[-1])), steps)
    return itertools.islice(itertools.cycle(sets), steps)


def newton_schulz(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str = "quintic",
    transpose: bool | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eps: float = 1e-15,
) -> torch.Tensor:
    """The orthogonalization of the fp32 matrix `x` (emerging_optimizers' `newton_schulz`): the
    iteration X <- a X + (b A + c A A) X, A = X X^T, from X = x / ||x||_F, on the smaller side
    (or `transpose`d as asked); in bf16 when torch's float32 matmul precision is `medium`.

    `reduce` (in-place sum over the ranks holding the other parts of `x`, split along the
    side X X^T contracts): the norm and each Gram matrix are summed over them."""
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if reduce is None:
        X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)
    else:
        norm = reduce((x * x).sum()).sqrt().clamp_min(eps)
        X = x / norm
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)  # torch has no fp32-in, bf16-compute matmul to ask for
    for a, b, c in ns_coefficients(coefficient_type, steps):
        A = X @ X.mT
        if reduce is not None:
            A = reduce(A)
        if c != 0.0:
            B = torch.addmm(A, A, A, alpha=c, beta=b)
            X = torch.addmm(X, B, X, alpha=1.0, beta=a)
        else:
            X = torch.addmm(X, A, X, alpha=b, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """--muon-scale-mode's factor for a [rows, cols] update (emerging_optimizers'
    `get_muon_scale_factor`)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r}: choose one of {SCALE_MODES}")


@contextlib.contextmanager
def fp32_matmul_precision(precision: str) -> Iterator[None]:
    """torch's float32 matmul precision set to `precision` inside (torch ignores `low`)."""
    if precision not in ("medium", "high"):
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _gathered(x: torch.Tensor, partition_dim: int) -> torch.Tensor:
    """The whole matrix of the tensor-parallel shards `x` (split along `partition_dim`)."""
    if partition_dim == 1:
        return gather_from_tensor_model_parallel_region(x)
    return gather_from_tensor_model_parallel_region(x.mT.contiguous()).mT


def _own_shard(x: torch.Tensor, partition_dim: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of the whole matrix `x`."""
    if partition_dim == 1:
        return scatter_to_tensor_model_parallel_region(x)
    return scatter_to_tensor_model_parallel_region(x.mT.contiguous()).mT.contiguous()


def orthogonalized(x: torch.Tensor, config: MuonConfig, partition_dim: int | None) -> torch.Tensor:
    """The scaled orthogonal update of one matrix `x`, this rank's shard when `partition_dim`
    (the tensor-parallel split, None when whole) says it is split."""
    rows, cols = x.shape
    steps, kind = config.num_ns_steps, config.coefficient_type
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if partition_dim is None or tp == 1 or config.tp_mode == "blockwise":
        update = newton_schulz(x, steps, kind)
    elif config.tp_mode == "duplicated":
        update = _own_shard(newton_schulz(_gathered(x, partition_dim), steps, kind), partition_dim)
    else:  # distributed: X X^T contracts over the split side, summed over the ranks
        reduce = all_reduce_sum_over_tensor_parallel
        update = newton_schulz(x, steps, kind, transpose=partition_dim == 0, reduce=reduce)
    if partition_dim is not None and config.tp_mode != "blockwise":
        rows, cols = (rows * tp, cols) if partition_dim == 0 else (rows, cols * tp)
    return update * (muon_scale(rows, cols, config.scale_mode) * config.extra_scale_factor)


def orthogonalized_update(
    u: torch.Tensor, config: MuonConfig, partition_dim: int | None, qkv: bool
) -> torch.Tensor:
    """`orthogonalized`, for a fused QKV weight (`qkv`, with `config.qkv_split`) per block:
    the queries of every group as one matrix, the keys as another, the values as a third."""
    if not (qkv and config.qkv_split):
        return orthogonalized(u, config, partition_dim)
    rows_per_group = sum(config.qkv_split)
    if u.size(0) % rows_per_group:
        raise ValueError(f"QKV weight of {tuple(u.shape)} rows: not groups of {config.qkv_split}")
    groups, width = u.size(0) // rows_per_group, u.size(-1)
    blocks = torch.split(u.view(groups, rows_per_group, width), list(config.qkv_split), dim=1)
    updates = [
        orthogonalized(block.reshape(-1, width), config, partition_dim).view(groups, -1, width)
        for block in blocks
    ]
    return torch.cat(updates, dim=1).view(u.shape)


class Muon(torch.optim.Muon):
    """torch's Muon (its checks, groups and `momentum_buffer` state) updating as Megatron-LM's
    (the module docstring). Groups may say `muon_partition_dim` (the tensor-parallel split of
    their matrices), `muon_qkv` (fused QKV weights, orthogonalized per block) and
    `muon_stacked_experts` (3-D [E, in, out] expert weights, orthogonalized per expert)."""

    def __init__(
        self, params: Iterable, lr: float, weight_decay: float, config: MuonConfig
    ) -> None:
        params = list(params)
        if params and not isinstance(params[0], dict):  # tensors: one group of them
            params = [{"params": params}]
        # torch checks that its groups hold 2-D parameters: the stacked experts join after.
        stacked = [group for group in params if group.get("muon_stacked_experts")]
        matrices = [group for group in params if not group.get("muon_stacked_experts")]
        if not matrices:
            raise ValueError("Muon needs at least one 2-D weight beside stacked experts")
        super().__init__(
            matrices,
            lr=lr,
            weight_decay=weight_decay,
            momentum=config.momentum,
            nesterov=config.nesterov,
            ns_steps=config.num_ns_steps,
        )
        self.config = config
        for group in stacked:
            self.add_param_group(group)
        # torch's iteration settings that Megatron-LM's flags replace (config) are not kept.
        for settings in (self.defaults, *self.param_groups):
            for key in ("ns_coefficients", "eps", "adjust_lr_fn"):
                settings.pop(key, None)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> object:
        """One Muon update of every matrix with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with fp32_matmul_precision(self.config.fp32_matmul_prec):
            for group in self.param_groups:
                params: list[torch.Tensor] = []
                grads: list[torch.Tensor] = []
                buffers: list[torch.Tensor] = []
                self._init_group(group, params, grads, buffers)
                for param, grad, buffer in zip(params, grads, buffers, strict=True):
                    self._update(param, grad, buffer, group)
        return loss

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, group: dict
    ) -> None:
        lr, momentum = group["lr"], group["momentum"]
        param.mul_(1.0 - lr * group["weight_decay"])
        buffer.lerp_(grad, 1.0 - momentum)
        u = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        if group.get("muon_stacked_experts"):
            # [E, in, out]: each expert's [out, in] matrix, as megatron-core keeps it.
            update = torch.stack(
                [orthogonalized(expert.float().mT, self.config, None).mT for expert in u]
            )
        else:
            update = orthogonalized_update(
                u.float(),
                self.config,
                group.get("muon_partition_dim"),
                group.get("muon_qkv", False),
            )
        param.add_(update.to(param.dtype), alpha=-lr)
