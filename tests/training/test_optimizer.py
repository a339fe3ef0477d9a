"""Param groups, AdamW, loss scalers and grad clipping behave as Megatron's.

Expected numbers are derived by hand in the comments: one AdamW step from zero moments moves
each weight by -lr * (wd * p + g / (|g| + eps)), the loss scalers follow Megatron's
DynamicGradScaler state machine, and clipping is checked against torch's own clip_grad_norm_.
"""

from __future__ import annotations

import math
from argparse import Namespace

import pytest
import torch

from megatron.training.optimizer import (
    ConstantLossScaler,
    DynamicLossScaler,
    GuardedAdamW,
    build_optimizer,
    clip_grad_norm,
    get_param_groups,
    loss_scaler_from_args,
    optimizer_from_args,
)
from tests.distributed import run_distributed
from tests.tolerances import assert_close_reordered, reordering_atol


def _model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


NORM_TERMS = sum(p.numel() for p in _model().parameters())
"""Our gradient norm and torch's sum the same squares (one per parameter element) in other
orders (per-tensor norms, then across tensors): the norms and the clip coefficient agree up to
that many fp32 terms (`tests.tolerances`)."""


def _norm_close(norm: float, reference: float) -> bool:
    return abs(norm - reference) <= reordering_atol(torch.tensor(reference), NORM_TERMS)


def _ids(params) -> set[int]:
    return {id(param) for param in params}


def test_param_groups_split_biases_and_norms_from_weights():
    """Linear weights decay; biases and LayerNorm weight/bias do not."""
    model = _model()
    decay, no_decay = get_param_groups(model)
    assert _ids(decay["params"]) == _ids([model[0].weight, model[2].weight])
    assert _ids(no_decay["params"]) == _ids(
        [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    )
    assert decay["name"] == "weight_decay" and decay["wd_mult"] == 1.0
    assert "weight_decay" not in decay  # the optimizer's default applies
    assert (no_decay["name"], no_decay["weight_decay"], no_decay["wd_mult"]) == (
        "no_weight_decay",
        0.0,
        0.0,
    )


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight
        # 2-D but named bias: the name rule sends it to the no-decay group.
        self.bias = torch.nn.Parameter(torch.zeros(2, 2))
        self.frozen = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)


def test_tied_weights_once_frozen_skipped_empty_group_dropped():
    """A tied tensor appears once, even across several modules; frozen params are left out."""
    model = _Tied()
    groups = get_param_groups([model, model.head, model.embedding])
    all_params = [param for group in groups for param in group["params"]]
    assert len(all_params) == len(_ids(all_params)) == 2
    decay, no_decay = groups
    assert _ids(decay["params"]) == {id(model.embedding.weight)}
    assert _ids(no_decay["params"]) == {id(model.bias)}
    only_weights = get_param_groups(torch.nn.Linear(4, 4, bias=False))
    assert [group["name"] for group in only_weights] == ["weight_decay"]


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_adamw_decoupled_decay_one_step(kind):
    """First step from zero moments: m_hat = g, v_hat = g^2, so
    p1 = p0 - lr * wd * p0 - lr * g / (|g| + eps) in the decay group, without the wd term
    in the no-decay group."""
    lr, wd, eps = 0.1, 0.5, 1e-8
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(get_param_groups(model), lr, wd, (0.9, 0.95), eps, kind=kind)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["foreach"] is True
    torch.manual_seed(0)
    model.weight.grad = torch.randn(2, 3)
    model.bias.grad = torch.randn(2)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    gw, gb = model.weight.grad.clone(), model.bias.grad.clone()
    optimizer.step()
    expected_w = w0 - lr * wd * w0 - lr * gw / (gw.abs() + eps)
    expected_b = b0 - lr * gb / (gb.abs() + eps)
    torch.testing.assert_close(model.weight.detach(), expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias.detach(), expected_b, rtol=1e-5, atol=1e-6)


def test_unknown_optimizer_names_the_flag():
    """Only adam/adamw are offered, as --optimizer's choices."""
    with pytest.raises(ValueError, match="--optimizer"):
        build_optimizer(get_param_groups(_model()), 1e-3, 0.0, (0.9, 0.999), 1e-8, kind="sgd")


