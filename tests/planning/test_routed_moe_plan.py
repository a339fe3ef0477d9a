"""Megatron-LM's routed MoE layers in the plan (megatron/planning/routed_moe.py).

- Activations against what autograd really keeps (saved-tensor hooks, CPU), to 1% like the
  dense model's (test_activations.py): top-k 1, 2 and 4, softmax and sigmoid scores (with
  pre-softmax, scaling, z-loss, aux and sequence aux losses, the expert bias, fp32 and fp64
  router dtypes), SwiGLU, GeLU and gpt-oss's clamped quick-GeGLU experts with and without
  biases, grouped GEMM and the loop,
  a shared expert, capacity factors, both dispatchers and `--moe-layer-freq` patterns, each on
  the fp32, autocast and DeepSpeed-bf16 paths with recomputation none, selective and full
  (selective recomputes only the attention core; full keeps nothing of an MoE layer but its
  group's input, as for a dense one).
- At EP 2 on 2 processes (gloo): with a capacity factor every expert overflows, so each rank's
  expert rows are E x capacity and its saved bytes are the plan's; dropless, the rows a rank
  gets depend on the routing, but the ranks' rows add up to EP x T x k, so their mean is the
  plan's balanced share. The dispatcher's collectives, counted by benchmarks/run_meters.py's
  `CommMeter` over a forward and backward, are `dispatch_bytes` (per rank with the
  all-gather dispatcher or a capacity factor, the ranks' mean for a dropless all-to-all).
- Megatron-LM's Mixtral recipe at 32 ranks: the plan counts its MoE activations and its
  all-to-all (hand-derived in `test_mixtral_plan_counts_moe_activations_and_all_to_all`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os

import pytest
import torch

from megatron.config import ModelConfig, RoutedMoEConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.planning.activations import (
    autocast_copy_bytes,
    logits_bytes,
    stage_activation_bytes,
)
from megatron.planning.communication import rank_communication, routed_dispatch_bytes
from megatron.planning.dtypes import dtypes
from megatron.planning.layout import stage_roles
from megatron.planning.routed_moe import dispatch_bytes, routed_mlp_bytes, routed_rows
from tests.model.helpers import spawn_collect
from tests.planning.plan_inputs import plan_inputs
from tests.planning.saved_tensors import saved_bytes

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, MICRO_BATCH = 2, 128, 4, 1024, 128, 2
RECOMPUTE = (None, "selective", "full")
PATHS = ("fp32", "autocast", "ds-bf16")

# (routed MoE fields, model fields, --moe-layer-freq pattern)
VARIANTS = [
    (dict(num_experts=4, top_k=1), dict(activation="swiglu"), (True, True)),
    (dict(num_experts=4, top_k=2, score_function="sigmoid", grouped_gemm=True), {}, (True, True)),
    (
        dict(num_experts=8, top_k=4, shared_expert_ffn_hidden_size=256, dispatcher="alltoall"),
        dict(activation="swiglu"),
        (True, True),
    ),
    (
        dict(num_experts=4, top_k=2, capacity_factor=0.5, grouped_gemm=True),
        dict(activation="swiglu", add_bias_linear=False),
        (True, True),
    ),
    (
        dict(num_experts=4, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3, dispatcher="alltoall"),
        {},
        (False, True),
    ),
    (
        dict(
            num_experts=4,
            top_k=2,
            pre_softmax=True,
            topk_scaling_factor=2.0,
            aux_loss_coeff=0.01,
            load_balancing="seq_aux_loss",
        ),
        dict(activation="gelu"),
        (True, False),
    ),
    (
        dict(
            num_experts=4,
            top_k=2,
            score_function="sigmoid",
            aux_loss_coeff=0.01,
            expert_bias=True,
            router_dtype="fp32",
            shared_expert_ffn_hidden_size=128,
            shared_expert_gate=True,
        ),
        {},
        (True, True),
    ),
    (
        dict(
            num_experts=4,
            top_k=1,
            capacity_factor=1.5,
            ffn_hidden_size=256,
            router_dtype="fp64",
            z_loss_coeff=0.01,
            shared_expert_ffn_hidden_size=128,
            grouped_gemm=True,
        ),
        dict(add_bias_linear=False),
        (True, True),
    ),
    (
        dict(
            num_experts=8,
            top_k=2,
            capacity_factor=0.25,
            dispatcher="alltoall",
            score_function="sigmoid",
            grouped_gemm=True,
        ),
        dict(activation="swiglu"),
        (True, True),
    ),
    # gpt-oss's experts: the clamped quick-GeGLU with its offset (keeping only its input),
    # biases on the router and the experts, attention sinks.
    (
        dict(num_experts=4, top_k=2, aux_loss_coeff=0.01, grouped_gemm=True),
        dict(
            activation="quick_geglu",
            glu_linear_offset=1.0,
            activation_clamp_value=7.0,
            softmax_type="learnable",
        ),
        (True, True),
    ),
]
# Every variant on every path; recomputation and dropout rotate over them.
CASES = [
    (v, path, RECOMPUTE[(v + p) % 3], (v + p) % 2 == 0)
    for v in range(len(VARIANTS))
    for p, path in enumerate(PATHS)
]


def _config(path: str, variant: int, **overrides: object) -> ModelConfig:
    moe, fields, pattern = VARIANTS[variant]
    fields = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        params_dtype="bfloat16" if path == "ds-bf16" else "float32",
        **fields,
    )
    fields.update(overrides)
    return ModelConfig(**fields, routed_moe=RoutedMoEConfig(moe_layers=pattern, **moe))


def _predicted(config: ModelConfig, path: str, **layout: int) -> int:
    inputs = plan_inputs(config, path, MICRO_BATCH, SEQ, **layout)
    return (
        stage_activation_bytes(inputs, LAYERS, True, True)
        + logits_bytes(inputs)
        + autocast_copy_bytes(inputs, LAYERS, True)
    )


@pytest.mark.parametrize(
    "variant,path,recompute,dropout",
    CASES,
    ids=[f"v{v}-{p}-{r}-drop{int(d)}" for v, p, r, d in CASES],
)
def test_one_process_prediction_matches_saved_tensors(variant, path, recompute, dropout):
    drop = 0.1 if dropout else 0.0
    config = _config(
        path, variant, recompute_granularity=recompute, hidden_dropout=drop, attention_dropout=drop
    )
    measured = saved_bytes(config, MICRO_BATCH, SEQ, autocast=path == "autocast")
    assert _predicted(config, path) == pytest.approx(measured, rel=0.01)


def test_moe_layers_keep_what_the_plan_says_beyond_a_dense_layer():
    """The MoE part alone, without the rest of the model to hide in: a one-layer model with
    and without its MoE layer differ by what `routed_mlp_bytes` says beyond the dense MLP,
    to the byte (dropless at EP 1: exactly T x k rows)."""
    for path in PATHS:
        moe = _config(path, 4, num_layers=1, hidden_dropout=0.0, attention_dropout=0.0)
        moe = dataclasses.replace(
            moe, routed_moe=dataclasses.replace(moe.routed_moe, moe_layers=(True,))
        )
        dense = dataclasses.replace(moe, routed_moe=None)
        autocast = path == "autocast"
        measured = saved_bytes(moe, MICRO_BATCH, SEQ, autocast) - saved_bytes(
            dense, MICRO_BATCH, SEQ, autocast
        )
        moe_inputs = plan_inputs(moe, path, MICRO_BATCH, SEQ)
        dense_inputs = plan_inputs(dense, path, MICRO_BATCH, SEQ)
        predicted = (
            stage_activation_bytes(moe_inputs, 1, True, True)
            + autocast_copy_bytes(moe_inputs, 1, True)
            - stage_activation_bytes(dense_inputs, 1, True, True)
            - autocast_copy_bytes(dense_inputs, 1, True)
        )
        assert predicted == measured, path
        assert routed_rows(moe_inputs) == SEQ * MICRO_BATCH * 2


# ---------------------------------------------------------------------------------------------
# EP 2 on two processes
# ---------------------------------------------------------------------------------------------

EP_CASES = {
    # name: (path, routed MoE fields, recompute)
    "alltoall-dropless-fp32": ("fp32", dict(dispatcher="alltoall"), None),
    "allgather-dropless-autocast": ("autocast", dict(dispatcher="allgather"), None),
    "alltoall-capacity-autocast-full": (
        "autocast",
        dict(dispatcher="alltoall", capacity_factor=0.25, aux_loss_coeff=0.01),
        "full",
    ),
    "allgather-capacity-ds-bf16": (
        "ds-bf16",
        dict(dispatcher="allgather", capacity_factor=0.25, grouped_gemm=True),
        None,
    ),
}


def _ep_config(name: str) -> ModelConfig:
    path, moe, recompute = EP_CASES[name]
    return ModelConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        params_dtype="bfloat16" if path == "ds-bf16" else "float32",
        activation="swiglu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity=recompute,
        routed_moe=RoutedMoEConfig(num_experts=4, moe_layers=(True, True), top_k=2, **moe),
    )


def _forward_backward_collectives(config: ModelConfig, autocast: bool) -> dict[str, int]:
    """Payload bytes by op of one training forward and backward, as CommMeter counts them."""
    from benchmarks.run_meters import CommMeter
    from megatron.model import GPTModel

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(config).train()
    tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ))
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous()
    meter = CommMeter(settle=False)
    meter.install(ddp_python_allreduce=False)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with region:
            losses = model(tokens, positions, None, labels=tokens)
        losses.float().sum().backward()
    finally:
        meter.uninstall()
    kinds = {"all_to_all_single": "all_to_all", "all_gather_single": "all_gather"}
    kinds["reduce_scatter_single"] = "reduce_scatter"
    counted: dict[str, int] = {}
    for call in meter.calls:
        op = kinds[call.op]  # nothing else runs: a KeyError would say what did
        counted[op] = counted.get(op, 0) + call.nbytes
    return counted


def _rows_per_expert(model_config: ModelConfig) -> list[int]:
    """Each expert's kept tokens per MoE layer in one forward of this rank's batch."""
    from megatron.model import GPTModel
    from megatron.model.moe_layer import routed_moe_layers

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(model_config).train()
    loads: list[int] = []

    def record(module, args, output):  # noqa: ANN001, ANN202
        loads.extend(output[1].sum(dim=0).tolist())

    for layer in routed_moe_layers(model):
        layer.router.register_forward_hook(record)
    tokens = torch.randint(0, model_config.vocab_size, (MICRO_BATCH, SEQ))
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous()
    with torch.no_grad():
        model(tokens, positions, None, labels=tokens)
    return loads


def _expert_parallel_body(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel(1, 1, expert_parallel_size=world_size)
    results = {}
    for name, (path, _, _) in EP_CASES.items():
        config = _ep_config(name)
        autocast = path == "autocast"
        results[name] = {
            "saved": saved_bytes(config, MICRO_BATCH, SEQ, autocast),
            "collectives": _forward_backward_collectives(config, autocast),
            "loads": _rows_per_expert(config),
        }
    return results


def test_expert_parallel_prediction_matches_saved_tensors_and_collectives():
    """EP 2 (= DP 2) on two gloo processes, each the same batch. With capacity 0.25 every
    expert keeps exactly its capacity (ceil(T k / E x 0.25) = 32 of ~128 routed), so each
    rank's rows are the plan's; dropless, the ranks' rows add up to EP x T x k."""
    world = spawn_collect(_expert_parallel_body, 2)
    for name, (path, moe, _) in EP_CASES.items():
        config = _ep_config(name)
        inputs = plan_inputs(config, path, MICRO_BATCH, SEQ, ep=2, dp=2, world_size=2)
        role = stage_roles(inputs)[0]
        predicted = _predicted(config, path, ep=2, dp=2, world_size=2)
        collectives = routed_dispatch_bytes(inputs, role)
        ranks = [rank[name] for rank in world]
        exact_per_rank = "capacity_factor" in moe or moe["dispatcher"] == "allgather"
        if "capacity_factor" in moe:
            assert all(load == 32 for rank in ranks for load in rank["loads"]), name
            saved = [rank["saved"] for rank in ranks]
        else:  # the plan's balanced share is the ranks' mean
            saved = [sum(rank["saved"] for rank in ranks) / 2]
        for measured in saved:
            assert predicted == pytest.approx(measured, rel=0.01), name
        for op, count in collectives.items():
            counted = [rank["collectives"].get(op, 0) for rank in ranks]
            if exact_per_rank:
                assert counted == [count, count], (name, op)
            else:
                assert sum(counted) == 2 * count, (name, op)
        assert sorted(collectives) == sorted(ranks[0]["collectives"]), name
    # The dispatcher's bytes land in the plan's communication: A2A or its own EP column.
    for name, (path, moe, _) in EP_CASES.items():
        inputs = plan_inputs(_ep_config(name), path, MICRO_BATCH, SEQ, ep=2, dp=2, world_size=2)
        inputs = dataclasses.replace(inputs, grad_accum_dtype="bf16")  # DeepSpeed's at ZeRO-0
        comm = rank_communication(inputs, stage_roles(inputs)[0])
        sent = sum(routed_dispatch_bytes(inputs, stage_roles(inputs)[0]).values())
        if moe["dispatcher"] == "alltoall":
            assert comm["all_to_all"] == sent and "expert_parallel" not in comm
        else:
            assert comm["expert_parallel"] == sent and comm["all_to_all"] == 0


