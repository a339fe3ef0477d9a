"""DeepSpeed-MoE layers in our GPT against references computed by hand, over gloo.

- At EP=1 the MoE layer (top-1 and top-2, no token dropping) equals a dense computation of the
  same gate and experts: softmax gate, the top-k experts' outputs weighted by the gate values
  (top-2 renormalised to sum to 1), in the forward and in every gradient.
- At 2 ranks, EP=2 (each rank holds 2 of the 4 experts, tokens cross by all-to-all) equals
  EP=1 from the same weights: outputs and gate gradients per rank, and each expert's gradient
  equal to the sum of its EP=1 gradients over the ranks (its tokens come from both).
- Capacity dropping follows DeepSpeed's gating on a hand-checked case: with every token routed
  to experts 0 then 1 and room for 4, tokens 0-3 keep both experts and 4-7 are dropped
  (output 0); top-1 with random token selection keeps exactly `capacity` tokens.
- The load-balancing loss equals its formula: E x sum_e(mean gate_e x share of tokens whose
  first choice is e) (top-1), E^2 x mean_e(the same product) (top-2).
- The gradient norm counts every expert once at EP=2 (the EP=1 norm of the averaged grads).
- The parameter counts of `model_size` match an MoE GPT's parameters (total and active).
- Full recomputation (ours and DeepSpeed's checkpointing) keeps the MoE loss's gradients (it
  reaches the backward inside the recomputed layers) and its logged value (counted once).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig, MoEConfig
from megatron.core import parallel_state
from tests.core.spawn_checks import BODY
from tests.tolerances import assert_close_reordered, reordering_atol

HIDDEN, FFN, EXPERTS = 32, 48, 4
TOKENS = 8 * 2  # per rank: `_tokens` is [s=8, b=2, h]
# DeepSpeed's layer and the hand-written reference (or EP=2 and EP=1) sum the same fp32 terms
# in other orders (other matmul shapes, tokens grouped per expert, all-to-all), so they agree
# to a reordering bound (tests/tolerances.py) counted from the longest sums into the values.
# Forward: the gate's logits (HIDDEN), its softmax (EXPERTS), an expert's two linears
# (HIDDEN, FFN) and the top-2 combination (2);
MOE_FORWARD_TERMS = HIDDEN + EXPERTS + HIDDEN + FFN + 2
# gradients: that chain forward and back, and a weight gradient's sum over the tokens (at
# EP=2 an expert's come from both ranks; at EP=1 its two halves are then all-reduced).
MOE_TERMS = 2 * MOE_FORWARD_TERMS + 2 * TOKENS


def _config(top_k: int, expert_parallel: int = 1, **moe) -> ModelConfig:
    settings = dict(
        experts_per_layer=(EXPERTS,),
        expert_parallel_size=expert_parallel,
        top_k=top_k,
        drop_tokens=False,
        top2_2nd_expert_sampling=False,
        min_capacity=0,
    )
    settings.update(moe)
    return ModelConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=16,
        ffn_hidden_size=FFN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe=MoEConfig(**settings),
    )


def _moe(config: ModelConfig, seed: int = 3):
    """A DeepSpeed MoE layer of our experts with its expert groups made as the engine makes
    them; every expert gets its own weights (DeepSpeed starts them as copies of one)."""
    import deepspeed
    from deepspeed.utils import groups

    from megatron.model.moe import build_moe_mlp

    deepspeed.init_distributed(dist_backend="gloo")
    groups.mpu = parallel_state.mpu
    layer = build_moe_mlp(config, EXPERTS)
    layer.set_deepspeed_parallelism()
    generator = torch.Generator().manual_seed(seed)
    local = EXPERTS // config.moe.expert_parallel_size
    first = parallel_state.get_data_parallel_rank() % config.moe.expert_parallel_size * local
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=generator))
        weights = [
            {n: torch.randn(p.shape, generator=generator) * 0.2 for n, p in _expert(layer, 0)}
            for _ in range(EXPERTS)
        ]
        for index in range(local):
            for name, param in _expert(layer, index):
                param.copy_(weights[first + index][name])
    return layer, weights


def _expert(layer, index: int):
    return layer.deepspeed_moe.experts.deepspeed_experts[index].named_parameters()


def _expert_output(weights: dict, x: torch.Tensor) -> torch.Tensor:
    """Our GeLU-tanh MLP written out: dense_4h_to_h(gelu(dense_h_to_4h(x)))."""
    hidden = x @ weights["dense_h_to_4h.weight"].T + weights["dense_h_to_4h.bias"]
    hidden = torch.nn.functional.gelu(hidden, approximate="tanh")
    return hidden @ weights["dense_4h_to_h.weight"].T + weights["dense_4h_to_h.bias"]


def _tokens(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, HIDDEN, generator=generator).requires_grad_()  # [s, b, h]


def _dense_reference(wg: torch.Tensor, weights: list[dict], x: torch.Tensor, top_k: int):
    """(output, l_aux) of the same gate and experts computed without DeepSpeed."""
    flat = x.reshape(-1, HIDDEN)
    gates = torch.softmax(flat.float() @ wg.T, dim=1)  # [tokens, E]
    values, indices = gates.topk(top_k, dim=1)
    if top_k == 2:
        values = values / values.sum(dim=1, keepdim=True)
    outputs = torch.stack([_expert_output(w, flat) for w in weights], dim=1)  # [tokens, E, h]
    chosen = outputs.gather(1, indices.unsqueeze(-1).expand(-1, -1, HIDDEN))
    output = (values.unsqueeze(-1) * chosen).sum(dim=1).reshape(x.shape)
    first = torch.nn.functional.one_hot(indices[:, 0], EXPERTS).float()
    product = gates.mean(dim=0) * first.mean(dim=0)
    l_aux = product.sum() * EXPERTS if top_k == 1 else product.mean() * EXPERTS * EXPERTS
    return output, l_aux


def _check_dense_equivalence(top_k: int) -> None:
    layer, weights = _moe(_config(top_k))
    x = _tokens(10 + dist.get_rank())
    output, l_aux, _ = layer(x)
    (output.square().sum() + l_aux).backward()
    wg = layer.deepspeed_moe.gate.wg.weight.detach().clone().requires_grad_()
    ref_weights = [{n: t.clone().requires_grad_() for n, t in w.items()} for w in weights]
    x_ref = x.detach().clone().requires_grad_()
    ref_output, ref_l_aux = _dense_reference(wg, ref_weights, x_ref, top_k)
    (ref_output.square().sum() + ref_l_aux).backward()
    assert_close_reordered(output, ref_output, terms=MOE_FORWARD_TERMS)
    # l_aux: the gate's forward, then means over the tokens and a sum over the experts.
    assert_close_reordered(l_aux, ref_l_aux, terms=MOE_FORWARD_TERMS + TOKENS + EXPERTS)
    assert_close_reordered(x.grad, x_ref.grad, terms=MOE_TERMS)
    assert_close_reordered(layer.deepspeed_moe.gate.wg.weight.grad, wg.grad, terms=MOE_TERMS)
    for index in range(EXPERTS):
        for name, param in _expert(layer, index):
            assert_close_reordered(
                param.grad, ref_weights[index][name].grad, terms=MOE_TERMS, msg=name
            )


def _check_expert_parallel_equals_ep1() -> None:
    from megatron.training.optimizer import clip_grad_norm

    results = {}
    for ep in (1, 2):
        layer, _ = _moe(_config(2, expert_parallel=ep))
        x = _tokens(20 + dist.get_rank())
        output, l_aux, _ = layer(x)
        (output.square().sum() + l_aux).backward()
        experts = {}
        local = EXPERTS // ep
        first = dist.get_rank() % ep * local
        for index in range(local):
            for name, param in _expert(layer, index):
                experts[(first + index, name)] = param.grad.clone()
        results[ep] = (
            output.detach(),
            layer.deepspeed_moe.gate.wg.weight.grad.clone(),
            experts,
            x.grad,
        )
        if ep == 2:
            from deepspeed.utils import groups

            params = list(layer.parameters())
            ep2_norm = clip_grad_norm(params, 0.0, None, groups._get_expert_parallel_group)
    (out1, gate1, experts1, xgrad1), (out2, gate2, experts2, xgrad2) = results[1], results[2]
    assert_close_reordered(out2, out1, terms=MOE_FORWARD_TERMS)
    assert_close_reordered(xgrad2, xgrad1, terms=MOE_TERMS)
    assert_close_reordered(gate2, gate1, terms=MOE_TERMS)
    summed = {}
    for key, grad in experts1.items():  # each expert's gradient from both ranks' tokens
        total = grad.clone()
        dist.all_reduce(total)
        summed[key] = total
    for key, grad in experts2.items():
        assert_close_reordered(grad, summed[key], terms=MOE_TERMS, msg=str(key))
    # The norm counts each expert once: this rank's gate gradient (no data-parallel average in
    # this layer-level check) plus every expert's gradient, each from the rank that holds it.
    expected = gate2.square().sum() + sum(g.square().sum() for g in summed.values())
    # A sum of every gradient's square (per parameter, then over parameters and ranks) in
    # another order, of gradients themselves within the MOE_TERMS bound (twice that, squared):
    # ~1.6e-3 relative, while an expert counted twice or missed is off by its share (~1/4).
    squares = gate2.numel() + sum(g.numel() for g in summed.values())
    atol = reordering_atol(expected, terms=squares + 2 * MOE_TERMS)
    assert abs(ep2_norm**2 - expected.item()) < atol, (ep2_norm**2, expected, atol)


def _check_capacity_dropping_top2() -> None:
    config = _config(2, drop_tokens=True, train_capacity_factor=1.0)
    layer, weights = _moe(config)
    with torch.no_grad():  # every token routes to expert 0, then to expert 1
        layer.deepspeed_moe.gate.wg.weight.zero_()
        layer.deepspeed_moe.gate.wg.weight[:, 0] = torch.tensor([3.0, 2.0, 0.0, 0.0])
    x = torch.zeros(8, 1, HIDDEN)
    x[:, :, 0] = 1.0
    x[:, :, 1:] = torch.randn(8, 1, HIDDEN - 1, generator=torch.Generator().manual_seed(5))
    output, _, counts = layer(x)
    # Capacity: ceil(8 tokens / 4 experts x factor 1.0 x 2) = 4 per expert.
    flat = output.reshape(8, HIDDEN)
    assert torch.equal(flat[4:], torch.zeros(4, HIDDEN)), "tokens 4-7 are over capacity"
    p = torch.softmax(torch.tensor([3.0, 2.0, 0.0, 0.0]), dim=0)
    g0, g1 = p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])
    tokens = x.reshape(8, HIDDEN)[:4]
    expected = g0 * _expert_output(weights[0], tokens) + g1 * _expert_output(weights[1], tokens)
    assert_close_reordered(flat[:4], expected.detach(), terms=MOE_FORWARD_TERMS)
    assert counts.tolist() == [8, 8, 0, 0]  # routed before the capacity cut


def _check_capacity_dropping_top1_random_selection() -> None:
    config = _config(1, drop_tokens=True, train_capacity_factor=1.0)
    layer, _ = _moe(config)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.zero_()
        layer.deepspeed_moe.gate.wg.weight[0, 0] = 5.0  # every token's choice: expert 0
    x = torch.zeros(8, 1, HIDDEN)
    x[:, :, 0] = 1.0
    output, _, _ = layer(x)
    kept = (output.reshape(8, HIDDEN).abs().sum(dim=1) > 0).sum().item()
    assert kept == 2  # capacity ceil(8 / 4 x 1.0) = 2; which two is DeepSpeed's random pick


def _check_parameter_counts() -> None:
    import deepspeed
    from deepspeed.utils import groups

    from megatron.model import GPTModel
    from megatron.model.model_size import num_parameters

    deepspeed.init_distributed(dist_backend="gloo")
    groups.mpu = parallel_state.mpu
    for residual in (False, True):
        base = _config(2, residual=residual)
        config = dataclasses.replace(
            base,
            num_layers=2,
            moe=dataclasses.replace(base.moe, experts_per_layer=(1, EXPERTS)),
        )
        model = GPTModel(config)
        actual = sum(p.numel() for p in model.parameters())
        assert num_parameters(config) == actual, (residual, num_parameters(config), actual)
        mlp = model.language_model.encoder.layers[1].mlp
        one_expert = sum(
            p.numel() for p in mlp.deepspeed_moe.experts.deepspeed_experts[0].parameters()
        )
        assert (
            num_parameters(config) - num_parameters(config, active=True)
            == (EXPERTS - 2) * one_expert
        )


def _check_recomputation_keeps_the_moe_loss_gradient() -> None:
    """Full recomputation (ours and DeepSpeed's) gives the MoE loss the same gradients."""
    import deepspeed
    from deepspeed.utils import groups

    from megatron.core.tensor_parallel import random as tp_random
    from megatron.model import GPTModel

    deepspeed.init_distributed(dist_backend="gloo")
    groups.mpu = parallel_state.mpu
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    results = {}
    for mode in ("none", "ours", "deepspeed"):
        base = _config(2)
        config = dataclasses.replace(
            base,
            num_layers=2,
            moe=dataclasses.replace(base.moe, experts_per_layer=(EXPERTS, EXPERTS)),
            recompute_granularity=None if mode == "none" else "full",
        )
        if mode == "deepspeed":
            tp_random.use_deepspeed_checkpointing(parallel_state.mpu, num_checkpoints=2)
        try:
            torch.manual_seed(0)
            model = GPTModel(config)
            for module in model.modules():
                if hasattr(module, "set_deepspeed_parallelism"):
                    module.set_deepspeed_parallelism()
            # The MoE loss (x its 0.1 coefficient) reaches the backward through the layers;
            # its value is read after the backward, which recomputes the layers.
            model.moe_losses.start()
            lm = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
            lm.backward()
            balancing = model.moe_losses.pop()["moe loss"]
        finally:
            tp_random.use_builtin_checkpointing()
        results[mode] = (
            lm.item(),
            balancing.item(),
            {n: p.grad for n, p in model.named_parameters()},
        )
    reference = results["none"]
    for mode in ("ours", "deepspeed"):
        lm, balancing, grads = results[mode]
        # Recomputation replays the same kernels on the same values (observed bitwise equal
        # at 1 and 4 threads): kept tight, not a reordering bound.
        assert (lm, balancing) == pytest.approx(reference[:2], rel=1e-6), mode
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[2][name], rtol=1e-5, atol=1e-6, msg=name)
        gate = "language_model.encoder.layers.0.mlp.deepspeed_moe.gate.wg.weight"
        assert grads[gate].abs().sum() > 0, "the gate learns through the MoE loss and routing"


