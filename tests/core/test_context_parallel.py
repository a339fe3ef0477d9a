"""Context parallelism (`--context-parallel-size C`) against one process, over gloo.

- Our attention layer with each of C ranks holding two of 2C chunks of the sequence
  (Megatron's load-balanced layout) equals the same layer over the whole sequence in one
  process: each rank's output part, its input-gradient part, and the weight gradients summed
  over the C ranks (what DDP / DeepSpeed reduce), for C = 2 and 4: ring attention (p2p) for
  causal GPT-2 attention, grouped-query attention with 2 key/value heads and multi-query
  attention with 1 (rotary positions of the global sequence), selective recomputation and
  bf16 (to bf16's precision); the allgather and a2a kinds; multi-latent attention (values
  narrower than queries and keys: the ring pads them) on each kind, with YaRN, without a query
  latent in bf16, and with `--recompute-modules core_attn mla_up_proj`. With a sliding window
  (`--window-size`) and packed documents (`--reset-attention-mask`'s document ids, whole on
  every rank), and both, on each kind and in bf16: one process is given the same
  `DocumentMask` (and the mask changes its output: the comparison has teeth).
- The GPT's per-token losses are the whole sequence's on every rank in sequence order, and
  each rank back-propagates its part times the gradient scale (C under DDP's average): the C
  ranks' gradients add up to C times one process's... divided back by DDP's average; also with
  packed documents, a window and learned positions restarting per document.
- Dropout: each context-parallel rank draws its ring-attention masks from its own seed.
(The ring's plan pair by pair: tests/model/test_ring_blocks.py; its block kernels:
tests/model/test_ring_kernels.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.config import MLAConfig, ModelConfig
from megatron.core import parallel_state
from megatron.core.process_groups import this_rank_groups
from megatron.core.tensor_parallel.mappings import this_ranks_sequence_part
from megatron.model.document_mask import DocumentMask
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
_MLA_SHAPES = dict(
    q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
    rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
)  # fmt: skip
# Multi-latent attention (values narrower than queries and keys), with its latent norms.
_MLA = dict(mla=MLAConfig(**_MLA_SHAPES), qk_layernorm=True, normalization="rmsnorm", **_LLAMA)
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
    "p2p multi-latent attention, YaRN": dict(_MLA),
    "p2p multi-latent attention, no query latent, bf16": dict(
        _MLA, mla=MLAConfig(**dict(_MLA_SHAPES, q_lora_rank=None)), params_dtype="bfloat16"
    ),
    "p2p multi-latent attention, --recompute-modules core_attn mla_up_proj": dict(
        _MLA, recompute_granularity="selective", recompute_modules=("core_attn", "mla_up_proj")
    ),
    "allgather multi-latent attention": dict(_MLA, cp_comm_types=("allgather",)),
    "a2a multi-latent attention": dict(_MLA, cp_comm_types=("a2a",)),
}
# Packed documents: [b][document lengths] (boundaries inside chunks and on chunk edges,
# documents across chunks; tests/model/test_ring_blocks.py checks the ring's plan for them).
DOCUMENTS = [[4, 5, 7], [8, 8]]
SHORT_DOCUMENTS = [[3, 10, 3], [1, 1, 14]]
MASKED_CASES = {
    "p2p sliding window (5, 0), rotary": dict(window_size=(5, 0), num_key_value_heads=2, **_LLAMA),
    "p2p sliding window (1, 0), shorter than a chunk": dict(window_size=(1, 0)),
    "p2p packed documents, rotary": dict(documents=DOCUMENTS, num_key_value_heads=2, **_LLAMA),
    "p2p packed documents and window (3, 0)": dict(
        documents=SHORT_DOCUMENTS, window_size=(3, 0), num_key_value_heads=1
    ),
    "p2p packed documents and window, bf16": dict(
        documents=DOCUMENTS, window_size=(6, 0), params_dtype="bfloat16", num_key_value_heads=2
    ),
    "p2p packed documents, selective recomputation": dict(
        documents=SHORT_DOCUMENTS, recompute_granularity="selective"
    ),
    "p2p multi-latent attention, packed documents and window": dict(
        _MLA, documents=DOCUMENTS, window_size=(5, 0)
    ),
    "allgather packed documents and window, rotary": dict(
        cp_comm_types=("allgather",), documents=DOCUMENTS, window_size=(5, 0), **_LLAMA
    ),
    "allgather packed documents, bf16, selective recomputation": dict(
        cp_comm_types=("allgather",),
        documents=SHORT_DOCUMENTS,
        params_dtype="bfloat16",
        recompute_granularity="selective",
    ),  # fmt: skip
    "a2a packed documents and window, rotary": dict(
        cp_comm_types=("a2a",),
        documents=DOCUMENTS,
        window_size=(3, 0),
        num_key_value_heads=4,
        **_LLAMA,
    ),  # fmt: skip
}


def document_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """[b, s] document ids: document i of each row repeated its length."""
    return torch.stack(
        [
            torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(row)])
            for row in lengths_per_row
        ]
    )


def _mask_of(case: dict) -> tuple[dict, DocumentMask | None]:
    """(the config's settings, the whole sequence's mask of `case`'s documents and window)."""
    case = dict(case)
    documents = case.pop("documents", None)
    window = case.get("window_size")
    if documents is None and window is None:
        return case, None
    return case, DocumentMask(None if documents is None else document_ids(documents), window)


def _run_layer(
    config: ModelConfig, hidden: torch.Tensor, grad: torch.Tensor, mask: DocumentMask | None
) -> tuple:
    """(output, input grad, {param: grad}) of a fresh layer 1 on `hidden`, seeded alike."""
    from megatron.model.multi_latent_attention import MultiLatentAttention
    from megatron.model.transformer import ParallelAttention

    torch.manual_seed(11)
    kind = ParallelAttention if config.mla is None else MultiLatentAttention
    layer = kind(config, 1, this_rank_groups())
    hidden = hidden.detach().requires_grad_()
    output, bias = layer(hidden, mask)
    output = output if bias is None else output + bias
    output.backward(grad)
    grads = {name: param.grad.clone() for name, param in layer.named_parameters()}
    return output.detach(), hidden.grad, grads


def _check_equals_one_process(case: dict, world: int) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # a2a's DistributedAttention
    settings, mask = _mask_of(case)
    config = _config(**settings)
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
    reference = _run_layer(config, hidden, grad, mask)
    if mask is not None:  # the mask matters here
        causal = _run_layer(config, hidden, grad, None)[0]
        assert (causal - reference[0]).abs().max() > 1e-2
    parallel_state.initialize_model_parallel(1, 1, 1, world)
    try:
        part = lambda tensor: this_ranks_sequence_part(tensor, dim=0)  # noqa: E731
        output, hidden_grad, grads = _run_layer(config, part(hidden), part(grad), mask)
        close(output, part(reference[0]))
        close(hidden_grad, part(reference[1]))
    finally:
        parallel_state.initialize_model_parallel(1, 1)
    for name, value in grads.items():
        value = value.float()
        dist.all_reduce(value)  # the context ranks' gradients add up
        close(value, reference[2][name].float(), msg=name)


def _check_model_returns_the_whole_sequences_losses(world: int, packed: bool = False) -> None:
    """Per-token losses of the whole sequence, in order, on every rank; each rank's part of
    the gradient is scaled by C, so DDP's average over the C ranks is one process's gradient.

    `packed`: end-of-document tokens in the text and pretrain_gpt's batch of them (document
    ids, loss mask without them, positions restarting per document: learned positions, which
    read them), with a sliding window, as `get_batch` splits it: tokens, labels and positions
    to this rank's part, the document ids and the loss mask whole."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.model import GPTModel
    from megatron.utils import get_ltor_masks_and_position_ids
    from tests.tolerances import grad_terms, loss_terms

    generator = torch.Generator().manual_seed(9)
    text = torch.randint(1, 128, (BATCH, SEQ + 1), generator=generator)
    mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float()
    documents = None
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    if packed:
        text[0, [3, 9, 10]] = text[1, [5, 12]] = 0  # end-of-document tokens
        documents, mask, positions = get_ltor_masks_and_position_ids(
            text[:, :-1], 0, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
        )

    def losses_and_grads(config: ModelConfig, context_parallel: int) -> tuple:
        parallel_state.initialize_model_parallel(1, 1, 1, context_parallel)
        model_parallel_cuda_manual_seed(11)  # the streams the split sequence's dropout forks
        try:
            torch.manual_seed(11)
            model = GPTModel(config)
            tokens, labels = text[:, :-1], text[:, 1:]
            parts = [this_ranks_sequence_part(t) for t in (tokens, positions, labels)]
            losses = model(parts[0], parts[1], documents, labels=parts[2])
            loss = torch.sum(losses.float().reshape(-1) * mask.reshape(-1)) / mask.sum()
            loss.backward()
            return losses.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}
        finally:
            parallel_state.initialize_model_parallel(1, 1)

    settings = dict(init_method_std=0.2, num_key_value_heads=2)
    if packed:
        settings["window_size"] = (6, 0)
    else:
        settings.update(_LLAMA)
    config = _config(**settings)
    reference = losses_and_grads(config, 1)
    scaled = _config(**settings, sequence_split_gradient_scale=world)
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
            for name, case in {**CASES, **MASKED_CASES}.items()
        },
        f"C={world} the model returns the whole sequence's losses": (
            _check_model_returns_the_whole_sequences_losses,
            world,
        ),
        f"C={world} packed documents, window, positions per document: the model's losses": (
            _check_model_returns_the_whole_sequences_losses,
            world,
            True,
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