# ---------------------------------------------------------------------------------------------
# EP 2 folded over TP 2 (sequence parallel) or CP 2, on two processes
# ---------------------------------------------------------------------------------------------

FOLDED_CASES = {
    # name: (path, routed MoE fields); every expert overflows its capacity (exact rows per
    # rank), or dropless (the ranks' mean is the plan's balanced share)
    "capacity-fp32": ("fp32", dict(capacity_factor=0.25, aux_loss_coeff=0.01)),
    "dropless-autocast-shared": ("autocast", dict(shared_expert_ffn_hidden_size=128)),
}
FOLDED_LAYOUTS = {"tp2-sp": dict(tp=2), "cp2": dict(cp=2)}


def _folded_config(name: str, layout: str) -> ModelConfig:
    _, moe = FOLDED_CASES[name]
    config = _ep_config("alltoall-dropless-fp32")
    routed = dataclasses.replace(config.routed_moe, expert_parallel_size=2, **moe)
    return dataclasses.replace(config, routed_moe=routed, sequence_parallel=layout == "tp2-sp")


def _folded_body(rank: int, world_size: int) -> dict:
    results = {}
    for layout in FOLDED_LAYOUTS:
        if layout == "tp2-sp":
            parallel_state.initialize_model_parallel(2, 1, expert_parallel_size=2)
        else:
            parallel_state.initialize_model_parallel(1, 1, 1, 2, expert_parallel_size=2)
        seq = SEQ // 2 if layout == "cp2" else SEQ  # a context-parallel rank's part
        for name, (path, _) in FOLDED_CASES.items():
            config = _folded_config(name, layout)
            saved = saved_bytes(config, MICRO_BATCH, seq, path == "autocast")
            results[f"{layout}-{name}"] = saved
        parallel_state.destroy_model_parallel()
    return results