SPAWN_WORLD_SIZES = [1, 2]
CHECKS = {
    1: {
        "top-1 equals the dense computation": (_check_dense_equivalence, 1),
        "top-2 equals the dense computation": (_check_dense_equivalence, 2),
        "top-2 capacity dropping": (_check_capacity_dropping_top2,),
        "top-1 capacity dropping with random token selection": (
            _check_capacity_dropping_top1_random_selection,
        ),
        "parameter counts": (_check_parameter_counts,),
        "recomputation keeps the MoE loss gradient": (
            _check_recomputation_keeps_the_moe_loss_gradient,
        ),
    },
    2: {
        "top-2 equals the dense computation at 2 ranks": (_check_dense_equivalence, 2),
        "EP=2 equals EP=1": (_check_expert_parallel_equals_ep1,),
    },
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check of this world size, at TP=1 (experts spread over the data-parallel ranks)."""
    from deepspeed.utils import groups

    parallel_state.initialize_model_parallel(1, 1)
    try:
        for name, (fn, *arguments) in CHECKS[world].items():
            checks.run(name, fn, *arguments)
    finally:
        groups.mpu = None  # the modules after this one set DeepSpeed up their own way
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's worlds, by size."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("world, name", [(w, n) for w, table in CHECKS.items() for n in table])
def test_moe_layer(spawned, world: int, name: str) -> None:
    """Each check passed on every rank."""
    spawned[world].assert_ok(name)


@pytest.mark.parametrize("world", sorted(CHECKS))
def test_spawned_body_ran_every_check(spawned, world: int) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[world].names() == set(CHECKS[world]), spawned[world].per_rank[0].get(BODY)