def test_optimizer_from_args():
    """--lr, --weight-decay, --adam-beta1/2, --adam-eps reach the optimizer's groups."""
    args = Namespace(
        lr=3e-4, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6, optimizer="adam"
    )
    decay, no_decay = optimizer_from_args(_model(), args).param_groups
    assert (decay["lr"], decay["weight_decay"], decay["betas"], decay["eps"]) == (
        3e-4,
        0.05,
        (0.8, 0.9),
        1e-6,
    )
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_adamw_on_gpu():
    """All parameters on the GPU: the fused kernel; its step matches the foreach one."""
    torch.manual_seed(0)
    cpu_model = _model()
    gpu_model = _model().cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    cpu_opt = build_optimizer(get_param_groups(cpu_model), 0.1, 0.5, (0.9, 0.95), 1e-8)
    gpu_opt = build_optimizer(get_param_groups(gpu_model), 0.1, 0.5, (0.9, 0.95), 1e-8)
    assert gpu_opt.defaults["fused"] is True
    for cpu_param, gpu_param in zip(cpu_model.parameters(), gpu_model.parameters()):
        cpu_param.grad = torch.randn_like(cpu_param)
        gpu_param.grad = cpu_param.grad.cuda()
    cpu_opt.step()
    gpu_opt.step()
    for cpu_param, gpu_param in zip(cpu_model.parameters(), gpu_model.parameters()):
        torch.testing.assert_close(gpu_param.detach().cpu(), cpu_param.detach())


def test_dynamic_loss_scaler_hysteresis_backoff_and_floor():
    """Hysteresis 2: the first overflow keeps the scale, the second halves it, and every
    further one halves again, never below min_scale."""
    scaler = DynamicLossScaler(initial_scale=16.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    scales = []
    for _ in range(5):
        scaler.update(found_inf=True)
        scales.append(scaler.scale)
    assert scales == [16.0, 8.0, 4.0, 2.0, 2.0]  # 16, 16/2, 8/2, 4/2, max(1, 2)
    assert scaler.inv_scale == 0.5


def test_dynamic_loss_scaler_growth_window_resets():
    """growth_interval clean steps double the scale and restore the hysteresis; an overflow
    restarts the count."""
    scaler = DynamicLossScaler(initial_scale=16.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    for found_inf in (False, False):
        scaler.update(found_inf)
    assert scaler.scale == 16.0
    scaler.update(found_inf=True)  # hysteresis 2 -> 1: no backoff, growth count back to 0
    assert scaler.scale == 16.0
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 16.0  # only 2 clean steps since the overflow
    scaler.update(found_inf=False)
    assert scaler.scale == 32.0
    scaler.update(found_inf=True)  # hysteresis was reset to 2 by the growth: keep 32
    assert scaler.scale == 32.0
    scaler.update(found_inf=True)
    assert scaler.scale == 16.0


def test_dynamic_loss_scaler_state_dict():
    """Megatron's keys; a restored scaler continues the same sequence (tensor scale accepted)."""
    scaler = DynamicLossScaler(initial_scale=64.0, min_scale=1.0, growth_interval=4, hysteresis=2)
    for found_inf in (True, False, False):
        scaler.update(found_inf)
    sd = scaler.state_dict()
    assert sd == {"scale": 64.0, "growth_tracker": 2, "hysteresis_tracker": 1}
    restored = DynamicLossScaler(initial_scale=8.0, min_scale=1.0, growth_interval=4, hysteresis=2)
    restored.load_state_dict({**sd, "scale": torch.tensor([64.0])})
    for found_inf in (False, False, True, True):
        scaler.update(found_inf)
        restored.update(found_inf)
        assert restored.scale == scaler.scale
    assert restored.scale == 64.0  # grew to 128 after 4 clean steps, then hysteresis 2 -> halved


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(initial_scale=0.0, min_scale=1.0), "--initial-loss-scale"),
        (dict(initial_scale=4.0, min_scale=8.0), "--min-loss-scale"),
        (dict(initial_scale=4.0, min_scale=1.0, growth_interval=0), "--loss-scale-window"),
        (dict(initial_scale=4.0, min_scale=1.0, hysteresis=0), "--hysteresis"),
    ],
)
def test_dynamic_loss_scaler_rejects_bad_flags(kwargs, flag):
    """Megatron's assertions, as ValueErrors naming the flag."""
    with pytest.raises(ValueError, match=flag):
        DynamicLossScaler(**kwargs)


