"""Megatron's pipeline schedules (torch.distributed.pipelining) against the dense model.

Over gloo, a small GPT (fp32, dropout 0) runs one global batch of 4 micro-batches three ways
from the same weights: dense (`GPTModel`, one process's math), PP=2 with 1F1B, and PP=2 with
two virtual stages per rank (interleaved 1F1B); at 4 ranks also TP=2 x PP=2 with sequence
parallelism. The mean loss and every parameter's gradient (each chunk's local layer mapped to
its global layer; the tied embedding's two copies after the embedding-group all-reduce; each
tensor-parallel shard against the same shard of the dense gradient) equal the dense ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state
from tests.core.spawn_checks import BODY
from tests.tolerances import assert_close_reordered, forward_terms, reordering_atol

SEQ, MICRO, MICROBATCHES, VOCAB = 16, 2, 4, 128


def _config(**overrides) -> ModelConfig:
    base = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return ModelConfig(**{**base, **overrides})


LLAMA = dict(
    normalization="rmsnorm",
    activation="swiglu",
    ffn_hidden_size=128,
    num_key_value_heads=2,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    position_embedding_type="rope",
)


def _batch(microbatches: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, labels and a loss mask (some positions masked) for the global batch."""
    generator = torch.Generator().manual_seed(7)
    text = torch.randint(0, VOCAB, (MICRO * microbatches, SEQ + 1), generator=generator)
    mask = (torch.rand(MICRO * microbatches, SEQ, generator=generator) > 0.2).float()
    return text[:, :-1].contiguous(), text[:, 1:].contiguous(), mask


def _masked_mean(loss_mask: torch.Tensor, losses: torch.Tensor) -> tuple:
    loss = (losses.float().reshape(-1) * loss_mask.reshape(-1)).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def _dense(config: ModelConfig, microbatches: int):
    """The dense model's state dict, mean micro-batch loss and gradients (TP=1, one process)."""
    from megatron.model import GPTModel

    parallel_state.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(1234)
        model = GPTModel(config)
        tokens, labels, mask = _batch(microbatches)
        total = 0.0
        for index in range(microbatches):
            part = slice(index * MICRO, (index + 1) * MICRO)
            loss, _ = _masked_mean(mask[part], model(tokens[part], labels=labels[part]))
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        return model.state_dict(), total, grads
    finally:
        parallel_state.destroy_model_parallel()


def _reordering_terms(config: ModelConfig, microbatches: int) -> tuple[int, int]:
    """(loss terms, gradient terms): the longest fp32 sums into the loss and the gradients.

    The pipeline (and tensor-parallel shards) sum the dense model's terms in other orders, so
    the two agree to a reordering bound (tests/tolerances.py): the forward into a logit, the
    softmax over VOCAB, the masked mean over a micro-batch's tokens and the mean over
    micro-batches; for gradients that chain forward and back, then a weight gradient's sum
    over every token.
    """
    tokens = MICRO * SEQ
    forward = forward_terms(config, SEQ) + VOCAB + tokens + microbatches
    return forward, 2 * forward + tokens * microbatches


def _global_name(chunk, local: str) -> str:
    """The dense `GPTModel` name of a chunk's parameter."""
    if local == "word_embeddings_for_head.weight":
        return "language_model.embedding.word_embeddings.weight"
    prefix = "language_model.encoder.layers."
    if local.startswith(prefix):
        index, rest = local.removeprefix(prefix).split(".", 1)
        first = chunk.language_model.encoder.layers[0].layer_number - 1
        return f"{prefix}{int(index) + first}.{rest}"
    return local


