"""tools/checkpoint/convert_to_hf.py and convert_from_hf.py against Hugging Face's own GPT-2.

Export: a random GPT (every weight and bias random, so a wrong permutation cannot hide) saved
with `save_megatron_checkpoint` and exported must load with `AutoModelForCausalLM` /
`AutoTokenizer` (offline) and give our logits; exporting the same model from TP=2 and PP=2
checkpoints gives the same files' weights; importing the export gives back our weights bit
for bit. Import: a random `GPT2LMHeadModel` saved with `save_pretrained`, imported at TP=2,
gives HF's logits in our GPTModel. Both GeLU forms are covered (`gelu_new` and exact `gelu`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron.checkpointing.huggingface import model_config  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    DenseCheckpoint,
    load_dense_checkpoint,
    save_megatron_checkpoint,
    shard_state_dict,
)
from megatron.model import GPTModel  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import MERGE_FILE, VOCAB_FILE  # noqa: E402
from tests.one_line_errors import (  # noqa: E402
    assert_one_line_error,
    damaged_checkpoint,
    file_under_a_file,
    snapshot,
)
from tools.checkpoint import convert_from_hf, convert_to_hf  # noqa: E402

TRUE_VOCAB = 50257
WORD = "language_model.embedding.word_embeddings.weight"
TEXT = "def greet(name):\n    return f'Hello, {name}!'  # ünïcödé, naïve café"
ARGS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=32,
    seq_length=32,
    make_vocab_size_divisible_by=128,
    true_vocab_size=TRUE_VOCAB,
    layernorm_epsilon=1e-5,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    vocab_file=VOCAB_FILE,
    merge_file=MERGE_FILE,
    tokenizer_type="GPT2BPETokenizer",
)
ACTIVATION_ARGS = {
    "gelu_new": dict(openai_gelu=True, bias_gelu_fusion=True),
    "gelu": dict(openai_gelu=False, bias_gelu_fusion=False),
}


def our_logits(state: dict[str, torch.Tensor], args: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, true vocab] of our TP=1 GPTModel with `state` (true vocab rows)."""
    config = model_config(args)
    padded = shard_state_dict(state, 1, 0, -(-state[WORD].size(0) // 128) * 128)
    config = dataclasses.replace(config, vocab_size=padded[WORD].size(0), parallel_output=False)
    model = GPTModel(config)
    model.load_state_dict(padded)
    with torch.no_grad():
        return model.eval()(tokens)[..., : state[WORD].size(0)]


def random_checkpoint(activation: str) -> DenseCheckpoint:
    """A TP=1 fp32 GPT with every parameter random (layer norms around 1)."""
    args = dict(ARGS, **ACTIVATION_ARGS[activation])
    torch.manual_seed(1)
    config = dataclasses.replace(model_config(args), vocab_size=TRUE_VOCAB)
    state = {}
    for name, tensor in GPTModel(config).state_dict().items():
        noise = torch.randn_like(tensor) * 0.2
        state[name] = 1 + noise if "layernorm.weight" in name else noise
    return DenseCheckpoint(state, args, 12, TRUE_VOCAB, {"consumed_train_samples": 48})


def export(load: str, save: str) -> None:
    """convert_to_hf.py --load load --save save, in this process."""
    assert convert_to_hf.main(["--load", load, "--save", save]) == 0


@pytest.fixture(scope="module", params=sorted(ACTIVATION_ARGS))
def exported(request, tmp_path_factory) -> tuple[DenseCheckpoint, str, str]:
    """(our model, its TP=1 checkpoint dir, its Hugging Face export)."""
    root = tmp_path_factory.mktemp(f"hf_{request.param}")
    ours = random_checkpoint(request.param)
    save_megatron_checkpoint(ours, str(root / "tp1"), 1, 1)
    export(str(root / "tp1"), str(root / "hf"))
    return ours, str(root / "tp1"), str(root / "hf")


def test_export_loads_and_matches_our_logits(exported):
    ours, _, hf_dir = exported
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "GPT2LMHeadModel" and model.dtype == torch.float32
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    activation = "gelu_new" if ours.args["openai_gelu"] else "gelu"
    assert config["activation_function"] == activation
    assert (config["vocab_size"], config["n_positions"], config["n_inner"]) == (50257, 32, 256)
    assert (config["bos_token_id"], config["eos_token_id"]) == (50256, 50256)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(TEXT)
    with torch.no_grad():
        hf_logits = model.eval()(ids).logits
    torch.testing.assert_close(
        hf_logits, our_logits(ours.state_dict, ours.args, ids), atol=1e-4, rtol=0
    )


def test_export_then_import_gives_our_weights_back(exported, tmp_path):
    ours, _, hf_dir = exported
    back = str(tmp_path / "back")
    assert convert_from_hf.main(["--load", hf_dir, "--save", back]) == 0
    loaded = load_dense_checkpoint(back)
    assert (loaded.iteration, loaded.true_vocab_size) == (0, TRUE_VOCAB)
    assert sorted(loaded.state_dict) == sorted(ours.state_dict)
    for name, tensor in ours.state_dict.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    for key in ("num_layers", "hidden_size", "num_attention_heads", "openai_gelu"):
        assert loaded.args[key] == ours.args[key]
    assert model_config(loaded.args).activation == model_config(ours.args).activation


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_export_is_the_same_from_any_split(exported, tmp_path, tp, pp):
    _, _, hf_dir = exported
    split = str(tmp_path / "split")
    save_megatron_checkpoint(load_dense_checkpoint(exported[1]), split, tp, pp)
    export(split, str(tmp_path / "hf"))
    expected = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    actual = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_import_of_a_hugging_face_gpt2_at_tp2(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=500,
        n_positions=24,
        n_embd=48,
        n_layer=2,
        n_head=4,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            offset = 1.0 if ".ln_" in name and name.endswith("weight") else 0.0
            param.copy_(offset + torch.randn_like(param) * 0.2)
    model.save_pretrained(str(tmp_path / "hf"))
    target = str(tmp_path / "ours")
    argv = ["--load", str(tmp_path / "hf"), "--save", target, "--target-tensor-parallel-size", "2"]
    assert convert_from_hf.main(argv) == 0
    loaded = load_dense_checkpoint(target)
    assert (
        loaded.args["padded_vocab_size"] == 512 and loaded.args["tensor_model_parallel_size"] == 2
    )
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
    torch.testing.assert_close(
        our_logits(loaded.state_dict, loaded.args, tokens), expected, atol=1e-4, rtol=0
    )


def test_cli_errors_are_one_line(tmp_path, capsys):
    """main() returns the exit status (1) and prints one line; reshard's test runs the CLI."""
    missing = str(tmp_path / "missing")
    assert convert_to_hf.main(["--load", missing, "--save", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: checkpoint directory {missing} does not exist"
    ]
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    assert convert_to_hf.main(["--load", missing, "--save", str(occupied)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: --save {occupied} is not empty; choose another folder or pass --force"
    ]
    assert (occupied / "keep.txt").read_text() == "mine" and len(os.listdir(occupied)) == 1
    assert convert_from_hf.main(["--load", missing, "--save", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: --load {missing} is not a directory"]
    assert not (tmp_path / "o").exists()


def test_models_gpt2_cannot_express_are_refused(tmp_path, capsys):
    rope = dict(ARGS, use_rotary_position_embeddings=True)
    config = dataclasses.replace(model_config(rope), vocab_size=TRUE_VOCAB)
    state = dict(GPTModel(config).state_dict())
    assert "language_model.embedding.position_embeddings.weight" not in state
    save_megatron_checkpoint(
        DenseCheckpoint(state, rope, 3, TRUE_VOCAB), str(tmp_path / "rope"), 1, 1
    )
    assert (
        convert_to_hf.main(["--load", str(tmp_path / "rope"), "--save", str(tmp_path / "o")]) == 1
    )
    assert "rotary" in capsys.readouterr().err and not (tmp_path / "o").exists()
    hf = tmp_path / "relu"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(model_type="gpt2", activation_function="relu")))
    assert convert_from_hf.main(["--load", str(hf), "--save", str(tmp_path / "o")]) == 1
    error = capsys.readouterr().err.splitlines()
    assert len(error) == 1 and "activation_function='relu'" in error[0]


# tool -> case -> (flags, the fragments the error line must name)
BAD_RUNS = {
    "to_hf_damaged": ("to", ["--load", "{d}/damaged", "--save", "{d}/new"], ["{damaged_file}"]),
    "to_hf_save_under_a_file": ("to", ["--load", "{ckpt}", "--save", "{blocked}"], ["--save"]),
    "to_hf_bad_vocab": ("to", ["--load", "{ckpt}", "--save", "{d}/new", "--vocab-file",
                               "{d}/notes.txt"], ["--vocab-file {d}/notes.txt"]),
    "from_hf_config_not_json": ("from", ["--load", "{d}/notjson", "--save", "{d}/new"],
                                ["--load {d}/notjson/config.json", "not a JSON config"]),
    "from_hf_config_without_shape": ("from", ["--load", "{d}/bare", "--save", "{d}/new"],
                                     ["--load {d}/bare", "'n_embd'"]),
    "from_hf_no_weights": ("from", ["--load", "{d}/noweights", "--save", "{d}/new"],
                           ["{d}/noweights"]),
    "from_hf_save_is_a_file": ("from", ["--load", "{d}/bare", "--save", "{d}/notes.txt"],
                               ["--save {d}/notes.txt"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> str:
    """A random 2-layer GPT with the GPT-2 tokenizer files in its args, at TP=1."""
    config = dataclasses.replace(model_config(ARGS), vocab_size=TRUE_VOCAB)
    state = dict(GPTModel(config).state_dict())
    folder = str(tmp_path_factory.mktemp("small") / "checkpoint")
    save_megatron_checkpoint(DenseCheckpoint(state, dict(ARGS), 3, TRUE_VOCAB), folder, 1, 1)
    return folder


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(small_checkpoint, tmp_path, capsys, case):
    """Exit 1, no traceback, one last `error:` line naming the flag or file; nothing written."""
    (tmp_path / "notes.txt").write_text("a file, not a vocabulary nor a folder\n")
    configs = {"notjson": "{not json", "bare": '{"model_type": "gpt2"}'}
    configs["noweights"] = json.dumps(
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).to_dict()
    )
    for name, text in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    paths = dict(d=tmp_path, ckpt=small_checkpoint, blocked=file_under_a_file(tmp_path))
    paths["damaged_file"] = damaged_checkpoint(tmp_path / "damaged")
    before = snapshot(tmp_path)
    tool, flags, named = BAD_RUNS[case]
    main = {"to": convert_to_hf.main, "from": convert_from_hf.main}[tool]
    code = main([f.format(**paths) for f in flags])
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()
