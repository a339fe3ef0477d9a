"""The LR/WD schedule matches Megatron's formulas, checkpoints, flags and DeepSpeed's engine.

Every expected value below is worked out by hand from Megatron's formulas, written in the
comment or expression next to it: warmup lr = init + (max - init) * n / warmup; linear
decay lr = min + (1 - r) * (max - min), cosine lr = min + (cos(pi r) + 1) / 2 * (max - min)
with r = (n - warmup) / (decay - warmup); inverse square root lr = max * sqrt(warmup / n).
"""

from __future__ import annotations

import math
from argparse import Namespace

import pytest
import torch

from megatron.training.optimizer import GuardedAdamW, build_optimizer, get_param_groups
from megatron.training.scheduler import OptimizerParamScheduler, scheduler_from_args
from tests.distributed import free_port
from tests.tolerances import reordering_atol


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def _optimizer(model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    model = model if model is not None else _model()
    return build_optimizer(get_param_groups(model), 1.0, 0.1, (0.9, 0.95), 1e-8)


def _scheduler(**overrides) -> OptimizerParamScheduler:
    kwargs = dict(
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        lr_decay_style="linear",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=110,
        wd_incr_style="constant",
    )
    kwargs.update(overrides)
    optimizer = kwargs.pop("optimizer", None) or _optimizer()
    return OptimizerParamScheduler(optimizer, **kwargs)


def _lr_at(scheduler: OptimizerParamScheduler, num_steps: int) -> float:
    """Advance `scheduler` to `num_steps` samples; its lr, checked against the param groups."""
    scheduler.step(num_steps - scheduler.num_steps)
    lr = scheduler.get_lr()
    assert [group["lr"] for group in scheduler.optimizer.param_groups] == [lr, lr]
    assert scheduler.get_last_lr() == [lr, lr]
    return lr


def test_warmup_then_linear_decay():
    """Warmup 10 samples to 1.0, linear to 0.1 over samples 10..110, 0.1 after."""
    sched = _scheduler()
    assert _lr_at(sched, 0) == 0.0  # construction applies step(0): warmup 0 / 10
    assert _lr_at(sched, 5) == pytest.approx(0.5)  # 1.0 * 5 / 10
    assert _lr_at(sched, 10) == pytest.approx(1.0)  # warmup end
    assert _lr_at(sched, 60) == pytest.approx(0.55)  # r = 50/100: 0.1 + 0.5 * 0.9
    assert _lr_at(sched, 110) == pytest.approx(0.1)  # decay end: r = 1
    assert _lr_at(sched, 111) == 0.1  # beyond: min_lr
    assert _lr_at(sched, 10_000) == 0.1


def test_warmup_starts_at_init_lr():
    """--lr-warmup-init: warmup goes from init_lr, not from 0."""
    sched = _scheduler(init_lr=0.2)
    assert _lr_at(sched, 0) == pytest.approx(0.2)
    assert _lr_at(sched, 5) == pytest.approx(0.6)  # 0.2 + 0.8 * 5 / 10
    assert _lr_at(sched, 10) == pytest.approx(1.0)


def test_warmup_then_cosine_decay():
    """Warmup 4, cosine from 1.0 to 0.2 over samples 4..12."""
    sched = _scheduler(min_lr=0.2, lr_warmup_steps=4, lr_decay_steps=12, lr_decay_style="cosine")
    assert _lr_at(sched, 2) == pytest.approx(0.5)  # 1.0 * 2 / 4
    assert _lr_at(sched, 4) == pytest.approx(1.0)  # warmup end, r = 0: cos(0) = 1
    # r = 2/8: (cos(pi/4) + 1) / 2 = 1/2 + sqrt(2)/4
    assert _lr_at(sched, 6) == pytest.approx(0.2 + 0.8 * (0.5 + math.sqrt(2) / 4))
    assert _lr_at(sched, 8) == pytest.approx(0.6)  # r = 1/2: cos(pi/2) = 0 -> 0.2 + 0.4
    assert _lr_at(sched, 12) == pytest.approx(0.2)  # decay end: cos(pi) = -1
    assert _lr_at(sched, 13) == 0.2


def test_constant_style_keeps_max_lr_after_warmup_forever():
    """'constant' returns max_lr after warmup, even past the decay end (Megatron's order)."""
    sched = _scheduler(lr_warmup_steps=4, lr_decay_steps=10, lr_decay_style="constant")
    assert _lr_at(sched, 2) == pytest.approx(0.5)
    assert _lr_at(sched, 4) == 1.0
    assert _lr_at(sched, 10) == 1.0
    assert _lr_at(sched, 500) == 1.0


def test_inverse_square_root():
    """lr = max * sqrt(warmup / n), floored at min_lr; min_lr past the decay end."""
    sched = _scheduler(lr_warmup_steps=4, lr_decay_steps=100, lr_decay_style="inverse-square-root")
    assert _lr_at(sched, 4) == pytest.approx(1.0)  # warmup end
    assert _lr_at(sched, 16) == pytest.approx(0.5)  # sqrt(4/16)
    assert _lr_at(sched, 64) == pytest.approx(0.25)  # sqrt(4/64)
    assert _lr_at(sched, 100) == pytest.approx(0.2)  # sqrt(4/100), decay end
    assert _lr_at(sched, 101) == 0.1  # past the decay end: min_lr
    floored = _scheduler(
        min_lr=0.3, lr_warmup_steps=4, lr_decay_steps=100, lr_decay_style="inverse-square-root"
    )
    assert _lr_at(floored, 64) == pytest.approx(0.3)  # max(0.3, 0.25)
    no_warmup = _scheduler(
        lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="inverse-square-root"
    )
    assert _lr_at(no_warmup, 0) == pytest.approx(1.0)  # max(warmup, 1) / max(n, 1) = 1
    assert _lr_at(no_warmup, 25) == pytest.approx(0.2)  # sqrt(1/25)


@pytest.mark.parametrize(
    "style, at_25",
    [
        ("linear", 0.025),  # 0 + 25/100 * 0.1
        ("cosine", 0.1 * (0.5 - math.sqrt(2) / 4)),  # (cos(0.75 pi) + 1) / 2 = 1/2 - sqrt(2)/4
    ],
)
def test_weight_decay_increment_and_no_decay_group_stays_zero(style, at_25):
    """WD grows 0 -> 0.1 over 100 samples in the decay group; the no-decay group stays at 0."""
    sched = _scheduler(start_wd=0.0, end_wd=0.1, wd_incr_steps=100, wd_incr_style=style)
    decay_group, no_decay_group = sched.optimizer.param_groups
    assert no_decay_group["name"] == "no_weight_decay"
    for num_steps, expected in [(0, 0.0), (25, at_25), (50, 0.05), (100, 0.1), (150, 0.1)]:
        sched.step(num_steps - sched.num_steps)
        assert sched.get_wd() == pytest.approx(expected)
        assert decay_group["weight_decay"] == pytest.approx(expected)
        assert no_decay_group["weight_decay"] == 0.0


def test_lr_mult_and_default_increment():
    """A group's lr_mult scales its lr; step() without an increment advances one global batch."""
    sched = _scheduler(default_increment=4)
    sched.optimizer.param_groups[1]["lr_mult"] = 0.5
    sched.step()
    sched.step()
    assert sched.num_steps == 8
    assert sched.get_lr() == pytest.approx(0.8)  # warmup 8 / 10
    lrs = [group["lr"] for group in sched.optimizer.param_groups]
    assert lrs == pytest.approx([0.8, 0.4])
    assert sched.get_last_lr() == lrs


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(lr_decay_steps=0, lr_warmup_steps=0), "--lr-decay-iters/--lr-decay-samples"),
        (dict(lr_warmup_steps=110), "--lr-warmup-iters"),
        (dict(min_lr=2.0), "--min-lr"),
        (dict(min_lr=-1.0), "--min-lr"),
        (dict(init_lr=2.0), "--lr-warmup-init"),
        (dict(lr_decay_style="exponential"), "--lr-decay-style"),
        (dict(start_wd=0.2, end_wd=0.1), "--start-weight-decay"),
        (dict(start_wd=0.0, end_wd=0.1), "--start-weight-decay"),  # constant needs equal ends
        (dict(wd_incr_style="step"), "--weight-decay-incr-style"),
        (dict(override_opt_param_scheduler=True), "--override-lr-scheduler"),
    ],
)
def test_invalid_values_name_their_flag(overrides, flag):
    """Megatron's assertions, as ValueErrors that name the flag to change."""
    with pytest.raises(ValueError, match=flag):
        _scheduler(**overrides)


