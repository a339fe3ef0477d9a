"""Megatron-LM's combined 1F1B flags (`--overlap-moe-expert-parallel-comm`,
`--delay-wgrad-compute`): what they reach, and the one-line refusals of megatron-core's rules
and of the layouts not built here."""

from __future__ import annotations

import pytest

from megatron.config import ModelConfig
from tests.arguments.test_routed_moe_flags import MIXTRAL_MOE, refusal, validated

OVERLAP = "--overlap-moe-expert-parallel-comm"


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_the_flags_reach_the_model_config(dispatcher: str) -> None:
    args = validated(
        f"{MIXTRAL_MOE} --moe-token-dispatcher-type {dispatcher} --expert-model-parallel-size 2 "
        f"{OVERLAP} --delay-wgrad-compute"
    )
    routed = ModelConfig.from_args(args).routed_moe
    assert routed.overlap_expert_comm and routed.delay_wgrad
    assert routed.dispatcher == dispatcher and args.layout.engine.value == "plain"
    assert not ModelConfig.from_args(validated(MIXTRAL_MOE)).routed_moe.overlap_expert_comm


@pytest.mark.parametrize(
    ("extra", "world_size", "words"),
    [
        ("--delay-wgrad-compute", 2, ["--delay-wgrad-compute needs", OVERLAP]),
        (f"--num-experts 4 {OVERLAP}", 2, [OVERLAP, "Megatron-LM's MoE"]),
        (f"{MIXTRAL_MOE} {OVERLAP}", 2, ["--expert-model-parallel-size > 1"]),
        (
            f"{MIXTRAL_MOE} --expert-model-parallel-size 2 {OVERLAP} --recompute-granularity full",
            2,
            ["--recompute-granularity full", "Megatron-LM refuses it too"],
        ),
        (
            f"{MIXTRAL_MOE} --expert-model-parallel-size 2 {OVERLAP} "
            "--recompute-granularity selective --recompute-modules moe",
            2,
            ["--recompute-modules moe"],
        ),
        (
            f"{MIXTRAL_MOE} --expert-model-parallel-size 2 {OVERLAP} "
            "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap",
            2,
            ["--moe-shared-expert-overlap", "one overlap"],
        ),
        (
            f"{MIXTRAL_MOE} --expert-model-parallel-size 2 {OVERLAP} --use-torch-fsdp2",
            2,
            [OVERLAP, "FSDP2"],
        ),
        (
            f"{MIXTRAL_MOE} --expert-model-parallel-size 2 {OVERLAP} "
            "--pipeline-model-parallel-size 2",
            4,
            [OVERLAP, "--pipeline-model-parallel-size 2", "PP = 1"],
        ),
    ],
    ids=[
        "delay-alone",
        "deepspeed-moe",
        "ep1",
        "full-recompute",
        "moe-recompute",
        "shared-overlap",
        "fsdp2",
        "pp2",
    ],  # fmt: skip
)
def test_refused_in_one_line(extra: str, world_size: int, words: list[str]) -> None:
    message = refusal(extra, world_size)
    for word in words:
        assert word in message, message


def test_refused_on_deepspeeds_engine(tmp_path) -> None:
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}')
    message = refusal(
        f"{MIXTRAL_MOE} --expert-model-parallel-size 2 {OVERLAP} --deepspeed "
        f"--deepspeed_config {config} --no-pipeline-parallel"
    )
    # Megatron-LM's MoE at EP > 1 is refused on DeepSpeed's engine before the overlap is.
    assert "needs no --deepspeed" in message, message
