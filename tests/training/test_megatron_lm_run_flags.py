"""Megatron-LM's run flags: --profile and --manual-gc (megatron.training.run_hooks),
--log-throughput's field in the iteration line, --decoupled-lr's own peak and floor for the
input and output layers, and their one-line refusals."""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os

import pytest
import torch

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.settled_args import with_settled
from megatron.training.monitor import IterationStats, format_iteration_log, parse_iteration_log
from megatron.training.run_hooks import RunHooks

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 1 --train-iters 10 --lr 1e-3"
)


def _args(extra: str, tmp_path) -> argparse.Namespace:
    argv = f"{BASE} --tensorboard-dir {tmp_path} {extra}".split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), 1, typed_flags(parser, argv))


def test_profile_window_writes_one_trace_of_those_iterations(tmp_path) -> None:
    args = _args("--profile --profile-step-start 2 --profile-step-end 3", tmp_path)
    hooks = RunHooks(args)
    steps = []
    for iteration in range(1, 6):
        hooks.before_iteration(iteration)
        with torch.profiler.record_function(f"step {iteration}"):
            steps.append(torch.ones(8, 8) @ torch.ones(8, 8))
        hooks.after_iteration(iteration)
    traces = glob.glob(os.path.join(tmp_path, "*.pt.trace.json"))
    assert len(traces) == 1, os.listdir(tmp_path)
    with open(traces[0]) as file:
        names = {event.get("name") for event in json.load(file)["traceEvents"]}
    assert {"step 2", "step 3"} <= names and not names & {"step 1", "step 4", "step 5"}


def test_profiling_ranks_other_than_this_one_record_nothing(tmp_path) -> None:
    args = _args(
        "--profile --profile-step-start 1 --profile-step-end 1 --profile-ranks 1", tmp_path
    )
    hooks = RunHooks(args)
    hooks.before_iteration(1)
    hooks.after_iteration(1)
    assert glob.glob(os.path.join(tmp_path, "*.pt.trace.json")) == []


def test_manual_gc_turns_automatic_collection_off_and_collects_on_its_interval(
    tmp_path, monkeypatch
) -> None:
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or 0)
    hooks = RunHooks(_args("--manual-gc --manual-gc-interval 2", tmp_path))
    try:
        hooks.start_training()
        assert not gc.isenabled() and len(collections) == 1
        for iteration in range(1, 6):
            hooks.after_iteration(iteration)
        assert len(collections) == 3  # after iterations 2 and 4
        hooks.around_evaluation()
        assert len(collections) == 4
    finally:
        gc.enable()


def test_log_throughput_adds_megatron_lms_field() -> None:
    stats = dict(
        iteration=5,
        train_iters=10,
        consumed_samples=40,
        consumed_tokens=1280,
        elapsed_ms_per_iteration=12.5,
        learning_rate=1e-3,
        global_batch_size=8,
        losses={"lm loss": 3.5},
        loss_scale=1.0,
        grad_norm=1.0,
        actual_seqlen=32,
        skipped_iterations=0,
        nan_iterations=0,
        samples_per_second=640.0,
        tokens_per_gpu_per_second=20480.0,
        tflops=0.25,
    )
    without = format_iteration_log(IterationStats(**stats))
    line = format_iteration_log(IterationStats(**stats, throughput=0.25))
    assert "throughput per GPU" not in without
    assert (
        " elapsed time per iteration (ms): 12.5 | throughput per GPU (TFLOP/s/GPU): 0.2 |" in line
    )
    assert parse_iteration_log(line)["throughput per GPU (TFLOP/s/GPU)"] == 0.2


@pytest.mark.parametrize(
    "extra, words",
    [
        ("--profile --profile-step-start 5 --profile-step-end 3", ["--profile-step-end 3"]),
        ("--manual-gc --manual-gc-interval -1", ["--manual-gc-interval -1"]),
    ],
)
def test_refused_in_one_line(extra: str, words: list[str], tmp_path) -> None:
    with pytest.raises(ArgumentError) as refused:
        _args(extra, tmp_path)
    assert all(word in str(refused.value) for word in words) and "\n" not in str(refused.value)


def test_decoupled_lr_gives_the_input_and_output_layers_their_own_peak_and_floor(tmp_path) -> None:
    """--decoupled-lr / --decoupled-min-lr: the word embeddings and untied output layer follow
    the same warmup and cosine decay between their own peak and floor."""
    from megatron.config import ModelConfig
    from megatron.model import GPTModel
    from megatron.training.engines.base import _param_groups
    from megatron.training.optimizer import build_optimizer
    from megatron.training.scheduler import scheduler_from_args

    args = _args(
        "--lr 1e-3 --min-lr 1e-4 --decoupled-lr 5e-4 --decoupled-min-lr 5e-5 "
        "--lr-warmup-iters 2 --lr-decay-style cosine --global-batch-size 1 "
        "--untie-embeddings-and-output-weights",
        tmp_path,
    )
    args = with_settled(args, padded_vocab_size=128)
    model = GPTModel(ModelConfig.from_args(args))
    groups = _param_groups(model, args)
    decoupled = [g for g in groups if g["name"] == "decoupled_lr"]
    assert len(decoupled) == 1 and len(decoupled[0]["params"]) == 2  # embedding, output layer
    optimizer = build_optimizer(groups, args.lr, 0.1, (0.9, 0.95), 1e-8)
    scheduler = scheduler_from_args(optimizer, args)
    seen = []
    for _ in range(10):
        scheduler.step(increment=1)
        lrs = {group["name"]: group["lr"] for group in optimizer.param_groups}
        seen.append((lrs["weight_decay"], lrs["decoupled_lr"]))
    assert seen[1] == pytest.approx((1e-3, 5e-4))  # the warmup's end: both peaks
    assert seen[-1] == pytest.approx((1e-4, 5e-5))  # the decay's end: both floors
    base, own = seen[5]
    assert (base - 1e-4) / (1e-3 - 1e-4) == pytest.approx((own - 5e-5) / (5e-4 - 5e-5))


