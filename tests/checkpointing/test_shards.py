"""megatron.checkpointing.shards / layouts: splits, merges and both on-disk layouts.

Everything here is exact: splitting and merging only move numbers, so every comparison is
`torch.equal`. The model is a real `GPTModel` state dict (every parameter kind), 4 layers so
that pipeline sizes 1, 2 and 4 all divide it. DeepSpeed-layout directories are written by
hand here, file for file as `engine.save_checkpoint` names them (tests/tools/test_reshard.py
converts real ones from `pretrain_gpt.py --deepspeed` runs).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

from megatron.checkpointing.file_format import flatten_model_state, load_file, nest_model_state
from megatron.checkpointing.pipeline_stages import (
    chunk_layers,
    chunk_state_dict,
    join_chunks,
    merge_pipeline_stages,
    renumber_layers,
)
from megatron.checkpointing.shapes import resolve_true_vocab_size
from megatron.checkpointing.shards import (
    CheckpointConversionError,
    DenseCheckpoint,
    checkpoint_splits,
    load_dense_checkpoint,
    merge_tp_shards,
    save_megatron_checkpoint,
    shard_state_dict,
)
from megatron.config import ModelConfig, MoEConfig
from megatron.core.process_groups import ModelGroups
from megatron.model import GPTModel
from megatron.model.sharding import Split, declared_splits, model_splits
from tests.conftest import MERGE_FILE, VOCAB_FILE

LAYERS, HIDDEN, HEADS, TRUE_VOCAB, DIVISIBLE = 4, 32, 4, 100, 8
WORD = "language_model.embedding.word_embeddings.weight"
HEAD = "word_embeddings_for_head.weight"
QKV = "language_model.encoder.layers.{}.self_attention.query_key_value.{}"
ARGS = dict(
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    max_position_embeddings=16,
    seq_length=16,
    make_vocab_size_divisible_by=DIVISIBLE,
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    padded_vocab_size=104,
    true_vocab_size=TRUE_VOCAB,
    tokenizer_type="GPT2BPETokenizer",
)
SPLITS = checkpoint_splits(ARGS)
"""How the model ARGS describe splits each tensor, as its layers declare it."""


@pytest.fixture(scope="module")
def dense() -> dict[str, torch.Tensor]:
    """A full GPTModel state dict, vocabulary trimmed to TRUE_VOCAB; no two values alike."""
    torch.manual_seed(0)
    config = ModelConfig(LAYERS, HIDDEN, HEADS, 104, 16, use_cpu_initialization=True)
    state = {name: torch.randn_like(t) for name, t in GPTModel(config).state_dict().items()}
    state[WORD] = state[WORD][:TRUE_VOCAB].clone()
    return state


def checkpoint(state: dict, iteration: int = 7) -> DenseCheckpoint:
    """A DenseCheckpoint of `state` with ARGS and some progress counters."""
    train_state = {"iteration": iteration, "consumed_train_samples": 56}
    return DenseCheckpoint(state, dict(ARGS), iteration, TRUE_VOCAB, train_state, "megatron")


def assert_same(actual: dict, expected: dict) -> None:
    """Same names, bit-identical tensors."""
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


# --- tensor-parallel splits ------------------------------------------------------------------


def test_the_layers_declare_every_parameter_kinds_split(dense):
    expected = {
        WORD: 0,
        "language_model.embedding.position_embeddings.weight": None,
        QKV.format(0, "weight"): 0,
        QKV.format(0, "bias"): 0,
        "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight": 0,
        "language_model.encoder.layers.0.self_attention.dense.bias": None,
        "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight": 1,
        "language_model.encoder.layers.0.mlp.dense_4h_to_h.bias": None,
        "language_model.encoder.layers.0.input_layernorm.weight": None,
        "language_model.encoder.layers.0.post_attention_layernorm.bias": None,
        "language_model.encoder.final_layernorm.weight": None,
    }
    for name, dim in expected.items():
        assert SPLITS[name].tensor_dim == dim, name
    assert sorted(SPLITS) == sorted(dense)
    # The last pipeline stage's copy of the tied word embeddings: vocab-parallel rows too.
    config = ModelConfig(LAYERS, HIDDEN, HEADS, 104, 16)
    with torch.device("meta"):
        last = GPTModel(config, ModelGroups(), stage=1, num_stages=2, layers=range(3, 5))
    assert declared_splits(last)[HEAD] == Split(tensor_dim=0, vocab=True)
    unknown = {**dense, "language_model.rotary.inv_freq": torch.zeros(2)}
    with pytest.raises(CheckpointConversionError, match="language_model.rotary.inv_freq"):
        shard_state_dict(unknown, 1, 0, 104, SPLITS)


def test_moe_experts_split_over_tensor_parallel_ranks_only_with_expert_tp() -> None:
    moe = "language_model.encoder.layers.1.mlp."
    expert = moe + "deepspeed_moe.experts.deepspeed_experts.3."
    split = {  # name -> dim with --enable-expert-tensor-parallelism (without: None, whole)
        expert + "dense_h_to_4h.weight": 0,
        expert + "dense_h_to_4h.bias": 0,
        expert + "dense_4h_to_h.weight": 1,
        expert + "dense_4h_to_h.bias": None,
        moe + "mlp.dense_h_to_4h.weight": 0,  # PR-MoE's dense MLP is built as an expert
        moe + "mlp.dense_4h_to_h.weight": 1,
        moe + "deepspeed_moe.gate.wg.weight": None,
        moe + "coefficient.weight": None,
        moe + "coefficient.bias": None,
    }
    config = ModelConfig(2, HIDDEN, HEADS, 104, 16, moe=MoEConfig((1, 4), residual=True))
    whole = model_splits(config)
    split_experts = model_splits(
        dataclasses.replace(
            config, moe=MoEConfig((1, 4), residual=True, expert_tensor_parallel=True)
        )
    )
    for name, dim in split.items():
        assert split_experts[name].tensor_dim == dim, name
        assert whole[name].tensor_dim is None, name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_merge_round_trip_is_exact(dense, tp):
    padded = 104 if tp == 1 else 112 if tp == 2 else 128
    shards = [shard_state_dict(dense, tp, rank, padded, SPLITS) for rank in range(tp)]
    for shard in shards:
        assert shard[WORD].shape == (padded // tp, HIDDEN)
        assert shard[QKV.format(1, "weight")].shape == (3 * HIDDEN // tp, HIDDEN)
        name = "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight"
        assert shard[name].shape == (HIDDEN, 4 * HIDDEN // tp)
    merged = merge_tp_shards(shards, SPLITS)
    assert merged[WORD].shape == (padded, HIDDEN)
    assert torch.equal(merged[WORD][TRUE_VOCAB:], torch.zeros(padded - TRUE_VOCAB, HIDDEN))
    merged[WORD] = merged[WORD][:TRUE_VOCAB]
    assert_same(merged, dense)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_gets_whole_heads_with_their_q_k_v(dense, tp):
    """QKV rows are [heads, 3, head width]: rank r holds heads r*heads/tp ... whole."""
    full = dense[QKV.format(2, "weight")].view(HEADS, 3, HIDDEN // HEADS, HIDDEN)
    bias = dense[QKV.format(2, "bias")].view(HEADS, 3, HIDDEN // HEADS)
    per_rank = HEADS // tp
    for rank in range(tp):
        shard = shard_state_dict(dense, tp, rank, 128, SPLITS)
        heads = slice(rank * per_rank, (rank + 1) * per_rank)
        assert torch.equal(shard[QKV.format(2, "weight")], full[heads].reshape(-1, HIDDEN))
        assert torch.equal(shard[QKV.format(2, "bias")], bias[heads].reshape(-1))


def test_vocab_is_repadded_with_zero_rows(dense):
    shards = [shard_state_dict(dense, 2, rank, 128, SPLITS) for rank in range(2)]
    assert torch.equal(shards[0][WORD], dense[WORD][:64])
    assert torch.equal(shards[1][WORD][: TRUE_VOCAB - 64], dense[WORD][64:])
    assert not shards[1][WORD][TRUE_VOCAB - 64 :].any()
    with pytest.raises(CheckpointConversionError, match="smaller than the 100 rows"):
        shard_state_dict(dense, 1, 0, 96, SPLITS)
    with pytest.raises(CheckpointConversionError, match="does not divide"):
        shard_state_dict(dense, 3, 0, 102, SPLITS)


# --- pipeline stages -------------------------------------------------------------------------


def _global(dense: dict, pp: int, rank: int) -> dict:
    """Stage `rank` of `pp` (one chunk per rank) with global layer numbers."""
    start = chunk_layers(LAYERS, pp, 1, rank, 0).start
    return renumber_layers(chunk_state_dict(dense, LAYERS, pp, 1, rank, 0), start)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_pipeline_split_and_merge(dense, pp):
    stages = [_global(dense, pp, rank) for rank in range(pp)]
    per_stage = LAYERS // pp
    for rank, stage in enumerate(stages):
        layers = {int(n.split(".")[3]) for n in stage if ".layers." in n}
        assert layers == set(range(rank * per_stage, (rank + 1) * per_stage))
        assert (WORD in stage) == (rank == 0)
        assert ("language_model.encoder.final_layernorm.bias" in stage) == (rank == pp - 1)
        assert (HEAD in stage) == (rank == pp - 1 and pp > 1)
        if HEAD in stage:
            assert torch.equal(stage[HEAD], dense[WORD])
        local = chunk_state_dict(dense, LAYERS, pp, 1, rank, 0)
        assert {int(n.split(".")[3]) for n in local if ".layers." in n} == set(range(per_stage))
    assert_same(merge_pipeline_stages(stages), dense)
    with pytest.raises(CheckpointConversionError, match="does not divide num_layers 4"):
        chunk_layers(LAYERS, 3, 1, 0, 0)


@pytest.mark.parametrize("pp, virtual", [(2, 2), (4, 1)])
def test_virtual_stages_hold_megatron_lm_interleaved_layers(dense, pp, virtual):
    """Chunk c of pipeline rank r is stage c x PP + r: with PP 2 x V 2, rank 0 holds layers
    0 and 2 (and the embedding), rank 1 layers 1 and 3 (and the head)."""
    chunks = [
        [chunk_state_dict(dense, LAYERS, pp, virtual, rank, c) for c in range(virtual)]
        for rank in range(pp)
    ]
    for rank in range(pp):
        for c, local in enumerate(chunks[rank]):
            stage = c * pp + rank
            assert {n.split(".")[3] for n in local if ".layers." in n} == {"0"}
            layer = dense[QKV.format(stage, "weight")]
            assert torch.equal(local[QKV.format(0, "weight")], layer)
            assert (WORD in local) == (stage == 0)
            assert (HEAD in local) == (stage == pp * virtual - 1)
    assert_same(join_chunks(chunks, LAYERS), dense)
    nested = [[nest_model_state(local) for local in rank] for rank in chunks]
    assert_same(join_chunks(nested, LAYERS), dense)
    with pytest.raises(CheckpointConversionError, match="need a pipeline-parallel size above 1"):
        chunk_layers(LAYERS, 1, 2, 0, 0)
    with pytest.raises(CheckpointConversionError, match="2 x 4 virtual stage.* num_layers 4"):
        chunk_layers(LAYERS, 2, 4, 0, 0)


def test_nested_and_flat_round_trip(dense):
    for rank in range(2):
        local = chunk_state_dict(dense, LAYERS, 2, 1, rank, 0)
        nested = nest_model_state(local)
        assert ("embedding" in nested["language_model"]) == (rank == 0)
        assert ("word_embeddings_for_head" in nested) == (rank == 1)
        assert_same(flatten_model_state(nested), local)
    legacy = {"language_model": {"transformer": {"layers.0.attention.dense.bias": dense[WORD]}}}
    flat = flatten_model_state(legacy)
    assert list(flat) == ["language_model.encoder.layers.0.self_attention.dense.bias"]


# --- the Megatron layout on disk -------------------------------------------------------------


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_save_then_load_megatron_layout(dense, tmp_path, tp, pp):
    root = str(tmp_path / "ckpt")
    directory = save_megatron_checkpoint(checkpoint(dense), root, tp, pp)
    assert directory == os.path.join(root, "iter_0000007")
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "7"
    padded = {1: 104, 2: 112, 4: 128}[tp]
    names = sorted(os.listdir(directory))
    suffixes = [f"_{p:03d}" for p in range(pp)] if pp > 1 else [""]
    assert names == sorted(f"mp_rank_{t:02d}{s}" for t in range(tp) for s in suffixes)
    for t in range(tp):
        for p, suffix in enumerate(suffixes):
            saved = load_file(
                os.path.join(directory, f"mp_rank_{t:02d}{suffix}", "model_optim_rng.pt")
            )
            assert saved["checkpoint_version"] == 3.0 and saved["iteration"] == 7
            assert saved["train_state"]["consumed_train_samples"] == 56
            assert "optimizer" not in saved and "rng_state" not in saved
            args = vars(saved["args"])
            assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (
                tp,
                pp,
            )
            assert (args["padded_vocab_size"], args["true_vocab_size"]) == (padded, TRUE_VOCAB)
            local = flatten_model_state(saved["model"])
            layers = {int(n.split(".")[3]) for n in local if ".layers." in n}
            assert layers == set(range(LAYERS // pp))  # Megatron: each stage counts from 0
            expected = shard_state_dict(dense, tp, t, padded, SPLITS)
            assert_same(local, chunk_state_dict(expected, LAYERS, pp, 1, p, 0))
    loaded = load_dense_checkpoint(root)
    assert_same(loaded.state_dict, dense)
    assert (loaded.iteration, loaded.true_vocab_size, loaded.layout) == (7, TRUE_VOCAB, "megatron")
    assert loaded.train_state["consumed_train_samples"] == 56
    assert loaded.args["tensor_model_parallel_size"] == tp


def test_dummy_vocab_rows_are_kept_when_repadding(dense, tmp_path):
    """The source's padding rows go back first (exact continuation), zeros after them."""
    source = checkpoint(dense)
    source.vocab_padding = torch.randn(4, HIDDEN)  # rows 100..103 of a TP=1 checkpoint
    save_megatron_checkpoint(source, str(tmp_path / "tp1"), 1, 1)
    loaded = load_dense_checkpoint(str(tmp_path / "tp1"))
    assert torch.equal(loaded.vocab_padding, source.vocab_padding)
    save_megatron_checkpoint(loaded, str(tmp_path / "tp4"), 4, 1)
    files = [tmp_path / f"tp4/iter_0000007/mp_rank_{r:02d}/model_optim_rng.pt" for r in range(4)]
    shards = [flatten_model_state(load_file(str(path))["model"]) for path in files]
    rows = merge_tp_shards(shards, SPLITS)[WORD]
    assert rows.shape == (128, HIDDEN)
    assert torch.equal(rows[:TRUE_VOCAB], dense[WORD])
    assert torch.equal(rows[TRUE_VOCAB:104], source.vocab_padding)
    assert not rows[104:].any()