def _args(**overrides) -> Namespace:
    fields = dict(
        lr=1e-3,
        min_lr=1e-4,
        lr_decay_style="linear",
        lr_decay_iters=None,
        lr_decay_samples=None,
        lr_warmup_fraction=None,
        lr_warmup_iters=0,
        lr_warmup_samples=0,
        train_iters=None,
        train_samples=None,
        global_batch_size=8,
        weight_decay=0.01,
        override_lr_scheduler=False,
        use_checkpoint_lr_scheduler=False,
    )
    fields.update(overrides)
    return Namespace(**fields)


def test_from_args_iteration_based_counts_samples():
    """Iterations x global batch: decay defaults to --train-iters; step() is one global batch."""
    sched = scheduler_from_args(_optimizer(), _args(train_iters=100, lr_warmup_iters=10))
    assert (sched.lr_decay_steps, sched.lr_warmup_steps, sched.wd_incr_steps) == (800, 80, 800)
    assert sched.default_increment == 8
    assert (sched.start_wd, sched.end_wd, sched.wd_incr_style) == (0.01, 0.01, "constant")
    assert sched.init_lr == 0.0
    for _ in range(10):
        sched.step()
    assert sched.get_lr() == pytest.approx(1e-3)  # 10 iterations = warmup end
    explicit = scheduler_from_args(_optimizer(), _args(train_iters=100, lr_decay_iters=50))
    assert explicit.lr_decay_steps == 400


