"""The plan of torch FSDP2 on the plain engine (`--use-distributed-optimizer`,
`--use-torch-fsdp2`): per-rank bytes computed by hand, the activations FSDP2's half-precision
weights leave, the dry run of a 4-rank job and the suggestions that shard a job to fit.
(benchmarks/planner_configs.py's `fsdp2-*` runs check the same model against measured peaks.)
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron.arguments import parse_args
from megatron.config import ModelConfig
from megatron.dry_run import plan_from_args, run_dry_run
from megatron.planning.activations import (
    autocast_copy_bytes,
    logits_bytes,
    stage_activation_bytes,
)
from megatron.planning.communication import data_parallel_collectives
from megatron.planning.devices import find_device
from megatron.planning.layout import stage_roles
from megatron.planning.memory import rank_memory
from megatron.planning.model_states import model_states
from megatron.planning.suggestions import candidate_changes
from tests.planning.plan_inputs import deepspeed_inputs, plan_inputs
from tests.planning.saved_tensors import saved_bytes

# h 64, 4 heads, V 1024, s 64, 2 layers, tied output layer. Per rank (TP 1), elements:
#   root: word embeddings 1024 x 64 = 65,536 + positions 64 x 64 = 4,096 + final norm 128
#         = 69,760
#   layer: norms 2 x 128 + QKV 3 x 64 x 64 + 192 = 12,480 + projection 4,096 + 64 = 4,160
#          + fc1 256 x 64 + 256 = 16,640 + fc2 64 x 256 + 64 = 16,448 -> 49,984
#   P = 69,760 + 2 x 49,984 = 169,728; every tensor's size is even, so at Z = 2 the shard is
#   P / 2 = 84,864 with no padding.
TINY = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024, max_position_embeddings=64
)
P, ROOT, LAYER, SHARD = 169_728, 69_760, 49_984, 84_864


def _inputs(sharding: str, path: str, reduce: str = "fp32", micro_batches: int = 2):
    base = plan_inputs(TINY, path, 2, 64, dp=2, world_size=2, micro_batches=micro_batches)
    return dataclasses.replace(base, sharding=sharding, grad_reduce_dtype=reduce)


def test_optim_grads_fp32_states_by_hand():
    inputs = _inputs("optim_grads", "fp32")
    role = stage_roles(inputs)[0]
    assert (role.num_parameters, sum(role.parameters.values())) == (P, P)
    states = model_states(inputs, role)
    assert states.weights == 4 * SHARD == 339_456  # the fp32 master shard
    assert states.optimizer == 8 * SHARD == 678_912  # exp_avg + exp_avg_sq shards
    assert states.sharded_gradients == 4 * SHARD  # reduce-scattered, fp32
    assert states.gathered == 4 * P == 678_912  # every unit gathered in fp32, kept to backward
    assert states.prefetched == 0
    assert states.unsharded_gradients == 4 * P  # whole fp32 gradients between micro-batches
    # The root's reduce-scatter: its carried fp32 gradient and the fp32 flat input.
    assert states.reduction == 4 * ROOT + 4 * ROOT == 558_080
    assert states.gather_copy == 4 * ROOT  # the flat all-gather output beside the copies


def test_optim_grads_params_bf16_states_by_hand():
    inputs = _inputs("optim_grads_params", "autocast")
    states = model_states(inputs, stage_roles(inputs)[0])
    assert states.weights == 4 * SHARD and states.optimizer == 8 * SHARD
    assert states.gathered == 2 * (ROOT + LAYER) == 239_488  # bf16: the root and one layer
    assert states.prefetched == 2 * LAYER == 99_968  # the next layer, in the backward
    assert states.unsharded_gradients == 4 * P  # bf16 gradients upcast to the fp32 reduce dtype
    reduced_in_bf16 = model_states(
        _inputs("optim_grads_params", "autocast", reduce="bf16"), stage_roles(inputs)[0]
    )
    assert reduced_in_bf16.unsharded_gradients == 2 * P  # bf16 throughout
    # One micro-batch: the root's gradient is still bf16 when it is copied to the fp32 input.
    one = _inputs("optim_grads_params", "autocast", micro_batches=1)
    single = model_states(one, stage_roles(one)[0])
    assert single.reduction == 2 * ROOT + 4 * ROOT


def test_the_forward_moment_adds_the_carried_gradients_and_the_gathered_units():
    """optim_grads - optim_grads_params at the forward: the one layer (fp32) the latter has
    freed; one micro-batch instead of two: the carried whole gradients."""
    grads, params = _inputs("optim_grads", "fp32"), _inputs("optim_grads_params", "fp32")
    role = stage_roles(grads)[0]
    forward = {
        name: rank_memory(i, role).moments["forward"]
        for name, i in (("og", grads), ("ogp", params))
    }
    assert forward["og"] - forward["ogp"] == 4 * LAYER
    one = rank_memory(_inputs("optim_grads", "fp32", micro_batches=1), role).moments["forward"]
    assert forward["og"] - one == 4 * P


@pytest.mark.parametrize("strategy,passes", [("optim_grads", 1), ("optim_grads_params", 2)])
def test_collectives_by_hand(strategy, passes):
    """Per micro-batch (2) each unit gathered once per forward (and again in the backward
    under optim_grads_params) in bf16; one fp32 reduce-scatter per step."""
    inputs = _inputs(strategy, "autocast")
    gather, scatter = data_parallel_collectives(inputs, stage_roles(inputs)[0])
    assert (gather.op, gather.bytes, gather.group) == ("all_gather", passes * 2 * 2 * P, 2)
    assert (scatter.op, scatter.bytes, scatter.group) == ("reduce_scatter", 4 * P, 2)


def test_half_precision_gathered_weights_leave_the_half_precision_activations():
    """FSDP2's bf16 `param_dtype` under autocast keeps what DeepSpeed's bf16 path keeps, with
    no autocast weight copies (autograd's saved tensors, one process)."""
    config = dataclasses.replace(TINY, params_dtype="bfloat16")
    inputs = _inputs("optim_grads_params", "autocast")
    predicted = stage_activation_bytes(inputs, 2, True, True) + logits_bytes(inputs)
    assert autocast_copy_bytes(inputs, 2, True) == 0
    assert predicted == pytest.approx(saved_bytes(config, 2, 64, autocast=True), rel=0.01)


SMALL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
    "--global-batch-size", "16", "--lr", "1e-4", "--train-iters", "10", "--bf16",
    "--data-path", "/nowhere/x",
]  # fmt: skip


