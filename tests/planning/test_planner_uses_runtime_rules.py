"""The planner asks the runtime's own rules instead of keeping copies that drift.

- `--moe-grouped-gemm`: whether an expert matmul runs torch's grouped matmul or the loop is
  `megatron.model.moe_experts.grouped_mm_runs`, which the experts call with their tensors'
  facts and the planner (megatron/planning/routed_moe.py) with the plan's device, compute
  dtype and GPU (`Device.compute_capability`). On a grid of devices, dtypes, capabilities and
  shapes the plan's grouped matmuls are the ones the experts run: on CPU a real forward
  counts torch's grouped_mm calls, on CUDA the experts' own check reads stand-in tensors and
  the capability torch would report.
- FP8 on a device without FP8 tensor cores: the plan's note that a run stops at start-up is
  `megatron.model.fp8.has_fp8_tensor_cores`, which `fp8_support` refuses by.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.arguments import parse_args
from megatron.config import Fp8Config, ModelConfig, RoutedMoEConfig
from megatron.dry_run import plan_from_args
from megatron.model import fp8 as runtime_fp8
from megatron.model import moe_experts
from megatron.planning import plan as plan_module
from megatron.planning import routed_moe
from megatron.planning.devices import DEVICES, find_device
from megatron.planning.dtypes import dtypes
from megatron.planning.inputs import PlanInputs
from megatron.planning.plan import build_plan, fp8_notes
from megatron.planning.routed_moe import routed_mlp_bytes
from tests.planning.plan_inputs import plan_inputs

EXPERTS, COUNTS = 4, [3, 0, 4, 3]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (hidden, expert ffn): every row fits; in half precision only the SwiGLU first matmul's
# 2 x 36 columns fit (one matmul grouped, one looped); rows of 60 fit only in fp32.
SHAPES = [(64, 128), (64, 36), (60, 128)]
ACTIVATIONS = ("swiglu", "gelu")
CAPABILITIES = [(7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]

FLAGS = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 "
    "--train-iters 10 --lr 1e-3 --bf16 --swiglu --num-experts 8 --moe-router-topk 2 "
    "--data-path /nowhere/doc --dry-run --dry-run-world-size 8"
)
OFFSETS = 8 * 4  # one grouped matmul's int32 group offsets, for the job's 8 local experts


def _config(hidden: int, ffn: int, activation: str, grouped: bool, dtype: str) -> ModelConfig:
    moe = RoutedMoEConfig(
        num_experts=EXPERTS, moe_layers=(True,), ffn_hidden_size=ffn, grouped_gemm=grouped
    )
    return ModelConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=16,
        params_dtype=dtype,
        activation=activation,
        routed_moe=moe,
    )


def _planned_grouped_matmuls(
    hidden: int,
    ffn: int,
    activation: str,
    precision: str,
    device_type: str,
    capability: tuple[int, int] | None,
) -> int:
    """How many of the experts' two matmuls the plan has run grouped: the group offsets
    `--moe-grouped-gemm` adds to the MoE layer's activations, per matmul."""
    kept = []
    for grouped in (True, False):
        inputs = plan_inputs(_config(hidden, ffn, activation, grouped, "float32"), "fp32", 1, 16)
        inputs = dataclasses.replace(
            inputs, precision=precision, device_type=device_type, compute_capability=capability
        )
        kept.append(routed_mlp_bytes(inputs, dtypes(inputs)))
    extra = kept[0] - kept[1]
    assert extra % (EXPERTS * 4) == 0, extra
    return extra // (EXPERTS * 4)


