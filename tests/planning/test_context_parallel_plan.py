"""The planner under context parallelism: bytes per `--cp-comm-type` worked by hand, the
roofline's ring overlap, activations of s / C tokens measured on two gloo ranks, and the
dry run's CP column and line."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.config import MLAConfig, ModelConfig
from megatron.core import parallel_state
from megatron.planning.activations import (
    autocast_copy_bytes,
    logits_bytes,
    stage_activation_bytes,
)
from megatron.planning.communication import context_parallel_parts, rank_communication
from megatron.planning.layout import stage_roles
from megatron.planning.roofline import ring_exposed_seconds
from tests.model.helpers import spawn_collect
from tests.planning.plan_inputs import plan_inputs
from tests.planning.saved_tensors import saved_bytes

# b = 2 sequences of s = 128 tokens over C = 2 ranks: 64 tokens each; 8 query heads and
# 2 key/value heads of hn = 16 (hidden 128); 2 layers; fp32 (e = 4).
LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, SEQ, MICRO_BATCH = 2, 128, 8, 2, 1024, 128, 2


def _config(comm_type: str = "p2p", **overrides: object) -> ModelConfig:
    fields = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cp_comm_types=(comm_type,),
    )
    return ModelConfig(**{**fields, **overrides})


def _parts(config: ModelConfig, **layout: int) -> dict[str, int]:
    fields = dict(cp=2, world_size=2, micro_batches=3)
    inputs = plan_inputs(config, "fp32", MICRO_BATCH, SEQ, **{**fields, **layout})
    return context_parallel_parts(inputs, stage_roles(inputs)[0])


# KV_local = 2 (K and V) x b 2 x s/C 64 x g 2 x hn 16 x e 4 = 32,768 bytes per layer.
KV_LOCAL = 2 * 2 * 64 * 2 * 16 * 4
# The loss gather: [b, s] fp32 = 2 x 128 x 4 = 1,024 bytes per micro-batch.
LOSSES = 2 * 128 * 4


def test_ring_bytes_by_hand():
    # p2p at C = 2: forward C-1 = 1 send of KV_local; backward 1 send of KV_local and C = 2
    # sends of the fp32 gradients (fp32 here: the same 32,768 each) = 4 x 32,768 per layer,
    # x 2 layers x 3 micro-batches = 786,432.
    assert _parts(_config("p2p"))["p2p"] == 4 * KV_LOCAL * 2 * 3 == 786_432
    assert _parts(_config("p2p"))["losses"] == LOSSES * 3
    # Full recomputation runs each forward again: one more KV send per layer (5 in all).
    full = _config("p2p", recompute_granularity="full")
    assert _parts(full)["p2p"] == 5 * KV_LOCAL * 2 * 3
    # C = 4 (s/C = 32 tokens: KV_local halves): forward 3, backward 3 + 4 gradients = 10.
    assert _parts(_config("p2p"), cp=4, world_size=4)["p2p"] == 10 * (KV_LOCAL // 2) * 2 * 3


def test_ring_gradients_travel_in_fp32():
    # bf16 under autocast: KV_local = 16,384; the gradients stay 4 bytes: 32,768 each.
    inputs = plan_inputs(_config("p2p"), "autocast", MICRO_BATCH, SEQ, cp=2, world_size=2)
    parts = context_parallel_parts(inputs, stage_roles(inputs)[0])
    assert parts["p2p"] == (2 * 16_384 + 2 * 32_768) * 2


def test_allgather_and_a2a_bytes_by_hand():
    # allgather: the all-gather's output (C x KV_local = 65,536) forward and the
    # reduce-scatter's input (the same) backward: 131,072 per layer, x 2 layers x 3.
    assert _parts(_config("allgather"))["allgather"] == 2 * 2 * KV_LOCAL * 2 * 3 == 786_432
    # a2a: q, k, v and the context each way: b 2 x s/C 64 x (2 x 128 + 2 x 32) x 4 bytes =
    # 163,840 per pass, forward and backward, x 2 layers x 3 micro-batches.
    assert _parts(_config("a2a"))["a2a"] == 2 * 163_840 * 2 * 3 == 1_966_080
    # Per layer: layer 1 p2p, layer 2 allgather.
    mixed = _parts(_config("p2p", cp_comm_types=("p2p", "allgather")))
    assert (mixed["p2p"], mixed["allgather"]) == (4 * KV_LOCAL * 3, 2 * 2 * KV_LOCAL * 3)


def test_multi_latent_attention_bytes_by_hand():
    """MLA: 8 heads of keys 12 + 4 rotary = 16 channels, values 6. The ring sends values
    padded to the keys' 16 channels: the same bytes as 8 key/value heads of 16 (4 x KV_local
    x 4 per layer). The allgather gathers keys (16) and values (6) per head; a2a moves queries
    (16), keys (16), values (6) and the context (6) per head."""
    mla = MLAConfig(q_lora_rank=32, kv_lora_rank=24, qk_head_dim=12, qk_pos_emb_head_dim=4,
                    v_head_dim=6, rope_type="rope")  # fmt: skip
    settings = dict(mla=mla, num_key_value_heads=HEADS, qk_layernorm=True)
    assert _parts(_config("p2p", **settings))["p2p"] == 4 * (4 * KV_LOCAL) * 2 * 3
    tokens = MICRO_BATCH * SEQ // 2
    gathered = 2 * tokens * HEADS * (16 + 6) * 4  # C x (K + V), forward and backward alike
    assert _parts(_config("allgather", **settings))["allgather"] == 2 * gathered * 2 * 3
    moved = tokens * HEADS * (16 + 16 + 6 + 6) * 4
    assert _parts(_config("a2a", **settings))["a2a"] == 2 * moved * 2 * 3


def test_gradients_are_reduced_over_data_x_context_ranks():
    """DDP at DP 1 x CP 2 all-reduces the fp32 gradients over both context ranks; the
    `context_parallel` entry is part of the total."""
    inputs = plan_inputs(_config(), "fp32", MICRO_BATCH, SEQ, cp=2, world_size=2)
    role = stage_roles(inputs)[0]
    kinds = rank_communication(inputs, role)
    assert kinds["data_parallel"] == 4 * role.num_parameters
    assert kinds["context_parallel"] == sum(context_parallel_parts(inputs, role).values())
    assert kinds["total"] == sum(value for key, value in kinds.items() if key != "total")


def test_ring_overlap_hides_what_fits_under_each_block():
    # C = 4, 1 s per KV transfer, 2 s per gradient transfer, blocks of 0.5 s forward (1 s
    # backward). Forward: 3 x (1 - 0.5) = 1.5. Backward: step 0: 1 - 1 = 0; steps 1-2:
    # 2 x (1 + 2 - 1) = 4; step 3: 2 - 1 = 1; the last gradient: 2. Exposed 8.5 of
    # 2 x 3 x 1 + 4 x 2 = 14.
    assert ring_exposed_seconds(4, 1.0, 2.0, 0.5) == (8.5, 14.0)
    assert ring_exposed_seconds(4, 0.1, 0.1, 1.0) == (0.1, 1.0)  # only the last gradient


def _predicted(config: ModelConfig, path: str, cp: int) -> int:
    inputs = plan_inputs(config, path, MICRO_BATCH, SEQ, cp=cp, world_size=cp)
    return (
        stage_activation_bytes(inputs, LAYERS, True, True)
        + logits_bytes(inputs)
        + autocast_copy_bytes(inputs, LAYERS, True)
    )


MEASURED = {
    "p2p": _config("p2p"),
    "p2p-dropout": _config("p2p", attention_dropout=0.1, hidden_dropout=0.1),
    "allgather": _config("allgather", num_key_value_heads=HEADS),
    "p2p+allgather": _config("p2p", cp_comm_types=("p2p", "allgather"), num_key_value_heads=8),
}


def _context_parallel_body(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel(1, 1, 1, world_size)
    return {
        f"{name}-{autocast}": saved_bytes(config, MICRO_BATCH, SEQ // world_size, autocast)
        for name, config in MEASURED.items()
        for autocast in (False, True)
    }


def test_context_parallel_activations_match_saved_tensors():
    """CP 2 on two gloo ranks: each rank's saved bytes are the plan's (to 1%), and the ring's
    a little over half of one process's over the whole sequence (flash kernel, no dropout):
    the ring keeps its merged output beside the output projection's input, and with grouped
    query heads a copy of the query, where the whole sequence's kernel shares them."""
    world = spawn_collect(_context_parallel_body, 2)
    for name, config in MEASURED.items():
        for autocast in (False, True):
            predicted = _predicted(config, "autocast" if autocast else "fp32", 2)
            for rank in world:
                assert predicted == pytest.approx(rank[f"{name}-{autocast}"], rel=0.01), name
    whole = _predicted(MEASURED["p2p"], "fp32", 1)
    assert 0.5 < world[0]["p2p-False"] / whole < 0.56


