"""Megatron-DeepSpeed's TensorBoard flags: each writes the tags theirs writes, with its meaning.

Two short in-process runs of `TrainingLoop` on the tiny GPT of tests/training/harness.py (one
gloo rank, fp16 on the plain path so there is a loss scale), one with every flag and one with
the defaults minus learning rate and loss scale, are read back with TensorBoard's
EventAccumulator. One spawned 2-rank world checks the reductions: the parameter norm under
tensor parallelism and the optimizer-state norms over a partitioned (ZeRO-like) state.
Tag names are those of microsoft/Megatron-DeepSpeed megatron/training.py at f4157bea.
"""

# The reference line below keeps Megatron-DeepSpeed's own str.format() calls, verbatim.
# ruff: noqa: UP032

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.checkpointing import TrainState
from megatron.core import parallel_state
from megatron.model import GPTModel
from megatron.training.monitor import (
    IterationStats,
    MetricsWriter,
    Timers,
    format_iteration_log,
    parse_iteration_log,
)
from megatron.training.step import StepResult
from megatron.training.training_log import (
    memory_scalars,
    optimizer_state_stats,
    params_l2_norm,
    write_training_scalars,
)
from tests.distributed import run_distributed
from tests.training import harness

ITERATIONS = 4
TOKENS_PER_ITERATION = harness.GLOBAL_BATCH * harness.SEQ
LOOP_FLAGS = (
    # fp16 for a loss scale; one that does not overflow, so every iteration updates.
    "--fp16",
    "--initial-loss-scale",
    "4096",
    "--train-iters",
    str(ITERATIONS),
    "--log-interval",
    "2",
    "--eval-interval",
    "2",
    "--eval-iters",
    "1",
    "--micro-batch-size",
    "2",
)
ALL_FLAGS = (
    "--log-batch-size-to-tensorboard",
    "--log-validation-ppl-to-tensorboard",
    "--log-optimizer-states-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--log-world-size-to-tensorboard",
    "--log-params-norm",
    "--log-timers-to-tensorboard",
    "--tensorboard-queue-size",
    "5",
)
DEFAULTS_OFF = ("--no-log-learnig-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard")


def _vs(tag: str) -> set[str]:
    return {tag, f"{tag} vs samples", f"{tag} vs tokens"}


OPTIMIZER_TAGS = {
    f"optimizer/{kind}_{stat}{suffix}"
    for kind in ("variance", "variance_sqrt", "momentum", "weight")
    for stat in ("l2", "l1", "abs_max")
    for suffix in ("", " vs tokens")
}
ALWAYS = {
    "steps-vs-samples/y=steps,x=samples",
    "steps-vs-samples/y=samples,x=steps",
    "steps-vs-tokens/y=steps,x=tokens",
    "steps-vs-tokens/y=tokens,x=steps",
    *_vs("lm-loss-training/lm loss"),
    *_vs("grad-norm/grad-norm"),
    *_vs("seqlen/actual_seq_length"),
    *_vs("lm-loss-validation/lm loss validation"),
    *_vs("lm-loss-validation/lm loss test"),
}
BY_DEFAULT = {*_vs("learning-rate/learning-rate"), *_vs("loss-scale/loss-scale")}
ONLY_WITH_FLAGS = {
    *_vs("batch-size/batch-size"),
    *_vs("world-size/world-size"),
    *_vs("params-norm/params-norm"),
    *_vs("iteration-time/iteration-time"),
    *_vs("lm-loss-validation/lm loss validation ppl"),
    *_vs("lm-loss-validation/lm loss test ppl"),
    *OPTIMIZER_TAGS,
    "forward-backward-time",
    "optimizer-time",
    "train-step-time",
    # On CPU; a CUDA run writes Megatron's mem-reserved-bytes, mem-allocated-bytes/-count.
    "mem-rss-bytes",
    "mem-max-rss-bytes",
}


