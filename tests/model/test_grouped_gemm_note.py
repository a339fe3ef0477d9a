"""`--moe-grouped-gemm` says at start-up where the experts' matmuls loop instead
(moe_experts.grouped_gemm_fallback_note, printed by training.build_engine): the runtime's own
rule (`grouped_mm_runs`) for the run's compute dtype and device, silent where it holds."""

from __future__ import annotations

import dataclasses

import torch

from megatron.config import ModelConfig, RoutedMoEConfig
from megatron.model.moe_experts import grouped_gemm_fallback_note

GROUPED = RoutedMoEConfig(num_experts=8, moe_layers=(True, True), grouped_gemm=True)


def _config(hidden: int = 1024, moe: RoutedMoEConfig | None = GROUPED) -> ModelConfig:
    config = ModelConfig(2, hidden, 2, 1024, 64, ffn_hidden_size=4 * hidden, activation="swiglu")
    return dataclasses.replace(config, routed_moe=moe)


def test_pre_hopper_gpus_loop_and_hopper_groups():
    assert grouped_gemm_fallback_note(_config(), torch.bfloat16, "cuda", (8, 0)) == (
        " > note: --moe-grouped-gemm: the experts' [1024 x 8192] and [4096 x 1024] matmuls "
        "loop over the experts here (bfloat16 on cuda sm_80): torch's grouped matmul needs "
        "rows of 16-byte multiples, and on GPUs bf16 on sm_90 (Hopper) or later"
    )
    assert grouped_gemm_fallback_note(_config(), torch.bfloat16, "cuda", (9, 0)) is None
    fp16 = grouped_gemm_fallback_note(_config(), torch.float16, "cuda", (9, 0))
    assert "(float16 on cuda sm_90)" in fp16


def test_cpu_rows_off_16_bytes_loop():
    assert grouped_gemm_fallback_note(_config(), torch.float32, "cpu", None) is None
    odd = grouped_gemm_fallback_note(_config(hidden=34), torch.float32, "cpu", None)
    assert "[34 x 272] and [136 x 34] matmuls loop over the experts here (float32 on cpu)" in odd


def test_unasked_or_dense_runs_say_nothing():
    unasked = RoutedMoEConfig(num_experts=8, moe_layers=(True, True))
    assert grouped_gemm_fallback_note(_config(moe=unasked), torch.bfloat16, "cuda", (8, 0)) is None
    assert grouped_gemm_fallback_note(_config(moe=None), torch.bfloat16, "cuda", (8, 0)) is None
