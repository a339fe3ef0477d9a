"""Older DeepSpeed config forms and Megatron-LM v1 flags, reconciled like every other fact.

- `"zero_optimization": true|false` (DeepSpeed's early form) is read as stage 1 / 0, with a
  start-up note; the tutorial's February 2020 config validates;
- Megatron-LM v1.1.5's ZeRO flags fill `zero_optimization` where the config is silent, and a
  typed one that contradicts it is one line naming both;
- the "activation_checkpointing" section sets the DeepSpeed checkpointing flags' values under
  `--deepspeed-activation-checkpointing` (typed flags win) and is set aside without it.
"""

from __future__ import annotations

import re

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.arguments.ds_activation_checkpointing import activation_checkpointing_line
from tests.arguments.test_ds_config import BASE, validated, write_config

# DeepSpeed's Megatron-LM GPT-2 tutorial, as published in February 2020.
TUTORIAL_CONFIG = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1,
    "zero_optimization": True,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0}},
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
}
# Megatron-LM v1.1.5's ds_pretrain_gpt2 script's ZeRO flags.
V115_ZERO_FLAGS = (
    "--zero-stage 0 --zero-reduce-bucket-size 50000000 --zero-allgather-bucket-size 5000000000 "
    "--zero-contigious-gradients --zero-reduce-scatter"
)
CHECKPOINTING = "--deepspeed-activation-checkpointing"


def _deepspeed_parse(config: dict, data_parallel_size: int, monkeypatch):
    """DeepSpeed's own parse of a reconciled config (the batch rule checked at this dp size)."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    class DataParallelOnly:
        """The one `mpu` method DeepSpeedConfig reads."""

        def get_data_parallel_world_size(self) -> int:
            """Data-parallel ranks."""
            return data_parallel_size

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda: 0)
    return DeepSpeedConfig(config, mpu=DataParallelOnly())


@pytest.mark.parametrize("enabled, stage", [(True, 1), (False, 0)])
def test_early_zero_switch_is_read_as_a_stage(tmp_path, enabled, stage):
    """true is ZeRO stage 1 and false stage 0, as DeepSpeed's read_zero_config_deprecated."""
    args = validated(tmp_path, {"zero_optimization": enabled})
    assert args.zero_stage == stage
    assert args.deepspeed_config_dict["zero_optimization"] == {"stage": stage}
    word = "true" if enabled else "false"
    assert (
        f' > --deepspeed_config {tmp_path}/ds.json: "zero_optimization": {word} (DeepSpeed\'s '
        f'early form) is read as "zero_optimization": {{"stage": {stage}}}, as DeepSpeed reads it'
    ) in args.deepspeed_config_notes


def test_early_zero_switch_takes_the_top_level_allgather_size(tmp_path):
    """DeepSpeed's early form kept the bucket size at the top level, as "allgather_size"."""
    args = validated(tmp_path, {"zero_optimization": True, "allgather_size": 200000000})
    result = args.deepspeed_config_dict
    assert result["zero_optimization"] == {"stage": 1, "allgather_bucket_size": 200000000}
    assert "allgather_size" not in result and args.zero_allgather_bucket_size == 200000000


def test_early_zero_switch_contradicted_by_a_typed_stage(tmp_path):
    """The usual one-line conflict, in the normalized key's words."""
    with pytest.raises(ArgumentError, match=re.escape('--zero-stage (2) contradicts "zero_opt')):
        validated(tmp_path, {"zero_optimization": False}, "--zero-stage 2")


def test_the_tutorials_config_validates_and_deepspeed_reads_it(tmp_path, monkeypatch):
    """Micro-batch 8 at data-parallel 2: ZeRO-1, dynamic fp16 loss scaling, and the "optimizer"
    section set aside (its max_grad_norm equals --clip-grad, so without a warning)."""
    base = [*BASE[:-2], "--micro-batch-size", "8"]
    args = validated(tmp_path, TUTORIAL_CONFIG, "--lr 0.00015", world_size=2, base=base)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (16, 1)
    assert (args.zero_stage, args.fp16, args.loss_scale, args.clip_grad) == (1, True, None, 1.0)
    assert (args.loss_scale_window, args.hysteresis, args.min_loss_scale) == (1000, 2, 1)
    assert "optimizer" not in args.deepspeed_config_dict
    notes = "\n".join(args.deepspeed_config_notes)
    assert '"zero_optimization": true (DeepSpeed\'s early form)' in notes
    assert 'its "optimizer" section is not used' in notes and "warning" not in notes
    parsed = _deepspeed_parse(args.deepspeed_config_dict, 2, monkeypatch)
    assert (parsed.zero_optimization_stage, parsed.train_batch_size) == (1, 16)
    assert parsed.gradient_clipping == 1.0 and parsed.steps_per_print == 1