def _run_loop(flags: tuple[str, ...], tensorboard_dir: str) -> dict:
    """Train ITERATIONS iterations as pretrain() wires the loop; what the test compares."""
    from megatron.training.loop import TrainingLoop
    from megatron.training.training import evaluate_and_print_results

    args, engine, _ = harness.build(
        harness.Layout("plain", 1, micro_batch=2),
        harness.dense_state_dict(),
        tensorboard_dir,
        (*LOOP_FLAGS, "--tensorboard-dir", tensorboard_dir, *flags),
    )
    writer = MetricsWriter(args.tensorboard_dir, None, queue_size=args.tensorboard_queue_size)
    # As pretrain(): the timers run at level 1 at least when TensorBoard wants them.
    level = max(args.timing_log_level, 1 if args.log_timers_to_tensorboard else 0)
    loop = TrainingLoop(args, engine, Timers(level), writer)
    loop.evaluate = lambda label, iterator, at: evaluate_and_print_results(
        label, engine, iterator, at, writer
    )
    samples = harness.sample_tokens(64)
    state = TrainState()
    valid = harness.data_iterator(args, samples[32:])
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        loop.train(harness.data_iterator(args, samples[:32]), valid, state)
        evaluate_and_print_results("test", engine, valid, state, writer, test=True)
    writer.close()
    optimizer = engine.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "params": [p.detach().clone() for p in params],
        "moments": [
            (optimizer.state[p]["exp_avg"].clone(), optimizer.state[p]["exp_avg_sq"].clone())
            for p in params
        ],
        "state": state,
        "output": output.getvalue(),
    }


def _events(directory: str):  # noqa: ANN202 - an EventAccumulator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory)
    events.Reload()
    return events


