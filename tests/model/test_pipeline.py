"""GPTModelPipe under DeepSpeed's pipeline engine (gloo on CPU) against GPTModel.

Two spawned worlds: 2 ranks (PP=2) and 4 ranks (TP=2 x PP=2). On every rank a GPTModel is
built with the same seed at the same TP size as the pipeline, and its state dict is loaded
into the local pipeline stage with `load_gpt_state_dict_into_pipeline`. Each world records
the name mapping and the stage's parameter names, an `eval_batch` loss, one `train_batch`
(two micro-batches, plain SGD, no clipping) with the updated weights and the next loss, and
the same step done by hand on the GPTModel; the pytest tests compare them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.model.helpers import LAYER_PARAMETERS, build_model, spawn_collect
from tests.tolerances import assert_close_reordered, grad_terms, loss_terms, reordering_atol

LAYERS = 4
CONFIG = dict(
    num_layers=LAYERS,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
)
MICRO_BATCH, MICRO_BATCHES, SEQ = 2, 2, 8
LR = 0.5
EMBEDDING_KEYS = (
    "language_model.embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight",
)


def reordering_terms(overrides: dict | None = None) -> dict[str, int]:
    """How many terms are summed into each compared value (see tests/tolerances.py).

    The pipeline splits the layers over stages and the batch into micro-batches and
    accumulates the gradients over those: GPTModel's sums in another order. "loss": the
    model's loss terms and the masked mean over all tokens; "grad": the gradients of that
    mean; "next": the loss after a step whose update carried the gradients' rounding.
    """
    config = ModelConfig(**{**CONFIG, **(overrides or {})})
    batch = MICRO_BATCH * MICRO_BATCHES
    loss = loss_terms(config, SEQ) + batch * SEQ
    grad = grad_terms(config, batch, SEQ)
    return {"loss": loss, "grad": grad, "next": loss + grad}


def assert_loss_close(results: dict, pipe_key: str, reference_key: str, terms: int) -> None:
    """A pipeline loss equals GPTModel's up to reordering (both floats of fp32 values)."""
    assert_close_reordered(
        torch.tensor(results[pipe_key]),
        torch.tensor(results[reference_key]),
        terms=terms,
        msg=f"{pipe_key} vs {reference_key}",
    )


def assert_step_close(
    pipe: torch.Tensor, reference: torch.Tensor, before: torch.Tensor, *, terms: int, msg: str
) -> None:
    """Weights after one SGD step w - LR g agree: the gradients' reordering, scaled by the
    update `reference - before`, plus the subtraction's rounding (one ulp of w in each run)."""
    atol = reordering_atol(reference - before, terms) + reordering_atol(reference, 1)
    torch.testing.assert_close(pipe, reference, atol=atol, rtol=0, msg=msg)


def assert_pipeline_matches_reference(results: dict, overrides: dict | None = None) -> None:
    """One rank's eval, train and next losses and updated weights equal GPTModel's."""
    terms = reordering_terms(overrides)
    assert_loss_close(results, "pipe_eval", "reference_eval", terms["loss"])
    assert_loss_close(results, "pipe_train", "reference_eval", terms["loss"])
    assert_loss_close(results, "pipe_next", "reference_next", terms["next"])
    for name, (pipe_tensor, reference_tensor, before) in results["updated"].items():
        assert_step_close(pipe_tensor, reference_tensor, before, terms=terms["grad"], msg=name)


def micro_batches() -> list[tuple]:
    """DeepSpeed pipeline inputs, all tensors: ((tokens, position_ids), (labels, loss_mask))."""
    generator = torch.Generator().manual_seed(1)
    batch = MICRO_BATCH * MICRO_BATCHES
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch, SEQ + 1), generator=generator)
    loss_mask = (torch.rand(batch, SEQ, generator=generator) > 0.25).long()
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous()
    return [
        (
            (tokens[i : i + MICRO_BATCH, :-1].contiguous(), positions),
            (tokens[i : i + MICRO_BATCH, 1:].contiguous(), loss_mask[i : i + MICRO_BATCH]),
        )
        for i in range(0, batch, MICRO_BATCH)
    ]


def reference_loss(model: torch.nn.Module) -> torch.Tensor:
    """Mean over the micro-batches of each one's loss-masked mean token loss, by hand."""
    total = 0.0
    for (tokens, positions), (labels, loss_mask) in micro_batches():
        losses = model(tokens, position_ids=positions, labels=labels)
        total = total + (losses * loss_mask).sum() / loss_mask.sum()
    return total / MICRO_BATCHES


