"""The plan of FP8 matmuls (`--fp8-format`, megatron/planning/fp8.py): each term against bytes
measured on this CPU (the allocator's events, autograd's saved tensors) or computed by hand from
the shapes, and a plan with FP8 against the same plan without it.

Measured by hand once (benchmarks/planner_accuracy.py's `compare` on configurations like
benchmarks/planner_configs.py's, 20-150 s each, too slow for CI): with --ffn-hidden-size 32768
(so the FP8 moments make the peak) plain bf16 predicted 1634.7 MiB (fp8 forward) against
1610.7 measured, fp32 1770.4 (backward) against 1818.5 (48 MiB of it the tied output layer's
gradient, which the `backward` moment leaves out at PP 1 with or without FP8); TP=2 with
sequence parallelism in bf16 819.2 against 807.9 MiB and its tensor-parallel bytes exact;
FSDP2 with --fp8-param-gather its all-gather bytes exact to 64 bytes of 113 MB.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from benchmarks.run_meters import MemoryMeter, window_peaks
from megatron.config import Fp8Config, ModelConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.dry_run import run_dry_run
from megatron.model.fp8 import Float8Matmul
from megatron.planning.activations import (
    autocast_copy_bytes,
    logits_bytes,
    logits_working_bytes,
    stage_activation_bytes,
)
from megatron.planning.communication import data_parallel_collectives, tensor_parallel_bytes
from megatron.planning.devices import find_device
from megatron.planning.fp8 import (
    Fp8Matmul,
    backward_bytes,
    forward_bytes,
    layer_matmuls,
    stage_transient,
)
from megatron.planning.layout import stage_roles
from megatron.planning.memory import rank_memory
from megatron.planning.model_states import model_states
from megatron.planning.plan import build_plan, format_plan
from megatron.planning.roofline import MATMUL_EFFICIENCY
from tests.planning.plan_inputs import plan_inputs
from tests.planning.saved_tensors import saved_bytes

HYBRID = Fp8Config()
# h 64, 4 heads, V 1024, s 64, 2 layers (tests/planning/test_fsdp_plan.py's TINY). Per layer
# the FP8 weights are QKV 192 x 64 = 12,288, the projection 64 x 64 = 4,096, the MLP's
# 256 x 64 = 16,384 and 64 x 256 = 16,384: 49,152 elements, 12 h^2.
TINY = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024, max_position_embeddings=64
)
P, ROOT, LAYER, FP8_LAYER = 169_728, 69_760, 49_984, 49_152


def _tiny(**fields: object) -> ModelConfig:
    """TINY with FP8 (hybrid unless `fields` says otherwise)."""
    return dataclasses.replace(TINY, **{"fp8": HYBRID, **fields})


def test_devices_with_fp8_tensor_cores_have_their_fp8_peak():
    """Hopper's dense FP8 is twice its bf16 (1,979 against 989 TFLOPS); Ampere has none."""
    for name in ("H100", "H200", "H100-96GB"):
        device = find_device(name)
        assert (device.fp8_flops, device.bf16_flops) == (1979e12, 989e12)
    assert find_device("B200").fp8_flops == 2 * find_device("B200").bf16_flops
    assert find_device("L40S").fp8_flops == 733e12
    assert find_device("A100").fp8_flops is None and find_device("V100").fp8_flops is None


@pytest.fixture(scope="module")
def matmuls() -> dict[bool, Float8Matmul]:
    """The FP8 matmul with and without FP8 weight gradients (torchao imported once)."""
    return {wgrad: Float8Matmul(Fp8Config(wgrad=wgrad)) for wgrad in (True, False)}


def _measured_matmul(matmul: Float8Matmul, m: int, k: int, n: int, half: bool) -> tuple[int, int]:
    """(forward, backward) peaks of one FP8 matmul's allocations above what was live before
    each pass (the allocator's events): fp32 weight, input and output gradient in bf16 when
    `half` (the plain path under autocast), else fp32."""
    dtype = torch.bfloat16 if half else torch.float32
    weight = torch.nn.Parameter(torch.randn(n, k))
    input_ = torch.randn(m, k, dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n, dtype=dtype)
    meter = MemoryMeter()
    meter.start()
    meter.mark("start")
    output = matmul(input_, weight)
    meter.mark("forward")
    output.backward(grad)
    meter.mark("end")
    trace = meter.stop()
    marks = [trace.marks[name] for name in ("start", "forward", "end")]
    (forward, backward), (start, after_forward, _) = window_peaks(trace.times, trace.deltas, marks)
    return forward - start, backward - after_forward


