"""The LLaMA-style options of the one GPT: each layer against a hand-written dense reference,
and the whole model at TP=2, TP=2 with sequence parallelism, and PP=2 against TP=1.

LLaMA here means: RMSNorm, SwiGLU, grouped-query attention (8 query heads over 2 key/value
heads), rotary positions with theta 500000, no linear biases, and an untied output layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.process_groups import this_rank_groups
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import flops_per_token, num_parameters
from megatron.model.attention import RotaryEmbedding, apply_rotary_pos_emb
from megatron.model.transformer import ParallelAttention, ParallelMLP
from megatron.model.utils import RMSNorm
from tests.model.helpers import (
    build_model,
    loss_grads_and_logits,
    random_batch,
    spawn_collect,
)
from tests.model.test_pipeline import assert_pipeline_matches_reference, pipeline_body
from tests.tolerances import assert_close_reordered, forward_terms, grad_terms, loss_terms

LLAMA = dict(
    normalization="rmsnorm",
    activation="swiglu",
    num_key_value_heads=2,
    position_embedding_type="rope",
    rotary_base=500000.0,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    ffn_hidden_size=96,
    vocab_size=128,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    layernorm_epsilon=1e-6,
    use_cpu_initialization=True,
    **LLAMA,
)
BATCH, SEQ = 2, 8
PIPELINE = {**LLAMA, "num_attention_heads": 4, "ffn_hidden_size": 48}
"""The LLaMA options on test_pipeline.py's model."""


def config(**overrides: object) -> ModelConfig:
    """`CONFIG` with some fields replaced."""
    return ModelConfig(**{**CONFIG, **overrides})


@pytest.fixture
def single_rank():
    """Layers built at TP=1 in this process, from seeded RNG streams."""
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)


# --- layers against dense references --------------------------------------------------------


def test_rmsnorm_matches_a_hand_written_one(single_rank):
    norm = RMSNorm(config())
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 2, 64, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_()
    weight = norm.weight.detach().clone().requires_grad_()
    reference = reference_x / torch.sqrt((reference_x**2).mean(-1, keepdim=True) + 1e-6) * weight
    out = norm(x)
    # rsqrt vs 1 / sqrt and another expression: the mean over h = 64 squares is the sum.
    assert_close_reordered(out, reference, terms=64)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference.backward(grad)
    # Backward: another sum over h for x, and a sum over the 5 x 2 tokens for the weight.
    assert_close_reordered(x.grad, reference_x.grad, terms=2 * 64 + 10)
    assert_close_reordered(norm.weight.grad, weight.grad, terms=2 * 64 + 10)


def test_rmsnorm_in_bf16_normalizes_in_fp32(single_rank):
    norm = RMSNorm(config(params_dtype="bfloat16"))
    x = torch.randn(4, 64) * 300
    out = norm(x.bfloat16())
    reference = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_swiglu_mlp_matches_dense_reference(single_rank, bias):
    mlp = ParallelMLP(config(add_bias_linear=bias))
    if bias:
        with torch.no_grad():
            mlp.dense_h_to_4h.bias.normal_()
            mlp.dense_4h_to_h.bias.normal_()
    w_in = mlp.dense_h_to_4h.weight
    gate, up = w_in[:96], w_in[96:]  # the TP=1 weight is [gate; up]
    x = torch.randn(6, 2, 64, requires_grad=True)
    out, out_bias = mlp(x)
    if bias:
        out = out + out_bias
    b_gate, b_up = (mlp.dense_h_to_4h.bias[:96], mlp.dense_h_to_4h.bias[96:]) if bias else (0, 0)
    hidden = F.silu(x @ gate.T + b_gate) * (x @ up.T + b_up)
    reference = hidden @ mlp.dense_4h_to_h.weight.T + (mlp.dense_4h_to_h.bias if bias else 0)
    # Separate gate/up matmuls vs the fused one: contractions over h = 64, then ffn = 96.
    assert_close_reordered(out, reference, terms=64 + 96)
    grads = torch.autograd.grad(out.sum(), (x, w_in))
    reference_grads = torch.autograd.grad(reference.sum(), (x, w_in))
    # Backward: over h (the output), 2 x ffn (gate and up) into x, 6 x 2 tokens into w_in.
    for got, expected in zip(grads, reference_grads):
        assert_close_reordered(got, expected, terms=64 + 96 + 64 + 2 * 96 + 12)