def pipeline_body(
    rank: int, world: int, tp: int, overrides: dict | None = None
) -> dict[str, object]:
    """One eval batch and one train step through DeepSpeed, and the same by hand.

    `overrides` replace fields of `CONFIG` (the LLaMA-style options in test_llama.py).
    """
    import deepspeed

    from megatron.model.pipeline import (
        GPTModelPipe,
        gpt_to_pipeline_name,
        load_gpt_state_dict_into_pipeline,
    )

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(tp, 2)
    model_parallel_cuda_manual_seed(3)
    config = ModelConfig(**{**CONFIG, **(overrides or {})})
    reference = build_model(config)
    reference_state = reference.state_dict()
    initial = {name: tensor.clone() for name, tensor in reference_state.items()}  # pre-step
    tied = not config.untie_embeddings_and_output_weights
    mapping = {name: gpt_to_pipeline_name(name, LAYERS, tied) for name in reference_state}
    try:
        gpt_to_pipeline_name("language_model.output_layer.weight", LAYERS, tied=True)
        unknown_name_error = None
    except KeyError as error:
        unknown_name_error = str(error)

    pipe = GPTModelPipe(config)
    # DeepSpeed broadcasts the tied embedding weight at construction; it must stay a leaf.
    all_leaves = all(param.is_leaf and param.grad_fn is None for param in pipe.parameters())
    local_keys = sorted(pipe.state_dict())
    load_gpt_state_dict_into_pipeline(pipe, reference_state, LAYERS)
    loaded = {  # bitwise: the loader copies the tensors
        name: torch.equal(pipe.state_dict()[mapping[name]], tensor)
        for name, tensor in reference_state.items()
        if mapping[name] in local_keys
    }

    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(
        model=pipe,
        optimizer=optimizer,
        config={
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": MICRO_BATCHES,
            "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0
            "steps_per_print": 10**6,
        },
    )
    pipe_eval = engine.eval_batch(iter(micro_batches()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe_train = engine.train_batch(iter(micro_batches()))
    pipe_next = engine.eval_batch(iter(micro_batches()))

    reference.train()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    reference_optimizer.zero_grad()
    reference_train = reference_loss(reference)
    reference_train.backward()
    reference_optimizer.step()
    with torch.no_grad():
        reference_next = reference_loss(reference.eval())
        reference_eval = reference_train.detach()  # dropout is 0: the pre-step loss

    pipe_state = pipe.state_dict()
    updated = {  # after the step: (pipeline, GPTModel, before)
        name: (pipe_state[mapping[name]].clone(), tensor.clone(), initial[name])
        for name, tensor in reference.state_dict().items()
        if mapping[name] in pipe_state and not name.endswith("position_embeddings.weight")
    }
    return {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "mapping": mapping,
        "unknown_name_error": unknown_name_error,
        "local_keys": local_keys,
        "loaded": loaded,
        "all_leaves": all_leaves,
        "backward_warnings": [
            str(w.message) for w in caught if "autograd kernel" in str(w.message)
        ],
        "pipe_eval": float(pipe_eval),
        "pipe_train": float(pipe_train),
        "pipe_next": float(pipe_next),
        "reference_eval": reference_eval.item(),
        "reference_next": reference_next.item(),
        "updated": updated,
        "first_position_table": (
            (
                pipe_state[mapping[EMBEDDING_KEYS[1]]].clone(),
                reference.state_dict()[EMBEDDING_KEYS[1]].clone(),
                initial[EMBEDDING_KEYS[1]],
            )
            if EMBEDDING_KEYS[1] in reference_state
            else None
        ),
    }


@pytest.fixture(scope="module")
def pp2() -> list[dict]:
    """Results of the PP=2 world (2 ranks), by rank."""
    return spawn_collect(pipeline_body, 2, 1)


@pytest.fixture(scope="module")
def tp2pp2() -> list[dict]:
    """Results of the TP=2 x PP=2 world (4 ranks), by rank."""
    return spawn_collect(pipeline_body, 4, 2)


@pytest.fixture(params=["pp2", "tp2pp2"])
def world(request) -> list[dict]:
    """Each world's results in turn."""
    return request.getfixturevalue(request.param)


def expected_mapping() -> dict[str, str]:
    """GPTModel key -> GPTModelPipe key, written out for LAYERS layers.

    Pipeline layer 0 is the tied embedding, 1..L the transformer layers, L+1 the final
    layer norm, L+2 the tied embedding again (its parameters live under `tied_modules`).
    """
    mapping = {
        EMBEDDING_KEYS[0]: "tied_modules.embed.word_embeddings.weight",
        EMBEDDING_KEYS[1]: "tied_modules.embed.position_embeddings.weight",
        "language_model.encoder.final_layernorm.weight": f"{LAYERS + 1}.weight",
        "language_model.encoder.final_layernorm.bias": f"{LAYERS + 1}.bias",
    }
    for i in range(LAYERS):
        for suffix in LAYER_PARAMETERS:
            mapping[f"language_model.encoder.layers.{i}.{suffix}"] = f"{i + 1}.{suffix}"
    return mapping


def owned_keys(stage: int) -> set[str]:
    """GPTModel keys a stage holds: the embedding, its half of the layers, (last) final LN."""
    per_stage = LAYERS // 2
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    keys = set(EMBEDDING_KEYS)
    keys |= {k for k in expected_mapping() if any(f".layers.{i}." in k for i in layers)}
    if stage == 1:
        keys |= {k for k in expected_mapping() if "final_layernorm" in k}
    return keys


# --- name mapping ---------------------------------------------------------------------------


def test_gpt_to_pipeline_name_maps_every_key(pp2):
    """Every GPTModel key maps to its pipeline key; unknown keys raise a KeyError naming them."""
    results = pp2[0]
    assert results["mapping"] == expected_mapping()
    assert "language_model.output_layer.weight" in results["unknown_name_error"]


def test_stage_parameter_names_are_the_mapped_keys(world):
    """Each stage holds exactly the mapped keys of the layers it owns; nothing is unmapped."""
    mapping = expected_mapping()
    for results in world:
        expected = {mapping[key] for key in owned_keys(results["stage"])}
        assert set(results["local_keys"]) == expected, results["stage"]
        assert set(results["loaded"]) == owned_keys(results["stage"])
        assert all(results["loaded"].values())  # the loader copied every owned tensor
    assert {results["stage"] for results in world} == {0, 1}


# --- numerics -------------------------------------------------------------------------------


def test_eval_batch_loss_equals_gpt_model_loss(world):
    """The pipeline's eval loss (mean over micro-batches of masked means) equals GPTModel's."""
    for results in world:
        assert_loss_close(results, "pipe_eval", "reference_eval", reordering_terms()["loss"])


def test_train_batch_step_equals_manual_sgd_step(world):
    """One train_batch (2 micro-batches, SGD) equals the hand-made step on GPTModel."""
    for results in world:
        assert_pipeline_matches_reference(results)
        assert results["reference_next"] < results["reference_eval"] - 0.05  # a real step


def test_tied_weights_stay_leaves_and_backward_does_not_warn(world):
    """DeepSpeed's tied-weight broadcast runs outside autograd (GPTModelPipe): no stage's
    parameter gets a grad_fn, and backward meets no `c10d::broadcast_ ... autograd kernel
    was not registered` node (torch's warning of possibly wrong gradients)."""
    for results in world:
        assert results["all_leaves"]
        assert results["backward_warnings"] == []


def test_first_stage_position_table_is_trained(world):
    """The position table that is used (first stage) receives the update."""
    for results in world:
        if results["stage"] == 0:
            pipe_table, reference_table, before = results["first_position_table"]
            assert not torch.equal(reference_table, before)  # the step moved it
            assert_step_close(
                pipe_table, reference_table, before, terms=reordering_terms()["grad"], msg="table"
            )


def test_pipeline_loss_checks_labels_when_asked():
    """The pipeline's loss function honours `check_labels` (GPTModelPipe binds the config's)."""
    from megatron.model.pipeline import masked_mean_loss

    logits = torch.randn(SEQ, MICRO_BATCH, 64)  # [s, b, vocab]
    labels = torch.randint(0, 64, (MICRO_BATCH, SEQ))
    labels[1, 3] = -1
    batch = (labels, torch.ones(MICRO_BATCH, SEQ))
    assert torch.isfinite(masked_mean_loss(logits, batch))
    with pytest.raises(ValueError, match="label -1 at sequence position 3, batch index 1 "):
        masked_mean_loss(logits, batch, check_labels=True)


def test_compiled_pipeline_loss_is_the_eager_loss():
    """`compiled=True` (GPTModelPipe's loss under `--torch-compile` at TP=1, which DeepSpeed
    calls outside the compiled layers) gives the eager loss and logits gradient, and
    `check_labels` still raises, checked eagerly before the compiled graph."""
    from megatron.model.pipeline import masked_mean_loss

    vocab = CONFIG["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQ, MICRO_BATCH, vocab, generator=generator).bfloat16()
    labels = torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=generator)
    loss_mask = (torch.rand(MICRO_BATCH, SEQ, generator=generator) > 0.25).float()
    results = {}
    for compiled in (False, True):
        leaf = logits.clone().requires_grad_()
        loss = masked_mean_loss(leaf, (labels, loss_mask), compiled=compiled)
        results[compiled] = (loss.detach(), torch.autograd.grad(loss, leaf)[0])
    (eager_loss, eager_grad), (loss, grad) = results[False], results[True]
    terms = vocab + MICRO_BATCH * SEQ  # the log-sum-exp, then the masked mean
    assert_close_reordered(loss, eager_loss, terms=terms)
    # Both round an fp32 softmax gradient to the logits' bf16: at most one rounding apart.
    assert_close_reordered(grad.float(), eager_grad.float(), terms=1, dtype=torch.bfloat16)
    labels[1, 3] = -1
    with pytest.raises(ValueError, match="label -1 at sequence position 3, batch index 1 "):
        masked_mean_loss(logits, (labels, loss_mask), check_labels=True, compiled=True)
