"""gpt-oss's layer options of the one GPT (issue 58), each against a reference.

- Attention sinks (`--softmax-type learnable / off-by-one`): the CPU flash kernel (whole
  sequence, sliding windows, packed documents) and FlexAttention's forward against the explicit
  math with the sink as one more softmax column (Hugging Face's eager gpt-oss), forward and
  backward, in fp32 and bf16; FlexAttention's backward on a GPU (gpu-marked).
- The clamped quick-GeGLU with its linear offset (and a clamped, offset SwiGLU) against
  megatron-core's formula under autograd, values on both sides of the clamps.
- YaRN rotary frequencies and factor against transformers' `yarn` rope initialisation, with
  and without rounding the ramp (gpt-oss: `truncate` false).
- `--window-attn-skip-freq`: which layers keep the window, and the whole model at TP=2 (with
  and without sequence parallelism) against TP=1 with every gpt-oss option on: the same
  loss, logits and gradients, the sinks split over the ranks by head.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model.attention import CoreAttention, RotaryEmbedding
from megatron.model.attention_sinks import dense_sink_attention, flex_sink_attention
from megatron.model.document_mask import DocumentMask
from megatron.model.gated_activation import QUICK_GELU_ALPHA, gated_activation
from megatron.yarn_config import YarnConfig, gpt_oss_yarn
from tests.model.helpers import (
    build_model,
    loss_grads_and_logits,
    random_batch,
    spawn_collect,
)
from tests.model.test_qk_layernorm import randomize
from tests.tolerances import assert_close_reordered, forward_terms, grad_terms, loss_terms

GPT_OSS = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    kv_channels=16,
    ffn_hidden_size=96,
    vocab_size=128,
    max_position_embeddings=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    normalization="rmsnorm",
    activation="quick_geglu",
    glu_linear_offset=1.0,
    activation_clamp_value=0.5,  # small: the random model's values cross it
    softmax_type="learnable",
    window_size=(5, 0),
    window_attn_skip_freq=2,
    position_embedding_type="yarn",
    yarn=YarnConfig(scaling_factor=4.0, original_max_position_embeddings=8, round_to_int=False),
    untie_embeddings_and_output_weights=True,
    use_cpu_initialization=True,
)
BATCH, SEQ = 2, 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _qkv(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((BATCH, HEADS, SEQ, HEAD_DIM),) + ((BATCH, KV_HEADS, SEQ, HEAD_DIM),) * 2
    tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    sinks = torch.randn(HEADS, generator=generator)
    return tuple(t.to(dtype).requires_grad_() for t in (*tensors, sinks))


MASKS = {
    "causal": None,
    "window": DocumentMask(None, (5, 0)),
    "documents": DocumentMask(torch.tensor([[0] * 6 + [1] * 10, [0] * 16])),
    "documents+window": DocumentMask(torch.tensor([[0] * 9 + [1] * 7, [0] * 16]), (3, 0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_sinks_on_the_cpu_flash_kernel_are_the_explicit_math(mask_name, dtype):
    """`CoreAttention` with learnable sinks (SDPA backend: torch's CPU flash kernel, one call
    per document under a `DocumentMask`) against the explicit math, forward and backward."""
    config = ModelConfig(**{**GPT_OSS, "num_attention_heads": HEADS, "kv_channels": HEAD_DIM})
    core = CoreAttention(config, 1, HEADS)
    query, key, value, sinks = _qkv(dtype)
    core.softmax_offset = torch.nn.Parameter(sinks.detach().clone())
    mask = MASKS[mask_name]
    out = core(query, key, value, mask)  # [s, b, np * hn]
    dense = None if mask is None else mask.dense(SEQ, SEQ, query.device)
    reference = dense_sink_attention(query, key, value, sinks, core.scale, dense)
    reference = reference.permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)
    # bf16: the kernels round their own intermediates (several bf16 ulps of O(1) values).
    tolerance = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=3e-2)
    torch.testing.assert_close(out.float(), reference.float(), **tolerance)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = torch.autograd.grad(out, (query, key, value, core.softmax_offset), upstream)
    expected = torch.autograd.grad(reference, (query, key, value, sinks), upstream)
    for name, a, b in zip(("query", "key", "value", "sinks"), got, expected):
        scale = 1.0 if dtype == torch.float32 else max(1.0, b.abs().max().item())
        try:
            torch.testing.assert_close(a.float() / scale, b.float() / scale, **tolerance)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


def test_off_by_one_is_a_zero_sink_and_unfused_the_reference():
    """`off-by-one`: a zero logit per head (a buffer, nothing to load); the `unfused` backend
    runs the explicit math and equals the fused kernel."""
    config = ModelConfig(**{**GPT_OSS, "softmax_type": "off-by-one", "kv_channels": HEAD_DIM})
    fused = CoreAttention(config, 1, HEADS)
    unfused = CoreAttention(dataclasses.replace(config, attention_backend="unfused"), 1, HEADS)
    assert list(fused.state_dict()) == [] and torch.equal(fused.softmax_offset, torch.zeros(4))
    query, key, value, _ = _qkv(torch.float32)
    torch.testing.assert_close(
        fused(query, key, value, None), unfused(query, key, value, None), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("mask_name", ["window", "documents+window"])
def test_flex_attention_sinks_forward_is_the_explicit_math(mask_name):
    """FlexAttention's kernel (eager on the CPU: forward only) rescaled by its log-sum-exp."""
    query, key, value, sinks = (t.detach() for t in _qkv(torch.float32))
    mask = MASKS[mask_name]
    out = flex_sink_attention(mask, query, key, value, sinks, 0.3, compiled=False)
    dense = mask.dense(SEQ, SEQ, query.device)
    reference = dense_sink_attention(query, key, value, sinks, 0.3, dense)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_sinks_backward_on_a_gpu():
    """The GPU path (compiled FlexAttention, its lse differentiable) against the math."""
    tensors = [t.detach().cuda().requires_grad_() for t in _qkv(torch.float32)]
    query, key, value, sinks = tensors
    mask = MASKS["documents+window"]
    out = flex_sink_attention(mask, query, key, value, sinks, 0.3)
    reference = dense_sink_attention(
        query, key, value, sinks, 0.3, mask.dense(SEQ, SEQ, query.device)
    )
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-4)
    upstream = torch.randn_like(out)
    got = torch.autograd.grad(out, tensors, upstream)
    expected = torch.autograd.grad(reference, tensors, upstream)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "alpha, offset, limit",
    [(QUICK_GELU_ALPHA, 1.0, 0.7), (QUICK_GELU_ALPHA, 0.0, None), (1.0, 0.5, 0.7)],
    ids=["gpt-oss", "quick-geglu", "clamped-swiglu"],
)
def test_gated_activation_is_megatron_cores_formula(alpha, offset, limit):
    """act(clamp(gate, max=v)) * (clamp(up, -v, v) + offset), act(x) = x sigmoid(alpha x),
    forward and backward, against autograd of megatron-core's expression (`mlp.py`'s glu)."""
    x = torch.randn(64, 2 * 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x.requires_grad_()
    bias = torch.randn(48, dtype=torch.float64, requires_grad=True)
    out = gated_activation(x, bias, alpha, offset, limit)
    gate, up = (x + bias).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        assert (x.detach() > limit).any() and (x.detach() < -limit).any()  # clamps act
    reference = gate * torch.sigmoid(alpha * gate) * (up + offset)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, bias), upstream)
    expected = torch.autograd.grad(reference, (x, bias), upstream)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "yarn",
    [gpt_oss_yarn(), dataclasses.replace(gpt_oss_yarn(), original_max_position_embeddings=4096)]
    + [YarnConfig(scaling_factor=8.0, beta_fast=16.0, original_max_position_embeddings=2048)],
    ids=["enable-gpt-oss", "gpt-oss-hf", "rounded"],
)
def test_yarn_frequencies_and_factor_are_transformers(yarn):
    """Our YaRN rotary (standard attention) against transformers' `yarn` rope parameters:
    the inverse frequencies and the attention factor on cos and sin."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = PretrainedConfig(
        hidden_size=64 * 8,
        num_attention_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=yarn.scaling_factor,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            truncate=yarn.round_to_int,
        ),
    )
    hf.rope_scaling = hf.rope_parameters  # (transformers' older spelling, for its reader)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = RotaryEmbedding(64, 1.0, 150000.0, yarn)
    torch.testing.assert_close(ours.inv_freq, inv_freq.float(), rtol=1e-6, atol=0)
    assert ours.factor == pytest.approx(factor, rel=1e-9)


def test_window_attn_skip_freq_picks_the_windowed_layers():
    """N: layer numbers not divisible by N keep the window (gpt-oss: 1, 3, ... windowed);
    a 0/1 list per layer; MTP layers take the last layer's."""
    config = ModelConfig(**GPT_OSS)
    assert [config.layer_window(n) for n in (1, 2, 3, 4)] == [(5, 0), None, (5, 0), None]
    listed = dataclasses.replace(config, window_attn_skip_freq=(0, 0, 1, 0))
    assert [listed.layer_window(n) for n in (1, 2, 3, 4)] == [None, None, (5, 0), None]
    model = build_model(config)
    windows = [layer.window for layer in model.language_model.encoder.layers]
    assert windows == [(5, 0), None, (5, 0), None]
    # The full layers see past the window: the model is not the all-windowed one.
    everywhere = build_model(dataclasses.replace(config, window_attn_skip_freq=None))
    tokens, _ = random_batch(BATCH, SEQ, config.vocab_size)
    with torch.no_grad():
        assert not torch.allclose(model.eval()(tokens), everywhere.eval()(tokens))


