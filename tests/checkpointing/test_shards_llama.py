"""megatron.checkpointing.shards / layouts for LLaMA-style models: GQA, SwiGLU, untied output.

The model is a real `GPTModel` state dict with RMSNorm, SwiGLU, 8 query and 4 key/value heads,
no linear biases, RoPE and an untied output layer (`language_model.output_layer.weight`).
Every comparison is `torch.equal`: splitting and merging only move numbers. The TP-parallel
forward of resharded files is checked in tests/tools/test_reshard.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron.checkpointing.file_format import flatten_model_state, load_file
from megatron.checkpointing.pipeline_stages import chunk_state_dict
from megatron.checkpointing.shapes import OUTPUT_LAYER, expected_shapes, model_config
from megatron.checkpointing.shards import (
    CheckpointConversionError,
    DenseCheckpoint,
    checkpoint_splits,
    load_dense_checkpoint,
    merge_tp_shards,
    save_megatron_checkpoint,
    shard_state_dict,
)
from megatron.model import GPTModel
from tests.checkpointing.test_shards import assert_same
from tests.pretrain_runs import LLAMA_ARCHITECTURE

TRUE_VOCAB, LAYERS, HIDDEN, FFN = 100, 4, 64, 96
WORD = "language_model.embedding.word_embeddings.weight"
QKV = "language_model.encoder.layers.1.self_attention.query_key_value.weight"
H_TO_4H = "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight"
LLAMA = dict(
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    num_attention_heads=8,
    num_key_value_heads=4,
    ffn_hidden_size=FFN,
    max_position_embeddings=16,
    seq_length=16,
    **LLAMA_ARCHITECTURE,
    make_vocab_size_divisible_by=8,
    true_vocab_size=TRUE_VOCAB,
)
SPLITS = checkpoint_splits(LLAMA)
"""How the LLaMA-style model splits each tensor, as its layers declare it."""


def swiglu_tensors(args: dict) -> set[str]:
    """The tensors the model `args` describe declares as SwiGLU's [gate; up] halves."""
    return {name for name, split in checkpoint_splits(args).items() if split.swiglu}


def llama_state(args: dict) -> dict[str, torch.Tensor]:
    """A random full state dict of the model `args` describe, vocabulary TRUE_VOCAB."""
    torch.manual_seed(0)
    config = dataclasses.replace(model_config(args), vocab_size=TRUE_VOCAB)
    return {name: torch.randn_like(t) for name, t in GPTModel(config).state_dict().items()}


@pytest.fixture(scope="module")
def dense() -> dict[str, torch.Tensor]:
    """The LLaMA-style model's full state dict (no position embeddings, no biases)."""
    return llama_state(LLAMA)


