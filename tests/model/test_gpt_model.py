"""GPTModel in one process: Megatron's layout and sizes, numerics against a dense reference.

The reference (`reference_logits`) is GPT-2 written out in plain torch from the state dict:
separate q/k/v cut from the fused weight in Megatron's per-head interleaved layout
`[heads, 3, head_dim]`, an explicit causal softmax and the configured GeLU, and rotary
embeddings as complex multiplications. Agreement with it pins the fused QKV layout, the
residual wiring and the tied output layer; the remaining tests compare the model with
itself under the options that must not change the result (attention backends, query-key
layer scaling, activation recomputation) and check the options that must fail loudly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron.config import ModelConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel, flops_per_token, model_size_report, num_parameters
from tests.model.helpers import (
    LAYER_PARAMETERS,
    build_model,
    complex_rotary,
    loss_and_grads,
    random_batch,
    tiny_config,
)
from tests.tolerances import (
    assert_close_reordered,
    forward_terms,
    grad_terms,
    loss_terms,
)

GPT2_SMALL = dict(
    num_layers=12,
    hidden_size=768,
    num_attention_heads=12,
    vocab_size=50304,
    max_position_embeddings=1024,
)


@pytest.fixture(autouse=True)
def _seeded_rng_streams():
    """Every test starts with the model-parallel RNG stream present (dropout needs it)."""
    model_parallel_cuda_manual_seed(1234)


def layer_keys(i: int) -> list[str]:
    """Megatron's state-dict keys of transformer layer `i`, in Megatron's order."""
    prefix = f"language_model.encoder.layers.{i}."
    names = LAYER_PARAMETERS
    return [prefix + name for name in names]


def reference_logits(
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    tokens: torch.Tensor,
    qkv_layout: str = "interleaved",
) -> torch.Tensor:
    """Dense GPT-2 in plain torch from a GPTModel state dict: [b, s] ids -> [b, s, V] logits.

    `qkv_layout`: "interleaved" reads the fused QKV rows as [heads, 3, head_dim] (Megatron's
    checkpoint format 3.0); "grouped" as [3, heads, head_dim], only as a negative control.
    """
    b, s = tokens.shape
    h, heads, hn = config.hidden_size, config.num_attention_heads, config.kv_channels
    gelu = "tanh" if config.activation == "gelu_tanh" else "none"
    word = state["language_model.embedding.word_embeddings.weight"]
    x = word[tokens]  # [b, s, h]
    if config.position_embedding_type == "learned_absolute":
        x = x + state["language_model.embedding.position_embeddings.weight"][:s]
    rotary_dim = int(hn * config.rotary_percent)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)

    def layer_norm(t: torch.Tensor, prefix: str) -> torch.Tensor:
        """The layer norm whose parameters are `{prefix}.weight` and `{prefix}.bias`."""
        weight, bias = state[prefix + ".weight"], state[prefix + ".bias"]
        return F.layer_norm(t, (h,), weight, bias, config.layernorm_epsilon)

    for i in range(config.num_layers):
        p = f"language_model.encoder.layers.{i}."
        qkv = (
            layer_norm(x, p + "input_layernorm")
            @ state[p + "self_attention.query_key_value.weight"].T
            + state[p + "self_attention.query_key_value.bias"]
        )
        if qkv_layout == "interleaved":
            q, k, v = qkv.view(b, s, heads, 3, hn).unbind(3)  # each [b, s, heads, hn]
        else:
            q, k, v = qkv.view(b, s, 3, heads, hn).unbind(2)
        if config.position_embedding_type == "rope":
            q = complex_rotary(q.transpose(0, 1), rotary_dim).transpose(0, 1)
            k = complex_rotary(k.transpose(0, 1), rotary_dim).transpose(0, 1)
        scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(hn)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        context = torch.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, heads * hn)
        x = (
            x
            + context @ state[p + "self_attention.dense.weight"].T
            + state[p + "self_attention.dense.bias"]
        )
        inner = (
            layer_norm(x, p + "post_attention_layernorm") @ state[p + "mlp.dense_h_to_4h.weight"].T
            + state[p + "mlp.dense_h_to_4h.bias"]
        )
        x = (
            x
            + F.gelu(inner, approximate=gelu) @ state[p + "mlp.dense_4h_to_h.weight"].T
            + state[p + "mlp.dense_4h_to_h.bias"]
        )
    return layer_norm(x, "language_model.encoder.final_layernorm") @ word.T


# --- layout and sizes -------------------------------------------------------------------


def test_state_dict_keys_and_shapes_are_megatrons():
    """Exactly Megatron's key names, in its order, with the unsplit shapes."""
    config = tiny_config(num_layers=3, hidden_size=32, ffn_hidden_size=80)
    state = GPTModel(config).state_dict()
    expected = [
        "language_model.embedding.word_embeddings.weight",
        "language_model.embedding.position_embeddings.weight",
        *(key for i in range(3) for key in layer_keys(i)),
        "language_model.encoder.final_layernorm.weight",
        "language_model.encoder.final_layernorm.bias",
    ]
    assert list(state) == expected
    h, ffn, v, p = 32, 80, 64, 16
    shapes = {
        "input_layernorm.weight": (h,),
        "input_layernorm.bias": (h,),
        "self_attention.query_key_value.weight": (3 * h, h),
        "self_attention.query_key_value.bias": (3 * h,),
        "self_attention.dense.weight": (h, h),
        "self_attention.dense.bias": (h,),
        "post_attention_layernorm.weight": (h,),
        "post_attention_layernorm.bias": (h,),
        "mlp.dense_h_to_4h.weight": (ffn, h),
        "mlp.dense_h_to_4h.bias": (ffn,),
        "mlp.dense_4h_to_h.weight": (h, ffn),
        "mlp.dense_4h_to_h.bias": (h,),
    }
    for i in range(3):
        for name, shape in shapes.items():
            assert tuple(state[f"language_model.encoder.layers.{i}.{name}"].shape) == shape, name
    assert tuple(state["language_model.embedding.word_embeddings.weight"].shape) == (v, h)
    assert tuple(state["language_model.embedding.position_embeddings.weight"].shape) == (p, h)
    assert tuple(state["language_model.encoder.final_layernorm.weight"].shape) == (h,)


