"""Context parallelism (`--context-parallel-size C`) against one process, over gloo.

- Our attention layer with each of C ranks holding two of 2C chunks of the sequence
  (Megatron's load-balanced layout) equals the same layer over the whole sequence in one
  process: each rank's output part, its input-gradient part, and the weight gradients summed
  over the C ranks (what DDP / DeepSpeed reduce), for C = 2 and 4: ring attention (p2p) for
  causal GPT-2 attention, grouped-query attention with 2 key/value heads and multi-query
  attention with 1 (rotary positions of the global sequence), selective recomputation and
  bf16 (to bf16's precision); the allgather and a2a kinds.
- The GPT's per-token losses are the whole sequence's on every rank in sequence order, and
  each rank back-propagates its part times the gradient scale (C under DDP's average): the C
  ranks' gradients add up to C times one process's... divided back by DDP's average.
- Dropout: each context-parallel rank draws its ring-attention masks from its own seed.
- One process: the ring's block kernels (fused CPU flash and the explicit math) agree, and the
  math kernel's gradients with dropout are those of its own forward (autograd).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.process_groups import this_rank_groups
from megatron.core.tensor_parallel.mappings import this_ranks_sequence_part
from tests.core.spawn_checks import BODY
from tests.tolerances import assert_close_reordered

SEQ, BATCH = 16, 2


def _config(**overrides) -> ModelConfig:
    settings = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        vocab_size=128,
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    settings.update(overrides)
    return ModelConfig(**settings)


_LLAMA = dict(position_embedding_type="rope", add_bias_linear=False, rotary_base=500000.0)
CASES = {
    "p2p causal GPT-2 attention": {},
    "p2p grouped-query attention, 2 key/value heads, rotary": dict(num_key_value_heads=2, **_LLAMA),
    "p2p multi-query attention, 1 key/value head, rotary": dict(num_key_value_heads=1, **_LLAMA),
    "p2p selective recomputation": dict(recompute_granularity="selective", num_key_value_heads=2),
    "p2p bf16 weights and activations": dict(params_dtype="bfloat16", num_key_value_heads=2),
    "allgather, 1 key/value head, rotary": dict(
        cp_comm_types=("allgather",), num_key_value_heads=1, **_LLAMA
    ),
    "allgather bf16": dict(cp_comm_types=("allgather",), params_dtype="bfloat16"),
    "a2a grouped-query attention, rotary": dict(
        cp_comm_types=("a2a",), num_key_value_heads=4, **_LLAMA
    ),
}


def _run_layer(config: ModelConfig, hidden: torch.Tensor, grad: torch.Tensor) -> tuple:
    """(output, input grad, {param: grad}) of a fresh layer 1 on `hidden`, seeded alike."""
    from megatron.model.transformer import ParallelAttention

    torch.manual_seed(11)
    layer = ParallelAttention(config, 1, this_rank_groups())
    hidden = hidden.detach().requires_grad_()
    output, bias = layer(hidden, None)
    output = output if bias is None else output + bias
    output.backward(grad)
    grads = {name: param.grad.clone() for name, param in layer.named_parameters()}
    return output.detach(), hidden.grad, grads


def _check_equals_one_process(case: dict, world: int) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # a2a's DistributedAttention
    config = _config(**case)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(SEQ, BATCH, config.hidden_size, generator=generator)  # [s, b, h]
    grad = torch.randn(SEQ, BATCH, config.hidden_size, generator=generator)
    hidden, grad = hidden.to(config.torch_dtype), grad.to(config.torch_dtype)
    # fp32: the ring sums each softmax over C blocks merged by their log-sum-exp, against
    # one softmax: a reordering of the same sums (tests/tolerances.py), as for Ulysses.
    forward_terms = 2 * config.hidden_size + config.kv_channels + 2 * SEQ
    terms = 2 * forward_terms + SEQ * BATCH

    def close(actual, expected, msg=None):
        if config.params_dtype == "float32":
            assert_close_reordered(actual, expected, terms=terms, msg=msg)
        else:
            # bf16: inputs, outputs and the weight gradients' sums rounded to bf16 (u = 2^-8).
            torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2, msg=msg)

    parallel_state.initialize_model_parallel(1, 1)
    reference = _run_layer(config, hidden, grad)
    parallel_state.initialize_model_parallel(1, 1, 1, world)
    try:
        part = lambda tensor: this_ranks_sequence_part(tensor, dim=0)  # noqa: E731
        output, hidden_grad, grads = _run_layer(config, part(hidden), part(grad))
        close(output, part(reference[0]))
        close(hidden_grad, part(reference[1]))
    finally:
        parallel_state.initialize_model_parallel(1, 1)
    for name, value in grads.items():
        value = value.float()
        dist.all_reduce(value)  # the context ranks' gradients add up
        close(value, reference[2][name].float(), msg=name)


def _check_model_returns_the_whole_sequences_losses(world: int) -> None:
    """Per-token losses of the whole sequence, in order, on every rank; each rank's part of
    the gradient is scaled by C, so DDP's average over the C ranks is one process's gradient."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.model import GPTModel
    from tests.tolerances import grad_terms, loss_terms

    generator = torch.Generator().manual_seed(9)
    text = torch.randint(0, 128, (BATCH, SEQ + 1), generator=generator)
    mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float()

    def losses_and_grads(config: ModelConfig, context_parallel: int) -> tuple:
        parallel_state.initialize_model_parallel(1, 1, 1, context_parallel)
        model_parallel_cuda_manual_seed(11)  # the streams the split sequence's dropout forks
        try:
            torch.manual_seed(11)
            model = GPTModel(config)
            tokens, labels = text[:, :-1], text[:, 1:]
            positions = torch.arange(SEQ).expand(BATCH, SEQ)
            parts = [this_ranks_sequence_part(t) for t in (tokens, positions, labels)]
            losses = model(parts[0], parts[1], labels=parts[2])
            loss = torch.sum(losses.float().reshape(-1) * mask.reshape(-1)) / mask.sum()
            loss.backward()
            return losses.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}
        finally:
            parallel_state.initialize_model_parallel(1, 1)

    config = _config(init_method_std=0.2, position_embedding_type="rope", num_key_value_heads=2)
    reference = losses_and_grads(config, 1)
    scaled = _config(
        init_method_std=0.2,
        position_embedding_type="rope",
        num_key_value_heads=2,
        sequence_split_gradient_scale=world,
    )
    losses, loss, grads = losses_and_grads(scaled, world)
    assert losses.shape == (BATCH, SEQ)
    terms = loss_terms(config, SEQ)
    assert_close_reordered(losses, reference[0], terms=terms)
    assert_close_reordered(loss, reference[1], terms=terms + BATCH * SEQ)
    for name, value in grads.items():
        dist.all_reduce(value)
        value /= world  # DDP's average over the data x context ranks
        assert_close_reordered(
            value, reference[2][name], terms=grad_terms(config, BATCH, SEQ), msg=name
        )


