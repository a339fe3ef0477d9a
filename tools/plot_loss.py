"""Plot the training and validation loss of a run from its log (Megatron's log lines).

    python tools/plot_loss.py --log runs/quickstart/train.log --output runs/quickstart/loss.png

Reads the iteration lines (`iteration N/ M | ... | lm loss: X | ...`) and the validation lines
(`validation loss at iteration N | lm loss value: X | ...`) that `pretrain_gpt.py` prints, from
one or more logs in order (a resumed run's logs, or a log a resumed run appended to; a later
line for the same iteration replaces an earlier one), and draws both curves into a PNG with
matplotlib. Lines of any other kind, and launcher prefixes such as `[default0]:`, are ignored.
Prints the first and last losses. Needs `pip install matplotlib` (`pip install -e .[plot]`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.extensions import install_hint  # noqa: E402
from megatron.training.monitor import parse_iteration_log, parse_validation_line  # noqa: E402
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402

LOSS_KEY = "lm loss"


class LogError(ValueError):
    """A log that cannot be read or holds no loss; the message names it."""


@dataclasses.dataclass
class LossCurves:
    """Loss by iteration: `train` from the iteration lines, `validation` from evaluations."""

    train: dict[int, float] = dataclasses.field(default_factory=dict)
    validation: dict[int, float] = dataclasses.field(default_factory=dict)


def read_loss_curves(paths: list[str]) -> LossCurves:
    """The losses logged in `paths`, read in order; LogError names a log that cannot be read."""
    curves = LossCurves()
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as log:
                for line in log:
                    if "iteration" not in line:
                        continue
                    _read_line(line, curves)
        except OSError as error:
            raise LogError(f"cannot read log {path}: {error.strerror}") from error
    return curves


def _read_line(line: str, curves: LossCurves) -> None:
    """Add the loss on `line`, if it is an iteration or validation line that carries one."""
    try:
        fields = parse_iteration_log(line)
    except ValueError:
        pass
    else:
        if isinstance(fields.get(LOSS_KEY), float):
            curves.train[int(fields["iteration"])] = float(fields[LOSS_KEY])
        return
    try:
        values = parse_validation_line(line)
    except ValueError:
        return
    if "iteration" in values and f"{LOSS_KEY} value" in values:
        curves.validation[int(values["iteration"])] = values[f"{LOSS_KEY} value"]


def plot_loss_curves(curves: LossCurves, output: str, title: str) -> None:
    """Draw both curves (log-scale loss) into the PNG `output`, written under a temporary name."""
    try:
        import matplotlib
    except ImportError:
        hint = install_hint("matplotlib", "plot")
        raise ImportError(f"plotting needs matplotlib: {hint}") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    train = sorted(curves.train.items())
    axes.plot([i for i, _ in train], [loss for _, loss in train], label="training (lm loss)")
    if curves.validation:
        validation = sorted(curves.validation.items())
        axes.plot(
            [i for i, _ in validation],
            [loss for _, loss in validation],
            "o-",
            label="validation (lm loss)",
        )
    axes.set_xlabel("iteration")
    axes.set_ylabel("loss (nats per token)")
    axes.set_yscale("log")  # the early drop and the late progress both stay visible
    for axis in (axes.yaxis.set_major_formatter, axes.yaxis.set_minor_formatter):
        axis(FormatStrFormatter("%g"))  # 4, 6, 10 rather than 4x10^0
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    temporary = f"{output}.partial-{os.getpid()}.png"
    try:
        figure.savefig(temporary)
        os.replace(temporary, output)
    finally:
        plt.close(figure)
        if os.path.exists(temporary):  # a failed write leaves no partial file behind
            os.remove(temporary)


def summary(curves: LossCurves) -> str:
    """One line per curve: first and last iteration and loss."""
    lines = []
    for name, curve in (("training", curves.train), ("validation", curves.validation)):
        if curve:
            first, last = min(curve), max(curve)
            lines.append(
                f"{name} loss: {curve[first]:.3f} at iteration {first} -> "
                f"{curve[last]:.3f} at iteration {last}"
            )
    return "\n".join(lines)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--log", nargs="+", required=True, help="Training logs, oldest first.")
    parser.add_argument("--output", required=True, help="PNG file to write.")
    parser.add_argument("--title", default="GPT-2 pretraining loss", help="Plot title.")
    args = parser.parse_args(argv)
    if os.path.isdir(args.output):
        parser.error(f"--output {args.output} is a folder; give the PNG file to write")
    check_output_path(args.output, "--output")
    return args


def plot(argv: list[str] | None) -> int:
    """Read the logs, write the plot, print the summary; raises on bad input."""
    args = get_args(argv)
    curves = read_loss_curves(args.log)
    if not curves.train:
        raise LogError(f"no iteration lines with an lm loss in {' '.join(args.log)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    plot_loss_curves(curves, args.output, args.title)
    print(summary(curves))
    print(f"loss curves written to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error on bad input."""
    return run_tool(lambda: plot(argv), (LogError, ImportError))


if __name__ == "__main__":
    sys.exit(main())
