"""The MoE load-balancing loss through autograd (Megatron core's `MoEAuxLossAutoScaler`), and
the per-step tracker through which its value reaches the log line as 'moe loss'.

The training loss is `lm loss + --moe-loss-coeff x (sum of the MoE layers' l_aux)`. The second
term no longer leaves the model: each MoE layer hands `coeff x l_aux` to
`MoEAuxLossAutoScaler` together with its output, which passes the output through unchanged and,
in the backward, gives the loss the gradient the main loss got. The engine's backward of the
LM loss alone then computes the gradient of the sum, on every engine and pipeline stage, and no
layer keeps a loss for the loop to collect.

That gradient is "the main loss's backward scale": what the engine multiplies the LM loss by
before its backward (1 / accumulated micro-batches, the fp16 loss scale, ...). Where the step
holds the loss it backpropagates (plain torch, DeepSpeed's engine), `scale_aux_losses_like`
reads it off that loss's own gradient, so it is exact whatever DeepSpeed's optimizer scales
by; under Megatron's pipeline schedules, whose earlier stages never see the loss, the step sets
it once per step (`MoEAuxLossAutoScaler.set_loss_scale`), as Megatron's schedules do.

The logged value goes through `MOE_AUX_LOSSES`, one `AuxLossTracker` per process, as Megatron
core logs its aux losses through a process-wide tracker: the model's outputs stay the
per-token losses (what pipeline stages send and the forward-step contract returns), and the
step reads one sum per step instead of scanning layers for state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MOE_LOSS = "moe loss"
"""The name of the logged value (Megatron-DeepSpeed's)."""


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Returns the output unchanged; the backward gives `aux_loss` the main loss's gradient."""

    main_loss_backward_scale: torch.Tensor | float = 1.0
    """The gradient the main loss gets in the current backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """`output` itself; `aux_loss` is kept for the backward."""
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """`grad_output` unchanged, and the main loss's backward scale for `aux_loss`."""
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        return grad_output, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor | float) -> None:
        """Set the gradient the aux losses get in the backward passes that follow."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


def _take_scale(grad: torch.Tensor) -> None:
    # A copy: the hook's tensor belongs to autograd.
    MoEAuxLossAutoScaler.set_loss_scale(grad.detach().clone())


def scale_aux_losses_like(loss: torch.Tensor) -> None:
    """Give the aux losses of the forward behind `loss` the gradient `loss` gets in its backward.

    A hook on `loss` records its gradient when the backward reaches it, which is before any
    layer's `MoEAuxLossAutoScaler` runs (they lie upstream of the loss), so the aux losses get
    exactly the factor the engine applies after this point, whatever it is.
    """
    if loss.requires_grad:
        loss.register_hook(_take_scale)


class AuxLossTracker:
    """The weighted load-balancing losses of one step (or evaluation), summed for the log line.

    The step `start`s it and reads it once with `pop`. Each encoder (a `ParallelTransformer`:
    the whole model, or one pipeline chunk) wraps its forward in `forward(coeff)`, inside which
    its MoE layers `record` their losses; the forward adds `coeff x` their sum to the step's
    total, as the training loss weighted them. Records outside an encoder's forward (a
    recomputation in the backward) and forwards outside a step (tests, generation) add nothing.
    """

    def __init__(self) -> None:
        self._total: torch.Tensor | None = None
        self._open = False
        self._forward: list[torch.Tensor] | None = None

    def start(self) -> None:
        """Begin a step: forget any earlier total and sum the forwards from now on."""
        self._total, self._open = None, True

    @contextlib.contextmanager
    def forward(self, coeff: float) -> Iterator[None]:
        """One encoder forward: the losses recorded inside it, times `coeff`, join the total."""
        outer, self._forward = self._forward, []
        try:
            yield
        finally:
            losses, self._forward = self._forward, outer
        if self._open and losses:
            value = torch.stack(losses).sum() * coeff  # [MoE layers] -> []
            self._total = value if self._total is None else self._total + value

    def record(self, loss: torch.Tensor) -> None:
        """One MoE layer's load-balancing loss of the current forward (its value only)."""
        if self._forward is not None:
            self._forward.append(loss.detach().float().reshape(()))

    def pop(self) -> dict[str, torch.Tensor]:
        """End the step: `{"moe loss": the sum}` over its forwards, or {} when no MoE layer ran."""
        total, self._total, self._open = self._total, None, False
        return {} if total is None else {MOE_LOSS: total}


MOE_AUX_LOSSES = AuxLossTracker()
"""This process's tracker: the MoE layers fill it, the training and evaluation steps read it."""


def attach_aux_loss(output: torch.Tensor, loss: torch.Tensor, coeff: float) -> torch.Tensor:
    """`output` of an MoE layer carrying `coeff x loss` into the backward; `loss` is recorded
    for the log line."""
    MOE_AUX_LOSSES.record(loss)
    return MoEAuxLossAutoScaler.apply(output, loss * coeff)
