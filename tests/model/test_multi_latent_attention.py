"""Multi-latent attention (`--multi-latent-attention`, issue 57) against its definition.

- The layer against a dense reference written out from its weights (RMSNorm of both latents,
  the decoupled rotary channels rotated as DeepSeek's interleaved pairs by complex
  multiplication, YaRN's softmax scale and cos/sin factor), forward and backward, with a query
  latent and YaRN at factor 4, and without a query latent at plain rope.
- YaRN's frequencies and attention factor against transformers' own YaRN implementation.
- The whole model, every weight random, at TP=2 and TP=2 with sequence parallelism against
  TP=1: the same loss, logits and gradients (the down-projections' gathered outputs, the
  latent norms' summed gradients).
- Its parameters are what `parameter_inventory` (the planner's) counts.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.config import MLAConfig, ModelConfig
from megatron.core.process_groups import this_rank_groups
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model.model_size import num_parameters
from megatron.model.multi_latent_attention import MultiLatentAttention, mla_yarn
from megatron.yarn_config import yarn_mscale
from tests.model.helpers import (
    build_model,
    loss_grads_and_logits,
    random_batch,
    spawn_collect,
)
from tests.model.test_qk_layernorm import randomize
from tests.tolerances import assert_close_reordered, forward_terms, grad_terms, loss_terms

YARN = MLAConfig(
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_head_dim=12,
    qk_pos_emb_head_dim=8,
    v_head_dim=10,
    rotary_scaling_factor=4.0,
    mscale=0.707,
    mscale_all_dim=1.0,
    original_max_position_embeddings=4,
)
"""DeepSeek-V3's form at toy widths (a query latent, YaRN); a short original context so the
ramp between kept and interpolated frequencies falls inside the 4 rotary frequencies."""
LITE = MLAConfig(
    q_lora_rank=None, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10,
    rope_type="rope",
)  # fmt: skip
"""DeepSeek-V2-Lite's form: queries straight from the hidden states, plain rope."""
MODEL = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
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
    qk_layernorm=True,
    untie_embeddings_and_output_weights=True,
    use_cpu_initialization=True,
)
VARIANTS = {"yarn": YARN, "lite": LITE}
BATCH, SEQ = 2, 8


def config(variant: str, **overrides: object) -> ModelConfig:
    """The model with the variant's attention."""
    return ModelConfig(**{**MODEL, "mla": VARIANTS[variant], **overrides})


def reference_frequencies(mla: MLAConfig, base: float) -> torch.Tensor:
    """Rotary inverse frequencies [d / 2]: plain, or transformers' YaRN."""
    dim = mla.qk_pos_emb_head_dim
    if mla.rope_type != "yarn":
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = PretrainedConfig()
    hf.hidden_size, hf.num_attention_heads, hf.head_dim = dim, 1, dim
    hf.max_position_embeddings = 64
    hf.rope_parameters = hf.rope_scaling = {
        "rope_type": "yarn",
        "rope_theta": base,
        "factor": mla.rotary_scaling_factor,
        "original_max_position_embeddings": mla.original_max_position_embeddings,
        "beta_fast": mla.beta_fast,
        "beta_slow": mla.beta_slow,
        "mscale": mla.mscale,
        "mscale_all_dim": mla.mscale_all_dim,
    }
    hf.rope_theta = base
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    return inv_freq.float(), factor


def interleaved_rotation(
    t: torch.Tensor, positions: torch.Tensor, inv_freq, factor
) -> torch.Tensor:
    """DeepSeek's rotary: channel pairs (2i, 2i + 1) turned by position x inv_freq[i] (as
    complex numbers), scaled by `factor`; the result in MLA's order (evens, then odds)."""
    pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2).contiguous())
    angles = torch.outer(positions.float(), inv_freq)  # [s, d / 2]
    turned = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, None, :]
    turned = torch.view_as_real(turned) * factor  # [..., d / 2, 2]
    return torch.cat((turned[..., 0], turned[..., 1]), dim=-1)


