"""The MoE load-balancing loss through autograd equals the loss it replaced, on every engine.

Before, the entry script's loss was `lm loss + --moe-loss-coeff x (sum of the MoE layers'
l_aux)`, the l_aux read off the layers after each forward, and the engine backpropagated that
sum. Now each layer hands `coeff x l_aux` to `MoEAuxLossAutoScaler` with its output and the
engine backpropagates the LM loss alone. Over gloo, one process, a 2-layer MoE GPT (4 experts,
top-2) runs one step of 3 accumulated micro-batches both ways from the same weights:

- plain torch (`train_step_plain`) against the old sum written out (`(loss x 1/3).backward()`
  per micro-batch): the gradients the optimizer gets and the reported 'lm loss' and 'moe
  loss' are bitwise equal: the aux losses get the same factor (read off the LM loss's gradient)
  and the backward sums the same terms in the same order;
- DeepSpeed's engine (`train_step_deepspeed`), ZeRO-0 fp32 (the optimizer gets the gradients)
  and ZeRO-1 fp16 (a loss scale of 2^8 on top of DeepSpeed's 1/3; the updated weights compared;
  bf16 on CPUs where DeepSpeed has no fp16)
  against `engine.backward(lm + coeff x aux)`: bitwise equal likewise.
- A coefficient of 0 takes the aux loss out of the gradients (the old sum with it removed).

The reference keeps the autograd route present but gives it a zero gradient
(`set_backward_scale(0)`): it adds exact zeros to the gate's gradients, so the reference is the old
computation.
"""

from __future__ import annotations

import dataclasses
import os
import types
from functools import partial

import pytest
import torch

from megatron.config import ModelConfig, MoEConfig
from megatron.core import parallel_state
from tests.core.spawn_checks import BODY

SEQ, MICRO, ACCUMULATED, VOCAB, COEFF = 16, 2, 3, 128, 0.37


def _config(coeff: float = COEFF) -> ModelConfig:
    moe = MoEConfig(
        experts_per_layer=(4, 4),
        top_k=2,
        drop_tokens=False,
        top2_2nd_expert_sampling=False,  # no draws: both computations route alike
        loss_coeff=coeff,
    )
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,  # large enough that the gates do not route uniformly
        use_cpu_initialization=True,
        moe=moe,
    )


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    text = torch.randint(0, VOCAB, (ACCUMULATED, MICRO, SEQ + 1), generator=generator)
    mask = (torch.rand(ACCUMULATED, MICRO, SEQ, generator=generator) > 0.2).float()
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous(), m) for t, m in zip(text, mask)]


def _masked_mean(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple:
    """pretrain_gpt.loss_func's arithmetic."""
    losses = output.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model, args) -> tuple:  # noqa: ANN001
    """Megatron's forward step on (tokens, labels, loss mask) micro-batches."""
    tokens, labels, loss_mask = next(data_iterator)
    return model(tokens, labels=labels), partial(_masked_mean, loss_mask)


def _model(config: ModelConfig, expert_groups: bool = True) -> torch.nn.Module:
    """The GPT from a fixed seed; with its expert groups, unless DeepSpeed's engine makes them."""
    from megatron.model import GPTModel
    from megatron.model.moe import set_up_expert_groups

    torch.manual_seed(1234)
    model = GPTModel(config)
    if expert_groups:
        set_up_expert_groups(model, parallel_state.deepspeed_mpu())
    return model


def _old_loss(model: torch.nn.Module, output: torch.Tensor, mask: torch.Tensor, coeff: float):
    """The entry script's old loss: LM loss + coeff x the layers' l_aux read off the model
    (DeepSpeed's MoE keeps its last l_aux), and the values it reported."""
    from deepspeed.moe.layer import MoE

    lm, _ = _masked_mean(mask, output)
    losses = [m.deepspeed_moe.l_aux for m in model.modules() if isinstance(m, MoE)]
    weighted = torch.stack([loss.float().reshape(()) for loss in losses]).sum() * coeff
    return lm + weighted, {"lm loss": lm.detach(), "moe loss": weighted.detach()}


def _grads_at_step(optimizer: torch.optim.Optimizer, names: dict) -> dict[str, torch.Tensor]:
    """The gradients the optimizer's next step gets, by parameter name (filled by a hook)."""
    grads: dict[str, torch.Tensor] = {}

    def keep(optimizer, args, kwargs) -> None:  # noqa: ANN001
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grads[names[param]] = param.grad.detach().clone()

    optimizer.register_step_pre_hook(keep)
    return grads