def test_decoupled_lr_covers_the_last_stages_tied_head_copy() -> None:
    """Under Megatron's schedules the last stage's copy of the tied embedding is the output
    layer: it follows --decoupled-lr as the first stage's embedding does (Megatron-LM)."""
    from megatron.training.optimizer import get_param_groups

    stage = torch.nn.Module()
    stage.word_embeddings_for_head = torch.nn.Embedding(8, 4)
    stage.dense = torch.nn.Linear(4, 4)
    groups = get_param_groups(stage, (5e-4, 5e-5))
    (decoupled,) = [group for group in groups if group["name"] == "decoupled_lr"]
    assert decoupled["params"] == [stage.word_embeddings_for_head.weight]


def test_lr_warmup_init_reaches_the_schedule(tmp_path) -> None:
    from megatron.training.scheduler import scheduler_arguments

    args = _args("--lr-warmup-init 2e-4 --lr-warmup-iters 2 --global-batch-size 1", tmp_path)
    assert scheduler_arguments(args)["init_lr"] == 2e-4
    assert scheduler_arguments(_args("--global-batch-size 1", tmp_path))["init_lr"] == 0.0


def test_decoupled_lr_on_deepspeeds_engine_is_refused_in_one_line(tmp_path) -> None:
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 1}}')
    with pytest.raises(ArgumentError, match="--decoupled-lr 0.0005 with --deepspeed"):
        _args(f"--decoupled-lr 5e-4 --deepspeed --deepspeed_config {config}", tmp_path)


ORACLE_SCRIPT = os.path.join(os.path.dirname(__file__), "megatron_core_lr_schedules.py")


def test_wsd_and_decoupled_groups_follow_megatron_core(tmp_path) -> None:
    """Megatron-LM's WSD schedule (each anneal style), param groups with their own peak and
    floor (--decoupled-lr) and a warmup from --lr-warmup-init give megatron-core 0.16.1's
    learning rates at every step."""
    from megatron.training.scheduler import OptimizerParamScheduler
    from tests.conftest import run_oracle

    base = dict(
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=110,
        wd_incr_style="constant",
    )
    groups = [{}, {"max_lr": 0.5, "min_lr": 0.05}]
    steps = [0, 5, 10, 40, 60, 70, 80, 90, 100, 109, 110, 120]
    cases = [
        {
            "name": style,
            "kwargs": {
                **base,
                "lr_decay_style": "WSD",
                "wsd_decay_steps": 50,
                "lr_wsd_decay_style": style,
            },
            "groups": groups,
            "steps": steps,
        }
        for style in ("exponential", "linear", "cosine", "minus_sqrt")
    ]
    cases.append(
        {
            "name": "cosine",
            "kwargs": {**base, "lr_decay_style": "cosine"},
            "groups": groups,
            "steps": steps,
        }
    )
    cases[-1]["name"] = "decoupled cosine"
    # --lr-warmup-init: the warmup climbs from it, not from 0.
    cases.append(
        {
            "name": "warmup from init",
            "kwargs": {**base, "init_lr": 0.2, "lr_decay_style": "linear"},
            "groups": groups,
            "steps": steps,
        }
    )
    cases_file, out_file = tmp_path / "cases.json", tmp_path / "lrs.json"
    cases_file.write_text(json.dumps(cases))
    run_oracle(ORACLE_SCRIPT, str(cases_file), str(out_file))
    expected = json.loads(out_file.read_text())
    for case in cases:
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in groups]
        optimizer = torch.optim.SGD(
            [{"params": [p], **extra} for p, extra in zip(params, groups)], lr=0.0
        )
        scheduler = OptimizerParamScheduler(optimizer, **case["kwargs"])
        ours, done = [], 0
        for step in steps:
            scheduler.step(step - done)
            done = step
            ours.append([group["lr"] for group in optimizer.param_groups])
        flat = [lr for row in expected[case["name"]] for lr in row]
        assert [lr for row in ours for lr in row] == pytest.approx(flat, rel=1e-12), case["name"]


def test_kill_switch_file_and_exit_on_missing_checkpoint(stdlib_dataset: str, tmp_path) -> None:
    """--exit-on-missing-checkpoint stops in one line on an empty --load; --kill-switch-file
    ends the run after the iteration that finds the file, saving it first."""
    from tests.pretrain_runs import launch, tiny_gpt_flags

    save = str(tmp_path / "checkpoints")
    flags = tiny_gpt_flags(stdlib_dataset) + ["--global-batch-size", "2", "--train-iters", "5"]
    missing = launch(1, flags + ["--load", save, "--exit-on-missing-checkpoint"])
    assert missing.returncode != 0
    errors = [line for line in missing.stdout.splitlines() if line.startswith("error:")]
    assert errors and "--exit-on-missing-checkpoint: no checkpoint in --load" in errors[0]
    switch = tmp_path / "stop-now"
    switch.write_text("")
    stopped = launch(
        1, flags + ["--save", save, "--save-interval", "100", "--kill-switch-file", str(switch)]
    )
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    assert f"exiting program at iteration 1: {switch} exists (--kill-switch-file)" in stopped.stdout
    assert os.path.isdir(os.path.join(save, "iter_0000001"))
