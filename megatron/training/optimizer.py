"""The optimizer side of training: param groups, AdamW, fp16 loss scaling, gradient clipping.

`get_param_groups` splits parameters the way Megatron does (no weight decay on biases and
norms), `build_optimizer` makes the bare AdamW that DeepSpeed wraps (or the plain-torch path
steps), the loss scalers are Megatron's `DynamicGradScaler` / `ConstantGradScaler`, and
`clip_grad_norm` is the model-parallel-aware norm (and clip) that `GuardedAdamW` runs before
each step where DeepSpeed does not run its own; a non-finite norm skips the step.
`count_zeros` (`--log-num-zeros-in-grad`) counts the zero gradient elements the same way
(`model_wide_sum`: each element of the model once, whatever the split).
"""

from __future__ import annotations

import math
from argparse import Namespace
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megatron.core import parallel_state

OPTIMIZERS = ("adam", "adamw")


# The input and output layers (`--decoupled-lr`): the word embeddings, the untied output layer.
# The input embedding, the untied output layer and, on the last of several pipeline stages, the
# tied copy of the embedding (Megatron-LM marks all three `is_embedding_or_output_parameter`).
DECOUPLED_LR_PARAMETERS = (
    "word_embeddings.weight",
    "output_layer.weight",
    "word_embeddings_for_head.weight",
)


def get_param_groups(
    modules: torch.nn.Module | list[torch.nn.Module],
    decoupled_lr: tuple[float, float | None] | None = None,
) -> list[dict]:
    """Megatron's split: 1-D params and biases get no weight decay; each tensor appears once.

    `decoupled_lr` (Megatron-LM's `--decoupled-lr`, `--decoupled-min-lr`): the input and output
    layers go to a group of their own with that peak and floor on the same schedule."""
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    decoupled: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for name, param in module.named_parameters():
            # Tied weights (embedding and output layer) must be stepped once, not twice.
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if decoupled_lr is not None and name.endswith(DECOUPLED_LR_PARAMETERS):
                decoupled.append(param)
            elif param.ndim == 1 or name == "bias" or name.endswith(".bias"):
                no_decay.append(param)
            else:
                decay.append(param)
    groups = [
        # No weight_decay key: the optimizer's default (--weight-decay) applies.
        {"params": decay, "wd_mult": 1.0, "name": "weight_decay"},
        # wd_mult 0.0 keeps the scheduler from writing a nonzero decay into this group.
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "name": "no_weight_decay"},
    ]
    if decoupled:
        max_lr, min_lr = decoupled_lr
        groups.append(
            {"params": decoupled, "wd_mult": 1.0, "name": "decoupled_lr", "max_lr": max_lr}
            | ({"min_lr": min_lr} if min_lr is not None else {})
        )
    return [group for group in groups if group["params"]]


def build_optimizer(
    param_groups: list[dict],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    kind: str = "adam",
) -> torch.optim.Optimizer:
    """AdamW over `param_groups`: Megatron's `--optimizer adam` is Adam with decoupled decay
    (`--optimizer muon`: `megatron.training.muon_optimizer.muon_optimizer`)."""
    if kind == "muon":
        raise ValueError("--optimizer muon: build it with muon_optimizer (muon_optimizer.py)")
    if kind not in OPTIMIZERS:
        raise ValueError(f"--optimizer {kind!r} is not supported; choose one of {OPTIMIZERS}")
    return torch.optim.AdamW(
        param_groups,
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        **adamw_kernel(param_groups),
    )


def adamw_kernel(params: list) -> dict:
    """AdamW's kernel for `params` (tensors or groups): {'fused': True} when every tensor is on
    the GPU, else {'foreach': True}."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    # The fused kernel wants every tensor on the GPU; foreach batches the per-tensor math.
    if tensors and all(tensor.is_cuda for tensor in tensors):
        return {"fused": True}
    return {"foreach": True}


def optimizer_from_args(
    model: torch.nn.Module | list[torch.nn.Module],
    args: Namespace,
    param_groups: list[dict] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of `--optimizer`, `--lr`, `--weight-decay`, `--adam-*` over `model`
    (or over `param_groups` already made from it); unguarded. `--optimizer muon` is built
    by `megatron.training.muon_optimizer.muon_optimizer`, which builds on this module."""
    return build_optimizer(
        param_groups or get_param_groups(model),
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        kind=args.optimizer,
    )


