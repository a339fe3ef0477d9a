"""A run's weights and Adam state as a torch_dist checkpoint (`megatron.checkpointing.
dist_checkpoint`) reads and fills them: each tensor-parallel rank's whole tensors for the plain
engine's module and optimizer (in place), or, for FSDP2-sharded chunks, this rank's DTensor
shards of them (in place too: `megatron.checkpointing.fsdp_slices` says where they sit, and
nothing is gathered). DeepSpeed's engine has its own holder (`megatron.checkpointing.
deepspeed_tensors`). DeepSpeed-MoE experts are named by their global numbers, so that expert
parallelism can change.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.checkpointing.pipeline_stages import model_chunks


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's parameter groups without their parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class WholeTensors:
    """This rank's weights and Adam state as whole tensors per tensor-parallel rank (what a
    torch_dist checkpoint holds of it), and how loaded ones are put back. This one: a plain
    module (or pipeline chunks) and torch optimizer, read and loaded in place."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.module, self.optimizer = module, optimizer

    def chunks(self) -> list[nn.Module]:
        """This rank's model chunks (one, or one per virtual pipeline stage)."""
        return model_chunks(self.module)

    def global_names(self) -> list[dict[str, str]]:
        """Per chunk, its local names that mean another tensor globally: DeepSpeed-MoE's
        experts, by their global numbers, so that expert parallelism can change."""
        chunks = self.chunks()
        if not any(type(m).__module__.startswith("deepspeed.moe") for m in self.module.modules()):
            return [{} for _ in chunks]
        from megatron.checkpointing.deepspeed_engine import global_expert_names

        return [global_expert_names(chunk) for chunk in chunks]

    def model_states(self) -> list[dict[str, torch.Tensor]]:
        """Each chunk's state dict to save (a collective where tensors are gathered)."""
        return [chunk.state_dict() for chunk in self.chunks()]

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        """Tensors to read each chunk's saved ones into (here the chunk's own, in place)."""
        return self.model_states()

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam's state by parameter name in `self.module` (a collective where gathered)."""
        by_param = {id(p): self.optimizer.state.get(p, {}) for p in self.module.parameters()}
        return {name: by_param[id(param)] for name, param in self.module.named_parameters()}

    def put(
        self,
        states: list[dict[str, torch.Tensor]],
        moments: dict[str, dict[str, torch.Tensor]] | None,
        groups: list[dict] | None,
    ) -> None:
        """Install what was read: `states` (`load_targets`' tensors, filled), and, unless
        None, the optimizer's `moments` by parameter name and its groups' hyperparameters."""
        if moments is None:
            return
        self.restore_hyperparameters(groups)
        params = dict(self.module.named_parameters())
        for name, state in moments.items():
            self.optimizer.state[params[name]] = state

    def restore_hyperparameters(self, groups: list[dict]) -> None:
        """Each optimizer parameter group's saved hyperparameters (as `parameter_groups`)."""
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(saved)

    def parameter_groups(self) -> list[dict]:
        """The optimizer's parameter groups' hyperparameters (saved in `common.pt`)."""
        return hyperparameters(self.optimizer)


def whole_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> WholeTensors:
    """The holder of a plain-engine run's tensors (FSDP2-sharded or not: a sharded chunk's
    state dict holds its DTensor shards, read and filled in place)."""
    return WholeTensors(module, optimizer)
