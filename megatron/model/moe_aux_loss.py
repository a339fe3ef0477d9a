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
it once per step (`AuxLossTracker.set_backward_scale`), as Megatron's schedules do.

The logged value and that scale belong to the run, not the process: one `AuxLossTracker` per
model, made with it (`GPTModel`, a rank's pipeline chunks, `GPTModelPipe`) and handed to its
layers at construction; the steps find it with `moe_losses_of(model)`. The model's outputs stay
the per-token losses (what pipeline stages send and the forward-step contract returns), and
the step reads one sum per step instead of scanning layers for state. (Megatron core keeps the
same tracker process-wide; two models in one process here keep theirs apart.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MOE_LOSS = "moe loss"
"""The name of the logged value (Megatron-DeepSpeed's)."""
PER_LAYER_PREFIX = "moe/"
"""Reported names starting with this are per-layer values for TensorBoard, not the log line."""


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Returns the output unchanged; the backward gives `aux_loss` the main loss's gradient,
    as `tracker` (the model's `AuxLossTracker`) holds it then."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, tracker) -> torch.Tensor:  # noqa: ANN001
        """`output` itself; `aux_loss` is kept for the backward."""
        ctx.save_for_backward(aux_loss)
        ctx.tracker = tracker
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        """`grad_output` unchanged, and the main loss's backward scale for `aux_loss`."""
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * ctx.tracker.backward_scale, None


def scale_aux_losses_like(loss: torch.Tensor, tracker: AuxLossTracker, factor: float = 1.0) -> None:
    """Give the aux losses of the forward behind `loss` the gradient `loss` gets in its backward
    (times `factor`: per-token loss backpropagates a sum, `megatron.training.token_loss`);
    `tracker` is the model's (`moe_losses_of`).

    A hook on `loss` records its gradient when the backward reaches it, which is before any
    layer's `MoEAuxLossAutoScaler` runs (they lie upstream of the loss), so the aux losses get
    exactly the factor the engine applies after this point, whatever it is.
    """

    def take_scale(grad: torch.Tensor) -> None:
        # A copy: the hook's tensor belongs to autograd.
        tracker.set_backward_scale(grad.detach() * factor)

    if loss.requires_grad:
        loss.register_hook(take_scale)


class AuxLossTracker:
    """The weighted load-balancing losses of one step (or evaluation), summed for the log line.

    The step `start`s it and reads it once with `pop`. Each encoder (a `ParallelTransformer`:
    the whole model, or one pipeline chunk) wraps its forward in `forward(coeff)`, inside which
    its MoE layers `record` their losses; the forward adds `coeff x` their sum to the step's
    total, as the training loss weighted them. Records outside an encoder's forward (a
    recomputation in the backward) and forwards outside a step (tests, generation) add nothing.

    Megatron-LM's MoE layers also `record_metric` their unweighted losses by name and layer
    ('load_balancing_loss', 'seq_load_balancing_loss', 'z_loss'): `pop` reports each as its
    sum over the layers divided by the model's MoE layers (Megatron-LM's mean over layers,
    also when a pipeline stage holds only some of them: the stages' values add up), and with
    `per_layer` each layer's value as 'moe/{name}_layer_{i}' (i from 0, TensorBoard only).
    """

    def __init__(self) -> None:
        self.backward_scale: torch.Tensor | float = 1.0
        """The gradient the main loss gets in the current backward (the module docstring)."""
        self._total: torch.Tensor | None = None
        self._open = False
        self._forward: list[torch.Tensor] | None = None
        self._metrics: dict[tuple[str, int], torch.Tensor] = {}
        self._losses: dict[str, torch.Tensor] = {}
        self._layers = (1, False)  # the model's MoE layers, per-layer logging
        self._parts_of: object = None  # a process group: see `sum_parts_over`

    def sum_parts_over(self, group: object) -> None:
        """The MoE layers' recorded losses are this rank's parts of values it shares with the
        ranks of `group` (each holding some of a micro-batch's tokens: sequence and context
        parallelism, as megatron-core's tp-cp group): `pop` adds the parts up."""
        self._parts_of = group

    def set_backward_scale(self, scale: torch.Tensor | float) -> None:
        """Set the gradient the aux losses get in the backward passes that follow."""
        self.backward_scale = scale

    def start(self) -> None:
        """Begin a step: forget any earlier total and sum the forwards from now on."""
        self._total, self._open, self._metrics, self._losses = None, True, {}, {}

    @contextlib.contextmanager
    def forward(self, coeff: float, moe_layers: int = 1, per_layer: bool = False) -> Iterator[None]:
        """One encoder forward: the losses recorded inside it, times `coeff`, join the total
        (`moe_layers`, `per_layer`: how the named metrics are reported)."""
        outer, self._forward = self._forward, []
        self._layers = (moe_layers, per_layer)
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

    def record_metric(self, name: str, layer_number: int, value: torch.Tensor) -> None:
        """Megatron-LM's named, unweighted loss of MoE layer `layer_number` (from 1)."""
        if self._forward is not None and self._open:
            key = (name, layer_number)
            value = value.detach().float().reshape(())
            self._metrics[key] = self._metrics[key] + value if key in self._metrics else value

    def record_loss(self, name: str, value: torch.Tensor) -> None:
        """A loss logged under its own name as it is, summed over the step's forwards
        (multi-token prediction's 'mtp_k loss'; the step averages over micro-batches)."""
        if self._open:
            value = value.detach().float().reshape(())
            self._losses[name] = self._losses[name] + value if name in self._losses else value

    def pop(self) -> dict[str, torch.Tensor]:
        """End the step: `{"moe loss": the sum}` over its forwards and the named metrics, or {}
        when no MoE layer ran."""
        total, self._total, self._open = self._total, None, False
        metrics, self._metrics = self._metrics, {}
        if self._parts_of is not None:
            total, metrics = _sum_parts(total, metrics, self._parts_of)
        reported = {} if total is None else {MOE_LOSS: total}
        reported.update(self._losses)
        self._losses = {}
        moe_layers, per_layer = self._layers
        for (name, layer), value in sorted(metrics.items()):
            mean = value / moe_layers
            reported[name] = reported[name] + mean if name in reported else mean
            if per_layer:
                reported[f"{PER_LAYER_PREFIX}{name}_layer_{layer - 1}"] = value
        return reported


def _sum_parts(
    total: torch.Tensor | None, metrics: dict[tuple[str, int], torch.Tensor], group: object
) -> tuple[torch.Tensor | None, dict[tuple[str, int], torch.Tensor]]:
    """`total` and each metric summed over `group` (one all-reduce)."""
    import torch.distributed as dist

    values = ([] if total is None else [total]) + list(metrics.values())
    if not values:
        return total, metrics
    summed = torch.stack(values)
    dist.all_reduce(summed, group=group)
    parts = list(summed.unbind())
    if total is not None:
        total = parts.pop(0)
    return total, dict(zip(metrics, parts, strict=True))


def attach_aux_loss(
    output: torch.Tensor, loss: torch.Tensor, coeff: float, tracker: AuxLossTracker
) -> torch.Tensor:
    """`output` of an MoE layer carrying `coeff x loss` into the backward; `loss` is recorded
    in the model's `tracker` for the log line."""
    tracker.record(loss)
    return MoEAuxLossAutoScaler.apply(output, loss * coeff, tracker)


def moe_losses_of(model: torch.nn.Module) -> AuxLossTracker:
    """The tracker `model`'s layers record into (through any wrapper: DDP, FSDP2, DeepSpeed's
    engine, a rank's list of pipeline chunks, which share one); a new, empty one for a model
    without transformer layers."""
    for module in model.modules():
        tracker = getattr(module, "moe_losses", None)
        if isinstance(tracker, AuxLossTracker):
            return tracker
    return AuxLossTracker()