def _adamw(model: torch.nn.Module, guarded: bool = True) -> torch.optim.Optimizer:
    from deepspeed.utils import groups

    from megatron.training.optimizer import GuardedAdamW

    params = list(model.parameters())
    if not guarded:  # what DeepSpeed's ZeRO stages accept, with the experts in groups apart
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        split = split_params_into_different_moe_groups_for_optimizer(
            {"name": "all", "params": params}
        )
        return torch.optim.AdamW(split, lr=1e-2)
    return GuardedAdamW(
        params,
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        eps=1e-8,
        expert_parallel_group=groups._get_expert_parallel_group,
    )


class _Scheduler:
    def step(self, increment: int) -> None:
        del increment


def _assert_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{what}: {name} differs"


def _check_plain(coeff: float) -> None:
    """train_step_plain's gradients and reports against the old sum, bitwise."""
    from megatron.training.step import (
        PlainTrainer,
        accumulate_reported,
        average_over_data_parallel,
        train_step_plain,
    )

    config = _config(coeff)
    batches = _micro_batches()
    reference = _model(config)
    reference.moe_losses.set_backward_scale(0.0)  # the autograd route adds exact zeros
    sums: dict[str, torch.Tensor] = {}
    for tokens, labels, mask in batches:
        loss, reported = _old_loss(reference, reference(tokens, labels=labels), mask, coeff)
        (loss.float() * (1.0 / ACCUMULATED)).backward()  # train_step_plain's old backward
        accumulate_reported(sums, reported)
    expected_grads = {n: p.grad for n, p in reference.named_parameters()}
    expected_losses = average_over_data_parallel(sums, ACCUMULATED)

    model = _model(config)
    optimizer = _adamw(model)
    grads = _grads_at_step(optimizer, {p: n for n, p in model.named_parameters()})
    trainer = PlainTrainer(model, optimizer, _Scheduler(), None, None, ACCUMULATED)
    args = types.SimpleNamespace(global_batch_size=MICRO * ACCUMULATED)
    result = train_step_plain(_forward_step, iter(batches), trainer, args)
    _assert_equal(grads, expected_grads, "gradients")
    assert result.losses == expected_losses, (result.losses, expected_losses)
    gate = "language_model.encoder.layers.0.mlp.deepspeed_moe.gate.wg.weight"
    assert grads[gate].abs().sum() > 0


def _half_on_this_cpu() -> str:
    """fp16 where DeepSpeed's CPU accelerator runs it (oneDNN's fp16: AVX512-FP16 / AMX-FP16
    CPUs), else bf16: DeepSpeed refuses fp16 on other CPUs, and so do our flags there."""
    from deepspeed.accelerator import get_accelerator

    return "fp16" if get_accelerator().is_fp16_supported() else "bf16"


def _engine(config: ModelConfig, stage: int, half: str | None):
    import deepspeed

    model = _model(config, expert_groups=False)
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATED,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": half == "fp16", "initial_scale_power": 8},
        "bf16": {"enabled": half == "bf16"},
        "gradient_clipping": 0.0,
        "wall_clock_breakdown": False,
    }
    optimizer = _adamw(model, guarded=not (half or stage))
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, mpu=parallel_state.deepspeed_mpu(), config=ds_config
    )
    return engine


def _names(engine) -> dict:  # noqa: ANN001 - a DeepSpeedEngine
    return {param: name for name, param in engine.module.named_parameters()}