def _grouped_mm_calls(experts: torch.nn.Module, tokens: torch.Tensor, monkeypatch) -> int:
    """How many times the experts' forward calls torch's grouped matmul."""
    calls = []
    grouped_mm = F.grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return grouped_mm(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(F, "grouped_mm", counted)
        experts(tokens, COUNTS)
    return len(calls)


@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_plan_groups_the_matmuls_the_experts_group(precision, shape, activation, monkeypatch):
    """On CPU: the experts' real forward, its grouped_mm calls counted."""
    hidden, ffn = shape
    dtype = DTYPES[precision]
    config = _config(hidden, ffn, activation, True, str(dtype).removeprefix("torch."))
    experts = moe_experts.GroupedExperts(config, EXPERTS, 0)
    tokens = torch.randn(sum(COUNTS), hidden, dtype=dtype)
    ran = _grouped_mm_calls(experts, tokens, monkeypatch)
    assert _planned_grouped_matmuls(hidden, ffn, activation, precision, "cpu", None) == ran


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_plan_groups_the_matmuls_the_experts_check_lets_through(
    capability, precision, shape, monkeypatch
):
    """On CUDA: the experts' own check of their tensors (`_grouped_mm_fits`, what `_matmul`
    asks) on stand-ins for CUDA tensors, torch reporting `capability` for their GPU."""
    hidden, ffn = shape
    width = 2 * ffn  # SwiGLU's first matmul: [gate | up]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    ran = 0
    for in_features, out_features in ((hidden, width), (ffn, hidden)):
        tokens = types.SimpleNamespace(
            is_cuda=True,
            device=torch.device("cuda", 0),
            dtype=DTYPES[precision],
            shape=(sum(COUNTS), in_features),
        )
        weight = types.SimpleNamespace(shape=(EXPERTS, in_features, out_features))
        ran += moe_experts._grouped_mm_fits(tokens, weight)
    planned = _planned_grouped_matmuls(hidden, ffn, "swiglu", precision, "cuda", capability)
    assert planned == ran
    if shape == SHAPES[0]:  # rows that fit any dtype: bf16 from sm_90 decides
        assert ran == (2 if capability >= (9, 0) and precision == "bf16" else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", DTYPES)
def test_this_gpus_plan_groups_the_matmuls_the_experts_group(precision, monkeypatch):
    """On this machine's GPU: the experts' real forward against the plan for its capability."""
    hidden, ffn = SHAPES[1]
    dtype = DTYPES[precision]
    config = _config(hidden, ffn, "swiglu", True, str(dtype).removeprefix("torch."))
    experts = moe_experts.GroupedExperts(config, EXPERTS, 0).cuda()
    tokens = torch.randn(sum(COUNTS), hidden, dtype=dtype, device="cuda")
    ran = _grouped_mm_calls(experts, tokens, monkeypatch)
    capability = torch.cuda.get_device_capability()
    assert _planned_grouped_matmuls(hidden, ffn, "swiglu", precision, "cuda", capability) == ran


def _moe_plans(device: str | None, grouped: bool):
    """The flags' plan on `device` (None: this machine, a CPU here), with or without
    `--moe-grouped-gemm`."""
    argv = FLAGS.split() + (["--moe-grouped-gemm"] if grouped else [])
    return plan_from_args(parse_args(argv), find_device(device) if device else None)


def _offsets_planned(device: str | None) -> int:
    """What `--moe-grouped-gemm` adds to one MoE layer's activations on `device`."""
    with_, without = (_moe_plans(device, grouped) for grouped in (True, False))
    return routed_mlp_bytes(with_.inputs, dtypes(with_.inputs)) - routed_mlp_bytes(
        without.inputs, dtypes(without.inputs)
    )


@pytest.mark.parametrize(
    "device,grouped", [("H100", True), ("H200", True), ("B200", True), ("A100", False)]
)
def test_bf16_plan_groups_on_hopper_and_later_and_falls_back_on_ampere(device, grouped):
    """The runtime runs grouped_mm on CUDA in bf16 from sm_90 (H100, H200, B200), the loop
    before it (A100: sm_80)."""
    plan = _moe_plans(device, True)
    assert plan.inputs.compute_capability == find_device(device).compute_capability
    assert _offsets_planned(device) == (2 * OFFSETS if grouped else 0)
    if grouped:  # at the end of the forward: two MoE layers' worth, one micro-batch
        loop = _moe_plans(device, False)
        forward = [p.roles[0].memory.moments["forward"] for p in (plan, loop)]
        assert forward[0] - forward[1] == 2 * 2 * OFFSETS


def test_a_cpu_plan_has_no_capability_and_groups_in_bf16():
    """On CPU the runtime asks no compute capability: grouped_mm runs in any dtype whose rows
    are 16-byte multiples."""
    plan = _moe_plans(None, True)
    assert plan.inputs.device_type == "cpu" and plan.inputs.compute_capability is None
    assert _offsets_planned(None) == 2 * OFFSETS
    # A CPU plan timed on a named GPU keeps its CPU tensors' rule.
    assert build_plan(plan.inputs, find_device("A100")).inputs.compute_capability is None


def test_a_runs_own_plan_reads_its_started_gpu(monkeypatch):
    """A run planning itself (`predicted_peak_bytes`: `from_args` on its device type, no
    device named) asks its own GPU, once CUDA is up; a dry run starts no device, and plans an
    unknown GPU as Hopper."""
    args = parse_args(FLAGS.split() + ["--moe-grouped-gemm"])
    unknown = build_plan(PlanInputs.from_args(args, "cuda")).inputs
    assert unknown.compute_capability is None
    assert routed_moe.UNKNOWN_GPU_CAPABILITY == find_device("H100").compute_capability
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    started = build_plan(PlanInputs.from_args(args, "cuda")).inputs
    assert started.compute_capability == (8, 0)
    assert routed_mlp_bytes(unknown, dtypes(unknown)) - routed_mlp_bytes(
        started, dtypes(started)
    ) == (2 * OFFSETS)


def test_the_plan_asks_the_model_for_grouped_mm(monkeypatch):
    """No copy in the planner: it calls the experts' own function, with the plan's facts,
    and follows whatever it says."""
    assert routed_moe.grouped_mm_runs is moe_experts.grouped_mm_runs
    asked = []

    def refuse(*facts):
        asked.append(facts)
        return False

    monkeypatch.setattr(routed_moe, "grouped_mm_runs", refuse)
    assert _offsets_planned("H100") == 0
    assert asked and all(facts[:3] == ("cuda", torch.bfloat16, (9, 0)) for facts in asked)
    assert {facts[3] for facts in asked} >= {256}  # the hidden size, into the first matmul
    monkeypatch.setattr(routed_moe, "grouped_mm_runs", lambda *facts: True)
    assert _offsets_planned("A100") == 2 * OFFSETS


def test_fp8_note_is_the_runtimes_fp8_check(monkeypatch):
    """`fp8_support` refuses FP8 training on a GPU exactly where the plan says a run stops at
    start-up, for every device of the table; the planner asks `has_fp8_tensor_cores`."""
    pytest.importorskip("torchao.float8")
    assert plan_module.has_fp8_tensor_cores is runtime_fp8.has_fp8_tensor_cores
    config = _config(64, 128, "swiglu", False, "float32")
    inputs = dataclasses.replace(
        plan_inputs(dataclasses.replace(config, fp8=Fp8Config()), "autocast", 1, 16),
        device_type="cuda",
    )
    for device in DEVICES.values():
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda _=None, d=device: d.compute_capability
        )
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None, d=device: d.name)
        refused = runtime_fp8.fp8_support(torch.device("cuda", 0)) is not None
        stops = any("stops there at start-up" in note for note in fp8_notes(inputs, device))
        assert refused == stops, device.name
        if device.fp8_flops is not None:  # a tabulated FP8 peak is one the runtime runs at
            assert not refused, device.name
    # MI300X (sm_94 as ROCm reports it) passes the check; the table has no FP8 peak for it.
    notes = fp8_notes(inputs, find_device("MI300X"))
    assert notes == [
        "MI300X: no FP8 peak in the device table; its FP8 matmuls are timed at the bf16 peak"
    ]
    monkeypatch.setattr(plan_module, "has_fp8_tensor_cores", lambda capability: False)
    assert any("stops there at start-up" in note for note in fp8_notes(inputs, find_device("H100")))
