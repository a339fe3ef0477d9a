"""The optimizer side of training: param groups, AdamW, fp16 loss scaling, gradient clipping.

`get_param_groups` splits parameters the way Megatron does (no weight decay on biases and
norms), `build_optimizer` makes the bare AdamW that DeepSpeed wraps (or the plain-torch path
steps), the loss scalers are Megatron's `DynamicGradScaler` / `ConstantGradScaler`, and
`clip_grad_norm` is the model-parallel-aware norm (and clip) that `GuardedAdamW` runs before
each step where DeepSpeed does not run its own; a non-finite norm skips the step.
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
DECOUPLED_LR_PARAMETERS = ("word_embeddings.weight", "output_layer.weight")


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
    """AdamW over `param_groups`: Megatron's `--optimizer adam` is Adam with decoupled decay."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"--optimizer {kind!r} is not supported; choose one of {OPTIMIZERS}")
    return torch.optim.AdamW(
        param_groups,
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        **_adamw_kernel(param_groups),
    )


def _adamw_kernel(params: list) -> dict:
    """{'fused': True} when every tensor is on the GPU, else {'foreach': True}."""
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
    (or over `param_groups` already made from it)."""
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
    """
    if getattr(param, "shared", False) or getattr(param, "ds_pipe_replicated", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank_0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) gradient, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [torch.linalg.vector_norm(_local(g), dtype=torch.float32).to(device) for g in grads]
    return torch.stack(norms).square().sum()


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter] | torch.Tensor,
    max_norm: float,
    model_parallel_group: object = None,
    expert_parallel_group: Callable[[str], object] | None = None,
    shard_group: object = None,
) -> float:
    """Megatron's clip_grad_norm_fp32: the global L2 grad norm; clip to `max_norm` if finite.

    `shard_group`: under FSDP2 the gradients are DTensors sharded over it; the squares of
    each rank's shards are summed over it too.

    MoE experts count once each: their squares are also summed over the expert-parallel
    group that `expert_parallel_group(param.group_name)` names (the group spreading that
    layer's experts; their data-parallel replicas hold the same gradients).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [param for param in parameters if param.grad is not None]
    grads = [_local(param.grad.detach()) for param in params]
    tp_rank_0 = parallel_state.get_tensor_model_parallel_rank() == 0
    counted = [param for param in params if counted_once(param, tp_rank_0)]
    device = _reduction_device(grads)
    # Under FSDP2 every gradient is a shard, experts' too (over the ranks holding the same
    # experts, whose expert-parallel peers hold the others): one sum over the data-parallel
    # ranks counts every piece once.
    sharded = shard_group is not None
    dense = [p.grad.detach() for p in counted if sharded or not is_expert_param(p)]
    sum_of_squares = _sum_of_squares(dense, device)
    expert_groups = [] if sharded else sorted({p.group_name for p in counted if is_expert_param(p)})
    if expert_groups and expert_parallel_group is None:
        raise ValueError("expert parameters need expert_parallel_group to count them once")
    for name in expert_groups:
        own = [p.grad.detach() for p in counted if is_expert_param(p) and p.group_name == name]
        experts = _sum_of_squares(own, device)
        all_reduce_if_distributed(experts, dist.ReduceOp.SUM, expert_parallel_group(name))
        sum_of_squares = sum_of_squares + experts
    if shard_group is not None:  # FSDP2: each data-parallel rank holds 1/DP of every gradient
        all_reduce_if_distributed(sum_of_squares, dist.ReduceOp.SUM, shard_group)
    if model_parallel_group is not None:
        all_reduce_if_distributed(sum_of_squares, dist.ReduceOp.SUM, model_parallel_group)
    total_norm = sum_of_squares.sqrt().item()
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    # inf/nan norms are reported, never used to scale: the step will be skipped anyway.
    if max_norm > 0 and clip_coeff < 1.0 and math.isfinite(total_norm):
        for grad in grads:
            grad.mul_(clip_coeff)
    return total_norm


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that guards its own step: skips it on non-finite grads, else clips first.

    For the paths where nothing else guards the step (plain torch, DeepSpeed fp32 ZeRO-0).
    `overflow` and `grad_norm` describe the last step; DeepSpeed's engine reads `overflow`
    to skip its scheduler step and `_global_grad_norm` for `get_global_grad_norm()`. ZeRO
    stages 1-3 accept only the exact AdamW type (else `zero_allow_untested_optimizer`):
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
            **_adamw_kernel(params),
        )
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

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> object:
        """Skip the update on inf/nan grads (any model-parallel rank), else clip and step."""
        loss = None
        if closure is not None:
            # Evaluated first so the guard sees the gradients it produced.
            with torch.enable_grad():
                loss = closure()
        if not self.guard:
            super().step()
            return loss
        params = [param for group in self.param_groups for param in group["params"]]
        # One pass: the norm (all-reduced over the model-parallel ranks, the gradients being
        # equal across data-parallel ranks) is non-finite exactly when some gradient is, and
        # clip_grad_norm leaves the gradients alone then.
        norm = clip_grad_norm(
            params,
            self.clip_grad,
            self.model_parallel_group,
            self.expert_parallel_group,
            self.shard_group,
        )
        self.overflow = not math.isfinite(norm)
        self.grad_norm = None if self.overflow else norm
        if not self.overflow:
            super().step()
        return loss
