"""Megatron's learning-rate and weight-decay schedule, counted in samples.

`OptimizerParamScheduler` follows Megatron-LM's class of the same name: linear warmup from
`init_lr` to `max_lr`, then a constant, linear, cosine or inverse-square-root decay to
`min_lr`, and a weight decay that grows from `start_wd` to `end_wd`. Steps are samples, so a
training step advances the schedule by the global batch size. Its state dict uses Megatron's
keys, so checkpoints move between the two code bases; and it answers what DeepSpeed's engine
asks of a client scheduler (`step()`, `step(increment=n)`, `state_dict`, `load_state_dict`).

Megatron-DeepSpeed's token schedule (`--lr-warmup-tokens`, `--lr-decay-tokens`) replaces the
warmup and/or the decay span by a count of consumed tokens. The count is read at each step from
`consumed_train_tokens`, which the training loop sets before every iteration (so, as there, it
lags one iteration behind the sample count), or passed as `step(token_num=...)`.

`scheduler_from_args` is Megatron's `get_optimizer_param_scheduler`: it turns the
`--lr-*` / `--train-*` flags into sample counts.
"""

from __future__ import annotations

import math
import types
from argparse import Namespace
from typing import Any

import torch

from megatron.utils import print_rank_0

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WD_INCR_STYLES = ("constant", "linear", "cosine")

_DECAY_FLAGS = "--lr-decay-iters/--lr-decay-samples"
_TOKEN_KEYS = {"lr_warmup_tokens": "warmup_tokens", "lr_decay_tokens": "decay_tokens"}
"""Megatron-DeepSpeed's state-dict keys for the token spans, and their older names."""
_WARMUP_FLAGS = "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction"
_WD_FLAGS = "--start-weight-decay/--end-weight-decay"


class SchedulerMismatchError(ValueError):
    """A checkpoint's LR/WD schedule differs from the command line's (message says the fix)."""


