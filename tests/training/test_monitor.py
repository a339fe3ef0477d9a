"""Tests for megatron/training/monitor.py: Megatron's log lines, timers, memory, metric writers."""

# The reference lines below keep Megatron-DeepSpeed's own str.format() calls, verbatim.
# ruff: noqa: UP032

from __future__ import annotations

import glob
import math
import os
import re
import sys
import time

import pytest
import torch

from megatron.training import monitor
from megatron.training.monitor import (
    IterationStats,
    MetricsWriter,
    Timers,
    format_iteration_log,
    format_validation_block,
    memory_report,
    parse_iteration_log,
    parse_validation_line,
)
from tests.distributed import run_distributed

MB = 1024.0 * 1024.0


def _stats(**overrides) -> IterationStats:
    values = dict(
        iteration=100,
        train_iters=1000,
        consumed_samples=3200,
        consumed_tokens=3200 * 1024,
        elapsed_ms_per_iteration=1234.5678,
        learning_rate=6.0e-4,
        global_batch_size=32,
        losses={"lm loss": 3.2087654},
        loss_scale=65536.0,
        grad_norm=1.23456,
        actual_seqlen=1024,
        skipped_iterations=0,
        nan_iterations=0,
        samples_per_second=25.921,
        tokens_per_gpu_per_second=13271.5,
        tflops=123.456,
        eta_seconds=3723.0,
    )
    values.update(overrides)
    return IterationStats(**values)


CASES = {
    "typical": _stats(),
    "large": _stats(
        iteration=12_345_678,
        train_iters=99_999_999,
        consumed_samples=395_061_696,
        consumed_tokens=809_086_353_408,
        global_batch_size=2048,
        eta_seconds=30 * 3600 + 5,
        tflops=0.004,
    ),
    "tiny lr, no scale, no norm, no eta": _stats(
        learning_rate=1.5e-12, loss_scale=None, grad_norm=None, eta_seconds=None
    ),
    "two losses, skipped, nan": _stats(
        losses={"lm loss": 10.9, "moe loss": 0.0123},
        skipped_iterations=3,
        nan_iterations=1,
        loss_scale=1.0,
        eta_seconds=0.0,
    ),
}


def _megatron_reference(stats: IterationStats) -> str:
    """The line built with Megatron's own format calls.

    Copied from microsoft/Megatron-DeepSpeed megatron/training.py, training_log()
    (commit 00caa0e9c4ba0f7848d54610157f455d054ab2e6), with its variables renamed to ours.
    """
    log_string = " iteration {:8d}/{:8d} |".format(stats.iteration, stats.train_iters)
    log_string += " consumed samples: {:12d} |".format(stats.consumed_samples)
    log_string += " consumed tokens: {:12d} |".format(stats.consumed_tokens)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(
        stats.elapsed_ms_per_iteration
    )
    log_string += " learning rate: {:.3E} |".format(stats.learning_rate)
    log_string += " global batch size: {:5d} |".format(stats.global_batch_size)
    for key, avg in stats.losses.items():
        if avg > 0.0:
            log_string += " {}: {:.6E} |".format(key, avg)
    if stats.loss_scale is not None:
        log_string += " loss scale: {:.1f} |".format(stats.loss_scale)
    if stats.grad_norm is not None:
        log_string += " grad norm: {:.3f} |".format(stats.grad_norm)
    log_string += " actual seqlen: {:5d} |".format(stats.actual_seqlen)
    log_string += " number of skipped iterations: {:3d} |".format(stats.skipped_iterations)
    log_string += " number of nan iterations: {:3d} |".format(stats.nan_iterations)
    log_string += " samples per second: {:.3f} |".format(stats.samples_per_second)
    log_string += " tokens per gpu per second (tgs): {:.3f} |".format(
        stats.tokens_per_gpu_per_second
    )
    log_string += " TFLOPs: {:.2f} |".format(stats.tflops)
    return log_string


@pytest.mark.parametrize("case", CASES)
def test_iteration_line_is_megatron_line_then_extras(case):
    stats = CASES[case]
    line = format_iteration_log(stats)
    reference = _megatron_reference(stats)
    assert line.startswith(reference)
    extras = f" progress: {100 * stats.iteration / stats.train_iters:.1f}% |"
    if stats.eta_seconds is not None:
        extras += " ETA: " + re.search(r"ETA: (\S+) \|", line).group(1) + " |"
    assert line == reference + extras


