"""Megatron-DeepSpeed's token schedule: --lr-warmup-tokens, --lr-decay-tokens, --train-tokens.

Every learning rate is compared, iteration by iteration, with `_Reference`, a transcription of
Megatron-DeepSpeed's `OptimizerParamScheduler` (microsoft/Megatron-DeepSpeed,
megatron/optimizer_param_scheduler.py, `get_lr` and `step`), driven as their training.py drives
it: `step(increment=global batch)` reading the tokens consumed *before* the iteration. The
loop test drives `TrainingLoop.train` with a stub step, so nothing is spawned.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.checkpointing import TrainState
from megatron.checkpointing.async_save import AsyncSaves
from megatron.settled_args import with_settled
from megatron.training.scheduler import (
    OptimizerParamScheduler,
    SchedulerMismatchError,
    scheduler_from_args,
)

GBS, SEQ = 4, 16
TOKENS_PER_ITERATION = GBS * SEQ  # 64
MAX_LR, MIN_LR = 1.0, 0.1


class _Reference:
    """Megatron-DeepSpeed's get_lr/step (megatron/optimizer_param_scheduler.py, lines 81-157),
    with `args.consumed_train_tokens` passed in as `token_num`."""

    def __init__(
        self,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        warmup_tokens: int | None,
        decay_tokens: int | None,
    ) -> None:
        self.max_lr, self.min_lr = MAX_LR, MIN_LR
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.lr_warmup_tokens, self.lr_decay_tokens = warmup_tokens, decay_tokens
        self.num_steps, self.num_tokens = 0, 0
        self.step(0, 0)

    def get_lr(self) -> float:
        if self.lr_warmup_tokens is None:
            if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
                if self.num_steps == self.lr_warmup_steps and self.lr_decay_tokens is not None:
                    self.lr_warmup_tokens = self.num_tokens
                return self.max_lr * float(self.num_steps) / float(self.lr_warmup_steps)
        else:
            if self.lr_warmup_tokens > 0 and self.num_tokens <= self.lr_warmup_tokens:
                return self.max_lr * float(self.num_tokens) / float(self.lr_warmup_tokens)
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.lr_decay_tokens is None:
            if self.num_steps > self.lr_decay_steps:
                return self.min_lr
        else:
            if self.num_tokens > self.lr_decay_tokens:
                return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            if self.lr_warmup_tokens is None:
                warmup_steps = max(self.lr_warmup_steps, 1)
                num_steps = max(self.num_steps, 1)
                lr = self.max_lr * warmup_steps**0.5 / (num_steps**0.5)
            else:
                warmup_tokens = max(self.lr_warmup_tokens, 1)
                num_tokens = max(self.num_tokens, 1)
                lr = self.max_lr * warmup_tokens**0.5 / (num_tokens**0.5)
            return max(self.min_lr, lr)
        if self.lr_decay_tokens is None:
            num_steps_ = self.num_steps - self.lr_warmup_steps
            decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
            decay_ratio = float(num_steps_) / float(decay_steps_)
        else:
            num_tokens_ = self.num_tokens - self.lr_warmup_tokens
            decay_tokens_ = self.lr_decay_tokens - self.lr_warmup_tokens
            decay_ratio = float(num_tokens_) / float(decay_tokens_)
        assert 0.0 <= decay_ratio <= 1.0
        delta_lr = self.max_lr - self.min_lr
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * delta_lr

    def step(self, increment: int, token_num: int) -> float:
        self.num_tokens = token_num
        self.num_steps += increment
        return self.get_lr()


def _scheduler(
    warmup_steps: int,
    decay_steps: int,
    style: str,
    warmup_tokens: int | None,
    decay_tokens: int | None,
    **overrides,
) -> OptimizerParamScheduler:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=MAX_LR)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        default_increment=GBS,
        lr_warmup_tokens=warmup_tokens,
        lr_decay_tokens=decay_tokens,
        **{"use_checkpoint_opt_param_scheduler": False, **overrides},
    )


def _iterate(scheduler: OptimizerParamScheduler, first: int, last: int) -> list[float]:
    """Iterations `first..last` (1-based) as the loop runs them: tokens before the iteration."""
    lrs = []
    for iteration in range(first, last + 1):
        scheduler.consumed_train_tokens = (iteration - 1) * TOKENS_PER_ITERATION
        scheduler.step()  # the pipeline engine's call; DeepSpeed's passes increment=GBS
        assert scheduler.get_last_lr() == [scheduler.get_lr()]
        lrs.append(scheduler.get_lr())
    return lrs


# (warmup samples, decay samples, warmup tokens, decay tokens); 40 iterations = 2560 tokens.
CASES = {
    "token warmup + token decay": (0, 160, 300, 2000),
    "iteration warmup + token decay": (5 * GBS, 160, None, 1500),
    "token warmup + sample decay": (0, 120, 300, None),
    "no warmup + token decay": (0, 160, 0, 2000),
}
ITERATIONS = 40


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
@pytest.mark.parametrize("case", list(CASES))
def test_lr_matches_megatron_deepspeed_every_iteration(case: str, style: str):
    """Our lr equals Megatron-DeepSpeed's at construction and after each of 40 iterations."""
    warmup_steps, decay_steps, warmup_tokens, decay_tokens = CASES[case]
    ours = _scheduler(warmup_steps, decay_steps, style, warmup_tokens, decay_tokens)
    ref = _Reference(warmup_steps, decay_steps, style, warmup_tokens, decay_tokens)
    assert ours.get_lr() == pytest.approx(ref.get_lr(), rel=1e-12)
    expected = [
        ref.step(GBS, (iteration - 1) * TOKENS_PER_ITERATION)
        for iteration in range(1, ITERATIONS + 1)
    ]
    assert _iterate(ours, 1, ITERATIONS) == pytest.approx(expected, rel=1e-12)
    assert ours.lr_warmup_tokens == ref.lr_warmup_tokens
    if decay_tokens is not None and style != "constant":
        assert expected[-1] == MIN_LR  # 39 * 64 tokens > lr_decay_tokens: min_lr