def test_dry_run_prints_context_parallel_bytes_and_overlap(capsys):
    from megatron.dry_run import run_dry_run

    argv = [
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
        "--num-key-value-heads", "2", "--swiglu", "--normalization", "rmsnorm",
        "--position-embedding-type", "rope", "--seq-length", "1024",
        "--max-position-embeddings", "1024", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "10", "--bf16",
        "--context-parallel-size", "2", "--data-path", "/nowhere/x",
        "--dry-run", "--dry-run-world-size", "4", "--dry-run-device", "H100",
    ]  # fmt: skip
    plan = run_dry_run(argv)
    output = capsys.readouterr().out
    assert "TP 1 x CP 2 x PP 1 x DP 2" in output and "CP MB" in output
    role = plan.roles[0]
    parts = context_parallel_parts(plan.inputs, role.role)
    # bf16, b 1, s/C 512, g 2, hn 16: KV_local 65,536; 4 transfers per layer but the two
    # gradient sends are fp32 (131,072 each): 2 x 65,536 + 2 x 131,072 = 393,216 per layer,
    # 2 layers, 2 micro-batches per data-parallel rank.
    assert parts["p2p"] == 393_216 * 2 * 2
    line = next(text for text in output.splitlines() if "context parallel 2 (p2p)" in text)
    assert f"p2p {parts['p2p'] / 1e6:.1f}" in line and "hidden behind attention" in line
    assert 0.0 <= plan.estimate.context_parallel_hidden <= 1.0
    assert dataclasses.asdict(plan.estimate)["context_parallel_s"] >= 0.0