def test_dry_run_of_torch_fsdp2_on_four_ranks(tmp_path, capsys):
    """`--use-torch-fsdp2 --dry-run --dry-run-world-size 4`: DP 4, 2 micro-batches; each
    rank 1/4 of the fp32 weights and the bf16 gathers twice per micro-batch."""
    path = str(tmp_path / "plan.json")
    argv = SMALL + ["--use-torch-fsdp2", "--dry-run", "--dry-run-world-size", "4"]
    plan = run_dry_run(argv + ["--dry-run-json", path])
    assert "plain FSDP2 optim_grads_params" in capsys.readouterr().out
    with open(path) as file:
        result = json.load(file)
    assert result["layout"]["sharding"] == "optim_grads_params"
    assert result["layout"]["micro_batches_per_iteration"] == 2
    role = plan.roles[0].role
    padded = sum(-(-n // 4) * 4 for n in role.tensor_sizes)
    for rank in result["ranks"]:
        # 2 micro-batches x 2 passes x 2 bytes gathered; 4 bytes reduce-scattered once.
        assert rank["comm_bytes_per_iteration"]["data_parallel"] == 8 * padded + 4 * padded
        assert rank["memory"]["optimizer"] == 8 * padded // 4


GPT_7B = [
    "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
    "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "10", "--bf16",
    "--data-path", "/nowhere/x", "--dry-run", "--dry-run-world-size", "8",
]  # fmt: skip


def test_a_plain_job_too_big_for_ddp_is_offered_fsdp2():
    """6.7B parameters under DDP (16 bytes each on every rank) do not fit an H100; sharded
    over 8 ranks they do: both strategies are offered and their command lines validate and
    fit; once sharded, only the stronger strategy is left to offer."""
    from megatron.dry_run import suggest

    device = find_device("H100")
    args = parse_args(GPT_7B + ["--dry-run-device", "H100"])
    plan = plan_from_args(args, device)
    assert not plan.fits
    offered = [c.description for c in candidate_changes(plan.inputs, 8, None) if c.knob == "zero"]
    assert offered[:2] == [
        "FSDP2 optim_grads (--use-distributed-optimizer)",
        "FSDP2 optim_grads_params (--use-torch-fsdp2)",
    ]
    suggestions = suggest(GPT_7B, args, plan)
    fsdp = [item for item in suggestions if item["change"].startswith("FSDP2")]
    assert fsdp
    for item in fsdp:
        assert plan_from_args(parse_args(item["argv"]), device).fits
    sharded = plan_from_args(parse_args(GPT_7B + ["--use-distributed-optimizer"]), device)
    offered = [c.flags for c in candidate_changes(sharded.inputs, 8, None) if c.knob == "zero"]
    assert offered == [{"--use-torch-fsdp2": None, "--use-distributed-optimizer": False}]


def test_a_checkpoint_costs_fsdp2_no_device_memory_and_deepspeeds_torch_dist_its_whole_state():
    """A save under FSDP2 (torch_dist: each rank writes its own slices through host copies)
    adds no moment; DeepSpeed ZeRO-1 under torch_dist gathers the rank's whole fp32 weights
    and both Adam moments first: 12 bytes a parameter beside the states the step holds."""
    from megatron.planning.memory import checkpoint_transient_bytes

    for sharding in ("optim_grads", "optim_grads_params"):
        inputs = dataclasses.replace(
            _inputs(sharding, "fp32"), checkpoint_format="torch_dist", checkpoints=True
        )
        memory = rank_memory(inputs, stage_roles(inputs)[0])
        assert "checkpoint" not in memory.moments, sharding
    deepspeed = dataclasses.replace(
        deepspeed_inputs(TINY, "bf16", 1, dp=2), checkpoint_format="torch_dist", checkpoints=True
    )
    role = stage_roles(deepspeed)[0]
    assert checkpoint_transient_bytes(deepspeed, role) == 12 * P
    states = model_states(deepspeed, role)
    fixed = states.weights + states.optimizer + states.gradient_buffers + states.buffers
    assert rank_memory(deepspeed, role).moments["checkpoint"] == fixed + 12 * P
    # Not saving, or DeepSpeed's own format: nothing.
    for change in (dict(checkpoints=False), dict(checkpoint_format="torch")):
        assert checkpoint_transient_bytes(dataclasses.replace(deepspeed, **change), role) == 0