class ConstantLossScaler:
    """Megatron's ConstantGradScaler: the static scale of `--loss-scale`."""

    def __init__(self, scale: float) -> None:
        if scale <= 0.0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        """1 / scale, to unscale gradients."""
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Nothing to do: a static scale never changes."""

    def state_dict(self) -> dict:
        """Empty: the scale comes from the command line."""
        return {}

    def load_state_dict(self, sd: dict) -> None:
        """Nothing to restore."""


class DynamicLossScaler:
    """Megatron's DynamicGradScaler (fp16 loss scaling for the plain-torch path)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if initial_scale <= 0.0:
            raise ValueError(f"--initial-loss-scale must be positive, got {initial_scale}")
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(
                f"--min-loss-scale ({min_scale}) must be positive and at most "
                f"--initial-loss-scale ({initial_scale})"
            )
        if growth_factor <= 1.0:
            raise ValueError(f"loss scale growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss scale backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            raise ValueError(f"--loss-scale-window must be positive, got {growth_interval}")
        if hysteresis <= 0:
            raise ValueError(f"--hysteresis must be positive, got {hysteresis}")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def inv_scale(self) -> float:
        """1 / scale, to unscale gradients."""
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Back off after `hysteresis` overflows; grow after `growth_interval` clean steps."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            # Once out of hysteresis, every further overflow backs off again.
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        """Scale and trackers under Megatron's keys."""
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore; Megatron's checkpoints hold the scale as a 1-element tensor."""
        scale = sd["scale"]
        self.scale = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])


def loss_scaler_from_args(args: Namespace) -> DynamicLossScaler | ConstantLossScaler | None:
    """The fp16 loss scaler of the flags: static with --loss-scale, else dynamic; None off fp16."""
    if not args.fp16:
        return None
    if args.loss_scale:
        return ConstantLossScaler(args.loss_scale)
    return DynamicLossScaler(
        initial_scale=args.initial_loss_scale,
        min_scale=args.min_loss_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=int(args.loss_scale_window),
        hysteresis=args.hysteresis,
    )