CPU_CASES = [
    (256, 128, 512, True, True),
    (256, 128, 512, False, True),
    (32, 512, 256, True, True),  # more weight than tokens: the input gradient's matmul
    (512, 64, 64, False, True),
    (256, 128, 512, True, False),
    (32, 512, 256, False, False),
]


@pytest.mark.parametrize("onednn", [False, True], ids=["reference-kernel", "as-this-cpu-runs"])
@pytest.mark.parametrize("m,k,n,half,wgrad", CPU_CASES)
def test_one_fp8_matmul_allocates_what_the_plan_says_on_this_cpu(
    matmuls, m, k, n, half, wgrad, onednn
):
    """torchao's matmul and torch's CPU `_scaled_mm` as run here: the forward's height (its
    output, which the plan counts among the activations, alive there) and the backward's, to
    the bytes of the scales (a few 4-byte tensors). With oneDNN off, torch's reference kernel
    on every CPU; with it on, oneDNN's where this CPU has AMX (`cpu_scaled_mm_is_onednn`)."""
    config = dataclasses.replace(TINY, fp8=Fp8Config(wgrad=wgrad))
    inputs = plan_inputs(config, "autocast" if half else "fp32", 2, 64)
    matmul = Fp8Matmul(m, k, n)
    with torch.backends.mkldnn.flags(enabled=onednn):
        forward, backward = _measured_matmul(matmuls[wgrad], m, k, n, half)
        planned = forward_bytes(inputs, matmul), backward_bytes(inputs, matmul)
    output = m * n * (2 if half else 4)
    assert 0 <= forward - (planned[0] + output) < 64
    assert 0 <= backward - planned[1] < 64


def test_fp8_matmul_heights_on_a_gpu_by_hand():
    """M 1024 tokens, K 256, N 1024, bf16 on a GPU (no CPU kernel copies), from torchao's code:
    forward, above F.linear's output (2 MN), the weight's cast beside the input's FP8 copy
    before the output exists (MK + 9 NK - 2 MN), as high as the matmul over both FP8 copies
    beside the output (MK + NK); backward, the output
    gradient's second cast beside its first copy, the FP8 weight and the input gradient
    (MN + NK + 2 MK + 9 MN); without FP8 weight gradients the first cast (9 MN)."""
    inputs = dataclasses.replace(plan_inputs(_tiny(), "autocast", 2, 64), device_type="cuda")
    matmul = Fp8Matmul(1024, 256, 1024)
    assert forward_bytes(inputs, matmul) == 262_144 + 9 * 262_144 - 2 * 1_048_576 == 524_288
    assert backward_bytes(inputs, matmul) == 1_048_576 + 262_144 + 524_288 + 9 * 1_048_576
    no_wgrad = dataclasses.replace(inputs, model=_tiny(fp8=Fp8Config(wgrad=False)))
    assert backward_bytes(no_wgrad, matmul) == 9 * 1_048_576
    # QKV's bias, added to the product, makes a second output: i MN beside it (here above the
    # input's cast, 9 MK = 589,824, and the weight's, MK + 9 NK = 83,968).
    biased = Fp8Matmul(4096, 16, 128, bias=True)
    assert forward_bytes(inputs, biased) == 2 * 4096 * 128 == 1_048_576


@pytest.mark.parametrize("path", ["fp32", "autocast"])
def test_a_gpt_forward_and_backward_peak_where_the_plan_puts_them(path):
    """A 2-layer GPT whose MLP (ffn 4096) makes the FP8 matmuls the height of each pass: the
    forward's peak above the parameters is the kept activations and the last MLP's second
    matmul (`fp8 forward`), the backward's the activations, its first FP8 matmul's transient
    and the tied output layer's weight gradient (held to the embedding's backward; the plan's
    `backward` moment leaves it out at PP 1, with or without FP8), to 2% (under autocast the
    plan counts the output layer's weight copy from the forward's start)."""
    config = dataclasses.replace(_tiny(), vocab_size=128, ffn_hidden_size=4096)
    config = dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0)
    inputs = plan_inputs(config, path, 2, 64)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    from megatron.model import GPTModel

    model = GPTModel(config).train()
    tokens = torch.randint(0, 128, (2, 64))
    positions = torch.arange(64).expand(2, 64).contiguous()
    meter = MemoryMeter()
    meter.start()
    meter.mark("start")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=path == "autocast"):
        loss = model(tokens, positions, None, labels=tokens).float().mean()
    meter.mark("forward")
    loss.backward()
    meter.mark("end")
    trace = meter.stop()
    marks = [trace.marks[name] for name in ("start", "forward", "end")]
    (forward, backward), _ = window_peaks(trace.times, trace.deltas, marks)
    kept = stage_activation_bytes(inputs, 2, True, True) + autocast_copy_bytes(inputs, 2, True)
    transient = stage_transient(inputs, [1, 2])
    assert transient.forward > logits_bytes(inputs)  # the FP8 moment, not the loss's
    assert kept + transient.forward == pytest.approx(forward, rel=0.02)
    output_gradient = 4 * 128 * 64
    assert kept + transient.backward + output_gradient == pytest.approx(backward, rel=0.02)


