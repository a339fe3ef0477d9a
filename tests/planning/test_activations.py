"""The activation model against what autograd really keeps (saved-tensor hooks, CPU).

Every combination of precision path, dropout, recomputation and MLP activation, on one
process, and tensor parallelism with and without sequence parallelism on two; the
prediction must match the saved bytes to 1%.
"""

from __future__ import annotations

import itertools

import pytest

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.model.model_size import stage_parameters_per_rank
from megatron.planning.activations import (
    autocast_copy_bytes,
    logits_bytes,
    stage_activation_bytes,
)
from megatron.yarn_config import YarnConfig
from tests.model.helpers import spawn_collect
from tests.planning.plan_inputs import plan_inputs
from tests.planning.saved_tensors import saved_bytes

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, MICRO_BATCH = 2, 128, 4, 1024, 128, 2


def _config(**overrides: object) -> ModelConfig:
    fields = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return ModelConfig(**{**fields, **overrides})


def _predicted(config: ModelConfig, path: str, **layout: int) -> int:
    inputs = plan_inputs(config, path, MICRO_BATCH, SEQ, **layout)
    return (
        stage_activation_bytes(inputs, LAYERS, True, True)
        + logits_bytes(inputs)
        + autocast_copy_bytes(inputs, LAYERS, True)
    )


CASES = list(
    itertools.product(
        ["fp32", "autocast", "ds-bf16"],
        [(0.0, 0.0), (0.1, 0.1)],
        [None, "selective", "full"],
        ["gelu_tanh", "swiglu"],
    )
) + [(path, (0.1, 0.0), None, "gelu_tanh") for path in ("fp32", "autocast", "ds-bf16")]


@pytest.mark.parametrize(
    "path,dropout,recompute,activation",
    CASES,
    ids=[f"{p}-drop{d[0]}/{d[1]}-{r}-{a}" for p, d, r, a in CASES],
)
def test_one_process_prediction_matches_saved_tensors(path, dropout, recompute, activation):
    config = _config(
        params_dtype="bfloat16" if path == "ds-bf16" else "float32",
        hidden_dropout=dropout[0],
        attention_dropout=dropout[1],
        recompute_granularity=recompute,
        activation=activation,
    )
    measured = saved_bytes(config, MICRO_BATCH, SEQ, autocast=path == "autocast")
    assert _predicted(config, path) == pytest.approx(measured, rel=0.01)


# gpt-oss's layers (issue 58): attention sinks, sliding windows on every other layer, YaRN
# rotary positions, the clamped quick-GeGLU with its offset, grouped-query attention.
GPT_OSS = dict(
    activation="quick_geglu",
    glu_linear_offset=1.0,
    activation_clamp_value=7.0,
    softmax_type="learnable",
    window_size=(31, 0),
    window_attn_skip_freq=2,
    position_embedding_type="yarn",
    yarn=YarnConfig(scaling_factor=4.0, round_to_int=False),
    num_key_value_heads=2,
)
# Without dropout the sinks' fused kernel (CPU flash), with attention dropout their math.
GPT_OSS_CASES = [
    (path, dropout, recompute)
    for path in ("fp32", "autocast", "ds-bf16")
    for dropout, recompute in ((0.0, None), (0.0, "selective"), (0.0, "full"), (0.1, None))
]


@pytest.mark.parametrize(
    "path,dropout,recompute",
    GPT_OSS_CASES,
    ids=[f"{p}-drop{d}-{r}" for p, d, r in GPT_OSS_CASES],
)
def test_gpt_oss_layers_prediction_matches_saved_tensors(path, dropout, recompute):
    config = _config(
        params_dtype="bfloat16" if path == "ds-bf16" else "float32",
        hidden_dropout=dropout,
        attention_dropout=dropout,
        recompute_granularity=recompute,
        **GPT_OSS,
    )
    measured = saved_bytes(config, MICRO_BATCH, SEQ, autocast=path == "autocast")
    assert _predicted(config, path) == pytest.approx(measured, rel=0.01)