class OptimizerParamScheduler:
    """Anneals the learning rate and weight decay of every param group, step = one sample."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        default_increment: int = 1,
        lr_warmup_tokens: int | None = None,
        lr_decay_tokens: int | None = None,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str = "exponential",
    ) -> None:
        self.optimizer = optimizer
        # WSD (warmup, stable, decay): the lr holds at max_lr until the last `wsd_decay_steps`
        # samples of the decay span, then falls to min_lr in `lr_wsd_decay_style`.
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        # Kept as given: --lr-warmup-fraction makes it a float, as in Megatron's checkpoints.
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.default_increment = default_increment
        self.num_steps = 0
        # None: warmup / decay counted in samples. With token decay and a sample warmup,
        # get_lr records here the tokens consumed when the warmup ends.
        self.lr_warmup_tokens = lr_warmup_tokens
        self.lr_decay_tokens = lr_decay_tokens
        self.num_tokens = 0
        self.consumed_train_tokens = 0
        """Tokens consumed before the coming iteration; the training loop keeps it current."""
        self.last_lr: list[float] = []
        _check(self)
        # Megatron sets the initial lr at construction, before any optimizer step.
        self.step(0)

    def _validate(self) -> None:
        _check(self)

    def get_wd(self) -> float:
        """The weight decay at the current sample count."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _warmup_lr(self) -> float | None:
        """The warmup lr, in tokens or in samples; None once the warmup is over."""
        if self.lr_warmup_tokens is not None:
            if self.lr_warmup_tokens > 0 and self.num_tokens <= self.lr_warmup_tokens:
                return self._warmed(float(self.num_tokens) / float(self.lr_warmup_tokens))
            return None
        if self.lr_warmup_steps <= 0:
            return None
        if self.lr_decay_tokens is not None and self.num_steps >= self.lr_warmup_steps:
            # Sample warmup, token decay: the decay starts from the tokens consumed when the
            # warmup ends. Megatron-DeepSpeed records them at num_steps == warmup exactly; a
            # count that jumps past it (a warmup that is no multiple of the batch) left None
            # there and crashed, so this records at the first step at or past the end.
            self.lr_warmup_tokens = self.num_tokens
            return self.max_lr
        if self.num_steps <= self.lr_warmup_steps:
            return self._warmed(float(self.num_steps) / float(self.lr_warmup_steps))
        return None

    def _warmed(self, warmup_ratio: float) -> float:
        """The lr `warmup_ratio` of the way from init_lr to max_lr."""
        return self.init_lr + (self.max_lr - self.init_lr) * warmup_ratio

    def _decay_ratio(self) -> float:
        """How far the decay has gone (0 at the warmup end, 1 at the decay end)."""
        if self.lr_decay_tokens is None:
            return float(self.num_steps - self.lr_warmup_steps) / float(
                self.lr_decay_steps - self.lr_warmup_steps
            )
        # No warmup at all (neither tokens nor samples) leaves None: the decay starts at 0
        # tokens (Megatron-DeepSpeed would fail on None here).
        warmup_tokens = self.lr_warmup_tokens or 0
        return float(self.num_tokens - warmup_tokens) / float(self.lr_decay_tokens - warmup_tokens)

    def get_lr(self) -> float:
        """The learning rate at the current sample/token count (before any group's `lr_mult`)."""
        warmup_lr = self._warmup_lr()
        if warmup_lr is not None:
            return warmup_lr
        # Megatron tests "constant" before the decay end: the lr stays at max_lr forever.
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.lr_decay_tokens is None:
            if self.num_steps > self.lr_decay_steps:
                return self.min_lr
        elif self.num_tokens > self.lr_decay_tokens:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            if self.lr_warmup_tokens is None:
                warmup, count = max(self.lr_warmup_steps, 1), max(self.num_steps, 1)
            else:
                warmup, count = max(self.lr_warmup_tokens, 1), max(self.num_tokens, 1)
            return max(self.min_lr, self.max_lr * warmup**0.5 / count**0.5)
        if self.lr_decay_style == "WSD":
            return self.min_lr + self._wsd_coefficient() * (self.max_lr - self.min_lr)
        decay_ratio = self._decay_ratio()
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _wsd_coefficient(self) -> float:
        """Megatron-LM's WSD: 1 until the anneal starts, then its decay style's curve to 0."""
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        return 2.0 * math.pow(0.5, ratio) - 1.0  # exponential

    def group_lr(self, group: dict) -> float:
        """The lr of a param group with its own peak and floor (`max_lr`, `min_lr`: Megatron-LM's
        --decoupled-lr groups) on the same warmup and decay."""
        saved = self.max_lr, self.min_lr
        self.max_lr = float(group["max_lr"])
        self.min_lr = float(group.get("min_lr") if group.get("min_lr") is not None else saved[1])
        try:
            return self.get_lr()
        finally:
            self.max_lr, self.min_lr = saved

    def step(self, increment: int | None = None, token_num: int | None = None) -> None:
        """Advance by `increment` samples (default: one global batch) and set the token count
        (default: `consumed_train_tokens`); set every group's lr/wd."""
        self.num_tokens = self.consumed_train_tokens if token_num is None else token_num
        self.num_steps += self.default_increment if increment is None else increment
        new_lr = self.get_lr()
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            lr = new_lr if group.get("max_lr") is None else self.group_lr(group)
            group["lr"] = lr * group.get("lr_mult", 1.0)
            # The no-decay group (biases, norms) carries wd_mult 0.0, so it stays at 0.
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)
        self.last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """The lr of each param group as set by the last `step` (torch schedulers' API)."""
        return list(self.last_lr)

    def state_dict(self) -> dict:
        """The schedule's state under Megatron-DeepSpeed's key names."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_warmup_tokens": self.lr_warmup_tokens,
            "num_steps": self.num_steps,
            "num_tokens": self.num_tokens,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_tokens": self.lr_decay_tokens,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: object, sd_value: object, name: str) -> object:
        """Megatron's rule: ours if overriding, else the checkpoint's (which must match ours
        unless --use-checkpoint-lr-scheduler)."""
        if self.override_opt_param_scheduler:
            print_rank_0(f" > overriding {name} value to {cls_value}")
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise SchedulerMismatchError(
                f"OptimizerParamScheduler: class input value {cls_value} and checkpoint value "
                f"{sd_value} for {name} do not match; pass --use-checkpoint-lr-scheduler to take "
                f"the checkpoint's or --override-lr-scheduler to keep the command line's"
            )
        print_rank_0(f" > using checkpoint value {sd_value} for {name}")
        return sd_value

    def _token_span(self, sd: dict, key: str, cls_value: int | None, name: str) -> int | None:
        """`lr_warmup_tokens` / `lr_decay_tokens` from a checkpoint by Megatron-DeepSpeed's rule;
        a checkpoint from before the token schedule has neither and keeps ours."""
        old_key = _TOKEN_KEYS[key]
        if key not in sd and old_key not in sd:
            return cls_value
        sd_value = _first(sd, old_key, key)
        if key == "lr_warmup_tokens" and cls_value is None and self.lr_decay_tokens is not None:
            # A sample warmup under token decay recorded its end in tokens: that is state to
            # restore, not a flag to compare (Megatron-DeepSpeed's check refuses None != record,
            # i.e. every resume past the warmup).
            print_rank_0(f" > using checkpoint value {sd_value} for {name}")
            return sd_value
        return self._check_and_set(cls_value, sd_value, name)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from a checkpoint, also reading the key names of older Megatron releases."""
        sd = state_dict
        self.max_lr = self._check_and_set(
            self.max_lr, _first(sd, "start_lr", "max_lr"), "learning rate"
        )
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps,
            _first(sd, "warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "warmup iterations",
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps,
            _first(sd, "end_iter", "decay_steps", "lr_decay_steps"),
            "total number of iterations",
        )
        # Decay first: whether a warmup record is expected depends on the decay.
        self.lr_decay_tokens = self._token_span(
            sd, "lr_decay_tokens", self.lr_decay_tokens, "decay tokens"
        )
        self.lr_warmup_tokens = self._token_span(
            sd, "lr_warmup_tokens", self.lr_warmup_tokens, "warmup tokens"
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style,
            _first(sd, "decay_style", "lr_decay_style"),
            "learning rate decay style",
        )
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps,
                sd["wd_incr_steps"],
                "total number of weight decay iterations",
            )
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, sd["wd_incr_style"], "weight decay incr style"
            )
        self._validate()
        # The checkpoint's count replaces ours (Megatron adds it, equal on a fresh scheduler);
        # groups are updated once every value, weight decay included, is in place.
        self.num_steps = _first(sd, "num_iters", "num_steps")
        self.num_tokens = sd.get("num_tokens", self.num_tokens)
        self.step(0, token_num=self.num_tokens)


