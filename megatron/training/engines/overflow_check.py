"""DeepSpeed's FP16_UnfusedOptimizer checking its gradients for inf/NaN with one device read.

bf16 and fp16 at ZeRO-0 run DeepSpeed's FP16_UnfusedOptimizer (with a torch optimizer; the
fused FP16_Optimizer needs DeepSpeed's FusedAdam). Before each step its `CheckOverflow`
tests the gradients one by one (`has_overflow_serial`: `if ... has_inf_or_nan(p.grad)` is a
device-to-host read per parameter): at GPT-2 124M, 148 device syncs per iteration, each one
draining the GPU's queue (issue 56).

Here the same question is one fused kernel per device and dtype,
`torch._amp_foreach_non_finite_check_and_unscale_` (what torch's GradScaler checks with) with
a scale of 1.0, and one read of its flag. Multiplying by 1.0 leaves every gradient bit for bit
as it was (NaN stays NaN), and the answer, whether any element is inf or NaN, is the one
DeepSpeed's loop gives: the training is unchanged.
"""

from __future__ import annotations

import torch


def any_non_finite(params: list[torch.Tensor]) -> bool:
    """Whether any gradient of `params` holds an inf or a NaN, read from the device once."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None or grad.numel() == 0:
            continue
        if grad.is_sparse:  # only the stored entries can be non-finite
            grad = grad.coalesce()._values()
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    if not groups:
        return False
    flags = []
    for (device, _), grads in groups.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        one = torch.ones(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        flags.append(found.to(flags[0].device) if flags else found)
    return bool(torch.cat(flags).any())


def check_overflow_in_one_read(optimizer: object) -> bool:
    """Give `optimizer` (DeepSpeed's engine's) the one-read check, if it is an
    FP16_UnfusedOptimizer; whether it was."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if type(optimizer) is not FP16_UnfusedOptimizer:
        return False
    # CheckOverflow.has_overflow calls self.has_overflow_serial(params), then reduces the
    # answer over the model-parallel ranks as before.
    optimizer.overflow_checker.has_overflow_serial = any_non_finite
    return True
