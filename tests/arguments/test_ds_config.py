"""The DeepSpeed config and the flags state each fact once: conflicts are named, gaps are filled."""

from __future__ import annotations

import copy
import json
import re

import pytest

from megatron.arguments import (
    ArgumentError,
    build_parser,
    parse_args,
    typed_flags,
    validate_args,
)
from megatron.arguments.ds_config import (
    STEPS_PER_PRINT_NEVER,
    load_deepspeed_config,
    reconcile_deepspeed_config,
)

MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
BASE = f"{MODEL} --train-iters 10 --lr 1e-3 --micro-batch-size 2".split()


def write_config(tmp_path, config: dict | str) -> str:
    """`config` (a dict, or raw text) as tmp_path/ds.json; returns the path."""
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def validated(tmp_path, config: dict, extra: str = "", world_size: int = 1, base=BASE):
    """parse_args on `base + extra` with `config` as --deepspeed_config; ArgumentError escapes."""
    argv = [*base, "--deepspeed", "--deepspeed_config", write_config(tmp_path, config)]
    argv += extra.split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def test_empty_config_gets_every_fact_from_the_flags(tmp_path):
    """Flags (typed or default) fill every shared key, plus our quiet-logging defaults."""
    args = validated(tmp_path, {})
    assert args.deepspeed_config_dict == {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 1.0,  # Megatron's --clip-grad default, written out
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": STEPS_PER_PRINT_NEVER,
        "wall_clock_breakdown": False,
    }
    assert args.zero_stage == 0 and args.params_dtype == "float32"


def test_config_facts_flow_into_args(tmp_path):
    """Keys the flags left unsaid set args: batch, precision, clipping, ZeRO stage."""
    config = {
        "train_batch_size": 16,
        "fp16": {"enabled": True},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "steps_per_print": 10,
    }
    args = validated(tmp_path, config, world_size=2)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (16, 4)
    assert (args.fp16, args.params_dtype, args.clip_grad, args.zero_stage) == (
        True,
        "float16",
        0.5,
        2,
    )
    result = args.deepspeed_config_dict
    assert result["gradient_accumulation_steps"] == 4 and result["steps_per_print"] == 10
    assert result["zero_optimization"] == {"stage": 2, "overlap_comm": True}


def test_micro_batch_from_the_config_replaces_the_required_flag(tmp_path):
    """--micro-batch-size may come from the config instead; from neither it is still required."""
    no_micro = BASE[:-2]
    args = validated(tmp_path, {"train_micro_batch_size_per_gpu": 4}, base=no_micro)
    assert args.micro_batch_size == 4 and args.deepspeed_config_dict["train_batch_size"] == 4
    with pytest.raises(ArgumentError, match="missing required flag.*--micro-batch-size"):
        validated(tmp_path, {}, base=no_micro)


def test_accumulation_steps_from_the_config_set_the_global_batch(tmp_path):
    """gradient_accumulation_steps alone: global = micro x accumulation x data-parallel."""
    args = validated(tmp_path, {"gradient_accumulation_steps": 3}, world_size=2)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (12, 3)
    assert args.deepspeed_config_dict["train_batch_size"] == 12


def test_typed_flags_fill_the_config(tmp_path):
    """Typed flags fill absent keys: batch, bf16, clipping, ZeRO stage."""
    extra = "--global-batch-size 8 --bf16 --clip-grad 0.25 --zero-stage 3"
    result = validated(tmp_path, {}, extra).deepspeed_config_dict
    assert (result["train_batch_size"], result["gradient_accumulation_steps"]) == (8, 4)
    assert result["bf16"] == {"enabled": True} and result["fp16"] == {"enabled": False}
    assert result["gradient_clipping"] == 0.25 and result["zero_optimization"] == {"stage": 3}