def repeated_kv_attention(attention: ParallelAttention, x: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention written out: q/k/v from the grouped rows, k and v repeated."""
    nq, nkv, hn = 8, attention.groups_per_partition, attention.kv_channels
    g = nq // nkv
    rows = attention.query_key_value.weight.view(nkv, g + 2, hn, -1)
    w_q = rows[:, :g].reshape(nq * hn, -1)
    w_k, w_v = rows[:, g].reshape(nkv * hn, -1), rows[:, g + 1].reshape(nkv * hn, -1)
    s, b = x.shape[:2]
    q = (x @ w_q.T).view(s, b, nq, hn)
    k = (x @ w_k.T).view(s, b, nkv, hn).repeat_interleave(g, dim=2)  # head i reads i // g
    v = (x @ w_v.T).view(s, b, nkv, hn).repeat_interleave(g, dim=2)
    angles = RotaryEmbedding(hn, 1.0, 500000.0)(s)
    q, k = apply_rotary_pos_emb(q, angles), apply_rotary_pos_emb(k, angles)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / hn**0.5
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, nq * hn)
    return context @ attention.dense.weight.T


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_grouped_query_attention_matches_repeated_kv_reference(single_rank, kv_heads, backend):
    attention = ParallelAttention(
        config(num_key_value_heads=kv_heads, attention_backend=backend), 1, this_rank_groups()
    )
    assert attention.query_key_value.weight.shape == ((8 + 2 * kv_heads) * 8, 64)
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    out, bias = attention(x, None)
    assert bias is None  # --disable-bias-linear
    reference = repeated_kv_attention(attention, x)
    # QKV over h = 64, scores over hn = 8, context over SEQ keys, dense over 8 x 8 channels.
    forward = 64 + 8 + SEQ + 64
    assert_close_reordered(out, reference, terms=forward)
    weight = attention.query_key_value.weight
    grads = torch.autograd.grad(out.pow(2).sum(), (x, weight))
    reference_grads = torch.autograd.grad(reference.pow(2).sum(), (x, weight))
    # Backward: the forward's contractions again, and the SEQ x BATCH tokens into the weight.
    for got, expected in zip(grads, reference_grads):
        assert_close_reordered(got, expected, terms=2 * forward + SEQ * BATCH)


def test_one_kv_head_per_query_head_is_the_gpt2_layout(single_rank):
    """With nkv = nq the grouped rows are checkpoint version 3.0's [np, 3, hn]."""
    attention = ParallelAttention(config(num_key_value_heads=8), 1, this_rank_groups())
    x = torch.randn(SEQ, BATCH, 64)
    query, key, value = attention._query_key_value(x)
    rows = attention.query_key_value.weight.view(8, 3, 8, 64)
    expected = (x @ rows[:, 1].reshape(64, 64).T).view(SEQ, BATCH, 8, 8)
    # The fused QKV matmul vs a key-only one (other shapes): contractions over h = 64.
    assert_close_reordered(key, expected, terms=64)


def test_untied_model_has_its_own_output_layer(single_rank):
    model = build_model(config())
    names = dict(model.named_parameters())
    assert "language_model.output_layer.weight" in names
    assert "language_model.embedding.position_embeddings.weight" not in names
    assert not any(name.endswith(".bias") for name in names)
    assert model.output_weight() is names["language_model.output_layer.weight"]
    tokens = torch.randint(0, 128, (BATCH, SEQ))
    model(tokens, labels=tokens).mean().backward()
    assert names["language_model.output_layer.weight"].grad.abs().sum() > 0
    assert names["language_model.embedding.word_embeddings.weight"].grad.abs().sum() > 0


def test_num_parameters_and_flops_count_the_built_model(single_rank):
    """The counts behind the log line and MFU know GQA, SwiGLU, RMSNorm, no biases, untied."""
    model = build_model(config(attention_backend="unfused"))
    assert sum(p.numel() for p in model.parameters()) == num_parameters(model.config)
    tokens, labels = random_batch(3, SEQ, 128)
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=labels).mean().backward()
    assert counter.get_total_flops() == flops_per_token(model.config, SEQ) * tokens.numel()


# --- the whole model at TP=2, TP=2 + SP, PP=2 against TP=1 -----------------------------------


def measure(tokens, labels, **overrides) -> dict[str, object]:
    """Per-token loss, full gradients and full eval logits of a fresh LLaMA-style model."""
    model = build_model(config(**overrides))
    return loss_grads_and_logits(model, tokens, labels)


def tensor_parallel_body(rank: int, world: int) -> dict[str, object]:
    """TP=1, TP=2 and TP=2 with sequence parallelism in one 2-rank world."""
    tokens, labels = random_batch(BATCH, SEQ, CONFIG["vocab_size"])
    results: dict[str, object] = {}
    for tp, name, options in ((1, "tp1", {}), (2, "tp2", {})):
        parallel_state.initialize_model_parallel(tp, 1)
        model_parallel_cuda_manual_seed(11)
        results[name] = measure(tokens, labels, **options)
        if tp == 2:
            results["tp2-sp"] = measure(tokens, labels, sequence_parallel=True)
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def tp_world() -> list[dict]:
    """Results of the 2-rank tensor-parallel world, by rank."""
    return spawn_collect(tensor_parallel_body, 2)


@pytest.mark.parametrize("variant", ["tp2", "tp2-sp"])
def test_llama_tensor_parallel_equals_tp1(tp_world, variant):
    # TP=2 splits and reorders the same sums (see tests/model/helpers.py for the counts).
    for results in tp_world:
        reference, parallel = results["tp1"], results[variant]
        assert_close_reordered(parallel["loss"], reference["loss"], terms=loss_terms(config(), SEQ))
        assert_close_reordered(
            parallel["logits"], reference["logits"], terms=forward_terms(config(), SEQ)
        )
        assert set(parallel["grads"]) == set(reference["grads"])
        for name, grad in reference["grads"].items():
            assert_close_reordered(
                parallel["grads"][name],
                grad,
                terms=grad_terms(config(), BATCH, SEQ),
                msg=f"{variant} {name}",
            )


@pytest.fixture(scope="module")
def pp_world() -> list[dict]:
    """DeepSpeed's pipeline engine at PP=2 against GPTModel, LLaMA-style (2 ranks)."""
    return spawn_collect(pipeline_body, 2, 1, PIPELINE)


def test_llama_pipeline_equals_gpt_model(pp_world):
    """Eval loss, one SGD train step and the updated weights equal the GPTModel's; the last
    stage owns the untied output layer (`lm_head`), the first the word embeddings."""
    for results in pp_world:
        assert_pipeline_matches_reference(results, PIPELINE)
        assert results["reference_next"] < results["reference_eval"] - 0.05
    by_stage = {results["stage"]: results for results in pp_world}
    assert "0.word_embeddings.weight" in by_stage[0]["local_keys"]
    assert "6.lm_head.weight" in by_stage[1]["local_keys"]
    assert not any(key.startswith("tied_modules") for r in pp_world for key in r["local_keys"])
    assert "language_model.output_layer.weight" in by_stage[1]["updated"]