def _measure(tokens, labels, **overrides) -> dict[str, object]:
    model = build_model(ModelConfig(**{**GPT_OSS, **overrides}))
    randomize(model)
    return loss_grads_and_logits(model, tokens, labels)


def tensor_parallel_body(rank: int, world: int) -> dict[str, object]:
    """The gpt-oss-like model at TP=1, TP=2 and TP=2 with sequence parallelism."""
    tokens, labels = random_batch(BATCH, SEQ, GPT_OSS["vocab_size"])
    results: dict[str, object] = {}
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tp, 1)
        model_parallel_cuda_manual_seed(11)
        results[f"tp{tp}"] = _measure(tokens, labels)
        if tp == 2:
            results["tp2-sp"] = _measure(tokens, labels, sequence_parallel=True)
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def tp_world() -> list[dict]:
    """Results of the 2-rank world, by rank."""
    return spawn_collect(tensor_parallel_body, 2)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_tensor_parallel_equals_tp1(tp_world, layout):
    """Sinks split by head, biases, windows, YaRN and the clamped GeGLU at TP=2: TP=1's loss,
    logits and every gathered gradient (the sinks' included)."""
    config = ModelConfig(**GPT_OSS)
    sink = "language_model.encoder.layers.0.self_attention.core_attention.softmax_offset"
    for results in tp_world:
        reference, parallel = results["tp1"], results[layout]
        assert sink in reference["grads"] and reference["grads"][sink].abs().sum() > 0
        assert_close_reordered(parallel["loss"], reference["loss"], terms=loss_terms(config, SEQ))
        assert_close_reordered(
            parallel["logits"], reference["logits"], terms=forward_terms(config, SEQ)
        )
        assert set(parallel["grads"]) == set(reference["grads"])
        for name, grad in reference["grads"].items():
            assert_close_reordered(
                parallel["grads"][name],
                grad,
                terms=grad_terms(config, BATCH, SEQ),
                msg=f"{layout} {name}",
            )