# Sliding windows on CPUs (Mistral's --window-size): each sample's SDPA call with its band
# mask runs the math kernel; grouped-query attention expands the keys and values for it (as
# it does for attention dropout's math kernel).
WINDOWS = {
    "every layer": dict(window_size=(31, 0)),
    "grouped": dict(window_size=(31, 0), num_key_value_heads=2),
    "every other layer": dict(window_size=(31, 0), window_attn_skip_freq=2),
    "grouped, no window, attention dropout": dict(num_key_value_heads=2, attention_dropout=0.1),
}
WINDOW_CASES = [(path, name) for path in ("fp32", "autocast", "ds-bf16") for name in WINDOWS]


@pytest.mark.parametrize("path,name", WINDOW_CASES, ids=[f"{p}-{n}" for p, n in WINDOW_CASES])
def test_sliding_window_prediction_matches_saved_tensors(path, name):
    fields = {"hidden_dropout": 0.0, "attention_dropout": 0.0, **WINDOWS[name]}
    config = _config(params_dtype="bfloat16" if path == "ds-bf16" else "float32", **fields)
    measured = saved_bytes(config, MICRO_BATCH, SEQ, autocast=path == "autocast")
    assert _predicted(config, path) == pytest.approx(measured, rel=0.01)


TP_AUTOCAST = {
    # Under sequence parallelism the column-parallel layers cast inside their gather (no
    # weight copy kept); without dropout the embeddings' scattered part is its own tensor.
    "sp-autocast-swiglu": _config(sequence_parallel=True, activation="swiglu"),
    "autocast-dropout": _config(hidden_dropout=0.1, attention_dropout=0.1),
    # Each rank's heads with their sinks.
    "sp-autocast-gpt-oss": _config(sequence_parallel=True, attention_dropout=0.0, **GPT_OSS),
}


def _tensor_parallel_body(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel(world_size, 1)
    results = {}
    for sequence_parallel in (False, True):
        config = _config(sequence_parallel=sequence_parallel, hidden_dropout=0.1)
        results[sequence_parallel] = saved_bytes(config, MICRO_BATCH, SEQ, autocast=False)
    for name, config in TP_AUTOCAST.items():
        results[name] = saved_bytes(config, MICRO_BATCH, SEQ, autocast=True)
    from megatron.model import GPTModel

    model = GPTModel(_config())
    results["parameters"] = sum(param.numel() for param in model.parameters())
    return results


def test_tensor_parallel_prediction_matches_saved_tensors_and_parameters():
    """TP=2, with and without sequence parallelism, in fp32 and under bf16 autocast: each
    rank's saved bytes and its parameter count are the plan's."""
    world = spawn_collect(_tensor_parallel_body, 2)
    for sequence_parallel in (False, True):
        config = _config(sequence_parallel=sequence_parallel, hidden_dropout=0.1)
        predicted = _predicted(config, "fp32", tp=2, world_size=2)
        for rank in world:
            assert predicted == pytest.approx(rank[sequence_parallel], rel=0.01)
    for name, config in TP_AUTOCAST.items():
        predicted = _predicted(config, "autocast", tp=2, world_size=2)
        for rank in world:
            assert predicted == pytest.approx(rank[name], rel=0.01), name
    parts = stage_parameters_per_rank(_config(), 2, range(1, LAYERS + 1), True, True)
    assert [rank["parameters"] for rank in world] == [sum(parts.values())] * 2


@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
def test_without_linear_biases_autocast_keeps_the_branches_in_half_precision(activation):
    """`--disable-bias-linear` under autocast: no fp32 bias is added, so the MLP activation's
    input and the dropout masks after attention and the MLP stay bf16 (the embedding's mask
    stays fp32)."""
    config = _config(add_bias_linear=False, activation=activation)
    measured = saved_bytes(config, MICRO_BATCH, SEQ, autocast=True)
    assert _predicted(config, "autocast") == pytest.approx(measured, rel=0.01)
