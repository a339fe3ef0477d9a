"""The key/value cache (`InferenceParams`): incremental forwards equal one full forward.

A model run over a whole sequence and the same model fed the sequence in pieces (one token
at a time, a prompt then single tokens, or several multi-token chunks on a non-empty cache)
must give the same logits at every position, for each attention backend and both kinds of
position embedding, grouped-query attention (whose cache holds only the key/value heads),
multi-latent attention (keys wider than values; its cache holds the compressed latent) and
gpt-oss's layers (attention sinks, a sliding window on every other layer, YaRN).
"""

from __future__ import annotations

import pytest
import torch

from megatron.config import MLAConfig
from megatron.model.inference_params import InferenceParams
from megatron.yarn_config import YarnConfig
from tests.model.helpers import build_model, random_batch, tiny_config
from tests.tolerances import assert_close_reordered, forward_terms

BATCH, SEQ = 2, 12
VARIANTS = {
    "sdpa": dict(),
    "unfused": dict(attention_backend="unfused"),
    "unfused-layer-scaling": dict(attention_backend="unfused", apply_query_key_layer_scaling=True),
    "sdpa-rope": dict(position_embedding_type="rope"),
    "unfused-rope": dict(attention_backend="unfused", position_embedding_type="rope"),
    # LLaMA-style: the cache holds the 2 key/value heads, not the 4 query heads.
    "sdpa-llama": dict(
        position_embedding_type="rope",
        normalization="rmsnorm",
        activation="swiglu",
        num_key_value_heads=2,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    ),
    "unfused-mqa": dict(
        attention_backend="unfused", position_embedding_type="rope", num_key_value_heads=1
    ),
    # Multi-latent attention: keys wider than values, YaRN positions, a query latent.
    "sdpa-mla": dict(
        position_embedding_type="rope",
        normalization="rmsnorm",
        qk_layernorm=True,
        mla=MLAConfig(
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_head_dim=12,
            qk_pos_emb_head_dim=8,
            v_head_dim=10,
            rotary_scaling_factor=4.0,
            mscale_all_dim=1.0,
        ),
    ),
}
# gpt-oss: learned attention sinks, a window on layer 1 only, YaRN, the clamped quick-GeGLU.
GPT_OSS = dict(
    position_embedding_type="yarn",
    yarn=YarnConfig(scaling_factor=4.0, original_max_position_embeddings=4, round_to_int=False),
    normalization="rmsnorm",
    activation="quick_geglu",
    glu_linear_offset=1.0,
    activation_clamp_value=0.5,
    softmax_type="learnable",
    window_size=(3, 0),
    window_attn_skip_freq=2,
    num_key_value_heads=2,
)
VARIANTS["sdpa-gpt-oss"] = GPT_OSS
VARIANTS["unfused-gpt-oss"] = dict(GPT_OSS, attention_backend="unfused")
SPLITS = {
    "token-by-token": [1] * SEQ,
    "prefill-then-tokens": [5] + [1] * (SEQ - 5),
    "chunks-on-a-filled-cache": [3, 4, 1, 2, 2],
}


def incremental_logits(model, tokens: torch.Tensor, pieces: list[int]) -> torch.Tensor:
    """Logits [b, s, v] of `tokens` fed in pieces of the given lengths through one cache."""
    cache = InferenceParams(max_batch_size=tokens.size(0), max_sequence_length=tokens.size(1))
    outputs, start = [], 0
    for length in pieces:
        positions = torch.arange(start, start + length)[None]
        piece = tokens[:, start : start + length]
        outputs.append(model(piece, position_ids=positions, inference_params=cache))
        cache.sequence_len_offset += length
        start += length
    return torch.cat(outputs, dim=1)


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def model_and_tokens(request):
    """An eval-mode tiny model of one variant and a [b, s] batch of tokens."""
    config = tiny_config(**VARIANTS[request.param])
    tokens, _ = random_batch(BATCH, SEQ, config.vocab_size)
    return build_model(config).eval(), tokens


@pytest.mark.parametrize("split", list(SPLITS))
@torch.no_grad()
def test_incremental_logits_equal_full_forward(model_and_tokens, split):
    model, tokens = model_and_tokens
    pieces = SPLITS[split]
    assert sum(pieces) == SEQ
    full = model(tokens)
    cached = incremental_logits(model, tokens, pieces)
    # Other shapes (pieces of the sequence, the cache's keys): the same sums in other orders.
    assert_close_reordered(cached, full, terms=forward_terms(model.config, SEQ))


