"""MoE under Megatron's pipeline schedules without DeepSpeed trains like one process.

Over gloo, 2 ranks: a 2-layer MoE GPT (hidden 64, 4 experts, top-2, EP=1, fp32, no dropout,
--clip-grad 1, tied embeddings) trains 3 steps of 4 micro-batches two ways on the same batches:
- at PP=1 on plain torch (`train_step_plain` over a `GPTModel` that each rank holds whole and
  trains alone: one process's arithmetic), the reference;
- at PP=2 with 1F1B (`train_step_pipelined` over this rank's chunk: layer 1 on rank 0, layer 2
  on rank 1), the MoE losses of both stages reaching the backward through autograd.
Before each step the chunks take the reference's current weights, so every step starts from
the same weights; then the step's 'lm loss' and 'moe loss' (the sum over both stages' MoE
layers), and every gradient the optimizer gets (before clipping; the tied embedding's two
copies after the embedding-group all-reduce), equal the reference's; so do the evaluated losses
after training. With `--expert-interval 2` (rank 0 holds no MoE layer) the same holds.

Tolerances (tests/tolerances.py): PP=2 sums the same fp32 terms in other orders (each stage
accumulates its micro-batches' gradients at scale 1 and torch divides them by 4 at the end,
the tied embedding's two halves are summed by an all-reduce, the stages' MoE losses too), so
a value may differ by the reordering bound of one step's terms along its path. The gates route
alike by construction, and that premise is checked: from the same weights each layer runs the
same kernels on the same values in both runs, so its gate logits are bitwise equal.
"""

from __future__ import annotations

import types
from functools import partial

import pytest
import torch

from megatron.config import ModelConfig, MoEConfig
from megatron.core import parallel_state
from tests.core.spawn_checks import BODY
from tests.tolerances import (
    assert_close_reordered,
    assert_losses_reordered,
    grad_terms,
    training_loss_terms,
)

SEQ, MICRO, MICROBATCHES, STEPS, VOCAB = 16, 2, 4, 3, 128
MICRO_TOKENS, STEP_TOKENS = MICRO * SEQ, MICRO * MICROBATCHES * SEQ


def _config(experts: tuple[int, ...]) -> ModelConfig:
    moe = MoEConfig(
        experts_per_layer=experts,
        top_k=2,
        drop_tokens=False,
        # Drawn noise would differ: one process draws for both layers, each stage for its own.
        top2_2nd_expert_sampling=False,
        loss_coeff=0.1,
    )
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,  # a multiple of 64: no padding
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        use_cpu_initialization=True,
        moe=moe,
    )


def _micro_batches(seed: int, count: int) -> list[dict]:
    """`count` micro-batches as the data loader gives them, plus a loss mask."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, VOCAB, (count, MICRO, SEQ + 1), generator=generator)
    mask = (torch.rand(count, MICRO, SEQ, generator=generator) > 0.2).float()
    return [{"text": t, "loss_mask": m} for t, m in zip(text, mask)]


def _split(batch: dict) -> tuple:
    """((tokens, position ids), (labels, loss mask)): what the pipeline's batch function gives."""
    text = batch["text"]
    positions = torch.arange(SEQ).expand(MICRO, SEQ).contiguous()
    return (text[:, :-1].contiguous(), positions), (text[:, 1:].contiguous(), batch["loss_mask"])


def _masked_mean(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple:
    """pretrain_gpt.loss_func's arithmetic."""
    losses = output.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model, args) -> tuple:  # noqa: ANN001
    """Megatron's forward step (PP=1)."""
    (tokens, positions), (labels, loss_mask) = _split(next(data_iterator))
    return model(tokens, positions, labels=labels), partial(_masked_mean, loss_mask)


class _Scheduler:
    def step(self, increment: int) -> None:
        del increment


def _adamw(params, model_parallel_group) -> torch.optim.Optimizer:  # noqa: ANN001
    from deepspeed.utils import groups

    from megatron.training.optimizer import GuardedAdamW

    return GuardedAdamW(
        list(params),
        lr=1e-2,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        clip_grad=1.0,
        model_parallel_group=model_parallel_group,
        expert_parallel_group=groups._get_expert_parallel_group,
    )