@pytest.mark.parametrize(
    "extra, config, conflict",
    [
        (
            "",
            {"train_micro_batch_size_per_gpu": 4},
            '--micro-batch-size (2) vs "train_micro_batch_size_per_gpu" (4)',
        ),
        (
            "--global-batch-size 8",
            {"train_batch_size": 16},
            '--global-batch-size (8) vs "train_batch_size" (16)',
        ),
        (
            "--clip-grad 1.0",
            {"gradient_clipping": 0.5},
            '--clip-grad (1.0) vs "gradient_clipping" (0.5)',
        ),
        ("--fp16", {"fp16": {"enabled": False}}, '--fp16 (True) vs "fp16.enabled" (false)'),
        ("--bf16", {"bfloat16": {"enabled": False}}, '--bf16 (True) vs "bfloat16.enabled" (false)'),
        (
            "--zero-stage 1",
            {"zero_optimization": {"stage": 2}},
            '--zero-stage (1) vs "zero_optimization.stage" (2)',
        ),
    ],
)
def test_typed_flag_contradicting_the_config_names_both(tmp_path, extra, config, conflict):
    """The message names the flag and its value, the key and its value, and the file."""
    expected = conflict.replace(" vs ", " contradicts ")
    expected += f" in --deepspeed_config {tmp_path}/ds.json; state it in one place"
    with pytest.raises(ArgumentError, match=re.escape(expected)):
        validated(tmp_path, config, extra)


@pytest.mark.parametrize(
    "extra, config, dest, in_effect, named",
    [
        (
            "--fp16 --loss-scale 128",
            {"fp16": {"enabled": True, "loss_scale": 0}},
            "loss_scale",
            None,
            '--loss-scale (128.0) is not used under --deepspeed; "fp16.loss_scale" (0)',
        ),
        (
            "--fp16 --initial-loss-scale 1024",
            {"fp16": {"enabled": True, "initial_scale_power": 16}},
            "initial_loss_scale",
            65536.0,
            "--initial-loss-scale (1024.0) is not used under --deepspeed; "
            '"fp16.initial_scale_power" (16)',
        ),
        (
            "--fp16 --hysteresis 4",
            {"fp16": {"enabled": True, "hysteresis": 2}},
            "hysteresis",
            2,
            '--hysteresis (4) is not used under --deepspeed; "fp16.hysteresis" (2)',
        ),
    ],
)
def test_the_config_overrules_typed_loss_scale_flags_with_a_warning(
    tmp_path, extra, config, dest, in_effect, named
):
    """Megatron-DeepSpeed never reads the loss-scale flags under --deepspeed: the config's
    values are in effect (real scripts pass ones it contradicts), and start-up says so."""
    args = validated(tmp_path, config, extra)
    assert getattr(args, dest) == in_effect
    (warning,) = [line for line in args.deepspeed_config_notes if named in line]
    assert warning.endswith("is in effect, as in Megatron-DeepSpeed")


def test_batch_rule_mismatch_names_the_numbers(tmp_path):
    """train_batch_size = micro x accumulation x data-parallel, with dp from the world size."""
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 3}
    with pytest.raises(ArgumentError, match=re.escape("16 != 2 x 3 x 2")):
        validated(tmp_path, config, world_size=2)
    with pytest.raises(ArgumentError, match=r"train_batch_size \(10\) is not divisible .* = 4"):
        validated(tmp_path, {"train_batch_size": 10}, world_size=2)