def test_fp8_layers_keep_no_autocast_weight_copies():
    """Autograd's saved tensors (one process): torchao's matmul saves the fp32 weight itself,
    so an FP8 layer leaves none of autocast's four bf16 weight copies (12 h^2 x 2 bytes); a
    layer kept in bf16 (`--first-last-layers-bf16`) still does."""
    without = plan_inputs(TINY, "autocast", 2, 64)
    for fp8, layers in ((HYBRID, 2), (Fp8Config(bf16_layers_at_start=1), 1)):
        config = dataclasses.replace(TINY, fp8=fp8)
        inputs = plan_inputs(config, "autocast", 2, 64)
        copies = autocast_copy_bytes(without, 2, True) - autocast_copy_bytes(inputs, 2, True)
        assert copies == layers * FP8_LAYER * 2
        predicted = (
            stage_activation_bytes(inputs, 2, True, True)
            + logits_bytes(inputs)
            + autocast_copy_bytes(inputs, 2, True)
        )
        assert predicted == pytest.approx(saved_bytes(config, 2, 64, autocast=True), rel=0.01)


def test_sequence_parallel_fp8_layers_keep_whole_inputs_and_gather_them_once():
    """TP 2 with sequence parallelism, fp32, 2 micro-batches: each FP8 layer's QKV and first MLP
    input kept whole (T = 128 tokens, not 64: 2 x 64 x 64 x 4 bytes more per layer), and in
    the backward neither gathered again (2 x 128 x 64 x 4 bytes less per layer and
    micro-batch). (Measured on 2 ranks: 262,144 saved bytes more for the 2 layers, and the
    tensor-parallel bytes of the run above.)"""
    layout = dict(tp=2, world_size=2, micro_batches=2)
    config = dataclasses.replace(TINY, sequence_parallel=True)
    plain = plan_inputs(config, "fp32", 2, 64, **layout)
    fp8 = plan_inputs(dataclasses.replace(config, fp8=HYBRID), "fp32", 2, 64, **layout)
    kept = stage_activation_bytes(fp8, 2, True, True) - stage_activation_bytes(plain, 2, True, True)
    assert kept == 2 * (2 * 64 * 64 * 4) == 65_536
    role = stage_roles(plain)[0]
    saved = tensor_parallel_bytes(plain, role) - tensor_parallel_bytes(fp8, role)
    assert saved == 2 * 2 * (2 * 128 * 64 * 4) == 262_144
    assert "whole-sequence inputs kept +0.1 MiB per micro-batch" in format_plan(build_plan(fp8))


@pytest.mark.parametrize("strategy,passes", [("optim_grads", 1), ("optim_grads_params", 2)])
def test_fsdp2_gathers_fp8_weights_in_one_byte(strategy, passes):
    """--fp8-param-gather under FSDP2 at Z = 2, bf16, 2 micro-batches: the FP8 weights (every
    size even: no padding) gathered in 1 byte, not 2: optim_grads holds every unit
    (2 P - 2 x 49,152), optim_grads_params the root and one layer (2 (ROOT + LAYER) - 49,152);
    each gather moves 49,152 bytes less per layer, after a 4-byte amax all-reduce per weight."""
    config = _tiny(fp8=Fp8Config(param_gather=True))
    layout = dict(dp=2, world_size=2, micro_batches=2)
    inputs = dataclasses.replace(
        plan_inputs(config, "autocast", 2, 64, **layout), sharding=strategy
    )
    role = stage_roles(inputs)[0]
    states = model_states(inputs, role)
    if strategy == "optim_grads":
        assert states.gathered == 2 * P - 2 * FP8_LAYER
    else:
        assert states.gathered == 2 * (ROOT + LAYER) - FP8_LAYER
        assert states.prefetched == 2 * LAYER - FP8_LAYER
    gather, scatter, amax = data_parallel_collectives(inputs, role)
    assert gather.bytes == passes * 2 * (2 * P - 2 * FP8_LAYER)
    assert scatter.bytes == 4 * P  # fp32 gradients, as without FP8
    assert (amax.op, amax.bytes) == ("all_reduce", passes * 2 * 8 * 4)
    # Without the flag (or without FSDP2) every weight travels in bf16.
    plain = dataclasses.replace(inputs, model=_tiny())
    assert [c.bytes for c in data_parallel_collectives(plain, role)] == [
        passes * 2 * 2 * P,
        4 * P,
    ]


