"""DeepSpeed's BF16_Optimizer accumulating its micro-batch gradients in one add per group.

After every micro-batch's backward, BF16_Optimizer adds each parameter's bf16 gradient into
its fp32 accumulation buffer in a Python loop (`bf16_optimizer.py` `update_hp_grads` ->
`_update_hp_grad`: a cast, a view and an `add_` per parameter): at GPT-2 124M, 148 parameters
x 8 micro-batches = 1,184 host-bound launches per iteration, what kept DeepSpeed's ZeRO-1 at
0.79x and its pipeline engine at 0.49x of the plain engine on an H200 (issue 56).

Its fp32 buffer is already flat (`fp32_groups_gradients_flat`, each parameter's gradient a view
at the offset its bf16 weight has in `bf16_groups_flat`). Here the bf16 gradients get the same
layout: each parameter's `.grad` is a view into one flat bf16 buffer per group, as PyTorch DDP's
`gradient_as_bucket_view` does. Autograd accumulates into an existing `.grad` in place (with
grad mode off, `AccumulateGrad` adds to it), so after a backward the flat buffer holds every
gradient, and the accumulation is one `add_` of the flat bf16 buffer into the flat fp32 one,
element for element what the loop computes (`fp32 += float(bf16)`): the losses are bit-identical.
Clearing is one `zero_` of the buffer instead of a `_foreach_zero_` over the parameters.

The buffer lives as long as the optimizer (2 bytes per parameter): DeepSpeed frees the bf16
gradients after each step (`zero_grad(set_to_none=True)`), but they are alive through every
backward and step, so the peak is unchanged. Where a gradient is not a view of the buffer any
more (code that set `.grad` to None or to a tensor of its own) the group goes through
DeepSpeed's own per-parameter path once, and the views are put back when it is cleared.

Not installed when DeepSpeed already accumulates at hook time (`bf16.immediate_grad_update`),
or folds expert gradients itself (AutoEP's TP folding).
"""

from __future__ import annotations

import torch


class FlatBF16Gradients:
    """The flat bf16 gradient buffers of one BF16_Optimizer, and its replaced methods."""

    def __init__(self, optimizer: object) -> None:
        self.optimizer = optimizer
        self.buffers: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        for group_index, (params, flat) in enumerate(
            zip(optimizer.bf16_groups, optimizer.bf16_groups_flat)
        ):
            # The same padded length and offsets as the weights' (and the fp32 buffer's).
            buffer = torch.zeros_like(flat)
            views, offset = [], 0
            for param_index, param in enumerate(params):
                view = buffer.narrow(0, offset, param.numel()).view(param.shape)
                offset += param.numel()
                views.append(view)
                param.grad = view
                # What _update_hp_grad links on first use (the pipeline engine reduces the
                # tied embedding's gradient through it).
                param._hp_grad = optimizer.fp32_groups_gradients[group_index][param_index]
            self.buffers.append(buffer)
            self.views.append(views)

    def attached(self, group_index: int) -> bool:
        """Whether every gradient of the group is still its view of the buffer."""
        params = self.optimizer.bf16_groups[group_index]
        return all(p.grad is v for p, v in zip(params, self.views[group_index]))

    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        """BF16_Optimizer.update_hp_grads: fp32 gradients += the bf16 ones, one add per group."""
        optimizer = self.optimizer
        for index, buffer in enumerate(self.buffers):
            if not self.attached(index):
                self._update_group_per_parameter(index, clear_lp_grads)
                continue
            optimizer.fp32_groups_gradients_flat[index].add_(buffer)
            optimizer.fp32_groups_has_gradients[index] = [True] * len(self.views[index])
            if clear_lp_grads:
                buffer.zero_()

    def _update_group_per_parameter(self, index: int, clear_lp_grads: bool) -> None:
        """DeepSpeed's own loop for one group (its `.grad`s are no longer all views)."""
        for param_index, param in enumerate(self.optimizer.bf16_groups[index]):
            self.optimizer._update_hp_grad(param, index, param_index, clear_lp_grads)

    def clear_lp_grads(self, set_to_none: bool = False) -> None:
        """BF16_Optimizer.clear_lp_grads: zero the buffers and (re)attach every view.

        `set_to_none` keeps the buffer (nothing to free: it is the gradients' storage)."""
        for index, buffer in enumerate(self.buffers):
            buffer.zero_()
            if not self.attached(index):
                for param, view in zip(self.optimizer.bf16_groups[index], self.views[index]):
                    param.grad = view


def accumulate_in_flat_buffers(optimizer: object) -> FlatBF16Gradients | None:
    """Make `optimizer` (DeepSpeed's engine's) accumulate through flat bf16 buffers, if it is a
    BF16_Optimizer that accumulates after each backward; the installed buffers, or None.

    The methods are replaced on the instance: DeepSpeed's engines check the optimizer's exact
    type (`type(self.optimizer) == BF16_Optimizer` in the pipeline engine), so no subclass.
    """
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if type(optimizer) is not BF16_Optimizer:
        return None
    if optimizer.immediate_grad_update or getattr(optimizer, "autoep_folding_tp_group", None):
        return None
    flat = FlatBF16Gradients(optimizer)
    # Instance attributes shadow the class's methods, also for its own `self.` calls.
    optimizer.update_hp_grads = flat.update_hp_grads
    optimizer.clear_lp_grads = flat.clear_lp_grads
    return flat