def _first(state_dict: dict, *keys: str) -> object:
    """The value of the first of `keys` present in `state_dict`."""
    for key in keys:
        if key in state_dict:
            return state_dict[key]
    raise KeyError(f"scheduler state dict has none of the keys {keys}")


def _arg_or(args: Namespace, name: str, default: object) -> object:
    """`args.name`, or `default` when the flag is absent or unset."""
    value = getattr(args, name, None)
    return default if value is None else value


def scheduler_from_args(
    optimizer: torch.optim.Optimizer, args: Namespace
) -> OptimizerParamScheduler:
    """Megatron's `get_optimizer_param_scheduler`: the schedule in samples from the flags."""
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_arguments(args))
    print_rank_0(f"> learning rate decay style: {scheduler.lr_decay_style}")
    return scheduler


def scheduler_arguments(args: Namespace) -> dict:
    """`OptimizerParamScheduler` keyword arguments (steps in samples) from Megatron's flags."""
    if args.train_samples:
        # Sample-based: checked first because validate_args also fills train_iters from it.
        lr_decay_steps = _arg_or(args, "lr_decay_samples", args.train_samples)
        wd_incr_steps = args.train_samples
        lr_warmup_steps = args.lr_warmup_samples
    elif args.train_iters:
        lr_decay_iters = _arg_or(args, "lr_decay_iters", args.train_iters)
        lr_decay_steps = lr_decay_iters * args.global_batch_size
        wd_incr_steps = args.train_iters * args.global_batch_size
        lr_warmup_steps = args.lr_warmup_iters * args.global_batch_size
    else:
        raise ValueError("either --train-iters or --train-samples must be given")
    if args.lr_warmup_fraction is not None:
        lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
    return dict(
        init_lr=_arg_or(args, "lr_warmup_init", 0.0),
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=_arg_or(args, "start_weight_decay", args.weight_decay),
        end_wd=_arg_or(args, "end_weight_decay", args.weight_decay),
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=_arg_or(args, "weight_decay_incr_style", "constant"),
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_lr_scheduler,
        override_opt_param_scheduler=args.override_lr_scheduler,
        default_increment=args.global_batch_size,
        # Megatron-DeepSpeed: when set, these replace the sample warmup / decay span above.
        lr_warmup_tokens=getattr(args, "lr_warmup_tokens", None),
        lr_decay_tokens=getattr(args, "lr_decay_tokens", None),
        wsd_decay_steps=_wsd_decay_steps(args),
        lr_wsd_decay_style=_arg_or(args, "lr_wsd_decay_style", "exponential"),
    )


