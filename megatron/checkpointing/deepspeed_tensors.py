"""DeepSpeed's engine seen as whole tensors for `--ckpt-format torch_dist`.

A DeepSpeed run keeps its fp32 master weights and Adam moments in its optimizer wrapper,
partitioned over the data-parallel ranks (ZeRO 1-3, BF16_Optimizer) or whole (fp32 ZeRO-0,
where the client optimizer steps the parameters themselves). DeepSpeed's own accessors
(`deepspeed.utils.safe_get_full_fp32_param`, `safe_get_full_optimizer_state` and their
setters) assemble each parameter's whole tensor per tensor-parallel rank and write one back
into the partitions, so a torch_dist checkpoint holds the same tensors, under the same names,
as the plain engine's: either engine resumes the other's, at any layout. The weights saved are
the fp32 master copies; on loading the model's half-precision copies are refreshed from them.
DeepSpeed's fp16 loss scaler is saved both as itself and in Megatron's keys.

fp16 without ZeRO (FP16_Optimizer: fp32 copies outside DeepSpeed's accessors) and DeepSpeed's
pipeline engine are refused before the run starts (`megatron.arguments.checkpoint_format_flags`).
This is one of the few modules that import DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from megatron.checkpointing.whole_tensors import WholeTensors

MOMENTS = ("exp_avg", "exp_avg_sq")


class DeepSpeedWholeTensors(WholeTensors):
    """A DeepSpeed engine's weights and Adam state (collectives over each parameter's
    data-parallel group, in the same order on every rank)."""

    def __init__(self, engine: Any):
        # fp32 ZeRO-0: no wrapper, the client optimizer's state is keyed by the parameters;
        # otherwise the wrapper steps the client optimizer over its fp32 partitions.
        self.client = not hasattr(engine.optimizer, "optimizer")
        self.base = engine.optimizer if self.client else engine.optimizer.optimizer
        super().__init__(engine.module, self.base)
        self.engine = engine

    def _whole(self, param: torch.nn.Parameter, key: str | None = None) -> torch.Tensor:
        if self.client:
            return param.detach() if key is None else self.base.state[param][key]
        value = (
            safe_get_full_fp32_param(param)
            if key is None
            else safe_get_full_optimizer_state(param, key)
        )
        return value.reshape(_whole_shape(param))

    def model_states(self) -> list[dict[str, torch.Tensor]]:
        """The fp32 master weights and the module's buffers."""
        state = dict(self.module.state_dict())
        for name, param in self.module.named_parameters():
            state[name] = self._whole(param)
        return [state]

    def load_targets(self) -> list[dict[str, torch.Tensor]]:
        """fp32 zeros of each parameter's whole shape, on its device (where the run's device
        mesh reads them); the buffers themselves."""
        state = dict(self.module.state_dict())
        for name, param in self.module.named_parameters():
            state[name] = torch.zeros(_whole_shape(param), dtype=torch.float32, device=param.device)
        return [state]

    def _step(self) -> torch.Tensor | None:
        for state in self.base.state.values():
            if "step" in state:
                step = state["step"]
                return step.detach().clone() if torch.is_tensor(step) else torch.tensor(float(step))
        return None

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam's moments per parameter and the step; nothing before the first step."""
        step = self._step()
        if step is None:
            return {}
        self._link_state()
        return {
            name: {"step": step, **{key: self._whole(param, key) for key in MOMENTS}}
            for name, param in self.module.named_parameters()
            if param.requires_grad
        }

    def put(
        self,
        states: list[dict[str, torch.Tensor]],
        moments: dict[str, dict[str, torch.Tensor]] | None,
        groups: list[dict] | None,
    ) -> None:
        """Write the master weights (and the model's copies of them), then Adam's state."""
        (state,) = states
        params = dict(self.module.named_parameters())
        for name, param in params.items():
            if name in state:  # (not read: the model keeps its own, --dist-ckpt-strictness)
                self._set_weight(param, state[name])
        for name, buffer in self.module.named_buffers():
            if name in state and state[name] is not buffer:
                buffer.copy_(state[name])
        if moments is None:
            return
        self.restore_hyperparameters(groups)
        steps = {float(m["step"]) for m in moments.values() if "step" in m}
        if len(steps) > 1:
            raise ValueError(f"Adam's step differs between parameters: {sorted(steps)}")
        self._create_state(steps.pop() if steps else 0.0)
        for name, saved in moments.items():
            for key in MOMENTS:
                if key in saved:
                    self._set_moment(params[name], saved[key], key)

    def _set_weight(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if self.client:
            with torch.no_grad():
                param.copy_(value)
            return
        safe_set_full_fp32_param(param, value.to(param.device))
        if hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition of the model's copy
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters

            with GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.copy_(value)
        else:
            with torch.no_grad():
                param.copy_(value)

    def _set_moment(self, param: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        if self.client:
            self.base.state[param][key].copy_(value)
        else:
            safe_set_full_optimizer_state(param, value.to(param.device), key)

    def _create_state(self, step: float) -> None:
        """Adam's state for every partition DeepSpeed's optimizer steps (torch creates it at
        the first step), at `step`; then DeepSpeed's links from parameters to it."""
        # ZeRO-3 puts its fp32 partitions into the client optimizer's groups only to step.
        flats = getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", None) or [
            flat for group in self.base.param_groups for flat in group["params"]
        ]
        for flat in flats:
            state = self.base.state[flat]
            for key in MOMENTS:
                if key not in state:
                    state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            previous = state.get("step")
            state["step"] = (
                torch.tensor(step, dtype=previous.dtype, device=previous.device)
                if torch.is_tensor(previous)
                else torch.tensor(step, dtype=torch.float32)
            )
        self._link_state()

    def _link_state(self) -> None:
        """DeepSpeed's per-parameter views of Adam's state (ZeRO 1-2 and BF16_Optimizer make
        them after some steps only: fp32 ZeRO-1 never does)."""
        wrapper = self.engine.optimizer
        if hasattr(wrapper, "_hp_optimizer_states_linked"):
            wrapper._hp_optimizer_states_linked = False
            wrapper._lazy_init_hp_params_optimizer_state()

    def restore_counters(self, iteration: int, consumed_samples: int) -> None:
        """The engine's own step and sample counters, as its own checkpoints restore them."""
        self.engine.global_steps = iteration
        self.engine.global_samples = consumed_samples

    def loss_scaler_state(self) -> dict | None:
        """DeepSpeed's dynamic fp16 loss scaler, as itself and in Megatron's keys."""
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if scaler is None or not getattr(scaler, "dynamic", False):
            return None
        own = {
            key: getattr(scaler, key)
            for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        }
        # Megatron grows the scale when its tracker reaches the window; DeepSpeed when the
        # iterations since the last overflow, less one, are a multiple of it.
        since = (scaler.cur_iter - scaler.last_overflow_iter - 2) % scaler.scale_window
        return {
            "scale": float(scaler.cur_scale),
            "growth_tracker": since,
            "hysteresis_tracker": scaler.cur_hysteresis,
            "deepspeed": own,
        }

    def load_loss_scaler_state(self, saved: dict) -> None:
        """Restore DeepSpeed's scaler from its own keys, or from a plain run's Megatron keys."""
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if scaler is None or not getattr(scaler, "dynamic", False):
            return
        if "deepspeed" in saved:
            for key, value in saved["deepspeed"].items():
                setattr(scaler, key, value)
            return
        scale = saved["scale"]
        scaler.cur_scale = float(scale.item() if torch.is_tensor(scale) else scale)
        scaler.cur_hysteresis = int(saved["hysteresis_tracker"])
        scaler.last_overflow_iter = scaler.cur_iter - 2 - int(saved["growth_tracker"])


def _whole_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's shape on this tensor-parallel rank (ZeRO-3 keeps it in `ds_shape`)."""
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape
