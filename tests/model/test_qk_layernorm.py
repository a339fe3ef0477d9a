"""Qwen's attention options of the one GPT: q/k/v biases alone (`--add-qkv-bias`) and a norm of
each head's queries and keys (`--qk-layernorm`).

The attention layer against a hand-written dense reference (projections with their grouped
biases, RMSNorm over each head's kv_channels with the shared weights, then RoPE), forward and
backward; and the whole model, every weight random, at TP=2 and TP=2 with sequence parallelism
against TP=1: the same loss, logits and gradients, so the biases split per key/value group as
the weight rows do and the replicated QK norms' gradients (each rank's from its own heads) are
summed over the ranks.
"""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.process_groups import this_rank_groups
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model.attention import RotaryEmbedding, apply_rotary_pos_emb
from megatron.model.transformer import ParallelAttention
from tests.model.helpers import (
    build_model,
    loss_grads_and_logits,
    random_batch,
    spawn_collect,
)
from tests.tolerances import assert_close_reordered, forward_terms, grad_terms, loss_terms

QWEN = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    kv_channels=16,
    ffn_hidden_size=96,
    vocab_size=128,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    layernorm_epsilon=1e-6,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    add_qkv_bias=True,
    qk_layernorm=True,
    untie_embeddings_and_output_weights=True,
    use_cpu_initialization=True,
)
VARIANTS = {
    "qwen": {},
    "layernorm, every bias": dict(
        normalization="layernorm", activation="gelu", add_bias_linear=True
    ),
}
"""The Qwen options on a LLaMA-style model, and the QK norm as a LayerNorm (weight and bias)."""
BATCH, SEQ = 2, 8


def config(variant: str = "qwen") -> ModelConfig:
    """`QWEN` with a variant's changes."""
    return ModelConfig(**{**QWEN, **VARIANTS[variant]})


def randomize(model: torch.nn.Module, seed: int = 3) -> None:
    """Every parameter random, the same whole tensors at any TP: each is drawn at its full
    shape and this rank keeps its shard (norm weights around 1)."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for index, (name, param) in enumerate(sorted(model.named_parameters())):
        split = getattr(param, "tensor_model_parallel", False)
        shape = list(param.shape)
        if split:
            shape[param.partition_dim] *= world
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        full = torch.randn(shape, generator=generator) * 0.2
        if "layernorm.weight" in name:
            full += 1.0
        if split:  # with stride s, this rank's s blocks of the s x world
            stride = param.partition_stride
            blocks = full.chunk(stride * world, dim=param.partition_dim)
            full = torch.cat(blocks[rank::world], dim=param.partition_dim)
        with torch.no_grad():
            param.copy_(full)


@pytest.fixture
def single_rank():
    """Layers built at TP=1 in this process, from seeded RNG streams."""
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)


def reference_attention(attention: ParallelAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer written out: grouped q/k/v rows and biases, RMSNorm of each head's query and
    key (fp32, the shared weights), RoPE, causal softmax with key/value heads repeated."""
    nq, nkv, hn = 4, 2, 16
    g = nq // nkv
    rows = attention.query_key_value.weight.view(nkv, g + 2, hn, -1)
    bias = attention.query_key_value.bias.view(nkv, g + 2, hn)
    s, b = x.shape[:2]
    q = (x @ rows[:, :g].reshape(nq * hn, -1).T + bias[:, :g].reshape(-1)).view(s, b, nq, hn)
    k = (x @ rows[:, g].reshape(nkv * hn, -1).T + bias[:, g].reshape(-1)).view(s, b, nkv, hn)
    v = x @ rows[:, g + 1].reshape(nkv * hn, -1).T + bias[:, g + 1].reshape(-1)
    v = v.view(s, b, nkv, hn)

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    q, k = rms(q, attention.q_layernorm.weight), rms(k, attention.k_layernorm.weight)
    angles = RotaryEmbedding(hn, 1.0)(s)
    q, k = apply_rotary_pos_emb(q, angles), apply_rotary_pos_emb(k, angles)
    k, v = (t.repeat_interleave(g, dim=2) for t in (k, v))  # head i reads i // g
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / hn**0.5
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, nq * hn)
    return context @ attention.dense.weight.T


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_qk_layernorm_attention_matches_a_dense_reference(single_rank, backend):
    attention = ParallelAttention(
        ModelConfig(**{**QWEN, "attention_backend": backend}), 1, this_rank_groups()
    )
    names = {name: tuple(p.shape) for name, p in attention.named_parameters()}
    assert names == {
        "query_key_value.weight": (128, 64),
        "query_key_value.bias": (128,),
        "q_layernorm.weight": (16,),
        "k_layernorm.weight": (16,),
        "dense.weight": (64, 64),
    }
    with torch.no_grad():
        attention.query_key_value.bias.normal_()
        attention.q_layernorm.weight.uniform_(0.5, 1.5)
        attention.k_layernorm.weight.uniform_(0.5, 1.5)
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    out, bias = attention(x, None)
    assert bias is None  # the output projection has none
    reference = reference_attention(attention, x)
    # QKV over h, the norms over hn, scores over hn, context over SEQ keys, dense over np x hn.
    forward = 64 + 3 * 16 + SEQ + 64
    assert_close_reordered(out, reference, terms=forward)
    params = [attention.query_key_value.bias, attention.q_layernorm.weight]
    params.append(attention.k_layernorm.weight)
    grads = torch.autograd.grad(out.pow(2).sum(), [x, *params])
    reference_grads = torch.autograd.grad(reference.pow(2).sum(), [x, *params])
    for got, expected in zip(grads, reference_grads):
        assert_close_reordered(got, expected, terms=2 * forward + SEQ * BATCH * 4)


