"""DeepSpeed-Ulysses (`--ds-sequence-parallel-size S`) against one process, over gloo.

- Our attention layer with each of S ranks holding 1/S of the sequence (DeepSpeed's
  `DistributedAttention` around our core) equals the same layer on the full sequence in one
  process: each rank's output part, its input gradient part, and the weight gradients summed
  over the S ranks (what DeepSpeed's engine reduces), for S = 2 and 4; causal (SDPA, and an
  explicit mask with the unfused kernel), grouped-query attention with rotary positions,
  selective recomputation of the core, and bf16 (to bf16's precision).
- The groups are Megatron-DeepSpeed's: S adjacent ranks per sequence group, data-parallel groups
  of every S-th rank, one sequence-data-parallel group; refusals name the flags.
- DeepSpeed is given the sequence-parallel queries only when S > 1 (it reads their presence
  as Ulysses).
- The GPT's per-token losses are the whole sequence's on every rank (Megatron's loss function
  then averages over the whole loss mask), and each rank back-propagates its own part (times
  S under ZeRO-3): the S ranks' gradients add up to one process's.
- Dropout: each Ulysses rank draws its masks (embedding, attention, hidden) from its own
  model-parallel stream, while the default stream, which initializes replicated weights, stays
  the same on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.parallel_state import ParallelConfigError, generate_rank_groups
from megatron.core.process_groups import this_rank_groups
from megatron.model.document_mask import DocumentMask
from megatron.model.moe_aux_loss import AuxLossTracker
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


CASES = {
    "causal GPT-2 attention": {},
    "grouped-query attention with rotary positions": dict(
        num_key_value_heads=4,
        position_embedding_type="rope",
        add_bias_linear=False,
        rotary_base=500000.0,
    ),
    "unfused kernel with an explicit causal mask": dict(attention_backend="unfused"),
    "selective recomputation": dict(recompute_granularity="selective", num_key_value_heads=4),
    "bf16 weights and activations": dict(params_dtype="bfloat16", num_key_value_heads=4),
    "packed documents and a sliding window": dict(window_size=(5, 0), num_key_value_heads=4),
}


def _run_layer(config: ModelConfig, hidden: torch.Tensor, grad: torch.Tensor, mask) -> tuple:
    """(output, input grad, {param: grad}) of a fresh layer 1 on `hidden`, seeded alike."""
    from megatron.model.transformer import ParallelAttention

    torch.manual_seed(11)
    layer = ParallelAttention(config, 1, this_rank_groups())
    hidden = hidden.detach().requires_grad_()
    output, bias = layer(hidden, mask)
    output = output if bias is None else output + bias
    output.backward(grad)
    grads = {name: param.grad.clone() for name, param in layer.named_parameters()}
    return output.detach(), hidden.grad, grads


def _check_equals_one_process(case: dict, world: int) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # DistributedAttention's deepspeed.comm
    config = _config(**case)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(SEQ, BATCH, config.hidden_size, generator=generator)  # [s, b, h]
    grad = torch.randn(SEQ, BATCH, config.hidden_size, generator=generator)
    hidden, grad = hidden.to(config.torch_dtype), grad.to(config.torch_dtype)
    # fp32: S ranks' heads and sequence parts against one process sum the same terms in other
    # orders (other matmul shapes, the weight gradients' all-reduce): a reordering bound
    # (tests/tolerances.py). Longest sums, forward: QKV (hidden), scores (head dim), softmax
    # and context (SEQ each), projection (hidden); as many again backward; the weight
    # gradients sum over all SEQ * BATCH tokens.
    forward_terms = 2 * config.hidden_size + config.kv_channels + 2 * SEQ
    terms = 2 * forward_terms + SEQ * BATCH

    def close(actual, expected, msg=None):
        if config.params_dtype == "float32":
            assert_close_reordered(actual, expected, terms=terms, msg=msg)
        else:
            # bf16: the same rounding points in both, but sums over other splits (softmax,
            # matmuls), each result rounded to bf16 (u = 2^-8): bf16's own tolerances.
            torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2, msg=msg)

    mask = None
    if config.attention_backend == "unfused":
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]  # [1, 1, s, s]
    if config.window_size is not None:  # documents of random lengths, the full sequence's ids
        ends = torch.rand(BATCH, SEQ, generator=generator) < 0.2
        mask = DocumentMask((ends.cumsum(dim=1) - ends.int()).int(), config.window_size)
    parallel_state.initialize_model_parallel(1, 1, 1)
    reference = _run_layer(config, hidden, grad, mask)
    parallel_state.initialize_model_parallel(1, 1, world)
    try:
        rank = parallel_state.get_ulysses_rank()
        part = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
        output, hidden_grad, grads = _run_layer(config, hidden[part], grad[part], mask)
    finally:
        parallel_state.initialize_model_parallel(1, 1, 1)
    close(output, reference[0][part])
    close(hidden_grad, reference[1][part])
    for name, value in grads.items():
        value = value.float()
        dist.all_reduce(value)  # DeepSpeed's engine sums the sequence ranks' gradients
        close(value, reference[2][name].float(), msg=name)


def _model_losses(config: ModelConfig, world: int, mask: torch.Tensor, text: torch.Tensor):
    """(per-token losses, the masked mean, {param: grad}) of a fresh GPT at S = `world`, this
    rank holding its part of the tokens, labels and positions (as pretrain_gpt.get_batch)."""
    from megatron.core.tensor_parallel.mappings import this_ranks_sequence_part
    from megatron.model import GPTModel

    parallel_state.initialize_model_parallel(1, 1, world)
    try:
        torch.manual_seed(11)
        model = GPTModel(config)
        tokens, labels = text[:, :-1], text[:, 1:]
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        parts = [this_ranks_sequence_part(t) for t in (tokens, positions, labels)]
        losses = model(parts[0], parts[1], labels=parts[2])
        # pretrain_gpt.loss_func: the mean over the whole loss mask.
        loss = torch.sum(losses.float().reshape(-1) * mask.reshape(-1)) / mask.sum()
        loss.backward()
        return losses.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    finally:
        parallel_state.initialize_model_parallel(1, 1, 1)


def _check_model_returns_the_whole_sequences_losses(world: int, gradient_scale: int) -> None:
    """The GPT's per-token losses at S ranks are the whole sequence's on every rank, so
    Megatron's loss function averages them over the whole loss mask; each rank back-propagates
    its own part (times `sequence_split_gradient_scale`, ZeRO-3's S), so the S ranks' gradients add
    up to one process's (times the scale)."""
    import deepspeed

    from tests.tolerances import grad_terms, loss_terms

    deepspeed.init_distributed(dist_backend="gloo")
    generator = torch.Generator().manual_seed(9)
    text = torch.randint(0, 128, (BATCH, SEQ + 1), generator=generator)
    mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float()
    config = _config(init_method_std=0.2)
    reference = _model_losses(config, 1, mask, text)
    scaled = _config(init_method_std=0.2, sequence_split_gradient_scale=gradient_scale)
    losses, loss, grads = _model_losses(scaled, world, mask, text)
    assert losses.shape == (BATCH, SEQ)
    assert all(torch.equal(other, loss) for other in _gathered(loss)), "one loss on all ranks"
    # Attention's heads and sequence parts in other orders (see _check_equals_one_process).
    terms = loss_terms(config, SEQ)
    assert_close_reordered(losses, reference[0], terms=terms)
    assert_close_reordered(loss, reference[1], terms=terms + BATCH * SEQ)
    for name, value in grads.items():
        dist.all_reduce(value)  # DeepSpeed's engine sums the sequence ranks' gradients
        expected = reference[2][name] * gradient_scale
        assert_close_reordered(value, expected, terms=grad_terms(config, BATCH, SEQ), msg=name)


def _gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def _check_dropout_is_drawn_per_ulysses_rank(world: int) -> None:
    """Each Ulysses rank holds other tokens (and, in attention, other heads): its dropout masks
    come from its own stream, while replicated weights still initialize alike (issue 36,
    defect 10: every rank of a sequence group drew the same masks)."""
    import deepspeed

    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )
    from megatron.model.embedding import Embedding
    from megatron.model.transformer import ParallelTransformerLayer

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(1, 1, world)
    try:
        model_parallel_cuda_manual_seed(1234)
        default = _gathered(torch.rand(8))
        with get_cuda_rng_tracker().fork():
            split = _gathered(torch.rand(8))
        assert all(torch.equal(part, default[0]) for part in default)
        assert len({tuple(part.tolist()) for part in split}) == world
        config = _config(hidden_dropout=0.5, attention_dropout=0.5)
        torch.manual_seed(3)  # the same weights on every rank
        groups = this_rank_groups()
        embedding, layer = (
            Embedding(config, groups),
            ParallelTransformerLayer(config, 1, groups, AuxLossTracker()),
        )
        # The same tokens at the same positions on every rank: only the masks can differ.
        ids = torch.arange(BATCH * SEQ // world).reshape(BATCH, -1) % config.vocab_size
        embedded = _gathered(embedding(ids).detach())
        assert all(not torch.equal(part, embedded[0]) for part in embedded[1:])
        # A layer's training forward draws every mask from the per-rank stream.
        before = torch.get_rng_state()
        stream = get_cuda_rng_tracker().get_states()
        layer(torch.randn(SEQ // world, BATCH, config.hidden_size, generator=torch.Generator()))
        assert torch.equal(torch.get_rng_state(), before)
        after = get_cuda_rng_tracker().get_states()
        assert any(not torch.equal(after[name], stream[name]) for name in stream)
    finally:
        parallel_state.initialize_model_parallel(1, 1, 1)
        model_parallel_cuda_manual_seed(1234)


SPAWN_WORLD_SIZES = [2, 4]
CHECKS = {
    world: {
        **{
            f"S={world} {name}": (_check_equals_one_process, case, world)
            for name, case in CASES.items()
        },
        f"S={world} dropout drawn per Ulysses rank": (
            _check_dropout_is_drawn_per_ulysses_rank,
            world,
        ),
        f"S={world} the model returns the whole sequence's losses": (
            _check_model_returns_the_whole_sequences_losses,
            world,
            1,
        ),
        f"S={world} ZeRO-3's gradient scale S": (
            _check_model_returns_the_whole_sequences_losses,
            world,
            world,
        ),
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
def test_ulysses_attention_equals_one_process(spawned, world: int, name: str) -> None:
    """Each check passed on every rank."""
    spawned[world].assert_ok(name)


@pytest.mark.parametrize("world", sorted(CHECKS))
def test_spawned_body_ran_every_check(spawned, world: int) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[world].names() == set(CHECKS[world]), spawned[world].per_rank[0].get(BODY)


def test_groups_are_megatron_deepspeeds() -> None:
    """8 ranks at S=2: sequence groups of adjacent ranks, data groups of every second rank."""
    groups = generate_rank_groups(8, 1, 1, 2)
    assert groups["sequence"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["data"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["sequence_data"] == [list(range(8))]
    assert groups["model"] == [[rank] for rank in range(8)]  # no sequence peer counted twice
    assert "sequence" not in generate_rank_groups(8, 2, 1)  # without Ulysses: no such groups


@pytest.mark.parametrize(
    "world, tp, pp, sp, words",
    [
        (8, 2, 1, 2, "--tensor-model-parallel-size 1"),
        (8, 1, 2, 2, "--pipeline-model-parallel-size 1"),
        (6, 1, 1, 4, "--pipeline-model-parallel-size (1) x --ds-sequence-parallel-size (4) = 4"),
        (8, 1, 1, 0, "--ds-sequence-parallel-size (0) must be at least 1"),
    ],
)
def test_group_refusals_name_the_flags(world, tp, pp, sp, words) -> None:
    with pytest.raises(ParallelConfigError) as error:
        generate_rank_groups(world, tp, pp, sp)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_deepspeed_sees_sequence_queries_only_under_ulysses() -> None:
    """At S=1 the mpu has no sequence queries (DeepSpeed would take them as Ulysses)."""
    assert parallel_state.deepspeed_mpu() is parallel_state.mpu
    assert not hasattr(parallel_state.mpu, "get_ulysses_group")