@pytest.mark.parametrize("case", CASES)
def test_iteration_line_round_trip(case):
    stats = CASES[case]
    fields = parse_iteration_log(format_iteration_log(stats))
    expected = {
        "iteration": stats.iteration,
        "train iters": stats.train_iters,
        "consumed samples": stats.consumed_samples,
        "consumed tokens": stats.consumed_tokens,
        "elapsed time per iteration (ms)": round(stats.elapsed_ms_per_iteration, 1),
        "learning rate": float(f"{stats.learning_rate:.3E}"),
        "global batch size": stats.global_batch_size,
        **{k: float(f"{v:.6E}") for k, v in stats.losses.items() if v > 0},
        "actual seqlen": stats.actual_seqlen,
        "number of skipped iterations": stats.skipped_iterations,
        "number of nan iterations": stats.nan_iterations,
        "samples per second": round(stats.samples_per_second, 3),
        "tokens per gpu per second (tgs)": round(stats.tokens_per_gpu_per_second, 3),
        "TFLOPs": round(stats.tflops, 2),
        "progress": round(100 * stats.iteration / stats.train_iters, 1),
    }
    if stats.loss_scale is not None:
        expected["loss scale"] = stats.loss_scale
    if stats.grad_norm is not None:
        expected["grad norm"] = round(stats.grad_norm, 3)
    if stats.eta_seconds is not None:
        seconds = int(stats.eta_seconds)
        expected["ETA"] = f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    assert fields.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, str):
            assert fields[name] == value
        else:
            assert fields[name] == pytest.approx(value, rel=1e-12), name
        # Integer fields come back as int, the rest as float.
        assert isinstance(fields[name], type(value)), name


def test_iteration_line_optional_fields():
    line = format_iteration_log(CASES["tiny lr, no scale, no norm, no eta"])
    assert "loss scale" not in line and "grad norm" not in line and "ETA" not in line
    assert " learning rate: 1.500E-12 |" in line
    large = format_iteration_log(CASES["large"])
    assert large.startswith(" iteration 12345678/99999999 | consumed samples:    395061696 |")
    assert large.endswith(" progress: 12.3% | ETA: 30:00:05 |")
    assert format_iteration_log(_stats(eta_seconds=3723.4)).endswith(" ETA: 1:02:03 |")
    # Megatron prints only positive loss averages.
    assert "lm loss" not in format_iteration_log(_stats(losses={"lm loss": float("nan")}))


def test_parse_iteration_line_with_launcher_prefix():
    line = "[default7]:" + format_iteration_log(_stats()) + "\n"
    assert parse_iteration_log(line)["iteration"] == 100


@pytest.mark.parametrize(
    "line",
    [
        "",
        "training ...",
        " iteration 5 | lm loss: 3.0 |",
        " validation loss at iteration 100 | lm loss value: 3.2E+00 | lm loss PPL: 2.4E+01 | ",
        "-" * 40,
        "Evaluating iter 10/100",
        " iteration        1/      10 | garbage without colon |",
    ],
)
def test_parse_iteration_rejects_other_lines(line):
    with pytest.raises(ValueError):
        parse_iteration_log(line)


def test_validation_block():
    block = format_validation_block("iteration 100", {"lm loss": 3.25})
    dashes, middle, dashes_again = block.split("\n")
    # evaluate_and_print_results() in Megatron-DeepSpeed megatron/training.py.
    string = " validation loss at {} | ".format("iteration 100")
    string += "{} value: {:.6E} | ".format("lm loss", 3.25)
    string += "{} PPL: {:.6E} | ".format("lm loss", math.exp(min(20, 3.25)))
    assert middle == string
    assert dashes == dashes_again == "-" * (len(string) + 1)
    assert middle == (
        " validation loss at iteration 100 | lm loss value: 3.250000E+00 | "
        "lm loss PPL: 2.579034E+01 | "
    )
    assert parse_validation_line(middle) == {
        "lm loss value": 3.25,
        "lm loss PPL": float(f"{math.exp(3.25):.6E}"),
        "iteration": 100,
    }


def test_validation_ppl_is_capped_and_labels_pass_through():
    label = "the end of training for val data"
    middle = format_validation_block(label, {"lm loss": 45.0})
    values = parse_validation_line(middle.split("\n")[1])
    assert values == {"lm loss value": 45.0, "lm loss PPL": float(f"{math.exp(20):.6E}")}
    with pytest.raises(ValueError):
        parse_validation_line(format_iteration_log(_stats()))
    with pytest.raises(ValueError):
        parse_validation_line(middle.split("\n")[0])


def test_memory_report_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pattern = r"\[Rank 3\] \(after 10 iterations\) memory \(MB\) \| rss: (\S+) \| max rss: (\S+)"
    report = memory_report("10 iterations", 3)
    rss, max_rss = map(float, re.fullmatch(pattern, report).groups())
    assert 0 < rss <= max_rss
    # Without psutil getrusage gives the peak only, shown for both.
    monkeypatch.setitem(sys.modules, "psutil", None)
    rss, max_rss = map(float, re.fullmatch(pattern, memory_report("10 iterations", 3)).groups())
    assert 0 < rss == max_rss


