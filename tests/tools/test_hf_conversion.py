"""tools/checkpoint/convert_to_hf.py and convert_from_hf.py against Hugging Face's GPT-2 and LLaMA.

Export: a random GPT (every weight and bias random, so a wrong permutation cannot hide) saved
with `save_megatron_checkpoint` and exported must load with `AutoModelForCausalLM` /
`AutoTokenizer` (offline) and give our logits (up to the rounding of fp32 sums in another
order, `forward_terms`); exporting the same model from TP=2 and PP=2 checkpoints gives the
same files' weights; importing the export gives back our weights bit for bit. Import: a
random `GPT2LMHeadModel` / `LlamaForCausalLM` saved with `save_pretrained`, imported at TP=2,
gives HF's logits in our GPTModel (up to the same rounding). Both GeLU forms of GPT-2 are covered
(`gelu_new` and exact `gelu`), and a LLaMA-style model (RMSNorm, SwiGLU, grouped-query
attention, RoPE theta 500000, untied output layer, no linear biases). The end-to-end test
trains that LLaMA at TP=2 with `pretrain_gpt.py`, exports it, and compares logits and greedy
generation with `transformers`, then imports it back.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron.checkpointing.huggingface import hf_architecture, model_config  # noqa: E402
from megatron.checkpointing.huggingface_llama import (  # noqa: E402
    from_llama_state_dict,
    to_llama_state_dict,
)
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    DenseCheckpoint,
    checkpoint_splits,
    load_dense_checkpoint,
    save_megatron_checkpoint,
    shard_state_dict,
)
from megatron.model import GPTModel  # noqa: E402
from megatron.text_generation import generate  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import MERGE_FILE, VOCAB_FILE  # noqa: E402
from tests.one_line_errors import (  # noqa: E402
    assert_one_line_error,
    damaged_checkpoint,
    file_under_a_file,
    snapshot,
)
from tests.pretrain_runs import LLAMA_ARCHITECTURE, launch, tiny_gpt_flags  # noqa: E402
from tests.tolerances import assert_close_reordered, forward_terms  # noqa: E402
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
LLAMA_ARGS = dict(
    num_attention_heads=8,
    num_key_value_heads=2,
    ffn_hidden_size=96,
    **LLAMA_ARCHITECTURE,
)
VARIANT_ARGS = {
    "gelu_new": dict(openai_gelu=True, bias_gelu_fusion=True),
    "gelu": dict(openai_gelu=False, bias_gelu_fusion=False),
    "llama": LLAMA_ARGS,
}
GPT2_CONFIG = dict(
    architectures=["GPT2LMHeadModel"], n_positions=32, n_inner=256, torch_dtype="float32",
    dtype="float32",
)  # fmt: skip
HF_CONFIG = {  # what each export's config.json says (besides vocabulary and bos / eos)
    "gelu_new": dict(GPT2_CONFIG, activation_function="gelu_new"),
    "gelu": dict(GPT2_CONFIG, activation_function="gelu"),
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        hidden_act="silu",
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,  # transformers 4.x reads it here, 5.x in rope_parameters
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype="float32",
        dtype="float32",
    ),
}
MODEL_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "kv_channels",
    "ffn_hidden_size", "max_position_embeddings", "layernorm_epsilon", "activation",
    "normalization", "position_embedding_type", "rotary_base", "rotary_percent",
    "untie_embeddings_and_output_weights", "add_bias_linear",
)  # fmt: skip
"""The `ModelConfig` fields an import must give back: they decide what the model computes."""


def same_model(args: dict, other: dict) -> bool:
    """Whether two checkpoints' args build models computing the same function."""
    config, other_config = model_config(args), model_config(other)
    return all(getattr(config, f) == getattr(other_config, f) for f in MODEL_FIELDS)


