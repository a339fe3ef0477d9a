"""The whole GPT under tensor and sequence parallelism (gloo on CPU) against TP=1.

One spawned world per size (2 and 4 ranks) builds the same model (CPU initialization, same
seed, so the weights do not depend on TP) at TP=1 and at TP=world, with and without
sequence parallelism, and records logits, per-token losses and gradients, gathered back to
full size with the parameters' `partition_dim`. The 2-rank world also runs the dropout
checks: recomputed layers replaying the same masks at TP=2, attention dropout drawing
different masks on different ranks, and hidden dropout agreeing across ranks unless the
activations are split along the sequence. The pytest tests assert on the recorded numbers.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.model.helpers import (
    build_model,
    loss_grads_and_logits,
    random_batch,
    spawn_collect,
)
from tests.tolerances import assert_close_reordered, forward_terms, grad_terms, loss_terms

CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    vocab_size=128,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
)
BATCH, SEQ = 2, 8
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
RECOMPUTE = {
    "full": dict(recompute_granularity="full"),
    "full-2-layers": dict(recompute_granularity="full", recompute_num_layers=2),
    "full-distributed": dict(recompute_granularity="full", distribute_saved_activations=True),
    "selective": dict(recompute_granularity="selective"),
    "selective-distributed": dict(
        recompute_granularity="selective", distribute_saved_activations=True
    ),
}


def config(**overrides: object) -> ModelConfig:
    """`CONFIG` with some fields replaced."""
    return ModelConfig(**{**CONFIG, **overrides})


def measure(tokens, labels, rng_seed=None, **overrides) -> dict[str, object]:
    """Per-token loss, full gradients and full eval-mode logits of a fresh model."""
    model = build_model(config(**overrides))
    return loss_grads_and_logits(model, tokens, labels, rng_seed)


def record_outputs(module: torch.nn.Module, store: dict, key: str) -> None:
    """Keep a copy of `module`'s last output in `store[key]`."""
    module.register_forward_hook(lambda _m, _i, out: store.__setitem__(key, out.detach().clone()))


def attention_dropout_observation(
    tokens, backend: str, sequence_parallel: bool
) -> dict[str, torch.Tensor]:
    """Layer-0 attention context in train and eval mode, with the same heads on every rank.

    Rank 0's query_key_value shard is broadcast to all TP ranks, so the ranks' attention
    inputs are identical and any difference in the context comes from the dropout masks.
    """
    model = build_model(
        config(
            num_layers=1,
            attention_dropout=0.5,
            attention_backend=backend,
            sequence_parallel=sequence_parallel,
        )
    )
    qkv = model.language_model.encoder.layers[0].self_attention.query_key_value
    with torch.no_grad():
        for param in (qkv.weight, qkv.bias):
            dist.broadcast(
                param,
                src=parallel_state.get_tensor_model_parallel_src_rank(),
                group=parallel_state.get_tensor_model_parallel_group(),
            )
    seen: dict[str, torch.Tensor] = {}
    record_outputs(model.language_model.encoder.layers[0].self_attention.core_attention, seen, "c")
    model_parallel_cuda_manual_seed(5)
    with torch.no_grad():
        model.train()(tokens)
        train = seen["c"]
        model.eval()(tokens)
    return {"train": train, "eval": seen["c"]}


def hidden_dropout_observation(tokens, sequence_parallel: bool) -> dict[str, object]:
    """Dropout masks and outputs of a rope model with hidden dropout 0.5 (attention's 0).

    Every `F.dropout` call (the embedding's, then each layer's two residual branches) has its
    mask recorded. With rope there is no position table, so a sequence whose halves hold the
    same tokens has identical embeddings in both halves: under sequence parallelism the two
    ranks then start from the same values, and only their dropout masks can make them differ.
    """
    model = build_model(
        config(
            position_embedding_type="rope",
            hidden_dropout=0.5,
            sequence_parallel=sequence_parallel,
        )
    )
    seen: dict[str, torch.Tensor] = {}
    record_outputs(model.language_model.embedding, seen, "embedding")
    record_outputs(model.language_model.encoder, seen, "final")
    masks: list[torch.Tensor] = []
    dropout = F.dropout

    def recording_dropout(input_, p=0.5, training=True, inplace=False):
        """F.dropout that also keeps the positions it zeroed."""
        output = dropout(input_, p, training, inplace)
        if training and p > 0:
            masks.append(output == 0)
        return output

    model_parallel_cuda_manual_seed(9)
    with torch.no_grad(), mock.patch.object(F, "dropout", recording_dropout):
        loss = model.train()(tokens, labels=tokens)
    out = {"embedding": seen["embedding"], "final": seen["final"], "loss": loss, "masks": masks}
    with torch.no_grad():
        model.eval()(tokens)
    out["embedding_eval"] = seen["embedding"]
    return out