def test_memory_report_on_cuda_is_megatrons_line(monkeypatch):
    for name, megabytes in [
        ("is_available", True),
        ("memory_allocated", 2.5),
        ("max_memory_allocated", 3.0),
        ("memory_reserved", 4.0),
        ("max_memory_reserved", 5.0),
    ]:
        value = megabytes if isinstance(megabytes, bool) else int(megabytes * MB)
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    assert memory_report("10 iterations", 0) == (
        "[Rank 0] (after 10 iterations) memory (MB) | allocated: 2.5 | max allocated: 3.0 "
        "| reserved: 4.0 | max reserved: 5.0"
    )


def test_timer_elapsed_of_sleep():
    timers = Timers(log_level=2)
    timer = timers("sleep", log_level=0)
    timer.start()
    time.sleep(0.05)
    timer.stop()
    assert 0.045 <= timer.elapsed(reset=False) < 1.0
    # A running timer counts its current span and keeps running.
    timer.start()
    time.sleep(0.02)
    running = timer.elapsed(reset=True)
    assert 0.065 <= running < 1.5
    assert timer.elapsed() < running
    timer.stop()
    assert timer.active_time() >= 0.065
    assert timers("sleep") is timer
    timer.start()
    with pytest.raises(RuntimeError, match="already been started"):
        timer.start()
    with pytest.raises(ValueError, match="log level 0"):
        timers("sleep", log_level=1)


def test_timers_above_log_level_are_no_ops():
    timers = Timers(log_level=0)
    skipped = timers("forward-backward", log_level=1)
    skipped.start()
    skipped.stop()
    # As Megatron: a later call without a level stays a no-op (new timers default to level 2).
    assert timers("forward-backward") is skipped
    timers("forward-backward").stop()
    with pytest.raises(RuntimeError):
        skipped.elapsed()
    assert timers.log(["forward-backward", "missing"]) is None
    with pytest.raises(ValueError, match="--timing-log-option"):
        Timers(0, "median")


def _timed(timers: Timers, name: str, seconds: float) -> None:
    timers(name, log_level=0).start()
    time.sleep(seconds)
    timers(name).stop()


LINE = r"\n    {} \.+: \((\d+\.\d\d), (\d+\.\d\d)\)"


def test_timers_log_format_one_rank():
    timers = Timers(log_level=0)
    _timed(timers, "optimizer", 0.02)
    _timed(timers, "forward-backward", 0.04)
    string = timers.log(["forward-backward", "missing", "optimizer"], normalizer=2.0)
    match = re.fullmatch(
        r"\(min, max\) time across ranks \(ms\):"
        + LINE.format("forward-backward")
        + LINE.format("optimizer"),
        string,
    )
    assert match, string
    low, high = float(match.group(1)), float(match.group(2))
    assert low == high and 19.0 <= low < 500  # 40 ms over normalizer 2
    # Megatron pads 'name ' with dots to 48 characters.
    first = string.split("\n")[1]
    assert first[4:52] == "forward-backward ".ljust(48, ".") and first[52:55] == ": ("
    # reset=True cleared them: nothing left to report.
    assert timers.log(["forward-backward", "optimizer"]) is None

    for option, pattern in [
        ("max", r"\(min, max\) time across ranks \(ms\):\n    optimizer \.+: \d+\.\d\d"),
        ("all", r"times across ranks \(ms\):\n  optimizer:\n     rank  0: \d+\.\d\d"),
    ]:
        timers = Timers(log_level=0, log_option=option)
        _timed(timers, "optimizer", 0.01)
        assert re.fullmatch(pattern, timers.log(["optimizer"]))


def _timers_across_ranks(rank: int, world_size: int) -> None:
    timers = Timers(log_level=0)
    _timed(timers, "step", 0.05 * (rank + 1))
    if rank == 1:
        _timed(timers, "only-rank-1", 0.01)
    string = timers.log(["step", "only-rank-1"], reset=False, barrier=True)
    match = re.fullmatch(
        r"\(min, max\) time across ranks \(ms\):"
        + LINE.format("step")
        + LINE.format("only-rank-1"),
        string,
    )
    assert match, string
    low, high, only_low, only_high = map(float, match.groups())
    assert 45.0 <= low <= high and high >= 95.0 and low < high
    assert only_low == only_high  # the rank without the timer is left out
    timers.log_option = "all"
    string = timers.log(["step"], reset=False)
    assert re.fullmatch(r"times across ranks \(ms\):\n  step:(\n     rank  [01]: \S+){2}", string)

    class Recorder:
        def __init__(self) -> None:
            self.scalars = []

        def add_scalar(self, name, value, step):
            self.scalars.append((name, value, step))

    writer = Recorder() if rank == world_size - 1 else None
    timers.write(["step"], writer, iteration=7, normalizer=1.0)
    if writer is not None:
        [(name, value, step)] = writer.scalars
        assert name == "step-time" and step == 7 and value == pytest.approx(high / 1000, abs=1e-5)