def test_the_args_describe_the_model_state_dict(dense):
    assert {n: tuple(t.shape) for n, t in dense.items()} == expected_shapes(LLAMA, TRUE_VOCAB)
    assert dense[QKV].shape == ((8 + 2 * 4) * 8, HIDDEN) and dense[H_TO_4H].shape == (2 * FFN, 64)
    assert OUTPUT_LAYER in dense and not [n for n in dense if n.endswith(".bias")]
    swiglu = swiglu_tensors(LLAMA)
    assert H_TO_4H in swiglu and len(swiglu) == LAYERS  # the weights (no biases)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_merge_round_trip(dense, tp):
    padded = {1: 104, 2: 112, 4: 128}[tp]
    shards = [shard_state_dict(dense, tp, rank, padded, SPLITS) for rank in range(tp)]
    gate, up = dense[H_TO_4H].chunk(2)
    groups = dense[QKV].view(4, 8 // 4 + 2, 8, HIDDEN)  # [nkv, nq / nkv + 2, hn, h]
    for rank, shard in enumerate(shards):
        # Each rank: its ffn / tp gate rows, then its ffn / tp up rows (silu(first) * second).
        expected = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        assert torch.equal(shard[H_TO_4H], expected)
        # Each rank: whole key/value groups, its query heads with their key and value.
        assert torch.equal(shard[QKV], groups.chunk(tp)[rank].reshape(-1, HIDDEN))
        assert shard[OUTPUT_LAYER].shape == (padded // tp, HIDDEN)
    merged = merge_tp_shards(shards, SPLITS)
    for name in (WORD, OUTPUT_LAYER):
        assert not merged[name][TRUE_VOCAB:].any()
        merged[name] = merged[name][:TRUE_VOCAB]
    assert_same(merged, dense)


def test_gelu_mlp_is_not_split_in_halves():
    gelu = dict(LLAMA, swiglu=False, ffn_hidden_size=FFN)
    state = llama_state(gelu)
    assert not swiglu_tensors(gelu)
    shard = shard_state_dict(state, 2, 1, 112, checkpoint_splits(gelu))
    assert torch.equal(shard[H_TO_4H], state[H_TO_4H][FFN // 2 :])


def test_tp_not_dividing_the_key_value_heads_is_refused(tmp_path):
    gqa = dict(LLAMA, num_key_value_heads=2)
    source = DenseCheckpoint(llama_state(gqa), gqa, 5, TRUE_VOCAB)
    with pytest.raises(CheckpointConversionError) as error:
        save_megatron_checkpoint(source, str(tmp_path / "tp4"), 4, 1)
    assert str(error.value) == "tensor-parallel size 4 does not divide num_key_value_heads 2"
    assert not (tmp_path / "tp4").exists()
    save_megatron_checkpoint(source, str(tmp_path / "tp2"), 2, 1)
    assert_same(load_dense_checkpoint(str(tmp_path / "tp2")).state_dict, source.state_dict)


@pytest.mark.parametrize("tp, pp", [(2, 2), (4, 4)])
def test_pipeline_stages_keep_the_untied_output_layer_last(dense, tmp_path, tp, pp):
    source = DenseCheckpoint(dense, dict(LLAMA), 9, TRUE_VOCAB)
    source.vocab_padding = torch.randn(4, HIDDEN)
    source.output_layer_padding = torch.randn(4, HIDDEN)  # trained dummy rows, kept
    directory = save_megatron_checkpoint(source, str(tmp_path), tp, pp)
    for stage in range(pp):
        path = os.path.join(directory, f"mp_rank_01_{stage:03d}", "model_optim_rng.pt")
        saved = load_file(path)["model"]
        assert ("output_layer" in saved["language_model"]) == (stage == pp - 1)
        assert "word_embeddings_for_head" not in saved  # no tied copy to keep in sync
    loaded = load_dense_checkpoint(str(tmp_path))
    assert_same(loaded.state_dict, dense)
    for kept, given in (
        (loaded.vocab_padding, source.vocab_padding),
        (loaded.output_layer_padding, source.output_layer_padding),
    ):  # the source's dummy rows first, then zeros up to the TP-padded size
        assert torch.equal(kept[:4], given) and not kept[4:].any()


def test_deepspeed_pipeline_files_with_an_lm_head_layer(dense, tmp_path):
    """The pipeline engine's files: layer 0 embedding, 1..L, L+1 norm, L+2 `lm_head.weight`."""
    tag = tmp_path / "global_step3"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step3")
    args = dict(LLAMA, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    args["padded_vocab_size"] = 112
    torch.save({"module": None, "args": args, "iteration": 3}, tag / "mp_rank_00_model_states.pt")
    for rank in range(2):
        shard = shard_state_dict(dense, 2, rank, 112, SPLITS)
        layers: dict[int, dict] = {}
        for name, tensor in shard.items():
            if name.startswith("language_model.embedding."):
                layers.setdefault(0, {})[name.split(".", 2)[2]] = tensor
            elif ".layers." in name:
                number, key = name.split(".", 4)[3:]
                layers.setdefault(int(number) + 1, {})[key] = tensor
            elif name == OUTPUT_LAYER:
                layers[LAYERS + 2] = {"lm_head.weight": tensor}
            else:
                layers.setdefault(LAYERS + 1, {})[name.rsplit(".", 1)[1]] = tensor
        for number, params in layers.items():
            torch.save(params, tag / f"layer_{number:02d}-model_{rank:02d}-model_states.pt")
    loaded = load_dense_checkpoint(str(tmp_path))
    assert loaded.layout == "deepspeed"
    assert_same(loaded.state_dict, dense)


def test_stage_of_a_tp_rank_holds_no_tied_copy(dense):
    shard = shard_state_dict(dense, 1, 0, 104, SPLITS)
    last = chunk_state_dict(shard, LAYERS, 2, 1, 1, 0)
    assert OUTPUT_LAYER in last and "word_embeddings_for_head.weight" not in last
    first = chunk_state_dict(shard, LAYERS, 2, 1, 0, 0)
    assert WORD in first and OUTPUT_LAYER not in first
    assert flatten_model_state({"language_model": {"output_layer": {"weight": 1}}}) == {
        OUTPUT_LAYER: 1
    }