def tensor_parallel_body(rank: int, world: int) -> dict[str, object]:
    """TP=1 and TP=world runs in one world (plus the dropout checks when world == 2)."""
    tokens, labels = random_batch(BATCH, SEQ, CONFIG["vocab_size"])
    results: dict[str, object] = {}

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(11)
    results["tp1"] = measure(tokens, labels)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(world, 1)
    model_parallel_cuda_manual_seed(11)
    results["tp"] = measure(tokens, labels)
    results["sp"] = measure(tokens, labels, sequence_parallel=True)
    with torch.no_grad():
        results["gathered_logits"] = build_model(config(parallel_output=False)).eval()(tokens)
    if world == 2:
        for sp in (False, True):
            suffix = "-sp" if sp else ""
            plain = measure(tokens, labels, rng_seed=5, sequence_parallel=sp, **DROPOUT)
            results["dropout-plain" + suffix] = plain
            for name, options in RECOMPUTE.items():
                if sp and options.get("distribute_saved_activations"):
                    continue  # rejected by ModelConfig (test_distributed_saved_with_sp_is_rejected)
                results[f"dropout-{name}{suffix}"] = measure(
                    tokens, labels, rng_seed=5, sequence_parallel=sp, **DROPOUT, **options
                )
        for backend, sp in (("sdpa", False), ("unfused", False), ("sdpa", True)):
            key = f"attention-dropout-{backend}" + ("-sp" if sp else "")
            results[key] = attention_dropout_observation(tokens, backend, sp)
        repeated = torch.cat((tokens[:, : SEQ // 2],) * 2, dim=1)
        results["hidden-dropout"] = hidden_dropout_observation(repeated, False)
        results["hidden-dropout-sp"] = hidden_dropout_observation(repeated, True)
    parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    """Results of the 2-rank world, by rank."""
    return spawn_collect(tensor_parallel_body, 2)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    """Results of the 4-rank world, by rank."""
    return spawn_collect(tensor_parallel_body, 4)


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def world(request) -> list[dict]:
    """Each world's results in turn."""
    return request.getfixturevalue(f"world{request.param}")


# How many terms are summed into each compared value (see tests/tolerances.py): another TP
# size or sequence parallelism splits and reorders the same sums.
LOGIT_TERMS = forward_terms(ModelConfig(**CONFIG), SEQ)
LOSS_TERMS = loss_terms(ModelConfig(**CONFIG), SEQ)
GRAD_TERMS = grad_terms(ModelConfig(**CONFIG), BATCH, SEQ)


def assert_grads_close(actual: dict, expected: dict) -> None:
    """Same parameter names and the same full gradients, up to the order of their sums."""
    assert sorted(actual) == sorted(expected)
    for name, grad in expected.items():
        assert_close_reordered(actual[name], grad, terms=GRAD_TERMS, msg=name)


# --- tensor and sequence parallelism vs TP=1 -----------------------------------------------


def test_tensor_parallel_logits_match_tp1(world):
    """Gathered vocab-parallel logits, and `parallel_output=False` logits, equal TP=1's."""
    for results in world:
        expected = results["tp1"]["logits"]
        assert expected.shape == (BATCH, SEQ, CONFIG["vocab_size"])
        assert_close_reordered(results["tp"]["logits"], expected, terms=LOGIT_TERMS)
        assert_close_reordered(results["gathered_logits"], expected, terms=LOGIT_TERMS)
        assert_close_reordered(results["sp"]["logits"], expected, terms=LOGIT_TERMS)


def test_tensor_parallel_loss_matches_tp1(world):
    """Per-token losses at TP=world equal TP=1's on every rank."""
    for results in world:
        assert_close_reordered(results["tp"]["loss"], results["tp1"]["loss"], terms=LOSS_TERMS)


def test_tensor_parallel_grads_match_tp1(world):
    """Every gradient, gathered along its partition_dim, equals TP=1's on every rank."""
    for results in world:
        assert_grads_close(results["tp"]["grads"], results["tp1"]["grads"])


def test_sequence_parallel_matches_tp1_and_plain_tp(world):
    """Sequence parallelism changes neither the loss nor any (gathered) gradient.

    Layer norms and row-parallel biases see only a slice of the sequence per rank; their
    gradients are complete only if summed over the TP group.
    """
    for results in world:
        assert_close_reordered(results["sp"]["loss"], results["tp1"]["loss"], terms=LOSS_TERMS)
        assert_grads_close(results["sp"]["grads"], results["tp1"]["grads"])
        assert_grads_close(results["sp"]["grads"], results["tp"]["grads"])


def test_replicated_gradients_agree_across_ranks(world):
    """Layer-norm and row-parallel-bias gradients are the same on every TP rank.

    Bitwise: every rank runs the same kernels on the same (all-reduced, hence identical)
    inputs, and an all-reduce hands every rank the same bits.
    """
    for key in ("tp", "sp"):
        first = world[0][key]["grads"]
        for results in world[1:]:
            for name, grad in results[key]["grads"].items():
                if "layernorm" in name or name.endswith(("dense.bias", "dense_4h_to_h.bias")):
                    assert torch.equal(grad, first[name]), (key, name)


# --- dropout at TP=2 ----------------------------------------------------------------------


def recompute_cases() -> list:
    """Every recomputation variant, with and without sequence parallelism."""
    cases = []
    for name, options in RECOMPUTE.items():
        suffixes = ("",) if options.get("distribute_saved_activations") else ("", "-sp")
        for suffix in suffixes:
            cases.append(pytest.param(name + suffix, id=name + suffix))
    return cases


def test_distributed_saved_with_sp_is_rejected():
    """Sequence-parallel activations are already split: distributing them is an error."""
    with pytest.raises(ValueError, match="--distribute-saved-activations.*--sequence-parallel"):
        config(sequence_parallel=True, distribute_saved_activations=True)


@pytest.mark.parametrize("case", recompute_cases())
def test_recomputation_with_dropout_matches_plain_at_tp2(world2, case):
    """Recomputed layers (dropout 0.1) give the plain model's loss and gradients at TP=2."""
    plain_key = "dropout-plain-sp" if case.endswith("-sp") else "dropout-plain"
    for results in world2:
        plain, recomputed = results[plain_key], results[f"dropout-{case}"]
        # Tight: recomputation replays the same kernels on the same inputs at the same TP
        # (bitwise equal here); a wrong dropout mask errs by O(1).
        torch.testing.assert_close(recomputed["loss"], plain["loss"], atol=1e-6, rtol=0)
        assert sorted(recomputed["grads"]) == sorted(plain["grads"])
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(
                recomputed["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=name: n + m
            )


def test_dropout_is_active_at_tp2(world2):
    """The dropout runs differ from the dropout-free ones (else the tests above are empty)."""
    for results in world2:
        for key in ("dropout-plain", "dropout-plain-sp"):
            assert (results[key]["loss"] - results["tp"]["loss"]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["sdpa", "unfused", "sdpa-sp"])
def test_attention_dropout_masks_differ_across_ranks(world2, case):
    """Same heads on both ranks: equal contexts in eval mode, different ones in training.

    Bitwise in eval mode: both ranks run the same kernels on the same inputs and weights.
    """
    first, second = (results[f"attention-dropout-{case}"] for results in world2)
    assert torch.equal(first["eval"], second["eval"])
    assert not torch.equal(first["train"], first["eval"])  # dropout acted
    assert (first["train"] - second["train"]).abs().max() > 1e-3


def test_hidden_dropout_agrees_across_ranks_without_sequence_parallelism(world2):
    """Replicated activations drop out identically: equal embeddings and final hidden.

    Bitwise: both ranks run the same kernels on the same (replicated or all-reduced) values.
    """
    first, second = (results["hidden-dropout"] for results in world2)
    zeros = (first["embedding"] == 0).float().mean().item()
    assert 0.4 < zeros < 0.6  # dropout 0.5 acted on the embeddings
    assert torch.equal(first["embedding"], second["embedding"])
    assert len(first["masks"]) == 1 + 2 * CONFIG["num_layers"]
    assert len(second["masks"]) == len(first["masks"])
    for first_mask, second_mask in zip(first["masks"], second["masks"]):
        assert first_mask.shape == (SEQ, BATCH, CONFIG["hidden_size"])
        assert torch.equal(first_mask, second_mask)
    assert torch.equal(first["final"], second["final"])
    assert torch.equal(first["loss"], second["loss"])


def test_sequence_parallel_hidden_dropout_differs_across_ranks(world2):
    """Sequence slices drop out independently: same inputs, different dropout masks."""
    first, second = (results["hidden-dropout-sp"] for results in world2)
    assert first["embedding"].shape[0] == SEQ // 2
    # Both halves of the sequence hold the same tokens and there is no position table.
    assert torch.equal(first["embedding_eval"], second["embedding_eval"])
    first_mask, second_mask = first["embedding"] == 0, second["embedding"] == 0
    assert 0.4 < first_mask.float().mean().item() < 0.6
    assert (first_mask != second_mask).float().mean().item() > 0.3
    # The same for every residual-branch dropout inside the layers.
    assert len(first["masks"]) == 1 + 2 * CONFIG["num_layers"]
    assert len(second["masks"]) == len(first["masks"])
    for first_mask, second_mask in zip(first["masks"], second["masks"]):
        assert first_mask.shape == (SEQ // 2, BATCH, CONFIG["hidden_size"])
        assert (first_mask != second_mask).float().mean().item() > 0.3
    # Bitwise: the loss is computed from all-gathered and all-reduced values, alike on each rank.
    torch.testing.assert_close(first["loss"], second["loss"], atol=0, rtol=0)