def test_timers_minmax_across_two_gloo_ranks():
    run_distributed(_timers_across_ranks, 2)


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(str(tmp_path), None, queue_size=5)
    assert writer.enabled
    for step in (1, 2, 3):
        writer.add_scalar("lm-loss-training/lm loss", 10.0 / step, step)
    writer.add_scalars({"learning-rate/learning-rate": 1e-4, "grad-norm/grad-norm": 2.5}, 3)
    writer.add_text("args", "--num-layers 2")
    writer.flush()
    writer.close()
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    loss = events.Scalars("lm-loss-training/lm loss")
    assert [(e.step, e.value) for e in loss] == [(1, 10.0), (2, 5.0), (3, pytest.approx(10 / 3))]
    assert [(e.step, e.value) for e in events.Scalars("grad-norm/grad-norm")] == [(3, 2.5)]
    assert events.Scalars("learning-rate/learning-rate")[0].value == pytest.approx(1e-4)
    assert "args/text_summary" in events.Tags()["tensors"]


def test_wandb_offline_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")  # installed by the [test] extra; absent on bare GPU images
    # No credentials and no WANDB_MODE: the writer must pick offline mode by itself.
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name in ("WANDB_SILENT", "WANDB_DISABLE_GIT", "WANDB_DISABLE_CODE"):
        monkeypatch.setenv(name, "true")
    save_dir = tmp_path / "runs"
    writer = MetricsWriter(
        None,
        "monitor-test",
        "offline-check",
        str(save_dir),
        config={"seed": 1234, "params_dtype": torch.float16},
    )
    try:
        assert writer.enabled
        writer.add_scalar("lm-loss-training/lm loss", 2.75, 5)
        writer.add_scalars({"grad-norm/grad-norm": 0.625}, 6)
        writer.add_scalar("lm-loss-training/lm loss vs samples", 2.75, 2)  # step went back
        writer.add_text("note", "hello")
    finally:
        writer.close()
    writer.close()  # a second close does nothing
    out = capsys.readouterr().out
    [run_dir] = glob.glob(str(save_dir / "wandb" / "offline-run-*"))
    assert f"wandb sync {run_dir}" in out
    assert out.count("wandb: skipping") == 1
    [record_file] = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    # wandb's service process may still be writing the file after finish() returns (seen on a
    # loaded machine: only the header was there); wait for the last history record.
    deadline = time.monotonic() + 60
    records = open(record_file, "rb").read()
    while b"grad-norm/grad-norm" not in records and time.monotonic() < deadline:
        time.sleep(0.2)
        records = open(record_file, "rb").read()
    # There is no public reader for .wandb files; history keys are protobuf strings (tag
    # 0x12, length, bytes) followed by the JSON value (tag 0x82 0x01, length, text). The skip
    # notice is in the file too, as captured console output, hence the exact encoding.

    def history_item(key: bytes, value: bytes) -> bytes:
        return b"\x12" + bytes([len(key)]) + key + b"\x82\x01" + bytes([len(value)]) + value

    assert history_item(b"lm-loss-training/lm loss", b"2.75") in records
    assert history_item(b"grad-norm/grad-norm", b"0.625") in records
    assert b"\x12#lm-loss-training/lm loss vs samples" not in records
    assert b"seed" in records and b"1234" in records and b"torch.float16" in records


def test_wandb_credentials_and_online_without_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.com login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert not monitor._wandb_credentials_found()
    netrc_file.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert monitor._wandb_credentials_found()
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(RuntimeError, match="wandb login"):
        MetricsWriter(None, "monitor-test")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert monitor._wandb_credentials_found()


def test_missing_packages_name_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        MetricsWriter(str(tmp_path), None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match="pip install wandb"):
        MetricsWriter(None, "monitor-test")


def test_disabled_writer_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    writer = MetricsWriter(None, None)
    assert not writer.enabled
    writer.add_scalar("a", 1.0, 1)
    writer.add_scalars({"b": 2.0}, 2)
    writer.add_text("c", "text")
    writer.flush()
    writer.close()
    assert os.listdir(tmp_path) == []
