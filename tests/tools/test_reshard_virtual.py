"""Virtual pipeline stages in the checkpoint tools: reshard.py writes and reads them as
Megatron-LM does, convert_to_hf.py and generate_samples_gpt.py read them.

A random 4-layer GPT-2 (the GPT-2 tokenizer) saved at TP=1 x PP=1 is resharded by the tool to
TP=2 x PP=2 x 2 virtual stages: each rank file holds `model0` and `model1`, chunk c of
pipeline rank r being layer 2c + r (numbered 0 in its chunk), the embedding in the first
stage's chunk and the head copy in the last; the args say virtual_pipeline_model_parallel_size
2. Back to one chunk per rank (`model`) and to PP=1 the weights stay bit-identical, and the
Hugging Face export and greedy text of the virtual-stage checkpoint equal those of the PP=1
one. Impossible target sizes are one-line errors that write nothing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file as load_safetensors

from megatron.checkpointing.file_format import flatten_model_state, load_file
from megatron.checkpointing.huggingface import model_config
from megatron.checkpointing.shards import (
    DenseCheckpoint,
    checkpoint_splits,
    load_dense_checkpoint,
    save_megatron_checkpoint,
    shard_state_dict,
)
from megatron.model import GPTModel
from tests.conftest import MERGE_FILE, VOCAB_FILE
from tests.one_line_errors import assert_one_line_error, snapshot
from tests.tools.test_generate_samples import GREEDY, continuations
from tools import generate_samples_gpt
from tools.checkpoint import convert_to_hf, reshard

GPT2_VOCAB, PADDED = 50257, 50304
ARGS = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    max_position_embeddings=32,
    seq_length=32,
    make_vocab_size_divisible_by=64,  # 50304 rows at TP 1 and 2
    true_vocab_size=GPT2_VOCAB,
    tokenizer_type="GPT2BPETokenizer",
    vocab_file=VOCAB_FILE,
    merge_file=MERGE_FILE,
)
WORD = "language_model.embedding.word_embeddings.weight"
QKV = "language_model.encoder.layers.{}.self_attention.query_key_value.weight"
HEAD = "word_embeddings_for_head.weight"
INTERLEAVED = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
               "--target-virtual-pipeline-parallel-size", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    """`pp1`: the random model at TP=1 x PP=1 (iteration 5); `vpp2`: resharded by the tool
    to TP=2 x PP=2 x 2 virtual stages."""
    root = tmp_path_factory.mktemp("reshard_virtual")
    torch.manual_seed(0)
    config = dataclasses.replace(model_config(ARGS), vocab_size=GPT2_VOCAB)
    state = {k: torch.randn_like(t) * 0.3 for k, t in GPTModel(config).state_dict().items()}
    source = DenseCheckpoint(state, dict(ARGS), 5, GPT2_VOCAB, {"consumed_train_samples": 40})
    found = {"pp1": str(root / "pp1"), "vpp2": str(root / "vpp2")}
    save_megatron_checkpoint(source, found["pp1"], 1, 1)
    assert reshard.main(["--load", found["pp1"], "--save", found["vpp2"], *INTERLEAVED]) == 0
    return found


def _rank_file(directory: str, tp: int, pp: int) -> dict:
    return load_file(f"{directory}/iter_0000005/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt")


def test_rank_files_hold_megatron_lm_model_chunks(dirs):
    loaded = load_dense_checkpoint(dirs["pp1"])
    dense, splits = loaded.state_dict, checkpoint_splits(loaded.args)
    for tp in range(2):
        shard = shard_state_dict(dense, 2, tp, PADDED, splits)
        for pp in range(2):
            saved = _rank_file(dirs["vpp2"], tp, pp)
            assert sorted(k for k in saved if k.startswith("model")) == ["model0", "model1"]
            args = vars(saved["args"])
            assert args["virtual_pipeline_model_parallel_size"] == 2
            assert args["num_layers_per_virtual_pipeline_stage"] == 1
            for chunk in range(2):
                local = flatten_model_state(saved[f"model{chunk}"])
                stage = 2 * chunk + pp
                assert {n.split(".")[3] for n in local if ".layers." in n} == {"0"}
                assert torch.equal(local[QKV.format(0)], shard[QKV.format(stage)])
                assert (WORD in local) == (stage == 0) and (HEAD in local) == (stage == 3)
    loaded = load_dense_checkpoint(dirs["vpp2"])
    assert (loaded.iteration, loaded.train_state["consumed_train_samples"]) == (5, 40)
    for name, tensor in dense.items():
        assert torch.equal(loaded.state_dict[name], tensor), name


def test_virtual_stages_are_kept_by_default_and_undone_on_request(dirs, tmp_path, capsys):
    expected = load_dense_checkpoint(dirs["pp1"]).state_dict
    kept, one_chunk, single = (str(tmp_path / name) for name in ("kept", "pp2", "pp1"))
    assert reshard.main(["--load", dirs["vpp2"], "--save", kept]) == 0
    assert "tensor-parallel 2 x pipeline-parallel 2 x 2 virtual stages (4 files)" in (
        capsys.readouterr().out
    )
    assert reshard.main(["--load", kept, "--save", one_chunk,
                         "--target-virtual-pipeline-parallel-size", "1"]) == 0  # fmt: skip
    saved = _rank_file(one_chunk, 1, 1)
    assert "model" in saved and "model0" not in saved
    assert vars(saved["args"])["virtual_pipeline_model_parallel_size"] is None
    assert reshard.main(["--load", one_chunk, "--save", single,
                         "--target-pipeline-parallel-size", "1"]) == 0  # fmt: skip
    for directory in (kept, one_chunk, single):
        loaded = load_dense_checkpoint(directory).state_dict
        assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


def test_chunks_are_counted_when_the_args_do_not_say(dirs, tmp_path):
    """Files whose args lack virtual_pipeline_model_parallel_size: the modelN keys tell."""
    copy = str(tmp_path / "vpp2")
    shutil.copytree(dirs["vpp2"], copy)
    path = f"{copy}/iter_0000005/mp_rank_00_000/model_optim_rng.pt"
    saved = load_file(path)
    del saved["args"].virtual_pipeline_model_parallel_size
    torch.save(saved, path)
    loaded = load_dense_checkpoint(copy).state_dict
    expected = load_dense_checkpoint(dirs["pp1"]).state_dict
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


def test_export_and_generation_read_virtual_stages(dirs, tmp_path, capsys):
    exported = {}
    for name, directory in dirs.items():
        assert generate_samples_gpt.main(["--load", directory, *GREEDY]) == 0
        text = continuations(capsys.readouterr().out)
        folder = str(tmp_path / name)
        assert convert_to_hf.main(["--load", directory, "--save", folder]) == 0
        exported[name] = (text, load_safetensors(os.path.join(folder, "model.safetensors")))
    (text, weights), (text_v, weights_v) = exported["pp1"], exported["vpp2"]
    assert text_v == text and len(text) == 1
    assert sorted(weights_v) == sorted(weights)
    assert all(torch.equal(weights_v[name], tensor) for name, tensor in weights.items())


# target flags -> the fragments the error line must name
BAD_SIZES = {
    "virtual_without_pipeline": (
        ["--target-virtual-pipeline-parallel-size", "2", "--target-pipeline-parallel-size", "1"],
        ["--target-virtual-pipeline-parallel-size 2", "pipeline-parallel size above 1"],
    ),
    "stages_not_dividing_layers": (
        ["--target-pipeline-parallel-size", "2", "--target-virtual-pipeline-parallel-size", "4"],
        ["--target-virtual-pipeline-parallel-size 4", "does not divide num_layers 4"],
    ),
    "virtual_zero": (
        ["--target-virtual-pipeline-parallel-size", "0"],
        ["--target-virtual-pipeline-parallel-size 0", "must be >= 1"],
    ),
    "virtual_not_an_int": (
        ["--target-virtual-pipeline-parallel-size", "two"],
        ["--target-virtual-pipeline-parallel-size", "'two'"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SIZES))
def test_impossible_virtual_stages_are_one_line_errors(dirs, tmp_path, capsys, case):
    before = snapshot(dirs["vpp2"])
    flags, named = BAD_SIZES[case]
    code = reshard.main(["--load", dirs["vpp2"], "--save", str(tmp_path / "new"), *flags])
    assert_one_line_error(code, capsys.readouterr().err, *named)
    assert not (tmp_path / "new").exists() and snapshot(dirs["vpp2"]) == before


def test_a_rank_file_missing_a_chunk_is_named(dirs, tmp_path, capsys):
    copy = str(tmp_path / "vpp2")
    shutil.copytree(dirs["vpp2"], copy)
    path = f"{copy}/iter_0000005/mp_rank_01_001/model_optim_rng.pt"
    saved = load_file(path)
    del saved["model1"]
    torch.save(saved, path)
    code = reshard.main(["--load", copy, "--save", str(tmp_path / "new")])
    assert_one_line_error(code, capsys.readouterr().err, f"{path} has no 'model1' entry")