def _check_pipeline(
    config: ModelConfig, tp: int, pp: int, virtual: int, microbatches: int = MICROBATCHES
) -> None:
    from megatron.checkpointing.pipeline_stages import chunk_state_dict
    from megatron.checkpointing.shards import shard_state_dict
    from megatron.core.pipeline_parallel.schedules import (
        PipelineRunner,
        initialize_tied_embedding,
        sync_tied_embedding_grads,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.model.pipeline_chunks import activation_shape, build_pipeline_chunks
    from megatron.model.sharding import model_splits
    from megatron.training.megatron_schedules_step import MicroBatchLoss

    dense_state, dense_loss, dense_grads = _dense(
        dataclasses.replace(config, sequence_parallel=False), microbatches
    )
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)  # the tensor-parallel RNG stream (dropout is 0)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    splits = model_splits(config)
    shard = shard_state_dict(dense_state, tp, tp_rank, VOCAB, splits)
    grad_shard = shard_state_dict(dense_grads, tp, tp_rank, VOCAB, splits)
    chunks = build_pipeline_chunks(config, pp_rank, pp, virtual)
    for index, chunk in enumerate(chunks):
        state = chunk_state_dict(shard, config.num_layers, pp, virtual, pp_rank, index)
        missing, unexpected = chunk.load_state_dict(state, strict=False)
        assert not unexpected and all("position_embeddings" in m for m in missing), missing
    initialize_tied_embedding(chunks)  # the head copy equals the first stage's embedding
    loss = MicroBatchLoss(_masked_mean)
    runner = PipelineRunner(
        chunks,
        loss,
        torch.device("cpu"),
        (MICRO, SEQ),
        activation_shape(config, MICRO, SEQ, chunks[0].groups),
        torch.float32,
    )
    tokens, labels, mask = _batch(microbatches)
    position_ids = torch.arange(SEQ).expand(MICRO * microbatches, SEQ).contiguous()
    loss.run(runner, microbatches, ((tokens, position_ids), labels, mask), train=True)
    sync_tied_embedding_grads(chunks)
    loss_terms, grad_terms = _reordering_terms(config, microbatches)
    loss_atol = reordering_atol(torch.tensor(dense_loss), terms=loss_terms)
    if parallel_state.is_pipeline_last_stage():
        mean = sum(float(r["lm loss"]) for r in loss.reported) / microbatches
        assert abs(mean - dense_loss) < loss_atol, (mean, dense_loss, loss_atol)
        assert len(loss.reported) == microbatches
    for chunk in chunks:
        for local, param in chunk.named_parameters():
            expected = grad_shard[_global_name(chunk, local)]
            assert_close_reordered(param.grad, expected, terms=grad_terms, msg=local)
    # A second step on the same schedule (shapes already inferred) gives the same result.
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    loss.reported = []
    loss.run(runner, microbatches, ((tokens, position_ids), labels, mask), train=True)
    if parallel_state.is_pipeline_last_stage():
        again = sum(float(r["lm loss"]) for r in loss.reported) / microbatches
        assert abs(again - dense_loss) < loss_atol, (again, dense_loss, loss_atol)
    # Evaluation: forward only, the same losses.
    loss.reported = []
    for chunk in chunks:
        chunk.eval()
    loss.run(runner, microbatches, ((tokens, position_ids), labels, mask), train=False)
    if parallel_state.is_pipeline_last_stage():
        evaluated = sum(float(r["lm loss"]) for r in loss.reported) / microbatches
        assert abs(evaluated - dense_loss) < loss_atol, (evaluated, dense_loss, loss_atol)
    parallel_state.destroy_model_parallel()


SPAWN_WORLD_SIZES = [2, 4]
CHECKS = {
    2: {
        "gpt2 pp2 1f1b": (_config(), 1, 2, 1),
        "gpt2 pp2 one micro-batch (all forwards, then all backwards)": (_config(), 1, 2, 1, 1),
        "gpt2 pp2 interleaved": (_config(), 1, 2, 2),
        "llama pp2 interleaved": (_config(**LLAMA), 1, 2, 2),
    },
    4: {
        "gpt2 tp2 pp2 sequence-parallel 1f1b": (_config(sequence_parallel=True), 2, 2, 1),
        "llama tp2 pp2 interleaved": (_config(**LLAMA), 2, 2, 2),
    },
}


def spawn_body(checks, rank: int, world: int) -> None:
    """Every check of this world size."""
    for name, arguments in CHECKS[world].items():
        checks.run(name, _check_pipeline, *arguments)
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's outcomes in the session's worlds, by size."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("world, name", [(w, n) for w, table in CHECKS.items() for n in table])
def test_pipeline_equals_the_dense_model(spawned, world: int, name: str) -> None:
    """Loss (train and eval) and every gradient equal the dense model's."""
    spawned[world].assert_ok(name)


@pytest.mark.parametrize("world", sorted(CHECKS))
def test_spawned_body_ran_every_check(spawned, world: int) -> None:
    """Nothing escaped the checks, and every check has a test."""
    assert spawned[world].names() == set(CHECKS[world]), spawned[world].per_rank[0].get(BODY)