def our_model(state: dict[str, torch.Tensor], args: dict) -> GPTModel:
    """Our TP=1 GPTModel (eval mode, full logits) holding `state` (true vocab rows)."""
    config = model_config(args)
    rows = -(-state[WORD].size(0) // 128) * 128
    padded = shard_state_dict(state, 1, 0, rows, checkpoint_splits(args))
    config = dataclasses.replace(config, vocab_size=padded[WORD].size(0), parallel_output=False)
    model = GPTModel(config)
    model.load_state_dict(padded)
    return model.eval()


def our_logits(state: dict[str, torch.Tensor], args: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, true vocab] of our TP=1 GPTModel with `state` (true vocab rows)."""
    with torch.no_grad():
        return our_model(state, args)(tokens)[..., : state[WORD].size(0)]


def random_checkpoint(variant: str) -> DenseCheckpoint:
    """A TP=1 fp32 GPT with every parameter random (layer norms around 1)."""
    args = dict(ARGS, **VARIANT_ARGS[variant])
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


@pytest.fixture(scope="module", params=sorted(VARIANT_ARGS))
def exported(request, tmp_path_factory) -> tuple[DenseCheckpoint, str, str, str]:
    """(our model, its TP=1 checkpoint dir, its Hugging Face export, the variant)."""
    root = tmp_path_factory.mktemp(f"hf_{request.param}")
    ours = random_checkpoint(request.param)
    save_megatron_checkpoint(ours, str(root / "tp1"), 1, 1)
    export(str(root / "tp1"), str(root / "hf"))
    return ours, str(root / "tp1"), str(root / "hf"), request.param


def test_export_loads_and_matches_our_logits(exported):
    ours, _, hf_dir, variant = exported
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    expected = HF_CONFIG[variant]
    assert {key: config[key] for key in expected} == expected
    assert type(model).__name__ == expected["architectures"][0] and model.dtype == torch.float32
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (
        50257,
        50256,
        50256,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(TEXT)
    with torch.no_grad():
        hf_logits = model.eval()(ids).logits
    # Another implementation of the same fp32 model: its sums run in other orders.
    expected = our_logits(ours.state_dict, ours.args, ids)
    terms = forward_terms(model_config(ours.args), ids.numel())
    assert_close_reordered(hf_logits, expected, terms=terms)


def test_export_then_import_gives_our_weights_back(exported, tmp_path):
    ours, _, hf_dir, _ = exported
    back = str(tmp_path / "back")
    assert convert_from_hf.main(["--load", hf_dir, "--save", back]) == 0
    loaded = load_dense_checkpoint(back)
    assert (loaded.iteration, loaded.true_vocab_size) == (0, TRUE_VOCAB)
    assert sorted(loaded.state_dict) == sorted(ours.state_dict)
    for name, tensor in ours.state_dict.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert same_model(loaded.args, ours.args)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_export_is_the_same_from_any_split(exported, tmp_path, tp, pp):
    _, _, hf_dir, _ = exported
    split = str(tmp_path / "split")
    save_megatron_checkpoint(load_dense_checkpoint(exported[1]), split, tp, pp)
    export(split, str(tmp_path / "hf"))
    expected = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    actual = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def random_hf_model(family: str):  # noqa: ANN201 - a transformers PreTrainedModel
    """A small GPT-2 or LLaMA (grouped-query, untied, biases, RoPE theta 500000), all random."""
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=500, n_positions=24, n_embd=48, n_layer=2, n_head=4,
            activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model_class = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            vocab_size=500, max_position_embeddings=24, hidden_size=48, intermediate_size=80,
            num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            attention_bias=True, mlp_bias=True,
        )  # fmt: skip
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(2)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = ".ln_" in name or "norm" in name
            offset = 1.0 if norm and name.endswith("weight") else 0.0
            param.copy_(offset + torch.randn_like(param) * 0.2)
    return model


def test_llama_weights_round_trip_with_biases_and_tied_embeddings():
    """to_llama_state_dict then from_llama_state_dict is the identity (attention/MLP biases)."""
    args = {**ARGS, **LLAMA_ARGS, "add_bias_linear": True}
    args["untie_embeddings_and_output_weights"] = False
    config = dataclasses.replace(model_config(args), vocab_size=300)
    torch.manual_seed(3)
    state = {k: torch.randn_like(t) for k, t in GPTModel(config).state_dict().items()}
    hf = to_llama_state_dict(state, config)
    assert "lm_head.weight" not in hf and hf["model.layers.1.self_attn.k_proj.bias"].shape == (16,)
    assert hf["model.layers.0.mlp.up_proj.weight"].shape == (96, 64)
    back = from_llama_state_dict({**hf, "lm_head.weight": hf["model.embed_tokens.weight"]}, config)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_import_of_a_hugging_face_model_at_tp2(tmp_path, family):
    model = random_hf_model(family)
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
    terms = forward_terms(model_config(loaded.args), tokens.numel())  # ours vs transformers
    ours = our_logits(loaded.state_dict, loaded.args, tokens)
    assert_close_reordered(ours, expected, terms=terms)


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


LLAMA_FLAGS = (
    "--num-attention-heads 8 --num-key-value-heads 2 --ffn-hidden-size 96 --normalization "
    "rmsnorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
    "--use-rotary-position-embeddings --no-position-embedding "
    "--rotary-position-embeddings-theta 500000 --tensor-model-parallel-size 2 --train-iters 3 "
    "--global-batch-size 4 --save-interval 3"
).split()


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory, stdlib_dataset) -> str:
    """A LLaMA-style checkpoint of 3 `pretrain_gpt.py` iterations at TP=2 (2 CPU ranks)."""
    save = str(tmp_path_factory.mktemp("trained_llama") / "checkpoint")
    run = launch(2, [*tiny_gpt_flags(stdlib_dataset), *LLAMA_FLAGS, "--save", save])
    assert run.returncode == 0, run.stdout[-5000:]
    return save


def test_trained_llama_exports_to_transformers_and_back(trained_llama, tmp_path):
    """Logits up to the rounding of sums in another order (fp32), the same greedy tokens, and
    the same weights imported back."""
    dense = load_dense_checkpoint(trained_llama)
    assert dense.args["tensor_model_parallel_size"] == 2 and dense.iteration == 3
    hf_dir = str(tmp_path / "hf")
    export(trained_llama, hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    assert model.config.rope_parameters["rope_theta"] == 500000.0
    ids = transformers.AutoTokenizer.from_pretrained(hf_dir)(TEXT, return_tensors="pt")
    ids = ids["input_ids"]
    ours = our_model(dense.state_dict, dense.args)
    with torch.no_grad():
        theirs, mine = model.eval()(ids).logits, ours(ids)[..., :TRUE_VOCAB]
    assert_close_reordered(theirs, mine, terms=forward_terms(model_config(dense.args), ids.numel()))
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=50256)
    generated = generate(ours, ids[0].tolist(), 12, greedy=True, vocab_size=TRUE_VOCAB)
    assert greedy[0, ids.size(1) :].tolist() == generated[0]

    back = str(tmp_path / "back")
    argv = ["--load", hf_dir, "--save", back, "--target-tensor-parallel-size", "2"]
    assert convert_from_hf.main(argv) == 0
    loaded = load_dense_checkpoint(back)
    assert sorted(loaded.state_dict) == sorted(dense.state_dict)
    for name, tensor in dense.state_dict.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert same_model(loaded.args, dense.args)
    assert loaded.args["tokenizer_type"] == "GPT2BPETokenizer"


# args on top of the LLaMA variant -> what the refusal must name
NOT_EXACTLY_LLAMA = {
    "layernorm": (dict(normalization="layernorm"), "normalization 'layernorm' (LLaMA: 'rmsnorm')"),
    "gelu": (dict(swiglu=False), "activation 'gelu_tanh' (LLaMA: 'swiglu')"),
    "learned positions": (
        dict(use_rotary_position_embeddings=False, add_position_embedding=True),
        "position_embedding_type 'learned_absolute' (LLaMA: 'rope')",
    ),
    "partial rotary": (dict(rotary_percent=0.5), "rotary_percent 0.5 (LLaMA: 1.0)"),
    "heads not dividing hidden": (
        dict(num_attention_heads=6, kv_channels=16),
        "hidden_size 64 not a multiple of num_attention_heads 6",
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_EXACTLY_LLAMA))
def test_models_llama_cannot_express_are_refused_naming_the_difference(case):
    changes, named = NOT_EXACTLY_LLAMA[case]
    config = model_config({**ARGS, **LLAMA_ARGS, **changes})
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    message = str(error.value)
    assert "\n" not in message and "LlamaForCausalLM" in message and named in message
    assert hf_architecture(model_config(dict(ARGS, **LLAMA_ARGS))) == "LlamaForCausalLM"
    with_biases = model_config({**ARGS, **LLAMA_ARGS, "add_bias_linear": True})
    assert hf_architecture(with_biases) == "LlamaForCausalLM"  # attention_bias, mlp_bias


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


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            dict(
                multi_latent_attention=True,
                q_lora_rank=None,
                kv_lora_rank=16,
                qk_head_dim=8,
                qk_pos_emb_head_dim=8,
                v_head_dim=8,
                rotary_scaling_factor=1.0,
                mscale=1.0,
                mscale_all_dim=0.0,
            ),
            "unnormalized latents (DeepseekV3 normalizes them: --qk-layernorm)",
        ),
        (
            dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1),
            "--mtp-num-layers) without multi-latent attention has no Hugging Face export",
        ),
    ],
    ids=["multi-latent attention", "multi-token prediction"],
)
def test_deepseek_parts_no_hf_model_computes_are_refused_by_flag(changes, named):
    """MLA with latents left unnormalized (DeepSeek normalizes them) and MTP without MLA (only
    DeepSeek-V3's format holds it): one line naming the flag."""
    config = model_config({**ARGS, **LLAMA_ARGS, **changes})
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    message = str(error.value)
    assert "\n" not in message and named in message
