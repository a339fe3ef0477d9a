"""Megatron-LM's FP8 flags: their meanings here, the notes, the one-line refusals and stops."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron.arguments import ArgumentError, build_parser, parse_args, typed_flags, validate_args
from megatron.arguments.precision import precision_summary
from megatron.config import fp8_config_from_args
from megatron.model import fp8

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --train-iters 10 --lr 1e-3 --micro-batch-size 2 "
    "--mock-data --bf16"
).split()


def validated(extra: str = "", world_size: int = 1):
    """The validated namespace of BASE + `extra`; ArgumentError escapes."""
    argv = BASE + extra.split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def notes(args) -> str:
    return "\n".join(args.compat_notes)


def test_fp8_format_alone_runs_tensorwise_and_says_why_not_delayed() -> None:
    args = validated("--fp8-format hybrid")
    assert (args.fp8, args.fp8_recipe) == ("hybrid", "tensorwise")
    assert "Megatron-LM's default --fp8-recipe delayed" in notes(args)
    assert "FP8 matmuls hybrid tensorwise (torchao)" in precision_summary(args)
    config = fp8_config_from_args(args)
    assert (config.format, config.recipe, config.wgrad) == ("hybrid", "tensorwise", True)
    assert [config.covers_layer(n, 4) for n in range(1, 5)] == [True] * 4


def test_megatron_deepspeeds_spellings_and_the_wgrad_switch() -> None:
    assert validated("--fp8-e4m3").fp8 == "e4m3"
    assert validated("--fp8-hybrid").fp8 == "hybrid"
    args = validated("--fp8-format e4m3 --fp8-recipe tensorwise --no-fp8-wgrad")
    assert "default --fp8-recipe" not in notes(args)
    assert not fp8_config_from_args(args).wgrad
    assert "weight gradients in high precision" in precision_summary(args)


def test_delayed_recipe_settings_are_accepted_and_said_to_do_nothing() -> None:
    """Megatron-LM's Llama-3 FP8 recipe passes them; under tensorwise they have no effect
    there either."""
    args = validated("--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max")
    assert "--fp8-amax-history-len, --fp8-amax-compute-algo set the delayed" in notes(args)


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8", "blockwise", "custom"])
def test_recipes_not_built_are_refused_in_one_line(recipe: str) -> None:
    with pytest.raises(
        ArgumentError, match=f"--fp8-recipe {recipe}: .*use --fp8-recipe tensorwise"
    ):
        validated(f"--fp8-format hybrid --fp8-recipe {recipe}")


def test_fp8_settings_without_a_format_do_nothing_and_say_so() -> None:
    args = validated("--fp8-recipe tensorwise --fp8-param-gather")
    assert args.fp8 is None and fp8_config_from_args(args) is None
    assert "--fp8-recipe, --fp8-param-gather without --fp8-format: no effect" in notes(args)


def test_param_gather_without_sharding_has_nothing_to_gather() -> None:
    assert "--fp8-param-gather: no weights are all-gathered" in notes(
        validated("--fp8-format hybrid --fp8-param-gather")
    )
    zero3 = (
        "--fp8-format hybrid --fp8-param-gather --deepspeed --no-pipeline-parallel --zero-stage 3"
    )
    assert (
        "--fp8-param-gather: DeepSpeed ZeRO-3 all-gathers the weights in the run's precision"
        in notes(validated(zero3))
    )
    sharded = validated("--fp8-format hybrid --fp8-param-gather --use-torch-fsdp2", world_size=2)
    assert "--fp8-param-gather" not in notes(sharded) and fp8_config_from_args(sharded).param_gather


def test_first_and_last_layers_in_bf16() -> None:
    args = validated(
        "--fp8-format hybrid --first-last-layers-bf16 --num-layers-at-start-in-bf16 1 "
        "--num-layers-at-end-in-bf16 2"
    )
    config = fp8_config_from_args(args)
    assert [config.covers_layer(n, 4) for n in range(1, 5)] == [False, True, False, False]
    with pytest.raises(ArgumentError, match="together at most --num-layers 4"):
        validated("--fp8-format hybrid --first-last-layers-bf16 --num-layers-at-end-in-bf16 4")


@pytest.mark.parametrize(
    "extra, what",
    [
        ("--hidden-size 72 --num-attention-heads 4", "--hidden-size is 72"),
        ("--ffn-hidden-size 200", "--ffn-hidden-size / --tensor-model-parallel-size is 200"),
        ("--seq-length 12 --max-position-embeddings 12 --micro-batch-size 1", "is 12"),
    ],
)
def test_shapes_fp8_gemms_cannot_take_are_refused(extra: str, what: str) -> None:
    with pytest.raises(ArgumentError, match=f"--fp8-format: .*{what}.*multiples of 16"):
        validated(f"--fp8-format hybrid {extra}")


def test_fp8_attention_is_refused() -> None:
    with pytest.raises(SystemExit), mock.patch("sys.stderr"):
        parse_args(BASE + ["--fp8-format", "hybrid", "--fp8-dot-product-attention"])


def _stop_line(capsys, reason: str | None = None, capability=None) -> str:
    patches = [mock.patch.object(fp8, "fp8_support", return_value=reason)] if reason else []
    if capability is not None:
        patches = [
            mock.patch.object(torch.cuda, "is_available", return_value=True),
            mock.patch.object(torch.cuda, "current_device", return_value=0),
            mock.patch.object(torch.cuda, "get_device_capability", return_value=capability),
            mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA A100"),
        ]
    for patch in patches:
        patch.start()
    try:
        with pytest.raises(SystemExit) as stopped:
            parse_args(BASE + ["--fp8-format", "hybrid"], world_size=1)
    finally:
        for patch in patches:
            patch.stop()
    assert stopped.value.code == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1, line
    return line


def test_without_torchao_the_run_stops_in_one_line(capsys) -> None:
    with mock.patch.dict("sys.modules", {"torchao": None, "torchao.float8": None}):
        reason = fp8.fp8_support(torch.device("cpu"))
    assert reason is not None and "torchao" in reason
    line = _stop_line(capsys, reason=reason)
    assert line.startswith("error: --fp8-format hybrid: FP8 training here needs torchao"), line


def test_a_gpu_without_fp8_tensor_cores_stops_in_one_line(capsys) -> None:
    line = _stop_line(capsys, capability=(8, 0))
    assert "NVIDIA A100 (sm_80) has no FP8 tensor cores" in line, line