def test_from_args_sample_based_wins_over_derived_train_iters():
    """--train-samples counts samples directly, even with train_iters filled in by validation."""
    args = _args(train_samples=1000, train_iters=125, lr_warmup_samples=100, lr_warmup_iters=7)
    sched = scheduler_from_args(_optimizer(), args)
    assert (sched.lr_decay_steps, sched.lr_warmup_steps, sched.wd_incr_steps) == (1000, 100, 1000)
    args = _args(train_samples=1000, lr_decay_samples=600)
    assert scheduler_from_args(_optimizer(), args).lr_decay_steps == 600


def test_from_args_warmup_fraction_and_optional_fields():
    """--lr-warmup-fraction is a fraction of the decay; optional WD fields are read if set."""
    sched = scheduler_from_args(
        _optimizer(), _args(train_samples=1000, lr_warmup_fraction=0.1, lr_warmup_init=1e-5)
    )
    assert sched.lr_warmup_steps == pytest.approx(100)  # 0.1 * 1000
    assert sched.init_lr == 1e-5
    sched = scheduler_from_args(
        _optimizer(),
        _args(
            train_iters=10,
            lr_warmup_fraction=0.25,
            start_weight_decay=0.0,
            end_weight_decay=0.1,
            weight_decay_incr_style="linear",
        ),
    )
    assert sched.lr_warmup_steps == pytest.approx(20)  # 0.25 * 10 * 8
    assert (sched.start_wd, sched.end_wd, sched.wd_incr_steps) == (0.0, 0.1, 80)
    with pytest.raises(ValueError, match="--train-iters or --train-samples"):
        scheduler_from_args(_optimizer(), _args())


def test_from_args_with_the_real_parser():
    """The flags parsed and validated by megatron.arguments have every field it reads."""
    from megatron.arguments import build_parser, validate_args

    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 4 --train-samples 400 --lr 1e-3 "
        "--lr-warmup-samples 40 --lr-decay-style cosine"
    ).split()
    args = validate_args(build_parser().parse_args(argv), 1)
    sched = scheduler_from_args(_optimizer(), args)
    assert (sched.lr_decay_steps, sched.lr_warmup_steps, sched.default_increment) == (400, 40, 4)
    assert sched.lr_decay_style == "cosine" and sched.use_checkpoint_opt_param_scheduler is False


def test_state_dict_round_trip_uses_megatron_keys():
    """A fresh scheduler loading a state dict continues at the same sample and lr."""
    sched = _scheduler(start_wd=0.0, end_wd=0.1, wd_incr_steps=100, wd_incr_style="linear")
    sched.step(37)
    sd = sched.state_dict()
    assert set(sd) == {
        "max_lr",
        "lr_warmup_steps",
        "lr_warmup_tokens",
        "num_steps",
        "num_tokens",
        "lr_decay_style",
        "lr_decay_steps",
        "lr_decay_tokens",
        "min_lr",
        "start_wd",
        "end_wd",
        "wd_incr_style",
        "wd_incr_steps",
    }
    resumed = _scheduler(
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="linear",
        use_checkpoint_opt_param_scheduler=False,
    )
    resumed.load_state_dict(sd)
    assert resumed.num_steps == 37
    assert resumed.get_lr() == sched.get_lr()
    for ours, theirs in zip(resumed.optimizer.param_groups, sched.optimizer.param_groups):
        assert (ours["lr"], ours["weight_decay"]) == (theirs["lr"], theirs["weight_decay"])
    assert resumed.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.037)


