"""Our multi-latent attention and group-limited routing equal released megatron-core's
(issue 57).

`megatron_core_mla.py` builds megatron-core 0.16.1's `MLASelfAttention` (local spec, CPU; see
there for the two start-up shims and the causal core attention at its softmax scale) for
DeepSeek-V3's form (a query latent, latent norms, YaRN at factor 4 with mscale 0.707 and
mscale-all-dim 1) and DeepSeek-V2-Lite's (no query latent, plain rope), runs forward and
backward, and saves its weights and results. Our `MultiLatentAttention` with the same flags,
its weights copied by name (megatron-core's names are ours), must give the same output and the
same gradients (input's and every weight's) up to fp32 sums in other orders. The same job
routes seeded logits with megatron-core's `topk_routing_with_score_function` (DeepSeek-V3's
sigmoid scores with an expert bias, top-4 of 16 in the best 2 of 4 groups, scaled by 2.5; softmax
before and after the top-k with groups): our router's weights and map are the same.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron.config import MLAConfig, ModelConfig, RoutedMoEConfig
from megatron.core.process_groups import this_rank_groups
from megatron.model.moe_router import topk_routing
from megatron.model.multi_latent_attention import MultiLatentAttention
from tests.conftest import run_oracle
from tests.distributed import free_port
from tests.tolerances import assert_close_reordered

JOB = os.path.join(os.path.dirname(__file__), "megatron_core_mla.py")
SHAPE = dict(kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10)
CASES = {
    "yarn": MLAConfig(q_lora_rank=24, rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.707,
                      mscale_all_dim=1.0, original_max_position_embeddings=4, **SHAPE),
    "lite": MLAConfig(q_lora_rank=None, rope_type="rope", **SHAPE),
}  # fmt: skip
FORWARD_TERMS = 64 + 24 + 16 + 20 + 8 + 40
"""Down-projection (hidden), latent norms and up-projections, scores, context, output."""


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    """megatron-core's weights, input, output and gradients for every case."""
    out = str(tmp_path_factory.mktemp("mla_oracle") / "mla.pt")
    run_oracle(JOB, out, str(free_port()))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_our_mla_equals_megatron_cores(oracle: dict, case: str) -> None:
    """Output and every gradient as megatron-core's, from its weights."""
    theirs = oracle[case]
    config = ModelConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128,
        max_position_embeddings=16, normalization="rmsnorm", layernorm_epsilon=1e-6,
        qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        position_embedding_type="rope", mla=CASES[case],
    )  # fmt: skip
    layer = MultiLatentAttention(config, 1, this_rank_groups())
    ours = dict(layer.named_parameters())
    assert ours.keys() == theirs["weights"].keys()
    with torch.no_grad():
        for name, weight in theirs["weights"].items():
            ours[name].copy_(weight)
    x = theirs["x"].clone().requires_grad_(True)
    out, _ = layer(x, None)
    assert_close_reordered(out, theirs["out"], terms=FORWARD_TERMS)
    out.pow(2).sum().backward()
    grads = {"x": x.grad} | {name: p.grad for name, p in layer.named_parameters()}
    assert grads.keys() == theirs["grads"].keys()
    for name, grad in theirs["grads"].items():
        assert_close_reordered(grads[name], grad, terms=3 * FORWARD_TERMS + 16, msg=name)


ROUTING = {
    "sigmoid, bias, groups (DeepSeek-V3)": dict(top_k=4, num_groups=4, group_topk=2,
        score_function="sigmoid", topk_scaling_factor=2.5, num_experts=16),
    "softmax before the top-k, groups": dict(top_k=2, num_groups=4, group_topk=2,
        pre_softmax=True, num_experts=8),
    "softmax after the top-k, groups": dict(top_k=4, num_groups=2, group_topk=1, num_experts=8),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ROUTING))
def test_group_limited_routing_equals_megatron_cores(oracle: dict, case: str) -> None:
    """The same experts for every token, with the same weights."""
    theirs = oracle["routing"][case]
    moe = RoutedMoEConfig(moe_layers=(True,), **ROUTING[case])
    probs, routing_map = topk_routing(theirs["logits"], moe, theirs["bias"])
    assert torch.equal(routing_map, theirs["map"].bool())
    assert routing_map.sum(dim=1).eq(moe.top_k).all()
    torch.testing.assert_close(probs, theirs["probs"], rtol=1e-6, atol=1e-7)