def test_iteration_zero_is_written_as_release(dense, tmp_path):
    directory = save_megatron_checkpoint(checkpoint(dense, iteration=0), str(tmp_path), 2, 1)
    assert directory == str(tmp_path / "release")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert load_dense_checkpoint(str(tmp_path)).iteration == 0


def test_refuses_a_directory_holding_a_checkpoint(dense, tmp_path):
    root = str(tmp_path)
    save_megatron_checkpoint(checkpoint(dense), root, 1, 1)
    (tmp_path / "latest").write_text("global_step3")  # a DeepSpeed tracker left there
    before = sorted(os.listdir(root))
    with pytest.raises(CheckpointConversionError, match=f"{root} already holds a checkpoint"):
        save_megatron_checkpoint(checkpoint(dense, iteration=9), root, 2, 1)
    assert sorted(os.listdir(root)) == before
    save_megatron_checkpoint(checkpoint(dense, iteration=9), root, 2, 1, overwrite=True)
    assert not (tmp_path / "latest").exists()  # would outrank the new tracker
    assert load_dense_checkpoint(root).iteration == 9
    assert not [name for name in os.listdir(root) if "partial" in name or "replaced" in name]


def test_impossible_splits_touch_nothing(dense, tmp_path):
    with pytest.raises(CheckpointConversionError, match="does not divide num_attention_heads"):
        save_megatron_checkpoint(checkpoint(dense), str(tmp_path / "a"), 3, 1)
    with pytest.raises(CheckpointConversionError, match="does not divide num_layers"):
        save_megatron_checkpoint(checkpoint(dense), str(tmp_path / "a"), 1, 3)
    assert not (tmp_path / "a").exists()