def _check_deepspeed(stage: int, half: bool) -> None:
    """train_step_deepspeed against engine.backward(lm + coeff x aux), bitwise (`half`: in
    fp16, or bf16 on a CPU without fp16)."""
    import deepspeed

    from megatron.training.step import (
        accumulate_reported,
        average_over_data_parallel,
        train_step_deepspeed,
    )

    deepspeed.init_distributed(dist_backend="gloo")
    config = _config()
    batches = _micro_batches()
    # With ZeRO-0 fp32 the client optimizer gets the gradients in param.grad; elsewhere
    # DeepSpeed's own optimizer keeps them, and the updated weights are compared instead.
    precision = _half_on_this_cpu() if half else None
    see_grads = stage == 0 and precision is None
    reference = _engine(config, stage, precision)
    expected_grads = _grads_at_step(reference.optimizer, _names(reference)) if see_grads else {}
    reference.module.moe_losses.set_backward_scale(0.0)
    sums: dict[str, torch.Tensor] = {}
    for tokens, labels, mask in batches:
        output = reference(tokens, labels=labels)
        loss, reported = _old_loss(reference.module, output, mask, COEFF)
        reference.backward(loss)
        reference.step()
        accumulate_reported(sums, reported)
    expected_losses = average_over_data_parallel(sums, ACCUMULATED)

    engine = _engine(config, stage, precision)
    grads = _grads_at_step(engine.optimizer, _names(engine)) if see_grads else {}
    args = types.SimpleNamespace(global_batch_size=MICRO * ACCUMULATED)
    result = train_step_deepspeed(_forward_step, iter(batches), engine, args)
    assert result.losses == expected_losses, (result.losses, expected_losses)
    assert engine.was_step_applied() and reference.was_step_applied()
    if see_grads:
        assert grads, "the optimizer's step hook saw no gradients"
        _assert_equal(grads, expected_grads, "gradients")
    weights = {n: p.detach() for n, p in engine.module.named_parameters()}
    _assert_equal(weights, dict(reference.module.named_parameters()), "updated weights")


def _check_zero_coefficient_drops_the_aux_gradient() -> None:
    """At --moe-loss-coeff 0 the gradients are those of the LM loss alone."""
    config = _config(0.0)
    tokens, labels, mask = _micro_batches()[0]
    results = []
    for scale in (1.0, 0.0):  # the aux route with its gradient, then without
        model = _model(config)
        model.moe_losses.set_backward_scale(scale)
        model.moe_losses.start()
        _masked_mean(mask, model(tokens, labels=labels))[0].backward()
        reported = model.moe_losses.pop()
        results.append(({n: p.grad for n, p in model.named_parameters()}, reported))
    (with_route, reported), (without_route, _) = results
    _assert_equal(with_route, without_route, "gradients")
    assert reported["moe loss"].item() == 0.0


def _check_tracker_counts_step_forwards_once() -> None:
    """Forwards outside a step add nothing; a recomputation in the backward adds nothing."""
    tokens, labels, mask = _micro_batches()[0]
    totals = {}
    for recompute in (None, "full"):
        config = dataclasses.replace(_config(), recompute_granularity=recompute)
        model = _model(config)
        model(tokens, labels=labels)  # outside a step
        model.moe_losses.start()
        _masked_mean(mask, model(tokens, labels=labels))[0].backward()
        totals[recompute] = model.moe_losses.pop()["moe loss"]
        assert model.moe_losses.pop() == {}, "pop ends the step"
    assert torch.equal(totals[None], totals["full"]), totals


SPAWN_WORLD_SIZES = [1]
CHECKS = {
    "plain torch: aux loss through autograd equals the old sum": (_check_plain, COEFF),
    "plain torch: coefficient 0.5 too": (_check_plain, 0.5),
    "DeepSpeed ZeRO-0 fp32: equals the old sum": (_check_deepspeed, 0, False),
    "DeepSpeed ZeRO-1 fp16 (loss scale; bf16 on a CPU without fp16): equals the old sum": (
        _check_deepspeed,
        1,
        True,
    ),
    "coefficient 0 drops the aux gradient": (_check_zero_coefficient_drops_the_aux_gradient,),
    "the tracker counts each forward of a step once": (_check_tracker_counts_step_forwards_once,),
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check, at TP=1 in one process."""
    import deepspeed
    from deepspeed.utils import groups

    # DeepSpeed's engine asks for the launcher's LOCAL_RANK, which this in-process world lacks.
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(1, 1)
    try:
        for name, (fn, *arguments) in CHECKS.items():
            checks.run(name, fn, *arguments)
    finally:
        groups.mpu = None  # the modules after this one set DeepSpeed up their own way
        parallel_state.destroy_model_parallel()
        if local_rank is None:
            del os.environ["LOCAL_RANK"]


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's world of one process."""
    return spawned_suite[__name__][1]


@pytest.mark.parametrize("name", list(CHECKS))
def test_moe_aux_loss(spawned, name: str) -> None:
    """Each check passed."""
    spawned.assert_ok(name)


def test_spawned_body_ran_every_check(spawned) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned.names() == set(CHECKS), spawned.per_rank[0].get(BODY)