def test_state_dict_loads_into_a_fresh_model_strictly():
    """A state dict round-trips (strict) and gives identical logits."""
    config = tiny_config()
    tokens, _ = random_batch(2, 8, 64)
    source = build_model(config, seed=0).eval()
    target = build_model(config, seed=5).eval()
    assert not torch.equal(source(tokens), target(tokens))
    target.load_state_dict(source.state_dict(), strict=True)
    # Bitwise: the same kernels on the same (copied) weights.
    assert torch.equal(source(tokens), target(tokens))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(ffn_hidden_size=72, kv_channels=12),
        dict(position_embedding_type="rope"),
    ],
    ids=["default", "ffn-and-kv-channels", "rope"],
)
def test_num_parameters_counts_the_built_model(overrides):
    """num_parameters equals the built model's parameter count (tied output counted once)."""
    config = tiny_config(num_layers=3, **overrides)
    model = GPTModel(config)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    embedding = model.language_model.embedding
    embedding_count = sum(p.numel() for p in embedding.parameters())
    assert num_parameters(config, include_embeddings=False) == (
        num_parameters(config) - embedding_count
    )


def test_gpt2_small_has_124_475_904_parameters():
    """GPT-2 small, vocab padded to 50304, 1024 positions: 124,475,904 parameters."""
    config = ModelConfig(**GPT2_SMALL)
    assert num_parameters(config) == 124_475_904
    assert num_parameters(config, include_embeddings=False) == 85_056_000
    assert "124,475,904 parameters" in model_size_report(config, 1024)


@pytest.mark.parametrize(
    "shape",
    [(12, 768, 12, 50304, 1024), (24, 1024, 16, 50304, 2048), (2, 32, 4, 64, 8)],
    ids=["gpt2-small", "gpt2-medium-2k", "tiny"],
)
def test_flops_per_token_closed_form(shape):
    """For ffn = 4h: 72 L h^2 + 12 L s h + 6 h V (Megatron's accounting, training)."""
    layers, h, heads, vocab, seq = shape
    config = ModelConfig(layers, h, heads, vocab, max(seq, 8))
    expected = 72 * layers * h**2 + 12 * layers * seq * h + 6 * h * vocab
    assert flops_per_token(config, seq) == expected


def test_flops_per_token_equals_counted_matmul_flops():
    """torch's FLOP counter over one forward + backward (unfused attention) agrees exactly."""
    config = tiny_config(attention_backend="unfused", ffn_hidden_size=96, kv_channels=12)
    model = build_model(config)
    tokens, labels = random_batch(3, 8, 64)
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=labels).mean().backward()
    assert counter.get_total_flops() == flops_per_token(config, 8) * tokens.numel()


