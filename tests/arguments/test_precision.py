"""Precision flags: DeepSpeed's bf16 gradient accumulation, device checks, the start-up line."""

from __future__ import annotations

import argparse

import pytest

from megatron.arguments import ArgumentError, parse_args
from megatron.arguments.precision import precision_summary, precision_warnings
from tests.arguments.test_ds_config import BASE, validated, write_config


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_with_zero_fills_fp32_gradient_accumulation(tmp_path, stage: int) -> None:
    args = validated(tmp_path, {"zero_optimization": {"stage": stage}}, "--bf16")
    assert args.deepspeed_config_dict["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "gradient accumulation fp32" in precision_summary(args)


def test_an_explicit_gradient_accumulation_dtype_is_kept(tmp_path) -> None:
    config = {"zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "bf16"}}
    args = validated(tmp_path, config, "--bf16")
    assert args.deepspeed_config_dict["data_types"] == {"grad_accum_dtype": "bf16"}
    assert "gradient accumulation bf16" in precision_summary(args)


def test_fp16_and_fp32_configs_get_no_data_types(tmp_path) -> None:
    for extra in ("--fp16 --zero-stage 1", "--zero-stage 2"):
        assert "data_types" not in validated(tmp_path, {}, extra).deepspeed_config_dict


@pytest.mark.parametrize("engine", ["", "--no-pipeline-parallel"])
def test_zero0_cannot_accumulate_bf16_in_fp32(tmp_path, engine: str) -> None:
    """DeepSpeed 0.19 at ZeRO 0 (pipeline engine or not) accumulates bf16 gradients in bf16
    and refuses "fp32" with a traceback: nothing is filled, and "fp32" is a one-line error."""
    args = validated(tmp_path, {}, f"--bf16 {engine}")
    assert args.zero_stage == 0 and "data_types" not in args.deepspeed_config_dict
    assert "gradient accumulation bf16" in precision_summary(args)
    assert precision_warnings(args) == []  # one micro-batch per step: nothing is summed
    accumulating = validated(tmp_path, {}, f"--bf16 {engine} --global-batch-size 8")
    (warning,) = precision_warnings(accumulating)
    assert "ZeRO-0 sums the 4 micro-batches' bf16 gradients in bf16" in warning
    assert (
        precision_warnings(validated(tmp_path, {}, "--bf16 --zero-stage 1 --global-batch-size 8"))
        == []
    )
    config = {"data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(ArgumentError, match=r'"data_types.grad_accum_dtype": "fp32" in .* ZeRO'):
        validated(tmp_path, config, f"--bf16 {engine}")


def test_zero0_cannot_accumulate_fp16_in_fp32_either(tmp_path) -> None:
    """DeepSpeed 0.19 refuses fp16 with "grad_accum_dtype": "fp32" at ZeRO 0 as it does bf16
    (`megatron.deepspeed_facts.optimizer_wrapper`): a one-line error here, not its traceback."""
    config = {"data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(ArgumentError, match=r'"fp32" in .* with fp16 needs ZeRO stage 1-3'):
        validated(tmp_path, config, "--fp16 --no-pipeline-parallel")
    assert validated(tmp_path, config, "--fp16 --zero-stage 1").zero_stage == 1


def _namespace(**flags) -> argparse.Namespace:
    defaults = dict(
        fp16=False, bf16=False, deepspeed=False, loss_scale=None, initial_loss_scale=2.0**32,
        loss_scale_window=1000, hysteresis=2, min_loss_scale=1.0,
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **flags})


def test_the_start_up_line_says_what_each_plain_precision_does() -> None:
    assert precision_summary(_namespace()) == (
        " > precision: parameters fp32, compute fp32, gradient accumulation fp32, loss scaling none"
    )
    assert precision_summary(_namespace(), tf32=True).startswith(
        " > precision: parameters fp32, compute fp32 (TF32 matmuls)"
    )
    assert precision_summary(_namespace(bf16=True)) == (
        " > precision: parameters fp32 = master weights (AdamW state fp32), compute bf16 "
        "(torch.autocast), gradient accumulation fp32, loss scaling none"
    )
    fp16 = precision_summary(_namespace(fp16=True))
    assert fp16.endswith("loss scaling dynamic from 2^32 (window 1000, hysteresis 2, min 1)"), fp16
    assert precision_summary(_namespace(fp16=True, loss_scale=128.0)).endswith("static 128")


def test_deepspeed_fp16_on_an_accelerator_without_it_is_one_line(
    monkeypatch, capsys, tmp_path
) -> None:
    """DeepSpeed's CPU accelerator has no fp16: a one-line error naming --fp16 and the ways
    out, not DeepSpeed's traceback from inside deepspeed.initialize."""
    import deepspeed.accelerator

    class NoHalf:
        def device_name(self) -> str:
            return "cpu"

        def is_fp16_supported(self) -> bool:
            return False

        def is_bf16_supported(self) -> bool:
            return True

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", NoHalf)
    deepspeed_flags = ["--deepspeed", "--deepspeed_config", write_config(tmp_path, {})]
    argv = [*BASE, "--fp16", *deepspeed_flags]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=1)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert error.startswith("error: --fp16 with --deepspeed: DeepSpeed's cpu accelerator")
    assert "use --bf16 with DeepSpeed, or drop --deepspeed" in error
    # --bf16 is supported there: accepted.
    assert parse_args([*BASE, "--bf16", *deepspeed_flags], world_size=1).bf16


@pytest.mark.parametrize("flag", ["--use-flash-attn", "--use-flash-attn-v2"])
def test_flash_attention_in_fp32_is_one_line(flag: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE, flag], world_size=1)
    error = capsys.readouterr().err.strip()
    assert error == (
        f"error: {flag} needs --bf16 or --fp16 (flash attention kernels compute in half "
        "precision); drop it for fp32, where SDPA picks the fastest fp32 kernel itself"
    )


def test_flash_attention_where_it_cannot_run_is_one_line(capsys) -> None:
    """On this CPU machine: no GPU, named; where flash kernels exist, the flags are accepted."""
    from megatron.model.attention import flash_attention_status

    argv = [*BASE, "--use-flash-attn", "--bf16"]
    available, detail = flash_attention_status()
    if available:
        assert parse_args(argv, world_size=1).use_flash_attn
        return
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=1)
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: --use-flash-attn: {detail}; drop the flag")
    assert "\n" not in error