def measure(tokens, labels, variant: str, **overrides) -> dict[str, object]:
    """Per-token loss, full gradients and full eval logits of the variant's random model."""
    model = build_model(ModelConfig(**{**QWEN, **VARIANTS[variant], **overrides}))
    randomize(model)
    return loss_grads_and_logits(model, tokens, labels)


def tensor_parallel_body(rank: int, world: int) -> dict[str, object]:
    """Each variant at TP=1, TP=2 and TP=2 with sequence parallelism in one 2-rank world."""
    tokens, labels = random_batch(BATCH, SEQ, QWEN["vocab_size"])
    results: dict[str, object] = {}
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tp, 1)
        model_parallel_cuda_manual_seed(11)
        for variant in VARIANTS:
            results[variant, f"tp{tp}"] = measure(tokens, labels, variant)
            if tp == 2:
                results[variant, "tp2-sp"] = measure(
                    tokens, labels, variant, sequence_parallel=True
                )
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def tp_world() -> list[dict]:
    """Results of the 2-rank tensor-parallel world, by rank."""
    return spawn_collect(tensor_parallel_body, 2)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tensor_parallel_equals_tp1(tp_world, variant, layout):
    """The q/k/v biases split per key/value group, the QK norms' summed gradients: TP=2 gives
    TP=1's loss, logits and every (gathered) gradient, the QK norms' and biases' included."""
    model_config = config(variant)
    for results in tp_world:
        reference, parallel = results[variant, "tp1"], results[variant, layout]
        assert_close_reordered(
            parallel["loss"], reference["loss"], terms=loss_terms(model_config, SEQ)
        )
        assert_close_reordered(
            parallel["logits"], reference["logits"], terms=forward_terms(model_config, SEQ)
        )
        assert set(parallel["grads"]) == set(reference["grads"])
        assert (
            "language_model.encoder.layers.1.self_attention.k_layernorm.weight"
            in (reference["grads"])
        )
        for name, grad in reference["grads"].items():
            assert_close_reordered(
                parallel["grads"][name],
                grad,
                terms=grad_terms(model_config, BATCH, SEQ),
                msg=f"{variant} {layout} {name}",
            )