def _record_grads(optimizer: torch.optim.Optimizer, names: dict) -> list[dict]:
    """Each step's gradients as the optimizer gets them (before clipping), by dense name."""
    steps: list[dict] = []

    def keep(optimizer, args, kwargs) -> None:  # noqa: ANN001
        params = (p for group in optimizer.param_groups for p in group["params"])
        steps.append({names[p]: p.grad.detach().clone() for p in params if p.grad is not None})

    optimizer.register_step_pre_hook(keep)
    return steps


def _record_gate_logits(model: torch.nn.Module) -> dict[int, list[torch.Tensor]]:
    """Every gate's logits [tokens, experts] as the model runs, by global layer number."""
    from deepspeed.moe.sharded_moe import TopKGate

    logits: dict[int, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKGate):
            layer = _layer_of(model, name)

            def keep(gate: TopKGate, inputs: tuple, layer: int = layer) -> None:
                # What TopKGate.forward computes first (in fp32), from its input and weight.
                weight = gate.wg.weight.detach().float()
                out = torch.nn.functional.linear(inputs[0].detach().float(), weight)
                logits.setdefault(layer, []).append(out)

            module.register_forward_pre_hook(keep)
    return logits


def _layer_of(model: torch.nn.Module, name: str) -> int:
    """The global layer number of the module `name` inside a layer of `model`."""
    prefix, _, _ = name.partition(".mlp.")
    return model.get_submodule(prefix).layer_number


def _global_name(chunk: torch.nn.Module, local: str) -> str:
    """The `GPTModel` name of a chunk's parameter (the head copy: the word embeddings)."""
    if local == "word_embeddings_for_head.weight":
        return "language_model.embedding.word_embeddings.weight"
    prefix = "language_model.encoder.layers."
    if local.startswith(prefix):
        index, rest = local.removeprefix(prefix).split(".", 1)
        first = chunk.language_model.encoder.layers[0].layer_number - 1
        return f"{prefix}{int(index) + first}.{rest}"
    return local


def _take_weights(chunk: torch.nn.Module, reference: torch.nn.Module, rank: int) -> None:
    """This stage's part of the reference's current weights (the head copy included)."""
    from megatron.checkpointing.pipeline_stages import chunk_state_dict

    num_layers = reference.config.num_layers
    state = chunk_state_dict(reference.state_dict(), num_layers, 2, 1, rank, 0)
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    assert not unexpected and all("position_embeddings" in m for m in missing), missing


def _pipeline_trainer(config: ModelConfig, rank: int):  # noqa: ANN202
    from megatron.core.pipeline_parallel.schedules import PipelineRunner
    from megatron.model.moe import set_up_expert_groups
    from megatron.model.pipeline_chunks import activation_shape, build_pipeline_chunks
    from megatron.training.megatron_schedules_step import MicroBatchLoss, PipelineTrainer

    chunks = build_pipeline_chunks(config, rank, 2)
    set_up_expert_groups(chunks, parallel_state.deepspeed_mpu())
    # The norm is summed over the stages, as in a run (the pipeline group).
    optimizer = _adamw(chunks.parameters(), parallel_state.get_model_parallel_group())
    loss = MicroBatchLoss(_masked_mean)
    runner = PipelineRunner(
        chunks,
        loss,
        torch.device("cpu"),
        (MICRO, SEQ),
        activation_shape(config, MICRO, SEQ, chunks[0].groups),
        torch.float32,
    )
    return PipelineTrainer(
        chunks, optimizer, _Scheduler(), None, None, MICROBATCHES, runner, _split, loss
    )