def test_initialization_statistics():
    """N(0, 0.02) weights, 0.02/sqrt(2L) on the residual outputs, LN 1/0, zero biases."""
    layers = 4
    config = ModelConfig(layers, 128, 4, 512, 256)
    model = build_model(config)
    scaled = 0.02 / math.sqrt(2 * layers)
    checked = 0
    for name, param in model.named_parameters():
        value = param.detach()
        if name.endswith("layernorm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith(".bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
        else:
            std = (
                scaled
                if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight"))
                else 0.02
            )
            assert value.std().item() == pytest.approx(std, rel=0.04), name
            assert abs(value.mean().item()) < 0.05 * std, name
            checked += 1
    assert checked == 2 + 4 * layers


# --- numerics against the dense reference ------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(activation="gelu_tanh"),
        dict(activation="gelu"),
        dict(position_embedding_type="rope", rotary_percent=1.0),
        dict(position_embedding_type="rope", rotary_percent=0.5, activation="gelu"),
        dict(num_attention_heads=2, kv_channels=24),
    ],
    ids=["gelu-tanh", "gelu-erf", "rope-1.0", "rope-0.5", "kv-channels"],
)
def test_logits_match_dense_reference(overrides):
    """Same logits as the hand-written dense GPT-2 (which pins the [heads, 3, hn] layout)."""
    config = tiny_config(num_layers=3, **overrides)
    model = build_model(config).eval()
    tokens, _ = random_batch(2, 12, 64)
    state = model.state_dict()
    with torch.no_grad():
        logits = model(tokens)
        expected = reference_logits(state, config, tokens)
        grouped = reference_logits(state, config, tokens, qkv_layout="grouped")
    assert logits.shape == (2, 12, 64)
    # Another code path (separate q/k/v, einsum attention): sums in another order.
    assert_close_reordered(logits, expected, terms=forward_terms(config, 12))
    # The negative control: reading the rows as [3, heads, hn] gives other logits.
    assert (grouped - expected).abs().max() > 1e-3


def test_gelu_variants_differ():
    """`activation` is honoured: erf and tanh GeLU give different logits (same weights)."""
    tokens, _ = random_batch(2, 8, 64)
    tanh_model = build_model(tiny_config(activation="gelu_tanh")).eval()
    erf_model = build_model(tiny_config(activation="gelu")).eval()
    erf_model.load_state_dict(tanh_model.state_dict())
    with torch.no_grad():
        difference = (tanh_model(tokens) - erf_model(tokens)).abs().max().item()
    # Same weights and kernels but for the GeLU: an ignored `activation` would give exactly 0.
    assert 1e-7 < difference < 1e-2