def test_expert_parallel_folded_over_tp_or_cp_matches_saved_tensors():
    """EP 2 over the 2 tensor-parallel ranks (sequence parallel: each routes its half of the
    tokens; the shared expert a tensor-parallel MLP) or the 2 context-parallel ranks: each
    rank's saved bytes are the plan's, or their mean where the rows depend on the routing."""
    world = spawn_collect(_folded_body, 2)
    for layout, sizes in FOLDED_LAYOUTS.items():
        for name, (path, moe) in FOLDED_CASES.items():
            config = _folded_config(name, layout)
            predicted = _predicted(config, path, ep=2, world_size=2, **sizes)
            saved = [rank[f"{layout}-{name}"] for rank in world]
            if "capacity_factor" not in moe:
                saved = [sum(saved) / 2]
            for measured in saved:
                assert predicted == pytest.approx(measured, rel=0.01), (layout, name)


def test_dispatch_bytes_by_hand():
    """T = 256 tokens, h = 128, E = 4, k = 2, EP 2, fp32 (r = c = 4 bytes):
    all-to-all: forward E x 8 (counts) + T k h r (tokens out) + T k h c (outputs back) =
    32 + 262,144 + 262,144, backward the same 524,288 again: 1,048,608 per layer; full
    recomputation runs the forward again (+524,320). All-gather: forward the tokens 2 T h r
    (262,144), the weights 2 T E r (8,192) and the map 2 T E (2,048), backward the outputs'
    gradient 2 T h c (262,144); reduce-scatters of the outputs forward, the tokens' and
    weights' gradients backward: 262,144 + 262,144 + 8,192."""
    config = _ep_config("alltoall-dropless-fp32")
    inputs = plan_inputs(config, "fp32", MICRO_BATCH, SEQ, ep=2, dp=2, world_size=2)
    assert dispatch_bytes(inputs, dtypes(inputs)) == {"all_to_all": 1_048_608}
    full = dataclasses.replace(config, recompute_granularity="full")
    inputs = dataclasses.replace(inputs, model=full)
    assert dispatch_bytes(inputs, dtypes(inputs)) == {"all_to_all": 1_048_608 + 524_320}
    gather = dataclasses.replace(
        config, routed_moe=dataclasses.replace(config.routed_moe, dispatcher="allgather")
    )
    inputs = dataclasses.replace(inputs, model=gather)
    assert dispatch_bytes(inputs, dtypes(inputs)) == {
        "all_gather": 262_144 + 8_192 + 2_048 + 262_144,
        "reduce_scatter": 262_144 + 262_144 + 8_192,
    }
    assert dispatch_bytes(dataclasses.replace(inputs, ep=1), dtypes(inputs)) == {}