def test_constant_loss_scaler_and_from_args():
    """--loss-scale: static; fp16 without it: dynamic from the flags; not fp16: none."""
    constant = ConstantLossScaler(128.0)
    constant.update(found_inf=True)
    assert constant.scale == 128.0 and constant.state_dict() == {}
    fields = dict(
        fp16=True,
        bf16=False,
        loss_scale=None,
        initial_loss_scale=2.0**32,
        min_loss_scale=1.0,
        loss_scale_window=1000.0,
        hysteresis=2,
    )
    dynamic = loss_scaler_from_args(Namespace(**fields))
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.scale, dynamic.min_scale, dynamic.growth_interval, dynamic.hysteresis) == (
        2.0**32,
        1.0,
        1000,
        2,
    )
    assert (dynamic.growth_factor, dynamic.backoff_factor) == (2.0, 0.5)
    static = loss_scaler_from_args(Namespace(**{**fields, "loss_scale": 512.0}))
    assert isinstance(static, ConstantLossScaler) and static.scale == 512.0
    assert loss_scaler_from_args(Namespace(**{**fields, "fp16": False, "bf16": True})) is None


def _twin_models_with_grads(scale: float = 1.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    first, second = _model(), _model()
    second.load_state_dict(first.state_dict())
    for a, b in zip(first.parameters(), second.parameters()):
        a.grad = torch.randn_like(a) * scale
        b.grad = a.grad.clone()
    return first, second


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(max_norm):
    """Same norm and same clipped grads as torch.nn.utils.clip_grad_norm_ on one process."""
    ours, theirs = _twin_models_with_grads()
    norm = clip_grad_norm(ours.parameters(), max_norm)
    reference = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert isinstance(norm, float)
    assert _norm_close(norm, reference.item()), (norm, reference.item())
    for a, b in zip(ours.parameters(), theirs.parameters()):  # scaled by either's coefficient
        assert_close_reordered(a.grad, b.grad, terms=NORM_TERMS)
    if max_norm < norm:
        clipped = math.sqrt(sum(p.grad.square().sum().item() for p in ours.parameters()))
        assert _norm_close(clipped, max_norm * norm / (norm + 1e-6)), (clipped, max_norm)


def test_clip_grad_norm_off_skips_none_and_reports_non_finite():
    """max_norm 0 only measures; grad-less params are skipped; inf/nan norms clip nothing."""
    ours, _ = _twin_models_with_grads()
    before = [p.grad.clone() for p in ours.parameters()]
    expected = math.sqrt(sum(g.square().sum().item() for g in before))
    ours[1].weight.grad = None
    expected_without = math.sqrt(
        sum(g.square().sum().item() for i, g in enumerate(before) if i != 2)
    )
    assert _norm_close(clip_grad_norm(ours.parameters(), 0.0), expected_without)
    assert expected_without < expected
    for bad, check in ((float("inf"), math.isinf), (float("nan"), math.isnan)):
        ours[0].weight.grad[0, 0] = bad
        kept = [p.grad.clone() for p in ours.parameters() if p.grad is not None]
        assert check(clip_grad_norm(ours.parameters(), 1e-3))
        after = [p.grad for p in ours.parameters() if p.grad is not None]
        for a, b in zip(after, kept):
            torch.testing.assert_close(a, b, equal_nan=True)


def test_clip_grad_norm_accumulates_half_precision_in_fp32():
    """fp16 grads whose sum of squares overflows fp16 (65504) still give the finite norm."""
    param = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    param.grad = torch.full((1000,), 300.0, dtype=torch.float16)
    norm = clip_grad_norm([param], 0.0)
    assert norm == pytest.approx(300.0 * math.sqrt(1000), rel=1e-4)  # sqrt(1000 * 300^2)


def _guarded(model: torch.nn.Module, **kwargs) -> GuardedAdamW:
    return GuardedAdamW(get_param_groups(model), 0.1, 0.5, (0.9, 0.95), 1e-8, **kwargs)


def test_guarded_adamw_clips_then_steps_like_adamw():
    """Finite grads: the same update as torch's clip_grad_norm_ followed by AdamW."""
    ours, reference = _twin_models_with_grads(scale=10.0)
    optimizer = _guarded(ours, clip_grad=1.0)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["foreach"] is True
    reference_optimizer = build_optimizer(get_param_groups(reference), 0.1, 0.5, (0.9, 0.95), 1e-8)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    reference_optimizer.step()
    optimizer.step()
    assert not optimizer.overflow
    assert _norm_close(optimizer.grad_norm, expected_norm), (optimizer.grad_norm, expected_norm)
    assert optimizer._global_grad_norm == optimizer.grad_norm  # what DeepSpeed reads
    # Adam's first step, lr * g / (|g| + eps), does not see the clip coefficient (up to eps):
    # the two norms' rounding leaves the weights as tight as one elementwise step.
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a.detach(), b.detach())