def test_iteration_warmup_records_its_end_in_tokens():
    """Iteration warmup + token decay: at num_steps == warmup the tokens are recorded (they lag
    one iteration) and the decay runs from there to lr_decay_tokens, then stays at min_lr."""
    sched = _scheduler(5 * GBS, 160, "linear", None, 1500)
    lrs = _iterate(sched, 1, 4)
    assert sched.lr_warmup_tokens is None
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8])  # 1.0 * 4k / 20
    assert _iterate(sched, 5, 5) == [1.0]
    assert sched.lr_warmup_tokens == 4 * TOKENS_PER_ITERATION  # tokens before iteration 5
    # Iteration 6 sees 320 tokens: r = (320 - 256) / (1500 - 256).
    assert _iterate(sched, 6, 6) == pytest.approx([MIN_LR + (1 - 64 / 1244) * (MAX_LR - MIN_LR)])
    # Iteration 25 sees 1536 tokens > 1500.
    assert _iterate(sched, 7, 25)[-1] == MIN_LR


def test_warmup_not_a_multiple_of_the_batch_records_at_the_first_step_past_it():
    """Where Megatron-DeepSpeed never sees num_steps == warmup (and fails on None), the
    warmup end is recorded at the first step past it."""
    sched = _scheduler(18, 160, "linear", None, 1500)  # 18 samples: 4.5 iterations
    assert _iterate(sched, 1, 5)[-1] == MAX_LR
    assert sched.lr_warmup_tokens == 4 * TOKENS_PER_ITERATION
    assert _iterate(sched, 6, 6) == pytest.approx([MIN_LR + (1 - 64 / 1244) * (MAX_LR - MIN_LR)])