def reference_attention(layer: MultiLatentAttention, x: torch.Tensor, cfg: ModelConfig):
    """The layer written out from its weights, in float64."""
    mla, n = cfg.mla, cfg.num_attention_heads
    s, b = x.shape[:2]
    x = x.double()

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()

    def w(linear) -> torch.Tensor:  # noqa: ANN001
        return linear.weight.double().T

    if mla.q_lora_rank is None:
        q = x @ w(layer.linear_q_proj)
    else:
        q = rms(x @ w(layer.linear_q_down_proj), layer.q_layernorm.weight) @ w(
            layer.linear_q_up_proj
        )
    q = q.view(s, b, n, mla.qk_head_dim + mla.qk_pos_emb_head_dim)
    latent, k_pos = (x @ w(layer.linear_kv_down_proj)).split(
        [mla.kv_lora_rank, mla.qk_pos_emb_head_dim], -1
    )
    kv = rms(latent, layer.kv_layernorm.weight) @ w(layer.linear_kv_up_proj)
    k_content, v = kv.view(s, b, n, -1).split([mla.qk_head_dim, mla.v_head_dim], -1)
    q_content, q_pos = q.split([mla.qk_head_dim, mla.qk_pos_emb_head_dim], -1)
    frequencies = reference_frequencies(mla, cfg.rotary_base)
    inv_freq, factor = frequencies if isinstance(frequencies, tuple) else (frequencies, 1.0)
    positions = torch.arange(s)
    q_pos = interleaved_rotation(q_pos, positions, inv_freq, factor).double()
    k_pos = interleaved_rotation(k_pos[:, :, None], positions, inv_freq, factor).double()
    query = torch.cat((q_content, q_pos), -1)
    key = torch.cat((k_content, k_pos.expand(-1, -1, n, -1)), -1)
    scale = 1 / math.sqrt(query.size(-1))
    if mla.rope_type == "yarn":  # DeepSeek's softmax scale: mscale(all dims) squared
        scale *= (0.1 * mla.mscale_all_dim * math.log(mla.rotary_scaling_factor) + 1) ** 2
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * scale
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, -1)
    return context @ w(layer.linear_proj)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_attention_matches_the_written_out_reference(variant: str, backend: str) -> None:
    """Forward and backward (input and latent-norm gradients) equal the float64 reference."""
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = config(variant, attention_backend=backend)
    layer = MultiLatentAttention(cfg, 1, this_rank_groups())
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    out, bias = layer(x, None)
    assert bias is None
    reference = reference_attention(layer, x, cfg)
    forward = 64 + 24 + 16 + 20 + SEQ + 40
    assert_close_reordered(out, reference.float(), terms=forward)
    params = [x, layer.kv_layernorm.weight, layer.linear_kv_down_proj.weight]
    grads = torch.autograd.grad(out.pow(2).sum(), params)
    expected = torch.autograd.grad(reference.pow(2).sum(), params)
    for got, want in zip(grads, expected):
        assert_close_reordered(got, want.float(), terms=2 * forward + SEQ * BATCH * 4)


def test_yarn_frequencies_and_factors_are_transformers() -> None:
    """The kept/interpolated frequency ramp, the cos/sin factor and the softmax factor."""
    inv_freq, factor = reference_frequencies(YARN, 10000.0)
    ours = mla_yarn(YARN).inverse_frequencies(YARN.qk_pos_emb_head_dim, 10000.0)
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, reference_frequencies(LITE, 10000.0))  # the ramp acts
    assert yarn_mscale(4.0, 0.707) / yarn_mscale(4.0, 1.0) == pytest.approx(factor, rel=1e-6)
    assert yarn_mscale(1.0, 1.0) == 1.0


def test_parameters_are_the_inventorys() -> None:
    """Names and shapes as megatron-core's; the planner's count equals the model's."""
    for variant in VARIANTS:
        model = build_model(config(variant))
        attention = {
            name.split("self_attention.")[1]: tuple(p.shape)
            for name, p in model.named_parameters()
            if ".layers.0.self_attention." in name
        }
        q = (
            {"linear_q_proj.weight": (80, 64)}
            if variant == "lite"
            else {
                "linear_q_down_proj.weight": (24, 64),
                "linear_q_up_proj.weight": (80, 24),
                "q_layernorm.weight": (24,),
            }
        )
        assert attention == {
            **q,
            "linear_kv_down_proj.weight": (24, 64),
            "linear_kv_up_proj.weight": (88, 16),
            "kv_layernorm.weight": (16,),
            "linear_proj.weight": (64, 40),
        }
        assert num_parameters(config(variant)) == sum(p.numel() for p in model.parameters())


def measure(tokens, labels, variant: str, **overrides) -> dict[str, object]:
    """Per-token loss, full gradients and full eval logits of the variant's random model."""
    model = build_model(config(variant, **overrides))
    randomize(model)
    return loss_grads_and_logits(model, tokens, labels)


def tensor_parallel_body(rank: int, world: int) -> dict[str, object]:
    """Each variant at TP=1, TP=2 and TP=2 with sequence parallelism in one 2-rank world."""
    from megatron.core import parallel_state

    tokens, labels = random_batch(BATCH, SEQ, MODEL["vocab_size"])
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
def test_tensor_parallel_equals_tp1(tp_world, variant: str, layout: str) -> None:
    """TP=2 (and with sequence parallelism) gives TP=1's loss, logits and every gradient."""
    cfg = config(variant)
    for results in tp_world:
        reference, got = results[variant, "tp1"], results[variant, layout]
        assert_close_reordered(got["loss"], reference["loss"], terms=loss_terms(cfg, SEQ))
        assert_close_reordered(got["logits"], reference["logits"], terms=forward_terms(cfg, SEQ))
        assert got["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            assert_close_reordered(
                got["grads"][name],
                grad,
                terms=grad_terms(cfg, BATCH, SEQ),
                msg=f"{variant} {layout} {name}",
            )
