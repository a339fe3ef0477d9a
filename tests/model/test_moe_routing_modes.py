"""DeepSeek-V3's routing modes on Megatron-LM's router (megatron/model/moe_router.py):
group-limited routing keeps each token's experts inside its best groups (megatron-core's exact
choices: tests/oracle/test_megatron_core_mla.py), and `--moe-router-force-load-balancing`
routes by noise (loads near even) while the router's weight still gets the gradient the
routing weights pass back (straight through)."""

from __future__ import annotations

import torch

from megatron.config import RoutedMoEConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model.moe_aux_loss import AuxLossTracker
from megatron.model.moe_router import TopKRouter, group_limited_scores, topk_routing
from tests.model.helpers import tiny_config


def _router(**fields: object) -> TopKRouter:
    moe = RoutedMoEConfig(moe_layers=(True, True), **{"num_experts": 8, "top_k": 2, **fields})
    torch.manual_seed(0)
    return TopKRouter(tiny_config(routed_moe=moe), 1, AuxLossTracker()).train()


def test_group_limited_experts_lie_in_the_chosen_groups() -> None:
    moe = RoutedMoEConfig(num_experts=16, moe_layers=(True,), top_k=4, num_groups=4, group_topk=2)
    logits = torch.randn(256, 16, generator=torch.Generator().manual_seed(3))
    _, routing_map = topk_routing(logits, moe, None)
    groups_used = routing_map.view(256, 4, 4).any(dim=-1).sum(dim=-1)
    assert groups_used.le(2).all() and groups_used.eq(2).any()
    masked = group_limited_scores(logits, 4, 4, 2)
    # Each token keeps 2 whole groups: 8 finite scores.
    assert torch.isfinite(masked).sum(dim=1).eq(8).all()
    # Without the limit some tokens would use more groups: the limit is doing something.
    free = topk_routing(logits, RoutedMoEConfig(num_experts=16, moe_layers=(True,), top_k=4), None)
    assert free[1].view(256, 4, 4).any(dim=-1).sum(dim=-1).gt(2).any()


def test_forced_balancing_routes_by_noise_and_passes_the_gradient_through() -> None:
    model_parallel_cuda_manual_seed(1234)  # the noise's stream, as a run seeds it
    router = _router(force_load_balancing=True)
    hidden = torch.randn(4096, 32, generator=torch.Generator().manual_seed(1))
    hidden[:, 0] += 10.0  # inputs a trained router would send to few experts
    probs, routing_map = router(hidden, seq_length=64)
    loads = routing_map.sum(dim=0).float()
    mean = 4096 * 2 / 8
    assert loads.min() > 0.8 * mean and loads.max() < 1.2 * mean, loads
    probs.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    unforced = _router()
    _, skewed = unforced(hidden, seq_length=64)
    assert skewed.sum(dim=0).float().max() > 1.5 * mean  # the router's own choice is skewed