def test_no_warmup_at_all_decays_from_zero_tokens():
    """Token decay with neither token nor sample warmup (Megatron-DeepSpeed fails on None):
    the same as --lr-warmup-tokens 0."""
    none = _scheduler(0, 160, "cosine", None, 2000)
    zero = _scheduler(0, 160, "cosine", 0, 2000)
    assert _iterate(none, 1, ITERATIONS) == _iterate(zero, 1, ITERATIONS)


@pytest.mark.parametrize("case", ["token warmup + token decay", "iteration warmup + token decay"])
@pytest.mark.parametrize("split", [3, 12])  # inside and after the warmup
def test_resume_continues_the_same_schedule(case: str, split: int):
    """state_dict after `split` iterations, a fresh scheduler loads it: the same lrs follow."""
    warmup_steps, decay_steps, warmup_tokens, decay_tokens = CASES[case]
    straight = _scheduler(warmup_steps, decay_steps, "cosine", warmup_tokens, decay_tokens)
    expected = _iterate(straight, 1, 30)
    first = _scheduler(warmup_steps, decay_steps, "cosine", warmup_tokens, decay_tokens)
    _iterate(first, 1, split)
    sd = copy.deepcopy(first.state_dict())
    assert sd["num_tokens"] == (split - 1) * TOKENS_PER_ITERATION
    assert (sd["lr_warmup_tokens"], sd["lr_decay_tokens"]) == (
        first.lr_warmup_tokens,
        decay_tokens,
    )
    resumed = _scheduler(warmup_steps, decay_steps, "cosine", warmup_tokens, decay_tokens)
    resumed.load_state_dict(sd)
    assert resumed.get_lr() == expected[split - 1]
    assert _iterate(resumed, split + 1, 30) == expected[split:]


def test_state_dict_without_token_keys_loads():
    """A checkpoint from before the token schedule (no token keys) loads, with and without
    token flags on the command line; Megatron-DeepSpeed's older key names load too."""
    old = _scheduler(20, 160, "cosine", None, None)
    _iterate(old, 1, 10)
    sd = old.state_dict()
    for key in ("num_tokens", "lr_warmup_tokens", "lr_decay_tokens"):
        del sd[key]
    plain = _scheduler(20, 160, "cosine", None, None)
    plain.load_state_dict(sd)
    assert (plain.num_steps, plain.get_lr()) == (40, old.get_lr())
    tokens = _scheduler(20, 160, "cosine", 300, 2000)
    tokens.load_state_dict(sd)
    assert (tokens.lr_warmup_tokens, tokens.lr_decay_tokens, tokens.num_steps) == (300, 2000, 40)
    legacy = {**sd, "warmup_tokens": 300, "decay_tokens": 2000, "num_tokens": 1000}
    renamed = _scheduler(20, 160, "cosine", 300, 2000)
    renamed.load_state_dict(legacy)
    assert renamed.num_tokens == 1000
    assert renamed.get_lr() == pytest.approx(
        MIN_LR + 0.5 * (math.cos(math.pi * 700 / 1700) + 1) * (MAX_LR - MIN_LR)
    )


def test_token_span_mismatch_follows_the_checkpoint_rules():
    """Different --lr-decay-tokens: refused by default, ours with override, theirs with
    use-checkpoint; an invalid span names its flag."""
    saved = _scheduler(0, 160, "linear", 300, 2000)
    _iterate(saved, 1, 10)
    sd = saved.state_dict()
    with pytest.raises(SchedulerMismatchError, match="decay tokens"):
        _scheduler(0, 160, "linear", 300, 3000).load_state_dict(sd)
    override = _scheduler(0, 160, "linear", 300, 3000, override_opt_param_scheduler=True)
    override.load_state_dict(sd)
    assert override.lr_decay_tokens == 3000
    checkpoint = _scheduler(0, 160, "linear", 300, 3000, use_checkpoint_opt_param_scheduler=True)
    checkpoint.load_state_dict(sd)
    assert checkpoint.lr_decay_tokens == 2000
    with pytest.raises(ValueError, match="--lr-decay-tokens"):
        _scheduler(0, 160, "linear", None, 0)
    with pytest.raises(ValueError, match="--lr-warmup-tokens"):
        _scheduler(0, 160, "linear", -1, 2000)


