"""Megatron-LM's other GPT example scripts (tests/compat/megatron_lm/, each with its source
path and commit) as a user runs them: each validates with `--dry-run` at the smallest world
that holds its layout, or stops in one line naming a feature not built here.

(The Llama-3, Mixtral, DeepSeek-V3 and gpt-oss recipes have their own modules: they validate
and train.)
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.dry_run import run_dry_run
from tests.compat.scripts import load_script, with_values

HERE = os.path.join(os.path.dirname(__file__), "megatron_lm")
# Script, the world it is validated at, and the words of its one-line refusal.
REFUSED = [
    # TP=8 x PP=16 needs 128 ranks. Megatron-LM refuses the schedule too: beside
    # --global-batch-size ("Cannot specify both"), and the script expands it unquoted.
    (
        "gpt3__train_gpt3_175b_distributed.json",
        128,
        ["--step-batch-size-schedule 0:16 2.4B:320", "Cannot specify both", "not built here"],
    ),
    (
        "megatron_fsdp__train_llama3_8b_fsdp_h100_fp8.json",
        8,
        ["--ckpt-format fsdp_dtensor", "not built here"],
    ),
    # DeepSeek-V3 on Megatron-FSDP: its multi-latent attention, multi-token prediction,
    # group-limited routing and --recompute-modules are built (issue 57); Megatron-FSDP's own
    # checkpoint format is not.
    (
        "megatron_fsdp__sbatch_mfsdp_deepseek_v3.json",
        8,
        ["--ckpt-format fsdp_dtensor", "not built here"],
    ),
]
FP8_FLAGS = (
    "--fp8-format",
    "--fp8-amax-history-len",
    "--fp8-amax-compute-algo",
    "--fp8-param-gather",
)


def _validate(argv: list[str], world_size: int):
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


@pytest.mark.parametrize("name, world_size, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_stops_in_one_line_naming_what_is_not_built(
    name: str, world_size: int, words: list[str]
) -> None:
    script = load_script(os.path.join(HERE, name))
    assert script.source.startswith("NVIDIA/Megatron-LM@")
    with pytest.raises(ArgumentError) as refused:
        _validate(script.argv + ["--dry-run"], world_size)
    message = str(refused.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_fsdp_recipe_on_mock_data_plans_with_fp8_at_8_ranks() -> None:
    """Without Megatron-FSDP's own checkpoint format, the Llama-3 8B FSDP recipe's mock data
    validates as Megatron-LM reads it (NullTokenizer's 128,256 ids padded to 128,256, --split
    not read) and plans at its 8 ranks, its FP8 flags on (tensorwise, said at start-up)."""
    script = load_script(os.path.join(HERE, "megatron_fsdp__train_llama3_8b_fsdp_h100_fp8.json"))
    assert all(flag in script.argv for flag in FP8_FLAGS)
    argv = with_values(script.argv, {"--ckpt-format": None})
    args = _validate(argv + ["--dry-run"], 8)
    assert (args.fp8, args.fp8_recipe, args.fp8_param_gather) == ("hybrid", "tensorwise", True)
    assert any("FP8 recipe tensorwise" in note for note in args.compat_notes)
    assert args.mock_data and args.data_path is None
    assert (args.tokenizer_type, args.vocab_size, args.tiktoken_pattern) == (
        "NullTokenizer",
        128256,
        "v2",
    )
    assert any("--split '99,1,0' is not read" in note for note in args.compat_notes)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dry_run(argv + ["--dry-run", "--dry-run-world-size", "8"])
    assert "dry run: 8 ranks" in printed.getvalue()
    assert "assumed GPT-2's" not in printed.getvalue()  # NullTokenizer's vocabulary, not GPT-2's


def test_gpt3_without_its_schedule_validates_and_plans_at_128_ranks() -> None:
    script = load_script(os.path.join(HERE, "gpt3__train_gpt3_175b_distributed.json"))
    argv = with_values(script.argv, {"--step-batch-size-schedule": None}) + ["--dry-run"]
    args = _validate(argv, 128)
    assert args.layout.describe() == "TP 8 x PP 16 x DP 1, fp16 on megatron_schedules"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dry_run(argv + ["--dry-run-world-size", "128"])
    assert "dry run: 128 ranks = TP 8 x PP 16 x DP 1" in printed.getvalue()
    assert "model: 174," in printed.getvalue()  # GPT-3 175B (GPT-2's vocabulary)


def test_sc21_table_1_validates_and_plans_with_full_recomputation_at_32_ranks() -> None:
    """The 2021 sc21 script (1.7B, 4 nodes of 8) as Megatron-LM 2.x ran it: its
    --activations-checkpoint-method uniform alone turns full recomputation on."""
    script = load_script(os.path.join(HERE, "academic_paper_scripts__sc21__SRUN.json"))
    args = _validate(script.argv + ["--dry-run"], 32)
    assert args.layout.describe() == "TP 1 x PP 1 x DP 32, fp16 on plain"
    assert (args.recompute_granularity, args.recompute_method) == ("full", "uniform")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dry_run(script.argv + ["--dry-run", "--dry-run-world-size", "32"])
    assert "dry run: 32 ranks = TP 1 x PP 1 x DP 32" in printed.getvalue()
