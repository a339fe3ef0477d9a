"""`--optimizer muon` as one optimizer object: Muon's groups and AdamW's, split by Megatron-LM's
rule, behind the interface the engines, the LR scheduler, clipping and checkpoints use.

`muon_param_groups` splits Megatron's param groups (`get_param_groups`) into Muon's matrices
and AdamW's rest; `MuonWithAdamW` steps both (its `param_groups` and `state` are both halves',
so the scheduler's lr/weight-decay writes and `state_dict` / `load_state_dict` work as for
AdamW); `GuardedMuonWithAdamW` adds our clipping and non-finite-step guard (`StepGuard`);
`deepspeed_muon` is DeepSpeed's own `MuonWithAuxAdam` over the same groups, for the ZeRO
wrappers that flatten parameters into partitions (which only DeepSpeed's Muon orthogonalizes).
The math is in `megatron.training.muon`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from megatron.core import parallel_state
from megatron.training.muon import Muon, MuonConfig
from megatron.training.optimizer import StepGuard, adamw_kernel

# Megatron-LM's `is_embedding_or_output_parameter`, by name: GPTModel's, GPTModelPipe's
# (`lm_head`) and the last pipeline stage's copy of tied word embeddings (pipeline_chunks.py).
EMBEDDING_OR_OUTPUT = (
    "word_embeddings.weight",
    "output_layer.weight",
    "lm_head.weight",
    "word_embeddings_for_head.weight",
)
QKV_WEIGHT = "self_attention.query_key_value.weight"
# Megatron-LM's MoE experts stacked as [E, in, out] (megatron/model/moe_experts.py): each
# expert's matrix is one of megatron-core's per-expert 2-D weights, transposed.
STACKED_EXPERTS = (".mlp.experts.weight1", ".mlp.experts.weight2")


def uses_muon(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron-LM's rule: a 2-D weight other than the word embeddings and the output layer
    (and not marked `use_muon = False`); each expert's matrix of a stacked expert weight."""
    stacked = param.ndim == 3 and name.endswith(STACKED_EXPERTS)
    if (param.ndim != 2 and not stacked) or name.endswith(EMBEDDING_OR_OUTPUT):
        return False
    return bool(getattr(param, "use_muon", True))


def muon_param_groups(
    modules: torch.nn.Module | list[torch.nn.Module], groups: list[dict]
) -> list[dict]:
    """`groups` (`get_param_groups`') split by `uses_muon`: each group's AdamW part keeps its
    settings with `use_muon` False; its Muon matrices go to groups of the same settings, one per
    tensor-parallel split dimension and fused-QKV kind (`muon_partition_dim`, `muon_qkv`)."""
    modules = [modules] if isinstance(modules, torch.nn.Module) else modules
    names = {id(p): n for module in modules for n, p in module.named_parameters()}
    split_model = parallel_state.get_tensor_model_parallel_world_size() > 1
    split: list[dict] = []
    for group in groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        muon: dict[tuple[int, bool, bool], list[torch.nn.Parameter]] = {}
        adamw = []
        for param in group["params"]:
            name = names.get(id(param), "")
            if not uses_muon(name, param):
                adamw.append(param)
                continue
            split_dim = getattr(param, "partition_dim", -1)
            if not (split_model and getattr(param, "tensor_model_parallel", False)):
                split_dim = -1
            kind = (split_dim, name.endswith(QKV_WEIGHT), param.ndim == 3)
            muon.setdefault(kind, []).append(param)
        if adamw:
            split.append(dict(settings, params=adamw, use_muon=False))
        for (split_dim, qkv, stacked), params in sorted(muon.items()):
            muon_settings = dict(
                settings,
                params=params,
                use_muon=True,
                muon_partition_dim=None if split_dim == -1 else split_dim,
                muon_qkv=qkv,
                muon_stacked_experts=stacked,
            )
            if not settings.get("moe"):  # DeepSpeed finds an expert group's ranks by its name
                kind = "_qkv" if qkv else ""
                kind += "_experts" if stacked else ""
                kind += "" if split_dim == -1 else f"_tp{split_dim}"
                muon_settings["name"] = f"{settings.get('name', 'group')}_muon{kind}"
            split.append(muon_settings)
    return split