def test_guarded_adamw_skips_non_finite_steps():
    """An inf grad: no update, no optimizer state, overflow set and no norm reported."""
    model, _ = _twin_models_with_grads()
    optimizer = _guarded(model, clip_grad=1.0)
    model[2].bias.grad[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert optimizer.overflow and optimizer.grad_norm is None
    assert not optimizer.state
    for param, old in zip(model.parameters(), before):
        assert torch.equal(param.detach(), old)
    model[2].bias.grad[0] = 0.0
    optimizer.step()  # the next finite step goes through
    assert not optimizer.overflow and optimizer.grad_norm is not None
    assert not torch.equal(model[0].weight.detach(), before[0])


def test_guarded_adamw_unguarded_is_plain_adamw():
    """guard=False: no check, no clipping, no norm (DeepSpeed guards those steps)."""
    ours, reference = _twin_models_with_grads(scale=10.0)
    optimizer = _guarded(ours, clip_grad=1.0, guard=False)
    build_optimizer(get_param_groups(reference), 0.1, 0.5, (0.9, 0.95), 1e-8).step()
    calls = []
    assert optimizer.step(closure=lambda: calls.append(1) or 3.0) == 3.0
    assert calls == [1]
    assert optimizer.grad_norm is None and not optimizer.overflow
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a.detach(), b.detach())


def _tensor_parallel_body(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(2, 1)
    # A tensor-parallel shard differs per rank; a replicated param has the same grad on both.
    shard = torch.nn.Parameter(torch.zeros(2))
    shard.tensor_model_parallel = True
    shard.grad = torch.tensor([3.0, 4.0]) * (rank + 1)  # rank 0: |g|^2 = 25, rank 1: 100
    replica = torch.nn.Parameter(torch.zeros(1))
    replica.grad = torch.tensor([10.0])  # counted once: 100
    group = parallel_state.get_model_parallel_group()
    norm = clip_grad_norm([shard, replica], 1.0, model_parallel_group=group)
    assert norm == pytest.approx(15.0)  # sqrt(25 + 100 + 100), the same on both ranks
    coeff = 1.0 / (15.0 + 1e-6)
    torch.testing.assert_close(replica.grad, torch.tensor([10.0 * coeff]))
    torch.testing.assert_close(shard.grad, torch.tensor([3.0, 4.0]) * (rank + 1) * coeff)

    if rank == 1:
        shard.grad[0] = float("inf")
    # An inf on one rank makes the norm, hence GuardedAdamW's skip, inf on both ranks.
    assert math.isinf(clip_grad_norm([shard, replica], 0.0, model_parallel_group=group))
    parallel_state.destroy_model_parallel()


def test_clip_and_finite_check_across_tensor_parallel_ranks():
    """TP=2: shards count on each rank, replicas once; one rank's inf is seen by both."""
    run_distributed(_tensor_parallel_body, 2)