def _reduction_device(grads: list[torch.Tensor]) -> torch.device:
    """Where a reduced scalar lives: with the grads, or on the GPU when NCCL needs it there."""
    if grads:
        return grads[0].device
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_if_distributed(tensor: torch.Tensor, op: dist.ReduceOp, group: object) -> None:
    """All-reduce in place over `group`; a no-op without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """An MoE expert's parameter (DeepSpeed marks them `allreduce = False`): each expert
    lives on one rank of its expert-parallel group."""
    return getattr(param, "allreduce", True) is False


def counted_once(param: torch.nn.Parameter, tp_rank_0: bool) -> bool:
    """Whether a model-wide norm counts `param` on this rank (Megatron's duplicate filter).

    A replicated param (norm, row-parallel bias) is the same on every tensor-parallel rank:
    counted on rank 0 only. A second copy of a tied weight is not counted: Megatron marks it
    `shared`, DeepSpeed's pipeline marks the later stages' tied module `ds_pipe_replicated`.
    Megatron-LM's experts under expert parallelism (`expert_folded_over_tensor_ranks`) are
    whole on each rank of an expert-parallel group spanning tensor-parallel ranks: counted on
    every rank (`model_wide_sum` adds their group's sum once per stage).
    """
    if getattr(param, "shared", False) or getattr(param, "ds_pipe_replicated", False):
        return False
    if getattr(param, "expert_folded_over_tensor_ranks", False):
        return True
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank_0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) gradient, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def _stacked_sum(values: list[torch.Tensor], device: torch.device, dtype: torch.dtype):  # noqa: ANN202
    if not values:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack([value.to(device=device, dtype=dtype) for value in values]).sum()


def model_wide_sum(
    values: list[tuple[torch.nn.Parameter, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    model_parallel_group: object = None,
    expert_parallel_group: Callable[[str], object] | None = None,
    shard_group: object = None,
) -> torch.Tensor:
    """The sum over the whole model of a per-parameter statistic of its gradient, each gradient
    element counted once (Megatron's rule for the gradient norm and the zero count).

    `values`: (parameter, the statistic of this rank's gradient of it, or of its shard). What
    `counted_once` leaves out (tensor-parallel duplicates, a tied weight's second copy) adds
    nothing. `shard_group`: each rank holds a shard of every gradient (FSDP2, ZeRO partitions):
    the sums are added over it. MoE experts count once each: without shards their sums are
    also added over the expert-parallel group that `expert_parallel_group(param.group_name)`
    names (the group spreading that layer's experts; their data-parallel replicas hold the same
    gradients), and that sum joins the total on tensor-parallel rank 0 only (Megatron-LM's
    expert-parallel group may span tensor-parallel ranks). Then everything is added over
    `model_parallel_group`. A collective of them all.
    """
    tp_rank_0 = parallel_state.get_tensor_model_parallel_rank() == 0
    counted = [(param, value) for param, value in values if counted_once(param, tp_rank_0)]
    # Sharded, every gradient is a shard, experts' too (over the ranks holding the same
    # experts, whose expert-parallel peers hold the others): one sum over the data-parallel
    # ranks counts every piece once.
    sharded = shard_group is not None
    dense = [value for param, value in counted if sharded or not is_expert_param(param)]
    total = _stacked_sum(dense, device, dtype)
    experts_of = [param.group_name for param, _ in counted if is_expert_param(param)]
    expert_groups = [] if sharded else sorted(set(experts_of))
    if expert_groups and expert_parallel_group is None:
        raise ValueError("expert parameters need expert_parallel_group to count them once")
    for name in expert_groups:
        own = [v for p, v in counted if is_expert_param(p) and p.group_name == name]
        experts = _stacked_sum(own, device, dtype)
        all_reduce_if_distributed(experts, dist.ReduceOp.SUM, expert_parallel_group(name))
        if tp_rank_0:
            total = total + experts
    if shard_group is not None:
        all_reduce_if_distributed(total, dist.ReduceOp.SUM, shard_group)
    if model_parallel_group is not None:
        all_reduce_if_distributed(total, dist.ReduceOp.SUM, model_parallel_group)
    return total


def zeros_in(grad: torch.Tensor) -> torch.Tensor:
    """How many elements of `grad` (this rank's shard of a DTensor) are exactly zero."""
    grad = _local(grad)
    return grad.numel() - torch.count_nonzero(grad)


def count_zeros(
    parameters: Iterable[torch.nn.Parameter],
    model_parallel_group: object = None,
    expert_parallel_group: Callable[[str], object] | None = None,
    shard_group: object = None,
) -> float:
    """Megatron's count_zeros_fp32: zero gradient elements over the whole model, each counted
    once (the groups as in `model_wide_sum`); parameters without a gradient add nothing."""
    params = [param for param in parameters if param.grad is not None]
    device = _reduction_device([param.grad for param in params])
    values = [(param, zeros_in(param.grad.detach())) for param in params]
    groups = (model_parallel_group, expert_parallel_group, shard_group)
    # float64: exact up to 2**53 elements, and every backend reduces it.
    return model_wide_sum(values, device, torch.float64, *groups).item()


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter] | torch.Tensor,
    max_norm: float,
    model_parallel_group: object = None,
    expert_parallel_group: Callable[[str], object] | None = None,
    shard_group: object = None,
) -> float:
    """Megatron's clip_grad_norm_fp32: the global L2 grad norm; clip to `max_norm` if finite.

    The squares are summed as `model_wide_sum` says (`shard_group`: under FSDP2 the gradients
    are DTensors sharded over it; MoE experts over their expert-parallel group).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [param for param in parameters if param.grad is not None]
    grads = [_local(param.grad.detach()) for param in params]
    device = _reduction_device(grads)
    squares = [
        (param, torch.linalg.vector_norm(grad, dtype=torch.float32).square())
        for param, grad in zip(params, grads)
    ]
    groups = (model_parallel_group, expert_parallel_group, shard_group)
    total_norm = model_wide_sum(squares, device, torch.float32, *groups).sqrt().item()
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    # inf/nan norms are reported, never used to scale: the step will be skipped anyway.
    if max_norm > 0 and clip_coeff < 1.0 and math.isfinite(total_norm):
        for grad in grads:
            grad.mul_(clip_coeff)
    return total_norm


class StepGuard:
    """What a guarded optimizer runs around its update: skip it on non-finite grads, else clip
    first. `overflow` and `grad_norm` describe the last step; DeepSpeed's engine reads
    `overflow` to skip its scheduler step and `_global_grad_norm` for `get_global_grad_norm()`.
    With `counts_zeros` (`--log-num-zeros-in-grad`) it also counts the zero gradient elements
    of each update, after clipping and before the update (as Megatron's optimizer), in
    `num_zeros`.
    """

    counts_zeros: bool = False
    num_zeros: float | None = None
    """Zero gradient elements of the last update; None when not counted or skipped."""

    def init_guard(
        self,
        clip_grad: float = 0.0,
        guard: bool = True,
        model_parallel_group: object = None,
        expert_parallel_group: Callable[[str], object] | None = None,
        shard_group: object = None,
    ) -> None:
        """Set the clipping threshold and the groups the norm is summed over."""
        self.clip_grad = clip_grad
        self.guard = guard
        self.model_parallel_group = model_parallel_group
        self.expert_parallel_group = expert_parallel_group
        self.shard_group = shard_group
        self.overflow = False
        self.grad_norm: float | None = None

    @property
    def _global_grad_norm(self) -> float | None:
        """The norm under the name DeepSpeed's engine copies after each step."""
        return self.grad_norm

    def guarded_step(self, update: Callable[[], object], closure: Callable | None) -> object:
        """Skip `update` on inf/nan grads (any model-parallel rank), else clip and run it."""
        loss = None
        if closure is not None:
            # Evaluated first so the guard sees the gradients it produced.
            with torch.enable_grad():
                loss = closure()
        if not self.guard:
            update()
            return loss
        params = [param for group in self.param_groups for param in group["params"]]
        # One pass: the norm (all-reduced over the model-parallel ranks, the gradients being
        # equal across data-parallel ranks) is non-finite exactly when some gradient is, and
        # clip_grad_norm leaves the gradients alone then.
        groups = (self.model_parallel_group, self.expert_parallel_group, self.shard_group)
        norm = clip_grad_norm(params, self.clip_grad, *groups)
        self.overflow = not math.isfinite(norm)
        self.grad_norm = None if self.overflow else norm
        self.num_zeros = None
        if not self.overflow:
            if self.counts_zeros:
                self.num_zeros = count_zeros(params, *groups)
            update()
        return loss


class GuardedAdamW(StepGuard, torch.optim.AdamW):
    """AdamW that guards its own step (`StepGuard`): skips it on non-finite grads, else clips.

    For the paths where nothing else guards the step (plain torch, DeepSpeed fp32 ZeRO-0).
    ZeRO stages 1-3 accept only the exact AdamW type (else `zero_allow_untested_optimizer`):
    use `build_optimizer` there, as DeepSpeed guards those steps itself.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float = 0.0,
        guard: bool = True,
        model_parallel_group: object = None,
        expert_parallel_group: Callable[[str], object] | None = None,
        shard_group: object = None,
    ) -> None:
        params = list(params)
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            **adamw_kernel(params),
        )
        self.init_guard(clip_grad, guard, model_parallel_group, expert_parallel_group, shard_group)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> object:
        """Skip the update on inf/nan grads (any model-parallel rank), else clip and step."""
        return self.guarded_step(super().step, closure)