def test_real_script_flags_build_a_token_schedule():
    """The Megatron-DeepSpeed scripts' combination passes validation; the sample spans stay."""
    from megatron.arguments import build_parser, validate_args

    base = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 256 "
        "--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --train-tokens 300000000000 "
        "--lr-decay-tokens 300000000000 --lr-warmup-tokens 3000000000 "
    )
    model = torch.nn.Linear(2, 2)
    for extra, decay_samples in [
        ("--train-samples 292968750", 292968750),
        ("--train-iters 1144409", 1144409 * 256),
        ("--train-iters 1144409 --lr-warmup-iters 100", 1144409 * 256),
    ]:
        args = validate_args(build_parser().parse_args((base + extra).split()), 1)
        sched = scheduler_from_args(torch.optim.AdamW(model.parameters()), args)
        assert (sched.lr_warmup_tokens, sched.lr_decay_tokens) == (3 * 10**9, 3 * 10**11)
        assert sched.lr_decay_steps == decay_samples
        assert args.train_tokens == 3 * 10**11


def test_training_continues_stops_at_train_tokens():
    """Megatron-DeepSpeed's condition: iterations left and fewer tokens than --train-tokens."""
    from megatron.training.loop import training_continues

    assert training_continues(TrainState(iteration=9, consumed_train_tokens=10**9), 10, None)
    assert not training_continues(TrainState(iteration=10), 10, None)
    assert training_continues(TrainState(iteration=3, consumed_train_tokens=99), 10, 100)
    assert not training_continues(TrainState(iteration=3, consumed_train_tokens=100), 10, 100)


def test_loop_stops_at_train_tokens_and_feeds_the_scheduler(monkeypatch):
    """`TrainingLoop.train` with a stub step: it stops once --train-tokens are consumed, before
    --train-iters, and each step's scheduler sees the tokens consumed before it."""
    from megatron.arguments import build_parser, validate_args
    from megatron.training.loop import TrainingLoop
    from megatron.training.monitor import Timers
    from megatron.training.step import StepResult

    argv = (
        f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
        f"--max-position-embeddings {SEQ} --micro-batch-size {GBS} --global-batch-size {GBS} "
        "--train-iters 100 --train-tokens 1000 --lr 1.0 --min-lr 0.1 --lr-decay-style linear "
        "--lr-warmup-tokens 300 --lr-decay-tokens 2000 --log-interval 1000 --eval-interval 0"
    ).split()
    args = validate_args(build_parser().parse_args(argv), 1)
    args = with_settled(args, padded_vocab_size=128)
    scheduler = scheduler_from_args(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), args)
    # The loop's step is replaced below; the loop commits background saves at the end.
    engine = SimpleNamespace(scheduler=scheduler, background_saves=AsyncSaves())
    loop = TrainingLoop(args, engine, Timers(0), None)
    seen: list[int] = []

    def step(data_iterator, global_batch_size=None):  # noqa: ANN001, ANN202
        seen.append(scheduler.consumed_train_tokens)
        scheduler.step(increment=global_batch_size)  # as DeepSpeed's engine.step(lr_kwargs)
        return StepResult({"lm loss": 1.0}, False, False, None, None)

    monkeypatch.setattr(loop, "step", step)
    state = TrainState()
    loop.train(iter(()), None, state)
    assert state.iteration == math.ceil(1000 / TOKENS_PER_ITERATION)  # 16, not 100
    assert state.consumed_train_tokens == 16 * TOKENS_PER_ITERATION
    assert seen == [k * TOKENS_PER_ITERATION for k in range(16)]
    ref = _Reference(0, 100 * GBS, "linear", 300, 2000)
    for tokens in seen:
        ref.step(GBS, tokens)
    assert scheduler.get_lr() == pytest.approx(ref.get_lr(), rel=1e-12)