def test_attention_backends_agree_on_loss_and_grads():
    """`sdpa` and `unfused` give the same loss and gradients (dropout 0, training mode)."""
    tokens, labels = random_batch(3, 10, 64)
    results = {}
    for backend in ("sdpa", "unfused"):
        model = build_model(tiny_config(num_layers=3, attention_backend=backend))
        results[backend] = loss_and_grads(model, tokens, labels)
    config = model.config
    assert_close_reordered(results["sdpa"][0], results["unfused"][0], terms=loss_terms(config, 10))
    for name, grad in results["sdpa"][1].items():
        assert_close_reordered(
            grad, results["unfused"][1][name], terms=grad_terms(config, 3, 10), msg=name
        )


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_document_mask_equals_separate_documents(backend):
    """A block-diagonal mask with reset positions gives each document its lone logits."""
    model = build_model(tiny_config(attention_backend=backend)).eval()
    first, _ = random_batch(2, 5, 64, seed=3)
    second, _ = random_batch(2, 7, 64, seed=4)
    packed = torch.cat((first, second), dim=1)
    s = packed.size(1)
    document = torch.tensor([0] * 5 + [1] * 7)
    allowed = (document[:, None] == document[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    mask = (~allowed).view(1, 1, s, s)
    positions = torch.cat((torch.arange(5), torch.arange(7))).unsqueeze(0)
    with torch.no_grad():
        packed_logits = model(packed, position_ids=positions, attention_mask=mask)
        alone = torch.cat((model(first), model(second)), dim=1)
        causal = model(
            packed, attention_mask=torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
        )
        default = model(packed)
    # Other shapes (12 keys vs 5 and 7) and an explicit mask vs the causal kernel: the same
    # sums blocked and ordered differently.
    terms = forward_terms(model.config, s)
    assert_close_reordered(packed_logits, alone, terms=terms)
    assert_close_reordered(causal, default, terms=terms)


def test_query_key_layer_scaling_changes_nothing_in_fp32():
    """`apply_query_key_layer_scaling` (unfused) divides and re-multiplies: same in fp32."""
    tokens, labels = random_batch(2, 8, 64)
    results = []
    for scaling in (False, True):
        config = tiny_config(
            num_layers=3, attention_backend="unfused", apply_query_key_layer_scaling=scaling
        )
        model = build_model(config)
        results.append(loss_and_grads(model, tokens, labels))
    layers = model.language_model.encoder.layers
    assert [layer.self_attention.core_attention.layer_number for layer in layers] == [1, 2, 3]
    # Dividing and re-multiplying the scores rounds each by an ulp or two: bounded as sums.
    assert_close_reordered(results[0][0], results[1][0], terms=loss_terms(config, 8))
    for name, grad in results[0][1].items():
        assert_close_reordered(grad, results[1][1][name], terms=grad_terms(config, 2, 8), msg=name)


# --- behaviour ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(attention_backend="unfused"), dict(position_embedding_type="rope")],
    ids=["sdpa", "unfused", "rope"],
)
def test_causality(overrides):
    """Changing token t leaves the logits before t unchanged and changes those from t on."""
    model = build_model(tiny_config(**overrides)).eval()
    tokens, _ = random_batch(2, 10, 64)
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    # Tight: the same kernels on the same shapes, and positions before 6 never read the
    # changed token (masked scores give exact zeros), so only a causality leak can differ.
    torch.testing.assert_close(before[:, :6], after[:, :6], atol=1e-6, rtol=0)
    assert (before[:, 6:] - after[:, 6:]).abs().amax(dim=(0, 2)).min() > 1e-4


def test_parallel_output_false_returns_full_vocabulary_logits():
    """`parallel_output=False` gives [b, s, V] logits (equal to the split ones at TP=1)."""
    tokens, labels = random_batch(2, 8, 64)
    split = build_model(tiny_config()).eval()
    gathered = build_model(tiny_config(parallel_output=False)).eval()
    with torch.no_grad():
        logits = gathered(tokens)
        assert logits.shape == (2, 8, 64)
        # Bitwise: at TP=1 the gather is the identity, so both run the same kernels.
        torch.testing.assert_close(logits, split(tokens), atol=0, rtol=0)
        with pytest.raises(ValueError, match="parallel_output"):
            gathered(tokens, labels=labels)


def test_loss_is_per_token_cross_entropy():
    """The labelled forward returns F.cross_entropy of the logits, per token, in fp32."""
    model = build_model(tiny_config()).eval()
    tokens, labels = random_batch(3, 8, 64)
    with torch.no_grad():
        losses = model(tokens, labels=labels)
        logits = model(tokens)
    expected = F.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), reduction="none")
    assert losses.shape == (3, 8) and losses.dtype == torch.float32
    # The vocab-parallel cross entropy vs F.cross_entropy: log-sum-exps over 64 in two ways.
    assert_close_reordered(losses, expected.view(3, 8), terms=64)


def test_check_labels_reaches_the_loss():
    """`check_labels`: a label past the vocabulary is a ValueError in [b, s] terms; off, none."""
    tokens, labels = random_batch(2, 8, 64)
    labels[1, 5] = 64  # the model's (padded) vocabulary is 64
    with torch.no_grad():
        assert torch.isfinite(build_model(tiny_config()).eval()(tokens, labels=labels)).all()
        checked = build_model(tiny_config(check_labels=True)).eval()
        with pytest.raises(ValueError, match="label 64 at sequence position 5, batch index 1 "):
            checked(tokens, labels=labels)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a CPU-only machine")
def test_flash_backend_without_gpu_raises():
    """`attention_backend='flash'` on a CPU-only machine fails at construction, naming the GPU."""
    with pytest.raises(RuntimeError, match="GPU"):
        GPTModel(tiny_config(attention_backend="flash"))


def test_sequence_longer_than_position_table_raises():
    """Max-length sequences run; one token more is a ValueError naming the flag."""
    model = build_model(tiny_config()).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 64)
        with pytest.raises(ValueError, match="--max-position-embeddings"):
            model(torch.zeros(1, 17, dtype=torch.long))


# --- activation recomputation ------------------------------------------------------------


def count_calls(model: GPTModel) -> tuple[list[int], list[int]]:
    """Per-layer counters of transformer-layer and core-attention forward calls (live lists)."""
    layers, cores = [], []
    for layer in model.language_model.encoder.layers:
        for counters, module in ((layers, layer), (cores, layer.self_attention.core_attention)):
            counters.append(0)
            index = len(counters) - 1

            def hook(*_, counters=counters, index=index):
                """Count one forward call."""
                counters[index] += 1

            module.register_forward_hook(hook)
    return layers, cores