# ---------------------------------------------------------------------------------------------
# Megatron-LM's Mixtral recipe
# ---------------------------------------------------------------------------------------------


def test_mixtral_plan_counts_moe_activations_and_all_to_all():
    """The captured Mixtral 8x7B recipe at 32 ranks (PP 4, EP 8, FSDP2 bf16, seq 4096,
    micro-batch 1, 32 micro-batches; every layer MoE, top-2 of 8, h 4096, F' 14336 SwiGLU,
    no biases, grouped GEMM, aux loss, all-to-all dispatch).

    Per MoE layer and micro-batch, T = 4,096 tokens, R = T k = 8,192 rows, 2-byte tensors:
    - activations: the router's input T h 2 = 33,554,432; the router 294,948 (top-k indices
      T k 8, softmax T k 4, logits T E 2, the aux loss's scores T E 4, counts E 4 and the
      loss 4); dispatch indices R 2 8 + order and inverse 2 R 8 = 262,144; the experts' input
      R h 2, first product R 2F' 2, silu R F' 2, activation R F' 2 and two int32 offsets =
      1,006,632,968; the combine R 2 + 2 R h 2 = 134,234,112: 1,174,978,604 bytes (1.09
      GiB);
    - all-to-all: 8 x 8 count bytes + 4 x R h 2 (tokens out and back, forward and backward)
      = 268,435,520 bytes; 8 layers a stage x 32 micro-batches: 68,719,493,120 per iteration.
    """
    from megatron.dry_run import run_dry_run
    from tests.compat.scripts import load_script

    script = load_script(
        os.path.join(
            os.path.dirname(__file__),
            "..",
            "compat",
            "megatron_lm",
            "mixtral__train_mixtral_8x7b_distributed.json",
        )
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        plan = run_dry_run(script.argv + ["--dry-run", "--dry-run-world-size", "32"])
    text = printed.getvalue()
    inputs = plan.inputs
    assert routed_mlp_bytes(inputs, dtypes(inputs)) == 1_174_978_604
    assert dispatch_bytes(inputs, dtypes(inputs)) == {"all_to_all": 268_435_520}
    line = next(line for line in text.splitlines() if "routed MoE:" in line)
    assert "32 of 32 layers, top-2 of 8 experts, EP 8, alltoall dispatcher" in line, line
    assert "8,192 expert rows (balanced)" in line and "activations 1.09 GiB" in line, line
    assert "dispatch all-to-all 268.4 MB" in line, line
    assert "planned for a balanced load" in text, text
    for role in plan.roles:
        assert role.communication["all_to_all"] == 68_719_493_120
        assert " 68719.5" in text
    # Stage 0 holds 4 micro-batches in flight, each 8 MoE layers' worth at least.
    assert plan.roles[0].memory.activations > 4 * 8 * 1_174_978_604


def test_shared_expert_overlap_hides_the_forward_dispatch_in_the_roofline():
    """`--moe-shared-expert-overlap` at EP 2: the roofline's all-to-all time drops by each MoE
    layer's forward dispatch (R h r over the link, (G-1)/G of it) or the shared expert's
    forward, whichever is shorter; nothing without it, at EP 1, or with the all-gather
    dispatcher."""
    from megatron.planning.devices import DEVICES
    from megatron.planning.roofline import all_to_all_seconds, estimate_step

    device = DEVICES["H100"]
    moe = dict(dispatcher="alltoall", shared_expert_ffn_hidden_size=128)
    base = _ep_config("alltoall-dropless-fp32")

    def plan(overlap: bool, ep: int = 2, **changes: object):
        routed = dataclasses.replace(
            base.routed_moe, shared_expert_overlap=overlap, expert_parallel_size=ep, **moe
        )
        config = dataclasses.replace(base, routed_moe=dataclasses.replace(routed, **changes))
        inputs = plan_inputs(config, "autocast", MICRO_BATCH, SEQ, ep=ep, dp=2, world_size=2)
        return inputs, stage_roles(inputs)[0]

    inputs, role = plan(True)
    rows, h = routed_rows(inputs), HIDDEN
    dispatch = rows * h * 4 * 0.5 / device.intra_node_bytes_per_s  # fp32 residual, (2-1)/2
    shared_flops = MICRO_BATCH * SEQ * (2 * h * 256 + 2 * 128 * h)  # SwiGLU 128 wide
    shared = shared_flops / (device.bf16_flops * 0.55)
    hidden = LAYERS * min(dispatch, shared)
    off, on = estimate_step(*plan(False), device), estimate_step(inputs, role, device)
    assert off.communication_s - on.communication_s == pytest.approx(hidden, rel=1e-9)
    assert all_to_all_seconds(inputs, role, device) > hidden > 0
    for changes in (dict(ep=1), dict(dispatcher="allgather")):
        with_flag = estimate_step(*plan(True, **changes), device)
        without = estimate_step(*plan(False, **changes), device)
        assert with_flag.communication_s == without.communication_s, changes
