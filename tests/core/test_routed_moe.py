"""Megatron-LM's MoE layer (`megatron.model.moe_layer`) against references, over gloo.

- One rank: top-k (1, 2, 4) with softmax, pre-softmax and sigmoid scores equals a per-token
  computation written out by hand (forward and every gradient); the grouped matmul equals the
  loop over experts; the load-balancing losses equal Megatron-LM's formulas; capacity
  dropping keeps the highest-weight (or earliest) tokens; aux-loss-free routing moves the
  expert biases toward balance: on skewed input the spread of the experts' loads shrinks.
- Two ranks: `--moe-shared-expert-overlap` (a gated shared expert computed while the tokens
  travel) gives the outputs and gradients of computing it after, bit for bit; dropless top-k
  (1, 2, 4) at EP=2, both dispatchers (all-to-all, all-gather), and
  top-2 under bf16 and fp16 autocast (within the half precision's bound),
  equals EP=1 from the same initial weights in outputs and in the gradients the optimizer
  sees (the router's averaged over the data-parallel ranks, each expert's over every token
  that reached it, divided by the data-parallel size, as Megatron-LM scales them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.config import ModelConfig, RoutedMoEConfig
from megatron.core import parallel_state
from megatron.core.process_groups import this_rank_groups
from megatron.model.moe_aux_loss import AuxLossTracker
from megatron.model.moe_layer import RoutedMoE, reduce_expert_gradients, update_expert_biases
from megatron.model.moe_router import load_balancing_loss
from tests.core.spawn_checks import BODY
from tests.tolerances import assert_close_reordered

HIDDEN, FFN, EXPERTS, SEQ, BATCH = 32, 64, 4, 8, 2
# The layer and the references sum the same fp32 terms in other orders (tokens grouped per
# expert, all-to-all, index_add): the router's logits (HIDDEN), an expert's two linears
# (HIDDEN, FFN), the top-k combination (4); gradients run that chain back and sum over tokens.
FORWARD_TERMS = HIDDEN + HIDDEN + FFN + 4
GRADIENT_TERMS = 2 * FORWARD_TERMS + 2 * SEQ * BATCH


def _config(top_k: int, **moe) -> ModelConfig:
    settings = dict(num_experts=EXPERTS, moe_layers=(True,), top_k=top_k, aux_loss_coeff=0.01)
    settings.update(moe)
    return ModelConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=16,
        ffn_hidden_size=FFN,
        routed_moe=RoutedMoEConfig(**settings),
    )


def _layer(config: ModelConfig, seed: int = 5) -> RoutedMoE:
    torch.manual_seed(seed)
    return RoutedMoE(config, 1, this_rank_groups(), AuxLossTracker()).train()


def _tokens(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator).requires_grad_()  # [s, b, h]


def _by_hand(layer: RoutedMoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its chosen experts, one at a time, weighted as Megatron-LM does."""
    moe, experts = layer.router.moe, layer.experts
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ layer.router.weight.t()
    if layer.router.bias is not None:  # with the linear layers' biases (megatron-core's)
        logits = logits + layer.router.bias
    if moe.score_function == "sigmoid":
        values, chosen = torch.sigmoid(logits).topk(moe.top_k, dim=1)
        weights = values / values.sum(1, keepdim=True) if moe.top_k > 1 else values
    elif moe.pre_softmax:
        weights, chosen = torch.softmax(logits, dim=1).topk(moe.top_k, dim=1)
    else:
        values, chosen = logits.topk(moe.top_k, dim=1)
        weights = torch.softmax(values, dim=1)
    rows = []
    for t in range(tokens.shape[0]):
        row = torch.zeros(HIDDEN)
        for slot in range(moe.top_k):
            e = chosen[t, slot]
            inner = F.gelu(tokens[t] @ experts.weight1[e] + experts.bias1[e], approximate="tanh")
            row = row + weights[t, slot] * (inner @ experts.weight2[e] + experts.bias2[e])
        rows.append(row)
    return torch.stack(rows).view_as(x)