@pytest.fixture(scope="module")
def runs(tmp_path_factory):  # noqa: ANN201
    """{'all': ..., 'defaults': ...}: each run's record, event reader and printed output."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results = {}
    try:
        for name, flags in (("all", ALL_FLAGS), ("defaults", DEFAULTS_OFF)):
            directory = str(tmp_path_factory.mktemp(name))
            record = _run_loop(flags, directory)
            record["events"] = _events(directory)
            results[name] = record
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return results


def _tags(events) -> set[str]:  # noqa: ANN001
    return set(events.Tags()["scalars"])


def test_each_flag_writes_megatrons_tags(runs):
    tags = _tags(runs["all"]["events"])
    assert ALWAYS | BY_DEFAULT | ONLY_WITH_FLAGS <= tags, sorted(
        (ALWAYS | BY_DEFAULT | ONLY_WITH_FLAGS) - tags
    )


def test_without_the_flags_their_tags_are_absent(runs):
    tags = _tags(runs["defaults"]["events"])
    assert ALWAYS <= tags, sorted(ALWAYS - tags)
    assert not tags & (BY_DEFAULT | ONLY_WITH_FLAGS), sorted(tags & (BY_DEFAULT | ONLY_WITH_FLAGS))


def test_vs_samples_and_tokens_use_the_consumed_counts_as_step(runs):
    events = runs["all"]["events"]
    iterations = list(range(1, ITERATIONS + 1))
    loss = events.Scalars("lm-loss-training/lm loss")
    by_tokens = events.Scalars("lm-loss-training/lm loss vs tokens")
    by_samples = events.Scalars("lm-loss-training/lm loss vs samples")
    assert [e.step for e in loss] == iterations
    assert [e.step for e in by_tokens] == [i * TOKENS_PER_ITERATION for i in iterations]
    assert [e.step for e in by_samples] == [i * harness.GLOBAL_BATCH for i in iterations]
    assert [e.value for e in by_tokens] == [e.value for e in loss]
    # Megatron's y=tokens,x=steps curve carries the same counts as values.
    tokens = events.Scalars("steps-vs-tokens/y=tokens,x=steps")
    assert [e.value for e in tokens] == [i * TOKENS_PER_ITERATION for i in iterations]
    # Validation (iterations 2 and 4, then the test set at 4) against the training counts.
    validation = events.Scalars("lm-loss-validation/lm loss validation vs tokens")
    assert [e.step for e in validation] == [2 * TOKENS_PER_ITERATION, 4 * TOKENS_PER_ITERATION]
    test = events.Scalars("lm-loss-validation/lm loss test vs samples")
    assert [e.step for e in test] == [ITERATIONS * harness.GLOBAL_BATCH]
    state = runs["all"]["state"]
    assert state.consumed_train_tokens == ITERATIONS * TOKENS_PER_ITERATION


def test_batch_size_world_size_and_loss_scale_values(runs):
    events = runs["all"]["events"]
    assert {e.value for e in events.Scalars("batch-size/batch-size")} == {harness.GLOBAL_BATCH}
    assert {e.value for e in events.Scalars("world-size/world-size vs tokens")} == {1.0}
    # fp16 on the plain path: the dynamic loss scale (2^32 at the start, as DeepSpeed's).
    scales = [e.value for e in events.Scalars("loss-scale/loss-scale")]
    assert len(scales) == ITERATIONS and all(s >= 1.0 for s in scales)


def test_validation_ppl_is_exp_of_the_loss(runs):
    events = runs["all"]["events"]
    for data in ("validation", "test"):
        for suffix in ("", " vs samples", " vs tokens"):
            loss = events.Scalars(f"lm-loss-validation/lm loss {data}{suffix}")
            ppl = events.Scalars(f"lm-loss-validation/lm loss {data} ppl{suffix}")
            assert [e.step for e in ppl] == [e.step for e in loss]
            for loss_event, ppl_event in zip(loss, ppl, strict=True):
                assert ppl_event.value == pytest.approx(math.exp(loss_event.value), rel=1e-5)


def _direct_optimizer_stats(params: list, moments: list) -> dict[str, float]:
    """The optimizer/* values from the AdamW state by hand, in float64."""
    momentum = [m.double() for m, _ in moments]
    variance = [v.double() for _, v in moments]
    weights = [p.double() for p in params]
    values = {}
    for kind, tensors in (
        ("variance", variance),
        ("variance_sqrt", [v.sqrt() for v in variance]),
        ("momentum", momentum),
        ("weight", weights),
    ):
        values[f"optimizer/{kind}_l2"] = math.sqrt(sum(t.square().sum().item() for t in tensors))
        values[f"optimizer/{kind}_l1"] = sum(t.abs().sum().item() for t in tensors)
        values[f"optimizer/{kind}_abs_max"] = max(t.abs().max().item() for t in tensors)
    return values


def test_optimizer_state_norms_equal_the_adamw_state(runs):
    run = runs["all"]
    events = run["events"]
    expected = _direct_optimizer_stats(run["params"], run["moments"])
    for tag, value in expected.items():
        # The last write (iteration 4) saw the final state.
        [*_, last] = events.Scalars(tag)
        [*_, last_by_tokens] = events.Scalars(f"{tag} vs tokens")
        assert last.step == ITERATIONS and last_by_tokens.step == run["state"].consumed_train_tokens
        assert last.value == pytest.approx(value, rel=1e-5), tag
        assert last_by_tokens.value == last.value


def test_params_norm_is_written_and_printed(runs):
    run = runs["all"]
    norm = math.sqrt(sum(p.double().square().sum().item() for p in run["params"]))
    [*_, last] = run["events"].Scalars("params-norm/params-norm")
    assert last.step == ITERATIONS and last.value == pytest.approx(norm, rel=1e-6)
    lines = [line for line in run["output"].splitlines() if line.startswith(" iteration")]
    assert [parse_iteration_log(line)["params norm"] for line in lines][-1] == round(norm, 3)
    assert all("params norm" not in line for line in runs["defaults"]["output"].splitlines())


def test_timers_are_written_as_name_time(runs):
    events = runs["all"]["events"]
    for name in ("forward-backward", "optimizer", "train-step"):
        times = events.Scalars(f"{name}-time")
        assert [e.step for e in times] == list(range(1, ITERATIONS + 1))
        assert all(e.value > 0.0 for e in times)


def test_params_norm_in_the_iteration_line_at_megatrons_place():
    stats = IterationStats(
        iteration=10,
        train_iters=100,
        consumed_samples=40,
        consumed_tokens=40 * 1024,
        elapsed_ms_per_iteration=12.5,
        learning_rate=1e-4,
        global_batch_size=4,
        losses={"lm loss": 3.5},
        loss_scale=1024.0,
        grad_norm=1.25,
        actual_seqlen=1024,
        skipped_iterations=0,
        nan_iterations=0,
        samples_per_second=2.0,
        tokens_per_gpu_per_second=2048.0,
        tflops=0.5,
        params_norm=123.4567,
    )
    line = format_iteration_log(stats)
    # Megatron-DeepSpeed training_log(): grad norm, [num zeros], params norm, actual seqlen.
    reference = " grad norm: {:.3f} |".format(1.25)
    reference += " params norm: {:.3f} |".format(123.4567)
    reference += " actual seqlen: {:5d} |".format(1024)
    assert reference in line
    assert parse_iteration_log(line)["params norm"] == 123.457
    stats.params_norm = None
    assert "params norm" not in format_iteration_log(stats)


class _Recorder:
    """A writer that keeps (tag, value, step) in order."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, name: str, value: float, step: int, x_axis: str | None = None) -> None:
        self.scalars.append((name, value, step))

    def add_scalars(self, values: dict, step: int, x_axis: str | None = None) -> None:
        for name, value in values.items():
            self.add_scalar(name, value, step)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_loss_scale_only_under_fp16(precision):
    args = argparse.Namespace(
        fp16=precision == "fp16",
        log_learning_rate_to_tensorboard=True,
        log_batch_size_to_tensorboard=False,
        log_loss_scale_to_tensorboard=True,
        log_world_size_to_tensorboard=False,
        log_memory_to_tensorboard=False,
        seq_length=8,
    )
    recorder = _Recorder()
    state = TrainState(iteration=3, consumed_train_samples=12, consumed_train_tokens=96)
    result = StepResult({"lm loss": 2.0}, False, False, None, 4096.0)
    write_training_scalars(recorder, args, state, result, 1e-3, 4, None)
    tags = {name for name, _, _ in recorder.scalars}
    assert ("loss-scale/loss-scale vs tokens" in tags) == (precision == "fp16")
    assert ("learning-rate/learning-rate vs tokens", 1e-3, 96) in recorder.scalars
    assert not any(tag.startswith(("grad-norm", "params-norm")) for tag in tags)


def test_memory_tags_are_megatrons_on_cuda(monkeypatch):
    stats = {
        "reserved_bytes.all.current": 4096,
        "allocated_bytes.all.current": 1024,
        "allocation.all.current": 7,
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    assert memory_scalars() == {
        "mem-reserved-bytes": 4096.0,
        "mem-allocated-bytes": 1024.0,
        "mem-allocated-count": 7.0,
    }


class _FakeWandbRun:
    def __init__(self) -> None:
        self.defined: list[tuple[str, str | None]] = []
        self.logged: list[tuple[dict, int]] = []

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.defined.append((name, step_metric))

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))


def test_wandb_plots_vs_tokens_against_a_tokens_axis():
    """As Megatron's interop logger: W&B's step stays the iteration, tokens are an axis."""
    writer = MetricsWriter(None, None)
    run = writer._wandb_run = _FakeWandbRun()
    state = TrainState(iteration=2, consumed_train_samples=8, consumed_train_tokens=128)
    from megatron.training.training_log import add_scalar_vs

    add_scalar_vs(writer, "grad-norm/grad-norm", 0.5, state)
    writer.add_scalar("lm-loss-training/lm loss", 3.0, 3)  # the next iteration still logs
    assert run.logged == [
        ({"grad-norm/grad-norm": 0.5}, 2),
        ({"grad-norm/grad-norm vs samples": 0.5, "Samples": 8.0}, 2),
        ({"grad-norm/grad-norm vs tokens": 0.5, "Tokens": 128.0}, 2),
        ({"lm-loss-training/lm loss": 3.0}, 3),
    ]
    assert ("grad-norm/grad-norm vs tokens", "Tokens") in run.defined
    assert ("Tokens", None) in run.defined


# --- two gloo ranks: the reductions --------------------------------------------------------


def _reductions(rank: int, world_size: int, dense: dict, out: str) -> None:
    """Spawned body (never asserts): TP=2 params norm; partitioned optimizer-state stats."""
    parallel_state.initialize_model_parallel(2, 1)
    model = GPTModel(harness.model_config())
    unset = harness.load_dense(model, dense, pipeline=False)
    tp_norm = params_l2_norm(model.parameters())
    # DP=2, each rank's AdamW holding half of the same tensors (as a ZeRO partition would).
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(5)
    tensors = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 7, 11)]
    mine = torch.optim.AdamW(tensors[rank::2], lr=0.1)
    everything = torch.optim.AdamW(
        [torch.nn.Parameter(t.detach().clone()) for t in tensors], lr=0.1
    )
    for optimizer in (mine, everything):
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.linspace(-1.0, 2.0, param.numel())
        optimizer.step()
    partitioned = optimizer_state_stats(mine, partitioned=True)
    whole = optimizer_state_stats(everything, partitioned=False)
    result = {"tp_norm": tp_norm, "unset": unset, "partitioned": partitioned, "whole": whole}
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as file:
        json.dump(result, file)


def test_reductions_across_two_ranks(tmp_path):
    dense = harness.dense_state_dict()
    run_distributed(_reductions, 2, dense, str(tmp_path))
    # The dense model's weights, each once (the output layer is the word embedding itself).
    expected = float(np.sqrt(sum(t.double().square().sum().item() for t in dense.values())))
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json", encoding="utf-8") as file:
            result = json.load(file)
        assert result["unset"] == []
        assert result["tp_norm"] == pytest.approx(expected, rel=1e-6)
        assert result["partitioned"] == pytest.approx(result["whole"], rel=1e-6)


def test_norms_sum_in_float64():
    """A float32 sum over millions of elements drifts by ~1e-4 on CPU; ours must not."""
    weight = torch.nn.Parameter(torch.randn(3_000_000, generator=torch.Generator().manual_seed(3)))
    expected = weight.detach().double().square().sum().sqrt().item()
    assert params_l2_norm([weight]) == pytest.approx(expected, rel=1e-12)
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    stats = optimizer_state_stats(optimizer, partitioned=False)
    expected = weight.detach().double().square().sum().sqrt().item()
    assert stats["optimizer/weight_l2"] == pytest.approx(expected, rel=1e-12)