@torch.no_grad()
def test_default_positions_follow_the_offset(model_and_tokens):
    model, tokens = model_and_tokens
    cache = InferenceParams(BATCH, SEQ)
    model(tokens[:, :7], inference_params=cache)
    cache.sequence_len_offset = 7
    step = model(tokens[:, 7:9], inference_params=cache)  # no position_ids given
    assert_close_reordered(step, model(tokens[:, :9])[:, 7:], terms=forward_terms(model.config, 9))


@torch.no_grad()
def test_cache_layout_per_layer():
    config = tiny_config()
    model = build_model(config).eval()
    tokens, _ = random_batch(BATCH, 4, config.vocab_size)
    cache = InferenceParams(max_batch_size=3, max_sequence_length=10)
    model(tokens, inference_params=cache)
    assert sorted(cache.key_value_memory_dict) == [1, 2]  # Megatron's 1-based layer numbers
    heads, head_dim = config.num_attention_heads, config.kv_channels
    for key, value in cache.key_value_memory_dict.values():
        assert key.shape == value.shape == (10, 3, heads, head_dim)


@torch.no_grad()
def test_mla_cache_holds_the_compressed_latent():
    """Multi-latent attention caches what DeepSeek's does: per position its key/value latent
    and the rotated shared key (16 + 8 channels here, against 4 heads x (20 + 10) for the
    up-projected keys and values), and the incremental logits still equal the full ones."""
    config = tiny_config(**VARIANTS["sdpa-mla"])
    model = build_model(config).eval()
    tokens, _ = random_batch(BATCH, SEQ, config.vocab_size)
    cache = InferenceParams(max_batch_size=3, max_sequence_length=SEQ)
    model(tokens, inference_params=cache)
    assert sorted(cache.key_value_memory_dict) == [1, 2]
    for memories in cache.key_value_memory_dict.values():
        assert [tuple(m.shape) for m in memories] == [(SEQ, 3, 1, 16 + 8)]


def test_causal_mask_is_aligned_to_the_newest_token():
    cache = InferenceParams(1, 8)
    cache.sequence_len_offset = 2
    mask = cache.causal_mask(3, torch.device("cpu"))
    expected = torch.tensor(
        [
            [False, False, False, True, True],
            [False, False, False, False, True],
            [False, False, False, False, False],
        ]
    )
    assert mask.shape == (1, 1, 3, 5)
    assert torch.equal(mask[0, 0], expected)


@torch.no_grad()
def test_cache_limits_raise():
    config = tiny_config()
    model = build_model(config).eval()
    tokens, _ = random_batch(BATCH, 6, config.vocab_size)
    with pytest.raises(ValueError, match="max_sequence_length"):
        model(tokens, inference_params=InferenceParams(BATCH, 5))
    with pytest.raises(ValueError, match="max_batch_size"):
        model(tokens, inference_params=InferenceParams(1, 6))
    cache = InferenceParams(BATCH, 32)
    cache.sequence_len_offset = config.max_position_embeddings - 2
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        model(tokens[:, :3], inference_params=cache)
    with pytest.raises(ValueError, match="max_batch_size >= 1"):
        InferenceParams(0, 4)


@torch.no_grad()
def test_unsupported_combinations_raise():
    config = tiny_config()
    tokens, _ = random_batch(BATCH, 4, config.vocab_size)
    model = build_model(config)
    with pytest.raises(RuntimeError, match="eval"):
        model.train()(tokens, inference_params=InferenceParams(BATCH, 4))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="attention_mask"):
        model.eval()(tokens, attention_mask=mask, inference_params=InferenceParams(BATCH, 4))
    sequence_parallel = build_model(tiny_config(sequence_parallel=True)).eval()
    with pytest.raises(ValueError, match="--sequence-parallel"):
        sequence_parallel(tokens, inference_params=InferenceParams(BATCH, 4))


@torch.no_grad()
def test_forward_without_cache_is_unchanged_by_a_cached_run():
    config = tiny_config()
    model = build_model(config).eval()
    tokens, _ = random_batch(BATCH, 8, config.vocab_size)
    before = model(tokens)
    incremental_logits(model, tokens, [4, 4])
    assert torch.equal(model(tokens), before)  # bitwise: the same forward, run twice