def _grads(layer: RoutedMoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    grads["input"] = x.grad.clone()
    return grads


def _check_equals_by_hand(top_k: int, score: str, pre_softmax: bool) -> None:
    config = _config(top_k, score_function=score, pre_softmax=pre_softmax, aux_loss_coeff=0.0)
    layer, x = _layer(config), _tokens(1)
    out, bias = layer(x)
    assert bias is None
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    ours = _grads(layer, x)
    layer.zero_grad()
    x.grad = None
    expected = _by_hand(layer, x)
    assert_close_reordered(out, expected, terms=FORWARD_TERMS)
    (expected * upstream).sum().backward()
    for name, grad in _grads(layer, x).items():
        assert_close_reordered(ours[name], grad, terms=GRADIENT_TERMS, msg=name)


def _check_grouped_gemm_equals_loop() -> None:
    results = []
    for grouped in (True, False):
        layer, x = _layer(_config(2, grouped_gemm=grouped)), _tokens(2)
        out, _ = layer(x)
        out.square().sum().backward()
        results.append((out, _grads(layer, x)))
    (grouped_out, grouped_grads), (loop_out, loop_grads) = results
    assert_close_reordered(grouped_out, loop_out, terms=FORWARD_TERMS)
    for name, grad in loop_grads.items():
        assert_close_reordered(grouped_grads[name], grad, terms=GRADIENT_TERMS, msg=name)


def _check_grouped_experts_take_a_broadcast_gradient() -> None:
    """The gradient of a sum reaches grouped_mm's backward as a broadcast (zero-stride) tensor."""
    from megatron.model.moe_experts import GroupedExperts

    experts = GroupedExperts(_config(2, grouped_gemm=True), EXPERTS, 0)
    tokens = torch.randn(10, HIDDEN, requires_grad=True)
    experts(tokens, [3, 0, 4, 3]).sum().backward()
    assert tokens.grad is not None and experts.weight1.grad.abs().sum() > 0


def _check_load_balancing_losses() -> None:
    """Megatron-LM's switch loss: E / (k T^2) x sum_e (sum of scores_e) x (tokens to e); the
    sequence-level one is that per sequence (tokens of [s, b] flattened), averaged."""
    logits = torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(3))
    moe = RoutedMoEConfig(num_experts=EXPERTS, moe_layers=(True,), top_k=2)

    def switch(part: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(part, dim=1)
        routed = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=1).indices, 1.0)
        tokens = part.shape[0]
        return EXPERTS / (2 * tokens * tokens) * (scores.sum(0) * routed.sum(0)).sum()

    aux = load_balancing_loss(logits, moe, SEQ)
    torch.testing.assert_close(aux, switch(logits))
    seq_moe = RoutedMoEConfig(**{**moe.__dict__, "load_balancing": "seq_aux_loss"})
    per_sequence = [switch(logits.view(SEQ, BATCH, EXPERTS)[:, b]) for b in range(BATCH)]
    torch.testing.assert_close(
        load_balancing_loss(logits, seq_moe, SEQ), torch.stack(per_sequence).mean()
    )
    uniform = torch.zeros(SEQ * BATCH, EXPERTS)  # equal scores: the loss is its minimum, 1
    assert load_balancing_loss(uniform, moe, SEQ).item() == pytest.approx(1.0)


def _check_aux_loss_gradient_balances_a_skewed_router() -> None:
    """Gradient steps on the load-balancing loss alone take a skewed router (1.29) to an
    even load (the loss's minimum, 1)."""
    moe = RoutedMoEConfig(num_experts=EXPERTS, moe_layers=(True,), top_k=2)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.1).requires_grad_()
    lean = 2.0 * weight.detach()[0] / weight.detach()[0].norm()
    tokens = torch.randn(256, HIDDEN, generator=generator) + lean
    optimizer = torch.optim.SGD([weight], lr=0.5)
    losses = []
    for _ in range(20):
        loss = load_balancing_loss(tokens @ weight.t(), moe, 256)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[0] > 1.2, losses
    assert losses[-1] < 1.02, losses


def _check_capacity_dropping() -> None:
    from megatron.model.moe_router import drop_over_capacity

    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.8, 0.2], [0.7, 0.3]])
    routing_map = torch.tensor([[True, False]] * 4)  # every token to expert 0
    # capacity = ceil(4 tokens x k=1 / 2 experts x 1.0) = 2
    for policy, kept in (("probs", [0, 2]), ("position", [0, 1])):
        moe = RoutedMoEConfig(
            num_experts=2, moe_layers=(True,), top_k=1, capacity_factor=1.0, drop_policy=policy
        )
        dropped_probs, dropped_map = drop_over_capacity(probs, routing_map, moe)
        assert dropped_map[:, 0].nonzero().flatten().tolist() == kept, policy
        assert not dropped_map[:, 1].any()
        torch.testing.assert_close(dropped_probs, probs * dropped_map)


def _spread(loads: torch.Tensor) -> float:
    """Mean distance of the experts' loads from their mean."""
    return (loads - loads.mean()).abs().mean().item()


def _check_expert_bias_balances_skewed_input() -> None:
    config = _config(
        2, score_function="sigmoid", expert_bias=True, bias_update_rate=0.003, aux_loss_coeff=0.0
    )
    layer = _layer(config)
    router = layer.router
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # 256 tokens leaning toward expert 0's router row: a skewed load
        lean = 2.0 * router.weight[0] / router.weight[0].norm()
        tokens = torch.randn(256, HIDDEN, generator=generator) + lean
    spreads, loads = [], []
    for _ in range(400):  # bias steps of 0.003: enough to cross the skew
        router(tokens, 256)  # training mode: counts the loads
        loads.append(router.local_tokens_per_expert.clone())
        spreads.append(_spread(loads[-1]))
        update_expert_biases(layer)
    first, settled = spreads[0], sum(spreads[-20:]) / 20
    assert loads[0].sum() == 256 * 2 and loads[0].argmax() == 0, loads[0]
    assert first >= 40, loads[0]  # the input is skewed
    # Sign updates settle into a small oscillation around balance.
    assert settled <= first / 4, (first, spreads[-20:], loads[-1])
    assert router.expert_bias[0] < 0, router.expert_bias  # the over-loaded expert pushed down
    assert not router.local_tokens_per_expert.any()  # counts reset after each update