def test_the_tutorials_max_grad_norm_that_differs_from_clip_grad_is_named(tmp_path):
    """The old Adam param is not DeepSpeed's clipping (0.19 refuses it): --clip-grad is."""
    args = validated(tmp_path, TUTORIAL_CONFIG, "--clip-grad 0.5 --micro-batch-size 8", 2)
    assert args.deepspeed_config_dict["gradient_clipping"] == 0.5
    assert (
        f' > warning: "optimizer.params.max_grad_norm" (1.0) in --deepspeed_config '
        f"{tmp_path}/ds.json differs from --clip-grad (0.5); --clip-grad is in effect"
    ) in args.deepspeed_config_notes


def test_v115_zero_flags_fill_a_silent_config_and_deepspeed_reads_them(tmp_path, monkeypatch):
    """At stage 0 too (DeepSpeed 0.19 accepts the keys there and does not use them)."""
    args = validated(tmp_path, {}, V115_ZERO_FLAGS)
    assert args.deepspeed_config_dict["zero_optimization"] == {
        "stage": 0,
        "reduce_bucket_size": 50000000,
        "allgather_bucket_size": 5000000000,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    zero = _deepspeed_parse(args.deepspeed_config_dict, 1, monkeypatch).zero_config
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == (0, 5e7, 5e9)


def test_zero_flags_not_given_leave_the_config_and_take_its_values(tmp_path):
    """No flag: DeepSpeed's defaults stay untouched; the config's values (5e8 included) flow
    into args."""
    assert validated(tmp_path, {}).deepspeed_config_dict["zero_optimization"] == {"stage": 0}
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "reduce_scatter": False}}
    args = validated(tmp_path, config)
    assert (args.zero_reduce_bucket_size, args.zero_reduce_scatter) == (500000000, False)
    assert args.zero_allgather_bucket_size is None and args.zero_contigious_gradients is None
    assert args.deepspeed_config_dict["zero_optimization"] == config["zero_optimization"]
    agreeing = validated(tmp_path, config, "--zero-reduce-bucket-size 500000000")
    assert agreeing.deepspeed_config_dict["zero_optimization"]["reduce_bucket_size"] == 5e8


@pytest.mark.parametrize(
    "extra, zero, conflict",
    [
        (
            "--zero-reduce-bucket-size 50000000",
            {"reduce_bucket_size": 5e8},
            "--zero-reduce-bucket-size (50000000) contradicts "
            '"zero_optimization.reduce_bucket_size" (500000000.0)',
        ),
        (
            "--zero-contigious-gradients",
            {"contiguous_gradients": False},
            "--zero-contigious-gradients (True) contradicts "
            '"zero_optimization.contiguous_gradients" (false)',
        ),
    ],
)
def test_typed_zero_flag_contradicting_the_config_names_both(tmp_path, extra, zero, conflict):
    """The rule of every shared fact: flag, key, file, both values, in one line."""
    expected = f"{conflict} in --deepspeed_config {tmp_path}/ds.json; state it in one place"
    with pytest.raises(ArgumentError, match=f"^{re.escape(expected)}$"):
        validated(tmp_path, {"zero_optimization": {"stage": 1, **zero}}, extra)