def test_missing_shard_and_wrong_shapes_are_named(dense, tmp_path):
    root = str(tmp_path)
    directory = save_megatron_checkpoint(checkpoint(dense), root, 2, 2)
    path = os.path.join(directory, "mp_rank_01_001", "model_optim_rng.pt")
    saved = load_file(path)
    os.remove(path)
    with pytest.raises(CheckpointConversionError, match=f"missing shard file {path}"):
        load_dense_checkpoint(root)
    torch.save(saved, path)
    first = os.path.join(directory, "mp_rank_00_000", "model_optim_rng.pt")
    saved = load_file(first)
    saved["args"].hidden_size = 64
    torch.save(saved, first)
    with pytest.raises(CheckpointConversionError, match="has shape .*hidden_size"):
        load_dense_checkpoint(root)


def test_locating_errors_name_the_paths(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointConversionError, match=f"{missing} does not exist"):
        load_dense_checkpoint(missing)
    with pytest.raises(CheckpointConversionError, match="latest_checkpointed_iteration.txt"):
        load_dense_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(CheckpointConversionError, match="iter_0000012 does not exist"):
        load_dense_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointConversionError, match="no checkpoint of iteration 5"):
        load_dense_checkpoint(str(tmp_path), iteration=5)


def test_true_vocab_size_sources():
    assert resolve_true_vocab_size({"true_vocab_size": 100}, None, "x") == 100
    assert resolve_true_vocab_size({"true_vocab_size": 100}, 42, "x") == 42
    files = {"vocab_file": VOCAB_FILE, "merge_file": MERGE_FILE}
    assert resolve_true_vocab_size(files, None, "x") == 50257
    with pytest.raises(CheckpointConversionError, match="pass --true-vocab-size"):
        resolve_true_vocab_size({"vocab_file": "/no/such.json"}, None, "x")