def test_fp16_and_bf16_cannot_both_be_enabled(tmp_path):
    """Between the flags and the config, at most one half-precision mode."""
    with pytest.raises(ArgumentError, match="fp16 and bf16 cannot both be enabled"):
        validated(tmp_path, {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ArgumentError, match="fp16 and bf16 cannot both be enabled"):
        validated(tmp_path, {"fp16": {"enabled": True}}, "--bf16")


def test_fp16_loss_scaling_is_filled_from_the_flags_only_when_absent(tmp_path):
    """With fp16, loss-scale flags fill absent keys; present keys flow back into args."""
    extra = "--fp16 --initial-loss-scale 65536 --loss-scale-window 500 --min-loss-scale 2"
    result = validated(tmp_path, {"fp16": {"hysteresis": 5}}, extra).deepspeed_config_dict
    assert result["fp16"] == {
        "enabled": True,
        "hysteresis": 5,
        "loss_scale": 0,  # dynamic: no --loss-scale
        "initial_scale_power": 16,
        "loss_scale_window": 500,
        "min_loss_scale": 2,
    }
    config = {"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 12}}
    args = validated(tmp_path, config)
    assert (args.loss_scale, args.initial_loss_scale) == (128.0, 4096.0)
    assert validated(tmp_path, {}).deepspeed_config_dict["fp16"] == {"enabled": False}


def test_initial_loss_scale_must_be_a_power_of_two(tmp_path):
    """DeepSpeed takes log2 of the initial scale, so 1000 cannot be expressed."""
    with pytest.raises(ArgumentError, match=r"--initial-loss-scale \(1000.0\) is not a power of 2"):
        validated(tmp_path, {}, "--fp16 --initial-loss-scale 1000")


def test_bfloat16_legacy_alias(tmp_path):
    """DeepSpeed's old "bfloat16" key is read as "bf16" and renamed to it; both is an error."""
    args = validated(tmp_path, {"bfloat16": {"enabled": True}})
    assert args.bf16 and args.params_dtype == "bfloat16"
    assert args.deepspeed_config_dict["bf16"] == {"enabled": True}
    assert "bfloat16" not in args.deepspeed_config_dict
    with pytest.raises(ArgumentError, match='give "bf16" or its legacy alias "bfloat16"'):
        validated(tmp_path, {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_zero_stage_both_directions(tmp_path):
    """--zero-stage fills the config; the config's stage sets args.zero_stage."""
    args = validated(tmp_path, {}, "--zero-stage 2")
    assert args.deepspeed_config_dict["zero_optimization"] == {"stage": 2}
    assert validated(tmp_path, {"zero_optimization": {"stage": 1}}).zero_stage == 1
    with pytest.raises(ArgumentError, match=r'"zero_optimization.stage" must be 0, 1, 2 or 3'):
        validated(tmp_path, {"zero_optimization": {"stage": 4}})


def test_input_dict_and_file_are_left_alone(tmp_path):
    """Reconciling returns a new dict; the caller's dict and the file on disk are unchanged."""
    config = {"train_batch_size": 8, "fp16": {"enabled": True}}
    before = copy.deepcopy(config)
    args = build_parser().parse_args([*BASE, "--deepspeed"])
    args.deepspeed_config_dict = config  # programmatic use: a dict instead of a file
    result = validate_args(args, 1, {"micro_batch_size"}).deepspeed_config_dict
    assert config == before and result is not config and result["fp16"] is not config["fp16"]
    assert args.gradient_accumulation_steps == 4
    path = write_config(tmp_path, before)
    text = open(path).read()
    args = build_parser().parse_args([*BASE, "--deepspeed", "--deepspeed_config", path])
    args.data_parallel_size = 1
    reconcile_deepspeed_config(args, load_deepspeed_config(path), {"micro_batch_size"})
    assert open(path).read() == text


def test_without_typed_flags_everything_set_counts_as_given(tmp_path):
    """validate_args(explicit_flags=None): values other than None/False count as typed."""
    path = write_config(tmp_path, {"fp16": {"enabled": True}, "gradient_clipping": 0.5})
    args = build_parser().parse_args([*BASE, "--deepspeed", "--deepspeed_config", path])
    with pytest.raises(ArgumentError, match=r"--clip-grad \(1.0\) contradicts"):
        validate_args(args, 1)
    args = build_parser().parse_args([*BASE, "--deepspeed", "--deepspeed_config", path])
    args.clip_grad = None
    assert validate_args(args, 1).fp16 is True  # --fp16 left False: the config decides


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "cannot read the file (No such file or directory)"),
        ('{\n  "train_batch_size": 8,\n  "fp16": {enabled: true}\n}', "invalid JSON at line 3"),
        ("[1, 2]", "the top level must be a JSON object"),
        ('{"fp16": {"enabled": true}, "fp16": {}}', 'key "fp16" appears twice'),
        ('{"fp16": true}', '"fp16" must be a JSON object'),
        ('{"gradient_clipping": "1.0"}', "\"gradient_clipping\" must be a number, not '1.0'"),
    ],
)
def test_unusable_files_are_named(tmp_path, text, message):
    """Missing, malformed or mistyped configs raise ArgumentError naming the file."""
    path = str(tmp_path / "ds.json") if text is None else write_config(tmp_path, text)
    argv = [*BASE, "--deepspeed", "--deepspeed_config", path]
    with pytest.raises(ArgumentError, match=re.escape(message)) as error:
        validate_args(build_parser().parse_args(argv), 1, {"micro_batch_size"})
    assert str(error.value).startswith(f"--deepspeed_config {path}: ")


def test_parse_args_exits_2_naming_the_conflict(tmp_path, capsys):
    """End to end: the contradiction is one `error:` line on stderr and exit status 2."""
    path = write_config(tmp_path, {"gradient_clipping": 0.5})
    argv = [*BASE, "--clip-grad", "1.0", "--deepspeed", "--deepspeed_config", path]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=2)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f'error: --clip-grad (1.0) contradicts "gradient_clipping" (0.5) in --deepspeed_config '
        f"{path}; state it in one place"
    )
    argv.remove("--clip-grad")
    argv.remove("1.0")
    assert parse_args(argv, world_size=2).clip_grad == 0.5  # untyped: the config's value


