"""Every captured Megatron-DeepSpeed GPT command line parses and validates here, or is refused
in one line naming the flag (or config key) of a feature we do not build.

The command lines are the real ones (tests/compat/scripts/*.json), validated at the world size
each script implies, with their paths pointed at fixtures and their DeepSpeed configs as the
scripts wrote them. Whether this machine can run fp16 is a separate, device check
(tests/arguments/test_precision.py); here only the flags' logic is checked.
"""

from __future__ import annotations

import os

import pytest

from megatron.arguments.errors import ArgumentError
from megatron.arguments.parser import build_parser, typed_flags
from megatron.arguments.validation import validate_args
from tests.compat.scripts import SCRIPT_FILES, load_script, localized

_CURRICULUM = '"curriculum_learning" is enabled, but sequence-length curriculum learning'
_FPDT = "--ds-sequence-parallel-fpdt: DeepSpeed's FPDT (chunked, offloaded Ulysses) is not built"
# The scripts we refuse, and the start of the one line that says why.
REFUSED = {
    "MoE__ds_pretrain_gpt_125M_dense_cl": _CURRICULUM,
    "curriculum_learning__ds_pretrain_gpt2": _CURRICULUM,
    "rebase__ds_pretrain_gpt_1.3B_rope_slw": _CURRICULUM,
    # The script passes --fp16 while its config enables bf16 and disables fp16.
    "offload_pp__ds_pretrain_gpt_350M": '--fp16 (True) contradicts "fp16.enabled" (false)',
    "sequence_parallel__ds_pretrain_gpt_6.7B_fpdt_32k": _FPDT,
    "zero_bubble_pp__zbh1_pretrain_gpt_1.3b": "--enable-zbh1-pipeline: the zero-bubble",
}
NAMES = [os.path.splitext(os.path.basename(path))[0] for path in SCRIPT_FILES]


def _validate(name: str, dataset: str, scratch: str):
    script = load_script(os.path.join(os.path.dirname(SCRIPT_FILES[0]), name + ".json"))
    argv = localized(script, dataset, scratch)
    parser = build_parser()
    return script, validate_args(
        parser.parse_args(argv), script.world_size, typed_flags(parser, argv)
    )


def test_the_captured_scripts_are_many_and_mostly_accepted() -> None:
    assert len(NAMES) >= 25
    assert set(REFUSED) <= set(NAMES)
    assert len(NAMES) - len(REFUSED) >= 15


@pytest.mark.parametrize("name", NAMES)
def test_script_parses_and_validates_or_is_refused_in_one_line(
    name: str, stdlib_dataset: str, tmp_path
) -> None:
    if name in REFUSED:
        with pytest.raises(ArgumentError) as refused:
            _validate(name, stdlib_dataset, str(tmp_path))
        message = str(refused.value)
        assert message.startswith(REFUSED[name]) or REFUSED[name] in message, message
        assert "\n" not in message
        return
    script, args = _validate(name, stdlib_dataset, str(tmp_path))
    argv = script.argv
    # The parallel layout multiplies out to the script's world size.
    sizes = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    sizes *= args.ds_sequence_parallel_size
    assert sizes * args.data_parallel_size == script.world_size
    # Batch arithmetic as DeepSpeed will see it.
    assert args.global_batch_size == (
        args.micro_batch_size * args.gradient_accumulation_steps * args.data_parallel_size
    )
    if script.ds_config:
        assert args.deepspeed_config_dict["train_batch_size"] == args.global_batch_size
    # Token flags, where given, survive with their values.
    for flag, dest in (
        ("--train-tokens", "train_tokens"),
        ("--lr-decay-tokens", "lr_decay_tokens"),
    ):
        if flag in argv:
            assert getattr(args, dest) == int(argv[argv.index(flag) + 1])
    if "--tokenizer-model" in argv:  # the LLaMA scripts' GPTSentencePieceTokenizer
        assert args.tokenizer_model == argv[argv.index("--tokenizer-model") + 1]
    if "--override-opt_param-scheduler" in argv:
        assert args.override_lr_scheduler
    if name.startswith("sequence_parallel__"):
        # DeepSpeed-Ulysses over 4 of the 8 ranks: 2 data-parallel replicas of 4 sequence parts;
        # under ZeRO-3 each part's loss is scaled by 4 for DeepSpeed's averaging reduce-scatter.
        assert (args.ds_sequence_parallel_size, args.data_parallel_size) == (4, 2)
        assert args.layout.sequence_split_gradient_scale == (4 if args.zero_stage == 3 else 1)
    if name == "MoE__ds_pretrain_gpt_350M_PR-MoE32or64":
        # EP 64 over its 32-expert layers: as DeepSpeed before 0.7 ran the script, they
        # spread over 32 ranks (DeepSpeed 0.7+ would assert num_experts % ep_size == 0).
        assert any("min(EP, its experts)" in note for note in args.compat_notes)


def test_universal_checkpointing_fp16_loss_scale_follows_the_config(
    stdlib_dataset: str, tmp_path
) -> None:
    """--loss-scale 12 is never read by Megatron-DeepSpeed under --deepspeed: the config's
    dynamic scaling is in effect, and start-up says so in one line."""
    _, args = _validate(
        "universal_checkpointing__megatron_gpt__run_fp16", stdlib_dataset, str(tmp_path)
    )
    assert args.loss_scale is None  # dynamic, as "loss_scale": 0 says
    assert args.deepspeed_config_dict["fp16"]["loss_scale"] == 0
    (warning,) = [line for line in args.deepspeed_config_notes if "--loss-scale" in line]
    assert "--loss-scale (12.0) is not used under --deepspeed" in warning
    assert '"fp16.loss_scale" (0)' in warning


def test_an_unknown_flag_is_one_line(capsys) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--no-such-flag", "--num-experts", "8"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "unrecognized arguments: --no-such-flag" in error
