"""megatron.deepspeed_facts: the wrapper table as DeepSpeed's source states it, and each row
checked against what a real `deepspeed.initialize` builds on this machine's CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron.deepspeed_facts import (
    OptimizerWrapper,
    UnsupportedByDeepSpeed,
    effective_overlap_comm,
    gradients_reduced_each_micro_batch,
    guards_steps,
    optimizer_state_partitioned,
    optimizer_wrapper,
)
from tests.distributed import run_distributed

W = OptimizerWrapper

# (precision, ZeRO stage, pipeline engine, grad_accum_dtype) -> wrapper, as
# engine._do_optimizer_sanity_check and _configure_fp16_optimizer read.
TABLE = [
    ("fp32", 0, False, None, W.CLIENT),
    ("fp32", 0, True, None, W.CLIENT),
    ("bf16", 0, False, None, W.FP16_UNFUSED),  # DDP_BFLOAT16 -> the fp16 wrapper class
    ("bf16", 0, True, None, W.BF16),
    ("fp16", 0, False, None, W.FP16_UNFUSED),
    ("fp16", 0, True, None, W.FP16_UNFUSED),  # not BF16_Optimizer: that is bf16's only
    ("bf16", 1, False, "fp32", W.BF16),
    ("bf16", 1, True, "fp32", W.BF16),
    ("bf16", 1, False, "bf16", W.ZERO),
    ("fp16", 1, False, None, W.ZERO),
    ("fp16", 1, True, None, W.ZERO),
    ("fp16", 1, False, "fp32", W.ZERO),
    ("bf16", 2, False, "fp32", W.ZERO),
    ("fp16", 2, False, None, W.ZERO),
    ("bf16", 3, False, "fp32", W.ZERO3),
    ("fp32", 1, False, None, W.ZERO),
]


@pytest.mark.parametrize("precision,stage,pipeline,accumulation,expected", TABLE)
def test_the_wrapper_deepspeed_runs(precision, stage, pipeline, accumulation, expected):
    assert optimizer_wrapper(precision, stage, pipeline, accumulation) is expected


def test_bf16_zero1_with_offload_runs_the_zero_optimizer():
    """The BF16 branch of _do_optimizer_sanity_check excludes ZeRO-Offload."""
    assert optimizer_wrapper("bf16", 1, False, "fp32", offload_optimizer=True) is W.ZERO


def test_a_fused_adam_client_gets_the_fused_fp16_wrapper():
    assert optimizer_wrapper("fp16", 0, False, fused_client_optimizer=True) is W.FP16_FUSED


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero0_refuses_fp32_accumulation_of_half_gradients(precision):
    with pytest.raises(UnsupportedByDeepSpeed, match="ZeRO stage 0"):
        optimizer_wrapper(precision, 0, True, "fp32")


def test_partitioned_state_and_guarded_steps():
    assert not optimizer_state_partitioned(W.FP16_UNFUSED)
    assert not optimizer_state_partitioned(W.CLIENT)
    assert all(optimizer_state_partitioned(w) for w in (W.BF16, W.ZERO, W.ZERO3))
    assert not guards_steps(W.CLIENT) and guards_steps(W.FP16_UNFUSED) and guards_steps(W.BF16)


def test_when_gradients_are_reduced_and_overlapped():
    assert [gradients_reduced_each_micro_batch(s) for s in range(4)] == [False, False, True, True]
    assert effective_overlap_comm(3, None, False) and not effective_overlap_comm(2, None, False)
    assert effective_overlap_comm(2, True, False)
    assert not effective_overlap_comm(1, True, True)  # the pipeline engine turns it off
    assert not effective_overlap_comm(0, True, False)


def test_importing_the_facts_imports_no_deepspeed():
    code = "import sys, megatron.deepspeed_facts; print('deepspeed' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# Built for real below: every row the CPU can run (fp16 only where DeepSpeed's CPU
# accelerator reports fp16 support).
REAL = [
    ("fp32", 0, False, None),
    ("bf16", 0, False, None),
    ("bf16", 0, True, None),
    ("bf16", 1, False, "fp32"),
    ("bf16", 1, False, "bf16"),
    ("bf16", 1, True, "fp32"),
    ("fp16", 0, False, None),
    ("fp16", 0, True, None),
    ("fp16", 1, True, None),
]


def _build_engines(rank: int, world_size: int, out: str) -> None:
    """`type(engine.optimizer).__name__` for each REAL row, written to `out` as JSON."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule

    fp16 = bool(get_accelerator().is_fp16_supported())
    built = {}
    for precision, stage, pipeline, accumulation in REAL:
        if precision == "fp16" and not fp16:
            continue
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
        if pipeline:
            model = PipelineModule(layers, num_stages=1, loss_fn=torch.nn.MSELoss())
        else:
            model = torch.nn.Sequential(*layers)
        model = model.to(dtype)
        config = {
            "train_batch_size": 2,
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": stage},
        }
        if precision != "fp32":
            config[precision] = {"enabled": True}
        if accumulation is not None:
            config["data_types"] = {"grad_accum_dtype": accumulation}
        client = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=config)
        built[f"{precision} {stage} {pipeline} {accumulation}"] = type(engine.optimizer).__name__
        engine.destroy()
    with open(out, "w") as file:
        json.dump(built, file)


@pytest.mark.slow
def test_each_wrapper_is_what_deepspeed_initialize_builds(tmp_path):
    out = str(tmp_path / "built.json")
    run_distributed(_build_engines, 1, out)
    with open(out) as file:
        built = json.load(file)
    assert len(built) >= 6, built
    for key, name in built.items():
        precision, stage, pipeline, accumulation = key.split()
        accumulation = None if accumulation == "None" else accumulation
        expected = optimizer_wrapper(precision, int(stage), pipeline == "True", accumulation)
        assert name == ("AdamW" if expected is W.CLIENT else expected.value), key


def test_the_bucket_defaults_are_deepspeeds():
    """Each default as DeepSpeed's own config class (and engine) has it."""
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from megatron import deepspeed_facts as facts

    parsed = DeepSpeedZeroConfig(stage=1)
    assert facts.REDUCE_BUCKET_SIZE == parsed.reduce_bucket_size
    assert facts.ALLGATHER_BUCKET_SIZE == parsed.allgather_bucket_size
    assert facts.PREFETCH_BUCKET_SIZE == parsed.prefetch_bucket_size
    assert facts.PARAM_PERSISTENCE_THRESHOLD == parsed.param_persistence_threshold
    assert facts.MAX_LIVE_PARAMETERS == parsed.max_live_parameters
    assert facts.MAX_REUSE_DISTANCE == parsed.max_reuse_distance
    assert facts.ENGINE_ALLREDUCE_BUCKET == MEMORY_OPT_ALLREDUCE_SIZE
    assert parsed.overlap_comm is False and DeepSpeedZeroConfig(stage=3).overlap_comm is True
    import deepspeed

    assert deepspeed.__version__.startswith(facts.DEEPSPEED_VERSION_READ)