def _wsd_decay_steps(args: Namespace) -> int | None:
    """WSD's anneal in samples: --lr-wsd-decay-samples, or --lr-wsd-decay-iters x the batch."""
    if getattr(args, "lr_wsd_decay_samples", None) is not None:
        return args.lr_wsd_decay_samples
    if getattr(args, "lr_wsd_decay_iters", None) is not None:
        return args.lr_wsd_decay_iters * args.global_batch_size
    return None


def _check(schedule: Any) -> None:
    """The checks of an `OptimizerParamScheduler`'s settings (its attributes, or
    `scheduler_arguments`' names): ValueError naming the flags."""
    if schedule.override_opt_param_scheduler and schedule.use_checkpoint_opt_param_scheduler:
        raise ValueError(
            "--override-lr-scheduler and --use-checkpoint-lr-scheduler cannot both be set"
        )
    if schedule.min_lr < 0.0:
        raise ValueError(f"--min-lr ({schedule.min_lr}) must not be negative")
    if schedule.max_lr < schedule.min_lr:
        raise ValueError(f"--min-lr ({schedule.min_lr}) is larger than --lr ({schedule.max_lr})")
    if schedule.init_lr > schedule.max_lr:
        raise ValueError(
            f"--lr-warmup-init ({schedule.init_lr}) is larger than --lr ({schedule.max_lr})"
        )
    if schedule.lr_decay_style == "WSD":
        if schedule.wsd_decay_steps is None or schedule.wsd_decay_steps <= 0:
            raise ValueError(
                "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples "
                f"above 0 (the anneal at the end of the decay span), got {schedule.wsd_decay_steps}"
            )
        if schedule.wsd_decay_steps > schedule.lr_decay_steps:
            raise ValueError(
                f"--lr-wsd-decay-*: the anneal ({schedule.wsd_decay_steps} samples) is longer "
                f"than the decay span ({schedule.lr_decay_steps} samples)"
            )
        if schedule.lr_decay_tokens is not None:
            raise ValueError("--lr-decay-style WSD counts samples; drop --lr-decay-tokens")
    if schedule.lr_decay_steps <= 0:
        raise ValueError(
            f"{_DECAY_FLAGS}: the decay must cover more than 0 samples, "
            f"got {schedule.lr_decay_steps}"
        )
    if not 0 <= schedule.lr_warmup_steps < schedule.lr_decay_steps:
        raise ValueError(
            f"{_WARMUP_FLAGS}: the warmup ({schedule.lr_warmup_steps} samples) must be at least 0 "
            f"and shorter than the decay ({_DECAY_FLAGS}: {schedule.lr_decay_steps} samples)"
        )
    if schedule.lr_warmup_tokens is not None and schedule.lr_warmup_tokens < 0:
        raise ValueError(f"--lr-warmup-tokens ({schedule.lr_warmup_tokens}) must not be negative")
    if schedule.lr_decay_tokens is not None and schedule.lr_decay_tokens <= 0:
        raise ValueError(f"--lr-decay-tokens ({schedule.lr_decay_tokens}) must be positive")
    if schedule.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(
            f"--lr-decay-style {schedule.lr_decay_style!r} is not one of {LR_DECAY_STYLES}"
        )
    if not 0.0 <= schedule.start_wd <= schedule.end_wd:
        raise ValueError(
            f"{_WD_FLAGS}: need 0 <= start ({schedule.start_wd}) <= end ({schedule.end_wd})"
        )
    if schedule.wd_incr_style not in WD_INCR_STYLES:
        raise ValueError(
            f"--weight-decay-incr-style {schedule.wd_incr_style!r} is not one of {WD_INCR_STYLES}"
        )
    if schedule.wd_incr_style == "constant" and schedule.start_wd != schedule.end_wd:
        raise ValueError(
            f"{_WD_FLAGS}: a constant --weight-decay-incr-style needs start ({schedule.start_wd}) "
            f"== end ({schedule.end_wd})"
        )
    if schedule.wd_incr_style != "constant" and schedule.wd_incr_steps <= 0:
        raise ValueError(
            f"--train-iters/--train-samples: weight decay increment needs more than 0 "
            f"samples, got {schedule.wd_incr_steps}"
        )


def check_schedule(settings: dict) -> None:
    """Raise ValueError, naming the flags, when `scheduler_arguments(args)` describe an
    impossible LR / weight-decay schedule (validation's check; no optimizer needed)."""
    _check(types.SimpleNamespace(**settings))
