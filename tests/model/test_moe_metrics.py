"""Megatron-LM's MoE losses in the log: 'load_balancing_loss' / 'seq_load_balancing_loss' and
'z_loss' are the unweighted losses averaged over the model's MoE layers (summed over the
step's forwards, which the step then averages), beside the weighted 'moe loss' the training
loss adds; with `--moe-per-layer-logging` each layer's value is reported as
'moe/{name}_layer_{i}', which reaches TensorBoard and not the iteration line."""

from __future__ import annotations

import pytest
import torch

from megatron.config import RoutedMoEConfig
from megatron.model import GPTModel
from megatron.model.moe_aux_loss import MOE_LOSS
from megatron.model.moe_router import load_balancing_loss
from megatron.training.monitor import IterationStats, format_iteration_log
from tests.model.helpers import random_batch, tiny_config

LAYERS = 4
MOE_LAYERS = (True, False, True, False)  # --moe-layer-freq 2
AUX, Z = 0.01, 0.001


def _model(balancing: str, per_layer: bool) -> GPTModel:
    routed = RoutedMoEConfig(
        num_experts=4,
        moe_layers=MOE_LAYERS,
        top_k=2,
        load_balancing=balancing,
        aux_loss_coeff=AUX,
        z_loss_coeff=Z,
        per_layer_logging=per_layer,
    )
    torch.manual_seed(0)
    return GPTModel(tiny_config(num_layers=LAYERS, routed_moe=routed)).train()


def _router_inputs(model: GPTModel) -> dict[int, torch.Tensor]:
    """Each MoE layer's router input [T, h] of the next forward (hooks, by layer number)."""
    seen: dict[int, torch.Tensor] = {}
    for layer in model.language_model.encoder.layers:
        if layer.is_routed_moe:
            number = layer.layer_number

            def keep(module, inputs, number=number):  # noqa: ANN001, ANN202
                seen[number] = inputs[0].detach()

            layer.mlp.router.register_forward_pre_hook(keep)
    return seen


@pytest.mark.parametrize(
    "balancing, name",
    [("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss")],
)
def test_named_losses_are_unweighted_means_over_the_moe_layers(balancing: str, name: str) -> None:
    model = _model(balancing, per_layer=True)
    inputs = _router_inputs(model)
    tokens, labels = random_batch(2, 16, 64)
    model.moe_losses.start()
    model(tokens, labels=labels)
    reported = model.moe_losses.pop()
    moe = model.language_model.encoder.layers[0].mlp.router.moe
    by_layer, z_by_layer = {}, {}
    for number, hidden in inputs.items():
        logits = model.language_model.encoder.layers[number - 1].mlp.router._logits(hidden)
        by_layer[number] = load_balancing_loss(logits, moe, seq_length=16)
        z_by_layer[number] = torch.logsumexp(logits.float(), dim=-1).square().mean()
    assert sorted(by_layer) == [1, 3]
    mean = sum(by_layer.values()) / 2
    torch.testing.assert_close(reported[name], mean)
    torch.testing.assert_close(reported["z_loss"], sum(z_by_layer.values()) / 2)
    # The training loss's term: the weighted sum over layers.
    weighted = AUX * sum(by_layer.values()) + Z * sum(z_by_layer.values())
    torch.testing.assert_close(reported[MOE_LOSS], weighted)
    for number in (1, 3):  # Megatron-LM numbers the per-layer tags from 0
        torch.testing.assert_close(reported[f"moe/{name}_layer_{number - 1}"], by_layer[number])
    assert not any("layer_1" in key or "layer_3" in key for key in reported)


def test_per_layer_values_only_when_asked_and_never_in_the_log_line() -> None:
    model = _model("aux_loss", per_layer=False)
    tokens, labels = random_batch(2, 16, 64)
    model.moe_losses.start()
    model(tokens, labels=labels)
    reported = {key: float(value) for key, value in model.moe_losses.pop().items()}
    assert sorted(reported) == ["load_balancing_loss", MOE_LOSS, "z_loss"]
    line = format_iteration_log(
        IterationStats(
            iteration=1,
            train_iters=2,
            consumed_samples=2,
            consumed_tokens=32,
            elapsed_ms_per_iteration=1.0,
            learning_rate=1e-3,
            global_batch_size=2,
            losses={"lm loss": 4.0, **reported, "moe/load_balancing_loss_layer_0": 1.0},
            loss_scale=None,
            grad_norm=None,
            actual_seqlen=16,
            skipped_iterations=0,
            nan_iterations=0,
            samples_per_second=1.0,
            tokens_per_gpu_per_second=16.0,
            tflops=0.0,
        )
    )
    assert " load_balancing_loss: " in line and " z_loss: " in line, line
    assert "moe/" not in line, line


def test_nothing_is_recorded_outside_a_training_step() -> None:
    model = _model("aux_loss", per_layer=True)
    tokens, labels = random_batch(2, 16, 64)
    model(tokens, labels=labels)  # no step started: a test or generation forward
    model.moe_losses.start()
    assert model.moe_losses.pop() == {}
    with torch.no_grad():
        model.moe_losses.start()
        model.eval()(tokens, labels=labels)  # evaluation: no auxiliary losses at all
        assert model.moe_losses.pop() == {}


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recomputation_logs_and_trains_as_without_it(method: str) -> None:
    """Full recomputation runs each layer without gradients first, then again in the backward:
    the logged losses are the first pass's, the same as without recomputation, and so are the
    gradients the auxiliary losses give the routers."""
    tokens, labels = random_batch(2, 16, 64)
    results = []
    for recompute in (False, True):
        model = _model("aux_loss", per_layer=True)
        if recompute:
            model.config.recompute_granularity = "full"
            model.config.recompute_method = method
            model.config.recompute_num_layers = 2
        model.moe_losses.start()
        model(tokens, labels=labels).mean().backward()
        routers = [
            layer.mlp.router.weight.grad.clone()
            for layer in model.language_model.encoder.layers
            if layer.is_routed_moe
        ]
        results.append((model.moe_losses.pop(), routers))
    (plain, plain_grads), (recomputed, recomputed_grads) = results
    assert sorted(recomputed) == sorted(plain)
    assert {"load_balancing_loss", "z_loss", MOE_LOSS} <= set(plain)
    for name, value in plain.items():
        torch.testing.assert_close(recomputed[name], value)
    for ours, theirs in zip(recomputed_grads, plain_grads):
        torch.testing.assert_close(ours, theirs)