@pytest.mark.parametrize(
    "granularity, method, num_layers, layer_calls, core_calls",
    [
        ("full", "uniform", 1, [2, 2, 2], [2, 2, 2]),
        ("full", "uniform", 2, [2, 2, 2], [2, 2, 2]),
        ("full", "block", 1, [2, 1, 1], [2, 1, 1]),
        ("full", "block", 2, [2, 2, 1], [2, 2, 1]),
        ("selective", "uniform", 1, [1, 1, 1], [2, 2, 2]),
    ],
    ids=["full-uniform-1", "full-uniform-2", "full-block-1", "full-block-2", "selective"],
)
def test_recomputation_with_dropout_matches_plain(
    granularity, method, num_layers, layer_calls, core_calls
):
    """Recomputed layers replay the same dropout masks: same loss, same gradients.

    The forward-call counts show which layers (or attention cores) were recomputed.
    """
    dropout = dict(num_layers=3, hidden_dropout=0.1, attention_dropout=0.1)
    tokens, labels = random_batch(3, 10, 64)
    plain = build_model(tiny_config(**dropout))
    recomputed = build_model(
        tiny_config(
            **dropout,
            recompute_granularity=granularity,
            recompute_method=method,
            recompute_num_layers=num_layers,
        )
    )
    plain_layers, plain_cores = count_calls(plain)
    layers, cores = count_calls(recomputed)
    expected_loss, expected_grads = loss_and_grads(plain, tokens, labels, rng_seed=7)
    loss, grads = loss_and_grads(recomputed, tokens, labels, rng_seed=7)
    assert (plain_layers, plain_cores) == ([1, 1, 1], [1, 1, 1])
    assert (layers, cores) == (layer_calls, core_calls)
    # Tight: recomputation replays the same CPU kernels on the same inputs, forward and
    # backward (bitwise equal at 1 and 4 threads, AVX2 and AVX-512); a wrong mask errs by O(1).
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5)
    # Dropout really was on: the evaluation-mode loss and another seed's loss differ.
    with torch.no_grad():
        eval_loss = plain.eval()(tokens, labels=labels)
    other_seed, _ = loss_and_grads(recomputed, tokens, labels, rng_seed=8)
    assert (eval_loss - expected_loss).abs().max() > 1e-3
    assert (other_seed - expected_loss).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputation_with_dropout_matches_plain_on_gpu(granularity):
    """On a GPU the RNG tracker forks the CUDA generator; recomputation still replays it."""
    dropout = dict(num_layers=3, hidden_dropout=0.1, attention_dropout=0.1)
    tokens, labels = (tensor.cuda() for tensor in random_batch(3, 10, 64))
    plain = build_model(tiny_config(**dropout)).cuda()
    recomputed = build_model(tiny_config(**dropout, recompute_granularity=granularity)).cuda()
    expected_loss, expected_grads = loss_and_grads(plain, tokens, labels, rng_seed=7)
    loss, grads = loss_and_grads(recomputed, tokens, labels, rng_seed=7)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=0)  # the same kernels
    # CUDA's embedding backward accumulates with atomics: gradients in no fixed order.
    for name, grad in expected_grads.items():
        assert_close_reordered(grads[name], grad, terms=grad_terms(plain.config, 3, 10), msg=name)
    other_seed, _ = loss_and_grads(recomputed, tokens, labels, rng_seed=8)
    assert (other_seed - expected_loss).abs().max() > 1e-3


def test_training_mode_with_dropout_is_reproducible_from_the_seeds():
    """Two runs after the same reseeding are bit-identical."""
    model = build_model(tiny_config(hidden_dropout=0.2, attention_dropout=0.2))
    tokens, labels = random_batch(2, 8, 64)
    first = loss_and_grads(model, tokens, labels, rng_seed=3)
    second = loss_and_grads(model, tokens, labels, rng_seed=3)
    # Bitwise: the same model, kernels and dropout masks twice.
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[1][name], second[1][name]) for name in first[1])


# --- reduced precision -------------------------------------------------------------------


def test_bf16_parameters_run_with_an_fp32_loss():
    """bf16 parameters: bf16 logits, fp32 loss close to the fp32 model's, bf16 gradients."""
    tokens, labels = random_batch(2, 8, 64)
    reference = build_model(tiny_config()).eval()
    model = GPTModel(tiny_config(params_dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    model.load_state_dict(reference.state_dict())
    model.eval()
    with torch.no_grad():
        assert model(tokens).dtype == torch.bfloat16
        expected = reference(tokens, labels=labels)
    losses = model(tokens, labels=labels)
    assert losses.dtype == torch.float32
    assert losses.mean().item() == pytest.approx(expected.mean().item(), abs=0.03)
    model.train()
    losses = model(tokens, labels=labels)
    assert losses.dtype == torch.float32
    losses.mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(param.grad.float()).all(), name