def test_checkpoint_mismatch_override_and_use_checkpoint():
    """Mismatch: error by default, ours with override, the checkpoint's with use-checkpoint."""
    saved = _scheduler()
    saved.step(20)
    sd = saved.state_dict()

    strict = _scheduler(max_lr=2.0, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate"):
        strict.load_state_dict(sd)

    override = _scheduler(
        max_lr=2.0, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True
    )
    override.load_state_dict(sd)
    assert override.max_lr == 2.0 and override.num_steps == 20
    assert override.get_lr() == pytest.approx(1.81)  # r = 10/100: 0.1 + 0.9 * (2.0 - 0.1)

    from_checkpoint = _scheduler(max_lr=2.0, use_checkpoint_opt_param_scheduler=True)
    from_checkpoint.load_state_dict(sd)
    assert from_checkpoint.max_lr == 1.0
    assert from_checkpoint.get_lr() == pytest.approx(0.91)  # r = 10/100: 0.1 + 0.9 * 0.9

    other_style = _scheduler(lr_decay_style="cosine", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate decay style"):
        other_style.load_state_dict(sd)


def test_reads_old_megatron_key_names():
    """start_lr / warmup_iter / end_iter / decay_style / num_iters from old checkpoints."""
    old = {
        "start_lr": 1.0,
        "min_lr": 0.1,
        "warmup_iter": 10,
        "end_iter": 110,
        "decay_style": "linear",
        "num_iters": 60,
    }
    sched = _scheduler(use_checkpoint_opt_param_scheduler=False)
    sched.load_state_dict(old)
    assert sched.num_steps == 60
    assert sched.get_lr() == pytest.approx(0.55)  # r = 50/100
    middle = {"max_lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "decay_steps": 110}
    sched = _scheduler(max_lr=3.0, use_checkpoint_opt_param_scheduler=True)
    sched.load_state_dict({**middle, "lr_decay_style": "linear", "num_steps": 110})
    assert sched.max_lr == 1.0 and sched.get_lr() == pytest.approx(0.1)


@pytest.fixture
def single_rank_world(monkeypatch):
    """A one-process gloo world through deepspeed.init_distributed, torn down afterwards."""
    import deepspeed

    assert not torch.distributed.is_initialized()
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    for name, value in {**env, "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        # DeepSpeed's own teardown also drops the groups it cached for this world.
        deepspeed.comm.destroy_process_group()


# ZeRO's optimizer check imports DeepSpeed's Muon module, which still uses torch.jit.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_engine_drives_the_scheduler(single_rank_world, stage):
    """DeepSpeed 0.19 steps our scheduler (ZeRO 0 and 1) with and without lr_kwargs."""
    import deepspeed

    torch.manual_seed(0)
    model = _model()
    optimizer = build_optimizer(get_param_groups(model), 0.01, 0.1, (0.9, 0.95), 1e-8)
    sched = _scheduler(
        optimizer=optimizer,
        max_lr=0.01,
        min_lr=0.001,
        lr_warmup_steps=4,
        lr_decay_steps=10,
        default_increment=2,
    )
    engine, engine_optimizer, _, engine_sched = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=sched,
        config={
            "train_batch_size": 2,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        },
    )
    assert engine_sched is sched
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    first = model[0].weight.detach().clone()
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step(lr_kwargs={"increment": 2})
    # DeepSpeed's no-argument call means one global batch (the default increment).
    engine.backward(engine(x).square().mean())
    engine.step()
    assert sched.num_steps == 6
    # Warmup 4, linear 0.01 -> 0.001 over samples 4..10: at 6, r = 2/6 and
    # lr = 0.001 + (1 - 1/3) * 0.009 = 0.007.
    assert engine.get_lr() == pytest.approx([0.007, 0.007])
    groups = {group["name"]: group for group in engine_optimizer.param_groups}
    assert groups["weight_decay"]["weight_decay"] == pytest.approx(0.1)
    assert groups["no_weight_decay"]["weight_decay"] == 0.0
    assert not torch.equal(model[0].weight.detach(), first)  # the engine did update the model


def test_deepspeed_skips_scheduler_when_guarded_optimizer_overflows(single_rank_world):
    """fp32 ZeRO-0: the engine reads GuardedAdamW's overflow and norm; no lr step on overflow."""
    import deepspeed

    torch.manual_seed(0)
    model = _model()
    optimizer = GuardedAdamW(get_param_groups(model), 0.01, 0.1, (0.9, 0.95), 1e-8, clip_grad=1e9)
    sched = _scheduler(optimizer=optimizer, default_increment=2)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=sched,
        # DeepSpeed 0.19 clips at 1.0 by default; off, so the norm seen is the raw one.
        config={"train_batch_size": 2, "gradient_clipping": 0.0, "steps_per_print": 10**9},
    )
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    engine.backward(engine(x).square().mean())
    model[2].bias.grad[0] = float("inf")
    engine.step()
    assert engine.skipped_steps == 1 and sched.num_steps == 0
    engine.backward(engine(x).square().mean())
    expected_norm = math.sqrt(sum(p.grad.square().sum().item() for p in model.parameters()))
    engine.step()
    assert engine.skipped_steps == 1 and sched.num_steps == 2
    # DeepSpeed's norm and ours sum the same squares (one per gradient element) in other orders.
    elements = sum(p.numel() for p in model.parameters())
    atol = reordering_atol(torch.tensor(expected_norm), terms=elements)
    assert abs(engine.get_global_grad_norm() - expected_norm) <= atol