@pytest.mark.parametrize(
    "config, extra, message",
    [
        (
            {},
            "--zero-allgather-bucket-size 0",
            "--zero-allgather-bucket-size (0) must be at least 1",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 1.5}},
            "",
            '"zero_optimization.reduce_bucket_size" must be a whole number of elements, not 1.5',
        ),
    ],
)
def test_unusable_zero_sizes_are_named(tmp_path, config, extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        validated(tmp_path, config, extra)


# --- the "activation_checkpointing" section -----------------------------------------------


def test_the_section_without_deepspeed_activation_checkpointing_is_set_aside(tmp_path):
    """As in Megatron-LM v1 and Megatron-DeepSpeed: no effect, and start-up says so."""
    args = validated(tmp_path, {"activation_checkpointing": {"partition_activations": True}})
    assert not args.partition_activations
    assert "activation_checkpointing" not in args.deepspeed_config_dict
    assert (
        f' > --deepspeed_config {tmp_path}/ds.json: its "activation_checkpointing" section is '
        "not used without --deepspeed-activation-checkpointing (as in Megatron-LM v1 and "
        "Megatron-DeepSpeed)"
    ) in args.deepspeed_config_notes


def test_the_sections_values_set_the_flags_fields_and_the_start_up_line(tmp_path):
    """Every key of the section reaches args; DeepSpeed gets the same, number_checkpoints being
    --num-layers as in v1 (start-up warns when the config said otherwise)."""
    section = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 7,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    args = validated(tmp_path, {"activation_checkpointing": section}, CHECKPOINTING)
    fields = ("partition_activations", "checkpoint_in_cpu", "contigious_checkpointing")
    fields += ("synchronize_each_layer", "profile_backward")
    assert all(getattr(args, field) is True for field in fields)
    assert args.deepspeed_config_dict["activation_checkpointing"] == {
        **section,
        "number_checkpoints": 2,
    }
    assert activation_checkpointing_line(args) == (
        " > DeepSpeed activation checkpointing: partition_activations=True, "
        "cpu_checkpointing=True, contiguous_memory_optimization=True, number_checkpoints=2, "
        "synchronize_checkpoint_boundary=True, profile=True"
    )
    assert (
        ' > warning: "activation_checkpointing.number_checkpoints" (7) in --deepspeed_config '
        f"{tmp_path}/ds.json is not used: DeepSpeed gets --num-layers (2), as in Megatron-LM v1"
    ) in args.deepspeed_config_notes


def test_typed_checkpointing_flags_win_over_the_section(tmp_path):
    """A typed switch overrules the section's false (with a warning); untyped ones take it."""
    section = {"partition_activations": False, "cpu_checkpointing": True}
    args = validated(
        tmp_path, {"activation_checkpointing": section}, f"{CHECKPOINTING} --partition-activations"
    )
    assert args.partition_activations and args.checkpoint_in_cpu
    assert args.deepspeed_config_dict["activation_checkpointing"]["partition_activations"]
    assert (
        ' > warning: --partition-activations overrides "activation_checkpointing.'
        f'partition_activations" (false) in --deepspeed_config {tmp_path}/ds.json; the typed '
        "flag is in effect"
    ) in args.deepspeed_config_notes
    plain = validated(tmp_path, {}, f"{CHECKPOINTING} --checkpoint-in-cpu")
    assert plain.checkpoint_in_cpu and not plain.partition_activations
    assert activation_checkpointing_line(plain).startswith(
        " > DeepSpeed activation checkpointing: partition_activations=False, "
        "cpu_checkpointing=True,"
    )


@pytest.mark.parametrize(
    "section, extra, message",
    [
        (
            {"contiguous_memory_optimization": True},
            "",
            '"activation_checkpointing.contiguous_memory_optimization" in --deepspeed_config '
            "{dir}/ds.json needs partitioned activations",
        ),
        ({}, "--contigious-checkpointing", "--contigious-checkpointing needs partitioned"),
        (
            {"partition_activations": True},
            "--tensor-model-parallel-size 2 --sequence-parallel",
            '"activation_checkpointing.partition_activations" in --deepspeed_config '
            "{dir}/ds.json cannot be combined with --sequence-parallel",
        ),
        (
            {"profile": "yes"},
            "",
            "\"activation_checkpointing.profile\" must be true or false, not 'yes'",
        ),
    ],
)
def test_unusable_checkpointing_settings_are_named(tmp_path, section, extra, message):
    """What DeepSpeed would assert on (or get wrong) is one line naming the key or flag."""
    config = {"activation_checkpointing": section}
    with pytest.raises(ArgumentError, match=re.escape(message.format(dir=tmp_path))):
        validated(tmp_path, config, f"{CHECKPOINTING} {extra}", world_size=2)


def test_a_section_that_is_not_an_object_is_named(tmp_path):
    argv = [*BASE, "--deepspeed", "--deepspeed_config"]
    argv += [write_config(tmp_path, {"activation_checkpointing": True})]
    parser = build_parser()
    with pytest.raises(ArgumentError, match='"activation_checkpointing" must be a JSON object'):
        validate_args(parser.parse_args(argv), 1, typed_flags(parser, argv))