# --- the DeepSpeed layout, written as the engine names its files ---------------------------


def _client(tp: int, pp: int, iteration: int) -> dict:
    args = dict(ARGS, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    args["padded_vocab_size"] = 112
    del args["true_vocab_size"]  # older files: the tokenizer size comes from --true-vocab-size
    return {
        "args": args,
        "iteration": iteration,
        "consumed_train_samples": 8 * iteration,
        "checkpoint_version": 3.0,
        "ds_version": "0.19.8",
    }


def _pipeline_layer_files(shard: dict) -> dict[int, dict]:
    layers: dict[int, dict] = {}
    for name, tensor in shard.items():
        if name.startswith("language_model.embedding."):
            layers.setdefault(0, {})[name.split(".", 2)[2]] = tensor
        elif ".layers." in name:
            _, _, _, number, key = name.split(".", 4)
            layers.setdefault(int(number) + 1, {})[key] = tensor
        else:
            layers.setdefault(LAYERS + 1, {})[name.split(".", 3)[3]] = tensor
    return layers


@pytest.mark.parametrize("engine", ["module", "pipeline"])
def test_deepspeed_layout(dense, tmp_path, engine):
    tp, pp = 2, (2 if engine == "pipeline" else 1)
    tag_dir = tmp_path / "global_step20"
    tag_dir.mkdir()
    shards = [shard_state_dict(dense, tp, rank, 112, SPLITS) for rank in range(tp)]
    for mp_rank in range(tp * pp):
        module = shards[mp_rank] if engine == "module" else None
        state = dict(_client(tp, pp, 20), module=module)
        torch.save(state, tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt")
    if engine == "pipeline":
        for rank, shard in enumerate(shards):
            for layer, tensors in _pipeline_layer_files(shard).items():
                torch.save(tensors, tag_dir / f"layer_{layer:02d}-model_{rank:02d}-model_states.pt")
    (tmp_path / "latest").write_text("global_step20")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    loaded = load_dense_checkpoint(str(tmp_path), true_vocab_size=TRUE_VOCAB)
    assert (loaded.layout, loaded.iteration) == ("deepspeed", 20)
    assert loaded.train_state["consumed_train_samples"] == 160
    assert_same(loaded.state_dict, dense)
    with pytest.raises(CheckpointConversionError, match="pass --true-vocab-size"):
        load_dense_checkpoint(str(tmp_path))  # ARGS' tokenizer files are not named
    victim = (
        "mp_rank_01_model_states.pt" if engine == "module" else "layer_02-model_01-model_states.pt"
    )
    path = str(tag_dir / victim)
    os.remove(path)
    with pytest.raises(CheckpointConversionError, match=f"missing shard file {path}"):
        load_dense_checkpoint(str(tmp_path), true_vocab_size=TRUE_VOCAB)


def test_both_trackers_disagreeing_follow_deepspeeds_tag(dense, tmp_path):
    save_megatron_checkpoint(checkpoint(dense, iteration=5), str(tmp_path), 1, 1)
    tag_dir = tmp_path / "global_step9"
    tag_dir.mkdir()
    state = dict(_client(1, 1, 9), module=shard_state_dict(dense, 1, 0, 112, SPLITS))
    torch.save(state, tag_dir / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step9")
    loaded = load_dense_checkpoint(str(tmp_path), true_vocab_size=TRUE_VOCAB)
    assert (loaded.layout, loaded.iteration) == ("deepspeed", 9)
    explicit = load_dense_checkpoint(str(tmp_path), iteration=5)
    assert (explicit.layout, explicit.iteration) == ("megatron", 5)


def test_zero3_checkpoints_go_through_zero_to_fp32(dense, tmp_path, monkeypatch):
    """ZeRO-3 model files hold placeholders: TP=1 weights come from DeepSpeed's zero_to_fp32
    (stood in for here; tests/tools/test_reshard.py converts real runs), TP>1 is refused."""
    tag_dir = tmp_path / "global_step4"
    tag_dir.mkdir()
    placeholders = {name: torch.empty(0) for name in dense}
    state = dict(
        _client(1, 1, 4), module=placeholders, ds_config={"zero_optimization": {"stage": 3}}
    )
    torch.save(state, tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step4")
    calls = []

    def fp32_state_dict(root: str, tag: str) -> dict:
        calls.append((root, tag))
        return shard_state_dict(dense, 1, 0, 112, SPLITS)

    fake = types.SimpleNamespace(get_fp32_state_dict_from_zero_checkpoint=fp32_state_dict)
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", fake)
    loaded = load_dense_checkpoint(str(tmp_path), true_vocab_size=TRUE_VOCAB)
    assert calls == [(str(tmp_path), "global_step4")]
    assert_same(loaded.state_dict, dense)
    state["args"]["tensor_model_parallel_size"] = 2
    torch.save(state, tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointConversionError, match="ZeRO-3 checkpoint with tensor-parallel"):
        load_dense_checkpoint(str(tmp_path), true_vocab_size=TRUE_VOCAB)