def _check_pp2_equals_pp1(experts: tuple[int, ...]) -> None:
    import deepspeed

    from megatron.model import GPTModel
    from megatron.model.moe import set_up_expert_groups
    from megatron.training.megatron_schedules_step import (
        evaluate_megatron_schedules,
        train_step_megatron_schedules,
    )
    from megatron.training.step import PlainTrainer, evaluate_forward_steps, train_step_plain

    deepspeed.init_distributed(dist_backend="gloo")
    config = _config(experts)
    parallel_state.initialize_model_parallel(1, 2)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(1234)
    model = GPTModel(config)  # the reference, whole on each rank: no collective touches it
    set_up_expert_groups(model, parallel_state.deepspeed_mpu())
    reference = PlainTrainer(
        model, _adamw(model.parameters(), None), _Scheduler(), None, None, MICROBATCHES
    )
    pipelined = _pipeline_trainer(config, rank)
    chunk = pipelined.model[0]
    expected_grads = _record_grads(reference.optimizer, {p: n for n, p in model.named_parameters()})
    names = {p: _global_name(chunk, n) for n, p in chunk.named_parameters()}
    grads = _record_grads(pipelined.optimizer, names)
    expected_logits, logits = _record_gate_logits(model), _record_gate_logits(chunk)
    args = types.SimpleNamespace(
        global_batch_size=MICRO * MICROBATCHES,
        gradient_accumulation_steps=MICROBATCHES,
        eval_iters=1,
    )
    batches = _micro_batches(7, MICROBATCHES * STEPS)
    expected_data, data = iter(batches), iter(batches)
    expected_losses, losses = [], []
    for _ in range(STEPS):
        _take_weights(chunk, model, rank)
        expected_losses.append(
            train_step_plain(_forward_step, expected_data, reference, args).losses
        )
        losses.append(train_step_megatron_schedules(data, pipelined, args).losses)
    _take_weights(chunk, model, rank)
    evaluation = _micro_batches(8, MICROBATCHES)
    expected_losses.append(
        evaluate_forward_steps(
            _forward_step, iter(evaluation), reference.model, args, MICROBATCHES, reference.autocast
        )
    )
    losses.append(evaluate_megatron_schedules(iter(evaluation), pipelined, args.eval_iters))

    # The premise: the same weights route every token alike (bitwise equal gate logits).
    assert logits.keys() <= expected_logits.keys() and (logits or experts[rank] == 1), logits
    for layer, calls in logits.items():
        assert len(calls) == len(expected_logits[layer]) == (STEPS + 1) * MICROBATCHES
        for call, (got, want) in enumerate(zip(calls, expected_logits[layer])):
            assert torch.equal(got, want), f"layer {layer}, gate call {call}"
    # One step's forward (into a logit, the softmax over the vocabulary, the masked mean).
    terms = [training_loss_terms(config, MICRO_TOKENS, STEP_TOKENS, 0)] * (STEPS + 1)
    for name in ("lm loss", "moe loss"):
        assert all(step[name] > 0 for step in expected_losses), expected_losses
        assert_losses_reordered(
            [step[name] for step in losses],
            [step[name] for step in expected_losses],
            terms=terms,
            vocab=VOCAB,
            digits=None,
            what=f"{name} at steps 1-{STEPS}, then evaluated",
        )
    # One step's forward and backward, and the sum over its micro-batches.
    terms = grad_terms(config, MICRO * MICROBATCHES, SEQ) + MICROBATCHES
    assert len(grads) == len(expected_grads) == STEPS
    for step, (step_grads, expected) in enumerate(zip(grads, expected_grads)):
        assert len(step_grads) == len(names), "the optimizer got every gradient of this stage"
        for name, grad in step_grads.items():
            assert_close_reordered(grad, expected[name], terms=terms, msg=f"step {step}: {name}")
    parallel_state.destroy_model_parallel()


SPAWN_WORLD_SIZES = [2]
CHECKS = {
    "PP=2 equals PP=1: an MoE layer on each stage": ((4, 4),),
    "PP=2 equals PP=1: --expert-interval 2 (no MoE layer on stage 0)": ((1, 4),),
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check; DeepSpeed's groups module is left as found."""
    from deepspeed.utils import groups

    try:
        for name, arguments in CHECKS.items():
            checks.run(name, _check_pp2_equals_pp1, *arguments)
            parallel_state.destroy_model_parallel()
    finally:
        groups.mpu = None
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's 2-rank world."""
    return spawned_suite[__name__][2]


@pytest.mark.parametrize("name", list(CHECKS))
def test_moe_pipeline_equals_one_process(spawned, name: str) -> None:
    """Each check passed on both ranks."""
    spawned.assert_ok(name)


def test_spawned_body_ran_every_check(spawned) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned.names() == set(CHECKS), spawned.per_rank[0].get(BODY)