class MuonWithAdamW(torch.optim.Optimizer):
    """`Muon` over the groups marked `use_muon`, AdamW (`--adam-*`) over the others, as one
    optimizer: `param_groups` holds both halves' groups (the very dicts each half steps) in
    the order given, and `state` both halves' state."""

    def __init__(
        self,
        param_groups: list[dict],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        config: MuonConfig,
    ) -> None:
        muon_groups = [group for group in param_groups if group.get("use_muon")]
        adamw_groups = [group for group in param_groups if not group.get("use_muon")]
        self.config = config
        self.muon = Muon(muon_groups, lr, weight_decay, config) if muon_groups else None
        self.adamw = None
        if adamw_groups:
            kernel = adamw_kernel(adamw_groups)
            self.adamw = torch.optim.AdamW(
                adamw_groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **kernel
            )
        # The halves filled in their defaults in these very dicts; both now hold every key.
        super().__init__(param_groups, {})
        self._share_groups_and_state()

    def _share_groups_and_state(self) -> None:
        """Point each half at its groups among `param_groups`, and at the one `state`."""
        for half, use_muon in ((self.muon, True), (self.adamw, False)):
            if half is not None:
                half.param_groups = [g for g in self.param_groups if g["use_muon"] is use_muon]
                half.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (new group dicts, new state), then the halves follow it."""
        super().load_state_dict(state_dict)
        self._share_groups_and_state()

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> object:
        """Muon's update of the matrices, then AdamW's of the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for half in (self.muon, self.adamw):
            if half is not None:
                half.step()
        return loss


class GuardedMuonWithAdamW(StepGuard, MuonWithAdamW):
    """`MuonWithAdamW` that guards its own step as `GuardedAdamW` does: skips it on non-finite
    gradients, else clips to `--clip-grad` (over both halves' gradients) first."""

    def __init__(
        self,
        param_groups: list[dict],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        config: MuonConfig,
        **guard: object,
    ) -> None:
        super().__init__(param_groups, lr, weight_decay, betas, eps, config)
        self.init_guard(**guard)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> object:
        """Skip the update on inf/nan grads (any model-parallel rank), else clip and step."""
        return self.guarded_step(super().step, closure)


def deepspeed_muon(groups: list[dict], args: argparse.Namespace) -> torch.optim.Optimizer:
    """DeepSpeed's `MuonWithAuxAdam` over the split `groups`, every parameter tagged `use_muon`
    (what its ZeRO and BF16 wrappers read). Its update is Megatron-LM's with Nesterov momentum,
    the `simple` coefficients, 5 bf16 steps (`ns_method` standard) and `shape_scaling`, each
    tensor-parallel shard on its own: `megatron.arguments.muon_flags` refuses other flags."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    for group in groups:
        for param in group["params"]:
            param.use_muon = group["use_muon"]
        group.setdefault("lr", args.lr)
        group.setdefault("weight_decay", args.weight_decay)
        if group["use_muon"]:
            group.update(momentum=args.muon_momentum, ns_method="standard")
        else:
            group.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    # No auxiliary optimizer: its inline AdamW (decoupled decay) steps the other groups.
    return MuonWithAuxAdam(groups, adam_w_mode=True)


def muon_optimizer(
    modules: torch.nn.Module | list[torch.nn.Module],
    groups: list[dict],
    args: argparse.Namespace,
    guard: dict | None = None,
    deepspeed_partitions: bool = False,
) -> torch.optim.Optimizer:
    """`--optimizer muon` over `groups` (Megatron's, made from `modules`): guarded with
    `guard` (`StepGuard.init_guard`'s arguments), unguarded without, DeepSpeed's own Muon
    with `deepspeed_partitions` (a DeepSpeed wrapper that flattens parameters)."""
    groups = muon_param_groups(modules, groups)
    if deepspeed_partitions:
        return deepspeed_muon(groups, args)
    settings = dict(
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        config=MuonConfig.from_args(args),
    )
    if guard is None:
        return MuonWithAdamW(groups, **settings)
    return GuardedMuonWithAdamW(groups, **settings, **guard)
