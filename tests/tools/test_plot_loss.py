"""tools/plot_loss.py: loss curves from Megatron log lines, as pretrain_gpt.py prints them."""

from __future__ import annotations

import math

from megatron.training.monitor import format_validation_block
from tests.one_line_errors import assert_one_line_error, file_under_a_file, snapshot
from tools.plot_loss import main, read_loss_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def iteration_line(iteration: int, total: int, loss: float) -> str:
    """An iteration line in Megatron's format (fields trimmed to the ones a parser needs)."""
    return (
        f" iteration {iteration:8d}/{total:8d} | consumed samples: {iteration * 16:12d} | "
        f"elapsed time per iteration (ms): 3256.1 | learning rate: 1.000E-04 | "
        f"global batch size:    16 | lm loss: {loss:.6E} | loss scale: 1.0 |\n"
    )


def validation_lines(iteration: int, loss: float) -> str:
    """The three validation lines Megatron prints after an evaluation."""
    return format_validation_block(f"iteration {iteration}", {"lm loss": loss}) + "\n"


def test_curves_plot_and_summary(tmp_path, capsys):
    first = tmp_path / "first.log"
    first.write_text(
        "[2026-11-22 09:00:00] some DeepSpeed start-up line\n"
        + "".join(iteration_line(i, 20, 10.0 - i / 4) for i in range(1, 11))
        + validation_lines(10, 7.5)
        + "[default0]:"
        + iteration_line(11, 20, 99.0),  # lost in the crash: the resumed run redoes it
        encoding="utf-8",
    )
    resumed = tmp_path / "resumed.log"
    resumed.write_text(
        "".join(iteration_line(i, 20, 10.0 - i / 4) for i in range(11, 21))
        + validation_lines(20, 5.25)
        + format_validation_block("the end of training for val data", {"lm loss": 5.0}),
        encoding="utf-8",
    )
    output = tmp_path / "loss.png"
    assert main(["--log", str(first), str(resumed), "--output", str(output)]) == 0
    assert output.read_bytes().startswith(PNG_MAGIC)
    assert not list(tmp_path.glob("*.partial*"))
    out = capsys.readouterr().out
    assert "training loss: 9.750 at iteration 1 -> 5.000 at iteration 20" in out
    assert "validation loss: 7.500 at iteration 10 -> 5.250 at iteration 20" in out

    curves = read_loss_curves([str(first), str(resumed)])
    assert sorted(curves.train) == list(range(1, 21))
    assert math.isclose(curves.train[11], 7.25)  # the resumed run's line replaced the lost one
    assert curves.validation == {10: 7.5, 20: 5.25}


def test_a_log_without_losses_is_a_one_line_error(tmp_path, capsys):
    log = tmp_path / "empty.log"
    log.write_text("nothing to see\n", encoding="utf-8")
    assert main(["--log", str(log), "--output", str(tmp_path / "x.png")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: no iteration lines") and error.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


def test_a_missing_log_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "missing.log"
    assert main(["--log", str(missing), "--output", str(tmp_path / "x.png")]) == 1
    error = capsys.readouterr().err
    assert error == f"error: cannot read log {missing}: No such file or directory\n"


def test_an_unwritable_output_is_one_line_and_an_earlier_plot_stays(tmp_path, capsys):
    """--output under a file, or a folder: one `error:` line naming --output; nothing changes."""
    log, empty = tmp_path / "train.log", tmp_path / "empty.log"
    log.write_text("".join(iteration_line(i, 2, 5.0) for i in (1, 2)), encoding="utf-8")
    empty.write_text("nothing\n")
    earlier = tmp_path / "loss.png"
    earlier.write_bytes(PNG_MAGIC + b"an earlier plot")
    blocked = file_under_a_file(tmp_path)
    before = snapshot(tmp_path)
    for output, named in ((blocked, f"--output {blocked}"), (tmp_path, f"--output {tmp_path}")):
        code = main(["--log", str(log), "--output", str(output)])
        assert_one_line_error(code, capsys.readouterr().err, named)
    # A log with no losses: the earlier plot under --output is left as it was.
    code = main(["--log", str(empty), "--output", str(earlier)])
    assert_one_line_error(code, capsys.readouterr().err, str(empty))
    assert snapshot(tmp_path) == before
