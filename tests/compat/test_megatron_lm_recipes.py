"""Megatron-LM's current recipes (tests/compat/megatron_lm/*.json): how far they get today.

Megatron-LM's Llama-3 8B recipe (`examples/llama/train_llama3_8b_h100_fp8.sh` as written:
FP8 hybrid with the delayed recipe's amax settings, which run as tensorwise scaling here and
say so) passes `--context-parallel-size`. Some of its other flags are built by a later issue
(Megatron-LM's training and data flags): `LATER` names each with its issue, and the first
test checks that each is still refused in one line (unknown to the parser, or refused by
validation), so the list must shrink as they land. Without them the command line validates
at its world size, and, scaled to a tiny model on CPU, runs through torchrun at CP=2: the
loss falls, the log lines parse, and a second
launch of the same command line resumes from the first one's checkpoint. Its DDP arguments
(`--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`,
`--grad-reduce-in-bf16`) run on torch FSDP2 (over the 2 context-parallel ranks there), and
its `--ckpt-format torch_dist` checkpoints through torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.dry_run import run_dry_run
from tests.compat.scripts import load_script, with_values
from tests.compat.test_script_runs import _iteration_lines, _launch
from tests.conftest import MERGE_FILE, VOCAB_FILE

RECIPE = os.path.join(
    os.path.dirname(__file__), "megatron_lm", "llama__train_llama3_8b_h100_fp8.json"
)
# Flags of the recipe that later issues build (issue 40: Megatron-LM's training, data and
# logging flags and recipes).
LATER: dict[str, int] = {}
# The recipe at a tiny size for 2 CPU ranks (its flags kept, values scaled).
TINY = {
    "--num-layers": ["2"],
    "--hidden-size": ["64"],
    "--ffn-hidden-size": ["224"],
    "--num-attention-heads": ["4"],
    "--num-query-groups": ["2"],
    "--kv-channels": ["16"],
    "--seq-length": ["64"],
    "--max-position-embeddings": ["64"],
    "--global-batch-size": ["4"],
    "--train-samples": ["24"],
    "--lr-decay-samples": ["24"],
    "--lr-warmup-samples": ["4"],
    "--lr": ["0.003"],
    "--min-lr": ["0.0003"],
    # The recipe's input and output layers learn 3.3x faster than the rest (5e-4 vs 1.5e-4).
    "--decoupled-lr": ["0.01"],
    "--decoupled-min-lr": ["0.001"],
    "--init-method-std": ["0.02"],
    "--eval-iters": ["1"],
    "--eval-interval": ["3"],
    "--save-interval": ["3"],
    "--context-parallel-size": ["2"],
    "--num-workers": ["0"],
}


def _without_later(argv: list[str], keep: str | None = None) -> list[str]:
    """`argv` without the `LATER` flags (and their values), but `keep`."""
    return with_values(argv, {flag: None for flag in LATER if flag != keep})


def _hf_gpt2_folder(path: str) -> str:
    """GPT-2's files as a Hugging Face tokenizer folder (what HuggingFaceTokenizer loads)."""
    os.makedirs(path, exist_ok=True)
    for ours, theirs in ((VOCAB_FILE, "vocab.json"), (MERGE_FILE, "merges.txt")):
        with open(ours) as source, open(os.path.join(path, theirs), "w") as out:
            out.write(source.read())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as config:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}, config)
    return path


def _localized(argv: list[str], dataset: str, scratch: str) -> list[str]:
    """Paths pointed at fixtures; --save and --load stay one folder, as in the recipe."""
    checkpoints = os.path.join(scratch, "checkpoints")
    return with_values(
        argv,
        {
            "--data-path": [dataset],
            "--tokenizer-model": [_hf_gpt2_folder(os.path.join(scratch, "tokenizer"))],
            "--data-cache-path": [os.path.join(scratch, "cache")],
            "--save": [checkpoints],
            "--load": [checkpoints],
            "--tensorboard-dir": [os.path.join(scratch, "tensorboard")],
        },
    )