def _check_ring_dropout_is_drawn_per_rank(world: int) -> None:
    """Every context rank's ring-attention masks come from its own seed."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.model.context_parallel import draw_dropout_seed

    parallel_state.initialize_model_parallel(1, 1, 1, world)
    try:
        model_parallel_cuda_manual_seed(1234)
        seed = torch.tensor([draw_dropout_seed()])
        seeds = [torch.empty_like(seed) for _ in range(world)]
        dist.all_gather(seeds, seed)
        assert len({int(s) for s in seeds}) == world, seeds
    finally:
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)


SPAWN_WORLD_SIZES = [2, 4]
CHECKS = {
    world: {
        **{
            f"C={world} {name}": (_check_equals_one_process, case, world)
            for name, case in CASES.items()
        },
        f"C={world} the model returns the whole sequence's losses": (
            _check_model_returns_the_whole_sequences_losses,
            world,
        ),
        f"C={world} ring dropout drawn per rank": (_check_ring_dropout_is_drawn_per_rank, world),
    }
    for world in SPAWN_WORLD_SIZES
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check of this world size (each initializes its own groups)."""
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
def test_context_parallel_equals_one_process(spawned, world: int, name: str) -> None:
    """Each check passed on every rank."""
    spawned[world].assert_ok(name)


@pytest.mark.parametrize("world", sorted(CHECKS))
def test_spawned_body_ran_every_check(spawned, world: int) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[world].names() == set(CHECKS[world]), spawned[world].per_rank[0].get(BODY)


def _qkv(heads: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randn(2, heads, 8, 16, generator=generator).to(dtype) for _ in range(3))


@pytest.mark.parametrize("causal", [True, False])
def test_fused_and_math_block_kernels_agree(causal: bool) -> None:
    """The CPU flash kernel and the explicit math: outputs, log-sum-exps and gradients."""
    from megatron.model.context_parallel import BlockKernel

    q, k, v = _qkv(4)
    grad = torch.randn_like(q)
    fused = BlockKernel(0.25, 0.0, 0)
    out, lse = fused.forward(q, k, v, causal, 0)
    math = BlockKernel(0.25, 1e-9, 0)  # dropout > 0 selects the math; 1e-9 drops nothing
    math_out, math_lse = math.forward(q, k, v, causal, 0)
    torch.testing.assert_close(math_out, out, rtol=0, atol=1e-5)
    torch.testing.assert_close(math_lse, lse, rtol=0, atol=1e-5)
    for mine, theirs in zip(
        math.backward(grad, q, k, v, out, lse, causal, 0),
        fused.backward(grad, q, k, v, out, lse, causal, 0),
        strict=True,
    ):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_math_kernel_dropout_gradients_are_its_forwards() -> None:
    """With dropout the backward redraws the forward's masks: its gradients are autograd's."""
    from megatron.model.context_parallel import BlockKernel

    q, k, v = (t.requires_grad_() for t in _qkv(4))
    kernel = BlockKernel(0.25, 0.3, seed=7)
    out, lse = kernel.forward(q, k, v, True, step=2)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), grad)
    ours = kernel.backward(
        grad, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), True, 2
    )
    for mine, theirs in zip(ours, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    other_step, _ = kernel.forward(q, k, v, True, step=3)
    assert not torch.equal(other_step, out)  # each block draws its own mask