def test_the_roofline_runs_fp8_flops_at_the_fp8_peak():
    """Per token the FP8 matmuls' forward is 2 x 12 h^2 per layer; training runs it 3 times
    (forward, input and weight gradients), and at H100's 1,979 TFLOPS instead of 989; an
    A100 has no FP8: the same step as without FP8, and a note."""
    tokens = 2 * 64
    fp8_flops = 3 * 2 * 2 * FP8_LAYER * tokens
    without = build_plan(plan_inputs(TINY, "autocast", 2, 64), find_device("H100"))
    with_fp8 = build_plan(plan_inputs(_tiny(), "autocast", 2, 64), find_device("H100"))
    assert with_fp8.estimate.fp8_flops == fp8_flops
    saved = fp8_flops / (989e12 * MATMUL_EFFICIENCY) - fp8_flops / (1979e12 * MATMUL_EFFICIENCY)
    difference = without.estimate.compute_s - with_fp8.estimate.compute_s
    assert difference == pytest.approx(saved, rel=1e-9)
    assert with_fp8.estimate.model_flops == without.estimate.model_flops
    no_wgrad = build_plan(
        plan_inputs(_tiny(fp8=Fp8Config(wgrad=False)), "autocast", 2, 64), find_device("H100")
    )
    assert no_wgrad.estimate.fp8_flops == 2 * fp8_flops / 3
    a100 = build_plan(plan_inputs(_tiny(), "autocast", 2, 64), find_device("A100"))
    assert (
        a100.estimate.compute_s
        == build_plan(plan_inputs(TINY, "autocast", 2, 64), find_device("A100")).estimate.compute_s
    )
    assert any("no FP8 tensor cores" in note for note in a100.notes)


def test_a_plan_with_fp8_differs_from_one_without_by_exactly_these_terms():
    """Plain bf16 on a GPU, TP 1: every moment loses the four autocast weight copies of each
    FP8 layer; the backward gains the largest FP8 matmul's backward transient; `fp8 forward`
    is the forward without the logits, with the forward transient; bytes sent are the same."""
    inputs = dataclasses.replace(plan_inputs(_tiny(), "autocast", 2, 64), device_type="cuda")
    plain = dataclasses.replace(inputs, model=TINY)
    role = stage_roles(inputs)[0]
    with_fp8, without = rank_memory(inputs, role), rank_memory(plain, role)
    copies = 2 * FP8_LAYER * 2
    transient = stage_transient(inputs, [1, 2])
    assert transient.forward == max(forward_bytes(inputs, mm) for mm in layer_matmuls(inputs, 2))
    changed = {name: with_fp8.moments[name] - without.moments[name] for name in without.moments}
    assert changed == {
        "forward": -copies,
        "backward": -copies + transient.backward,
        "boundary": 0,
        "step": 0,
        "embedding backward": -copies,
    }
    logits = logits_bytes(inputs) + logits_working_bytes(inputs)
    fp8_forward = without.moments["forward"] - copies - logits + transient.forward
    assert with_fp8.moments["fp8 forward"] == fp8_forward
    plan, plain_plan = build_plan(inputs), build_plan(plain)
    assert plan.roles[0].communication == plain_plan.roles[0].communication


SMALL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "10", "--bf16",
    "--data-path", "/nowhere/x", "--dry-run", "--dry-run-world-size", "2",
    "--fp8-format", "hybrid", "--first-last-layers-bf16",
]  # fmt: skip


def test_the_dry_run_names_fp8(tmp_path, capsys):
    """One line names the recipe, the FP8 linear layers (4 of the one layer not kept in bf16)
    and the transient copies; the JSON carries them."""
    path = str(tmp_path / "plan.json")
    run_dry_run(SMALL + ["--num-layers-at-end-in-bf16", "0", "--dry-run-json", path])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "FP8 matmuls" in line)
    assert line.strip().startswith("FP8 matmuls hybrid tensorwise: 4 linear layers; transient")
    with open(path) as file:
        fp8 = json.load(file)["fp8"]
    assert (fp8["format"], fp8["recipe"], fp8["linear_layers"]) == ("hybrid", "tensorwise", 4)
    assert fp8["transient_backward_bytes"] > 0