def _validate(argv: list[str], world_size: int):
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_the_recipe_stops_only_at_flags_of_later_issues(stdlib_dataset: str, tmp_path) -> None:
    script = load_script(RECIPE)
    argv = _localized(script.argv, stdlib_dataset, str(tmp_path))
    args = _validate(_without_later(argv), script.world_size)
    assert args.context_parallel_size == 1 and args.layout.data_parallel == 8
    assert args.tokenizer_type == "HFTokenizer" and args.num_key_value_heads == 8
    assert (args.fp8, args.fp8_recipe, args.fp8_param_gather) == ("hybrid", "tensorwise", True)
    assert any("--fp8-amax-history-len, --fp8-amax-compute-algo" in n for n in args.compat_notes)
    printed = io.StringIO()  # as written (its data and tokenizer elsewhere): the 8-rank plan
    with contextlib.redirect_stdout(printed):
        run_dry_run(script.argv + ["--dry-run", "--dry-run-world-size", "8"])
    assert "dry run: 8 ranks = TP 1 x PP 1 x DP 8; plain FSDP2 optim_grads" in printed.getvalue()
    assert "FP8 matmuls hybrid tensorwise: 128 linear layers" in printed.getvalue()
    at_cp2 = _validate(_without_later(with_values(argv, {"--context-parallel-size": ["2"]})), 8)
    # Its DDP arguments: Megatron-LM's distributed optimizer, here on torch FSDP2.
    assert at_cp2.layout.describe() == "TP 1 x CP 2 x PP 1 x DP 4, bf16, FSDP2 optim_grads on plain"
    still_refused = []
    for flag in LATER:
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                _validate(_without_later(argv, keep=flag), script.world_size)
        except ArgumentError as refusal:
            assert flag in str(refusal) and "\n" not in str(refusal), str(refusal)
            still_refused.append(flag)
        except SystemExit:
            assert f"unrecognized arguments: {flag}" in errors.getvalue() or (
                f"argument {flag}" in errors.getvalue()
            ), errors.getvalue()
            still_refused.append(flag)
    built = sorted(set(LATER) - set(still_refused))
    assert not built, f"now accepted: remove from LATER and run the recipe with them: {built}"


@pytest.mark.slow
def test_scaled_recipe_runs_at_cp2_and_a_second_launch_resumes(
    stdlib_dataset: str, tmp_path
) -> None:
    script = load_script(RECIPE)
    argv = _without_later(_localized(with_values(script.argv, TINY), stdlib_dataset, str(tmp_path)))
    first = _launch("torchrun", argv + ["--exit-interval", "3"], ranks=2)
    assert first.returncode == 0, first.stdout[-4000:]
    layout = "TP 1 x CP 2 x PP 1 x DP 1, bf16, FSDP2 optim_grads on plain"
    assert layout in first.stdout, first.stdout[-4000:]
    # Its 2 layers' 4 linear layers each; the untied output layer stays in bf16.
    assert "FP8 matmuls: 8 of this rank's 9 tensor-parallel linear layers" in first.stdout
    logged = _iteration_lines(first.stdout)
    assert [log["iteration"] for log in logged] == [1, 2, 3]
    second = _launch("torchrun", argv, ranks=2)  # the same command line again
    assert second.returncode == 0, second.stdout[-4000:]
    assert "at iteration 3" in second.stdout, second.stdout[-4000:]
    assert os.path.isfile(os.path.join(str(tmp_path), "checkpoints", "iter_0000003", ".metadata"))
    resumed = _iteration_lines(second.stdout)
    assert [log["iteration"] for log in resumed] == [4, 5, 6]
    losses = [log["lm loss"] for log in logged + resumed]
    assert losses[-1] < losses[0] - 0.5, losses  # it trains
    assert all(log["consumed tokens"] == 4 * 64 * log["iteration"] for log in logged + resumed)