class _DataParallelOnly:
    """The one `mpu` method DeepSpeedConfig reads: the data-parallel world size."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        """Data-parallel ranks."""
        return self.size


@pytest.mark.parametrize(
    "config, extra, world_size",
    [
        ({"train_batch_size": 16}, "--fp16", 2),
        ({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "", 1),
        ({"gradient_accumulation_steps": 2, "gradient_clipping": 0.0}, "--zero-stage 1", 4),
    ],
)
def test_deepspeed_accepts_the_reconciled_config(tmp_path, monkeypatch, config, extra, world_size):
    """DeepSpeedConfig (DeepSpeed's own parsing and batch checks) reads what args says."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    args = validated(tmp_path, config, extra, world_size)
    # DeepSpeedConfig asks the process group for the rank, then the mpu for the data-parallel
    # size; a rank without init_distributed is all it needs to check the batch rule for dp > 1.
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda: 0)
    parsed = DeepSpeedConfig(args.deepspeed_config_dict, mpu=_DataParallelOnly(world_size))
    assert parsed.world_size == args.data_parallel_size == world_size
    assert (
        parsed.train_batch_size,
        parsed.train_micro_batch_size_per_gpu,
        parsed.gradient_accumulation_steps,
    ) == (args.global_batch_size, args.micro_batch_size, args.gradient_accumulation_steps)
    assert (parsed.float16_config.enabled, parsed.bfloat16_config.enabled) == (args.fp16, args.bf16)
    assert parsed.gradient_clipping == args.clip_grad
    assert parsed.zero_optimization_stage == args.zero_stage
    assert parsed.zero_allow_untested_optimizer and parsed.steps_per_print == STEPS_PER_PRINT_NEVER
    if args.fp16:
        assert parsed.float16_config.initial_dynamic_scale() == args.initial_loss_scale


def test_a_disabled_curriculum_section_is_left_out_for_deepspeed(tmp_path):
    """Megatron-DeepSpeed's templates carry "curriculum_learning": {"enabled": false};
    DeepSpeed 0.19 refuses the legacy key whatever it says, so it never reaches DeepSpeed."""
    args = validated(tmp_path, {"curriculum_learning": {"enabled": False, "min_difficulty": 8}})
    assert "curriculum_learning" not in args.deepspeed_config_dict
    assert any('disabled "curriculum_learning"' in note for note in args.deepspeed_config_notes)


@pytest.mark.parametrize(
    "config, named",
    [
        ({"curriculum_learning": {"enabled": True}}, '"curriculum_learning" is enabled'),
        (
            {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True}}},
            '"data_efficiency.data_routing" is enabled',
        ),
    ],
)
def test_data_efficiency_features_that_are_on_are_refused(tmp_path, config, named):
    with pytest.raises(ArgumentError, match=re.escape(named)):
        validated(tmp_path, config)


def test_data_efficiency_with_every_feature_off_is_accepted(tmp_path):
    config = {"data_efficiency": {"enabled": True, "data_sampling": {"enabled": False}}}
    assert validated(tmp_path, config).deepspeed_config_dict["data_efficiency"]["enabled"]