def _reinitialize(expert_parallel: int) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_parallel_size=expert_parallel)


def _check_expert_parallel_equals_ep1(
    top_k: int, dispatcher: str, half: torch.dtype | None = None
) -> None:
    """`half`: both sides under that autocast (fp32 weights and gradients, half compute),
    compared within the half precision's reordering bound."""
    config = _config(top_k, dispatcher=dispatcher, z_loss_coeff=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _tokens(10 + rank)  # each data-parallel rank its own tokens
    results = {}
    for ep in (1, world):
        _reinitialize(ep)
        layer = _layer(config)
        with torch.autocast("cpu", dtype=half, enabled=half is not None):
            out, _ = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        reduce_expert_gradients(layer)  # EP=2: over the expert-data ranks, divided by DP
        for param in layer.parameters():
            if getattr(param, "allreduce", True) or ep == 1:  # what DDP averages
                dist.all_reduce(param.grad)
                param.grad /= world
        results[ep] = (out.detach(), _grads(layer, x), layer.first_expert, layer.num_local_experts)
        x.grad = None
    _reinitialize(1)
    (out1, grads1, _, _), (out2, grads2, first, local) = results[1], results[world]
    assert local == EXPERTS // world
    assert_close_reordered(out2, out1, terms=FORWARD_TERMS, dtype=half)
    for name, grad in grads1.items():
        if name.startswith("experts."):
            grad = grad[first : first + local]  # this rank's experts
        assert_close_reordered(grads2[name], grad, terms=GRADIENT_TERMS, dtype=half, msg=name)


def _check_shared_expert_overlap_is_bit_identical() -> None:
    """--moe-shared-expert-overlap at EP=2: the shared expert (gated) computed while the
    tokens travel gives the outputs and gradients of computing it after, bit for bit."""
    rank = dist.get_rank()
    _reinitialize(dist.get_world_size())
    results = []
    for overlap in (False, True):
        config = _config(
            2,
            dispatcher="alltoall",
            shared_expert_ffn_hidden_size=48,
            shared_expert_gate=True,
            shared_expert_overlap=overlap,
        )
        layer, x = _layer(config), _tokens(20 + rank)
        assert layer.overlap_shared == overlap
        out, _ = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), _grads(layer, x)))
    _reinitialize(1)
    (plain, plain_grads), (overlapped, overlapped_grads) = results
    assert torch.equal(plain, overlapped)
    assert plain_grads.keys() == overlapped_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.equal(grad, overlapped_grads[name]), name


SPAWN_WORLD_SIZES = [1, 2]
CHECKS = {
    1: {
        **{
            f"top-{k} {score}{' pre-softmax' if pre else ''} equals the per-token computation": (
                _check_equals_by_hand,
                k,
                score,
                pre,
            )
            for k in (1, 2, 4)
            for score, pre in (("softmax", False), ("softmax", True), ("sigmoid", False))
        },
        "grouped matmul equals the loop over experts": (_check_grouped_gemm_equals_loop,),
        "grouped experts take a broadcast gradient": (
            _check_grouped_experts_take_a_broadcast_gradient,
        ),
        "load-balancing losses follow Megatron-LM's formulas": (_check_load_balancing_losses,),
        "the aux loss's gradient balances a skewed router": (
            _check_aux_loss_gradient_balances_a_skewed_router,
        ),
        "capacity dropping keeps the highest-weight or earliest tokens": (
            _check_capacity_dropping,
        ),
        "expert bias balances a skewed load": (_check_expert_bias_balances_skewed_input,),
    },
    2: {
        f"dropless top-{k} at EP=2 equals EP=1 ({dispatcher})": (
            _check_expert_parallel_equals_ep1,
            k,
            dispatcher,
        )
        for k in (1, 2, 4)
        for dispatcher in ("alltoall", "allgather")
    }
    | {
        f"top-2 at EP=2 equals EP=1 under {name} autocast": (
            _check_expert_parallel_equals_ep1,
            2,
            "alltoall",
            half,
        )
        for name, half in (("bf16", torch.bfloat16), ("fp16", torch.float16))
    }
    | {
        "the shared expert overlapped with the dispatch is bit-identical": (
            _check_shared_expert_overlap_is_bit_identical,
        )
    },
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check of this world size, at TP=1."""
    parallel_state.initialize_model_parallel(1, 1)
    try:
        for name, (fn, *arguments) in CHECKS[world].items():
            checks.run(name, fn, *arguments)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's worlds, by size."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("world, name", [(w, n) for w, table in CHECKS.items() for n in table])
def test_routed_moe(spawned, world: int, name: str) -> None:
    """Each check passed on every rank."""
    spawned[world].assert_ok(name)


@pytest.mark.parametrize("world", sorted(CHECKS))
def test_spawned_body_ran_every_check(spawned, world: int) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[world].names() == set(CHECKS[world]), spawned[world].per_rank[0].get(BODY)
