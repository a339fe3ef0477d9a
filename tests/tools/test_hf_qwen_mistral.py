"""Hugging Face Qwen2, Qwen3 and Mistral <-> our GPT (`huggingface_qwen_mistral.py`).

A tiny random model of each family, built with transformers' own classes (2 layers, hidden 64,
4 heads over 2 key/value heads, vocabulary 1000 of a byte-level BPE trained on the standard
library the way Qwen's is; Qwen2: q/k/v biases, tied embeddings; Qwen3: QK norm, head_dim 32
!= hidden / heads; Mistral: sliding window 8 under sequences of 24 tokens and longer), every
weight random:

- imports with convert_from_hf.py and gives transformers' logits in our GPT (up to the
  rounding of fp32 sums in another order), also from the TP=2 checkpoint it writes (the q/k/v
  biases split per key/value group, the QK norms whole on each rank) in a 2-rank world;
- trains 3 AdamW steps in this process, exports with convert_to_hf.py and reads in transformers
  5.x (installed) and 4.46.3 (one subprocess for Qwen2 and Mistral; Qwen3 came in 4.51) as
  ours: the same ids, greedy tokens and logits; config.json says it in both releases' keys;
- imports back bit for bit, from a TP=2 save of the trained checkpoint too, and the flags
  convert_from_hf.py prints build the same model.

What no family computes is refused in one line naming it: config.json keys on import (the Qwen
sliding window, Qwen3's attention_bias, ...), flag combinations on export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.arguments import build_parser, validate_args  # noqa: E402
from megatron.checkpointing.huggingface import (  # noqa: E402
    gpt2_differences,
    hf_architecture,
    model_config,
)
from megatron.checkpointing.huggingface_qwen_mistral import (  # noqa: E402
    DIFFERENCES,
    megatron_args_from_mistral,
)
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    DenseCheckpoint,
    load_dense_checkpoint,
    save_megatron_checkpoint,
    shard_state_dict,
)
from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.model.sharding import declared_splits  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.text_generation import generate  # noqa: E402
from megatron.tokenizer.hf_tokenizer import HFTokenizer  # noqa: E402
from tests.conftest import REPO_ROOT, TRANSFORMERS_4, run_transformers_4  # noqa: E402
from tests.model.helpers import gather_across_tensor_group, spawn_collect  # noqa: E402
from tests.one_line_errors import assert_one_line_error  # noqa: E402
from tests.tolerances import assert_close_reordered, forward_terms  # noqa: E402
from tests.tools.hf_reader import read  # noqa: E402
from tests.tools.hf_routed_moe import printed_flags, read_config  # noqa: E402
from tests.tools.test_hf_conversion import MODEL_FIELDS, our_logits, our_model  # noqa: E402
from tools.checkpoint import convert_from_hf, convert_to_hf  # noqa: E402

READER = os.path.join(REPO_ROOT, "tests", "tools", "hf_reader.py")
PROMPT = "def greet(name):\n    return f'Hello, {name}!' if name else 'Hello, world!'"
NEW_TOKENS = 8
EOS = "<|endoftext|>"
COMMON = dict(
    max_position_embeddings=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
)  # fmt: skip
FAMILIES = {  # model_type -> (transformers classes, config keys beyond COMMON, our options)
    "qwen2": (
        ("Qwen2Config", "Qwen2ForCausalLM"),
        dict(rope_theta=1e6, tie_word_embeddings=True),
        dict(add_qkv_bias=True, untie_embeddings_and_output_weights=False),
    ),
    "qwen3": (
        ("Qwen3Config", "Qwen3ForCausalLM"),
        dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=False),
        dict(qk_layernorm=True, kv_channels=32),
    ),
    "mistral": (
        ("MistralConfig", "MistralForCausalLM"),
        dict(sliding_window=8, tie_word_embeddings=False),
        dict(window_size=(7, 0), rotary_base=10000.0),
    ),
}
IN_TRANSFORMERS_4 = ("qwen2", "mistral")
"""The families transformers 4.46.3 has (Qwen3 came in 4.51)."""
FIELDS = (*MODEL_FIELDS, "add_qkv_bias", "qk_layernorm", "window_size")
"""The `ModelConfig` fields that decide what a model computes."""


def fields(config: ModelConfig) -> dict:
    """`FIELDS` of `config` (a window as a tuple, however the args stored it)."""
    found = {name: getattr(config, name) for name in FIELDS}
    if found["window_size"] is not None:
        found["window_size"] = tuple(found["window_size"])
    return found


def random_hf_model(family: str, vocab: int):  # noqa: ANN201 - a transformers PreTrainedModel
    """The family's tiny model, every weight random (norms around 1, biases too)."""
    (config_class, model_class), keys, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(vocab_size=vocab, **COMMON, **keys)
    torch.manual_seed(7)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(("norm" in name) + torch.randn_like(param) * 0.2)
    return model


def convert(module, *argv: str) -> str:  # noqa: ANN001 - convert_from_hf or convert_to_hf
    """Run a tool's main in this process; its standard output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(list(argv)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def qwen_style_tokenizer(tmp_path_factory, stdlib_texts) -> str:
    """A byte-level BPE of 1000 tokens trained on the standard library with Qwen2's pipeline
    (NFC, its split pattern, then bytes): transformers 5 rebuilds a qwen2 or qwen3 folder's
    tokenizer with that pipeline whatever tokenizer.json says (4.x reads tokenizer.json), so
    only such a tokenizer reads alike in both. A folder: tokenizer.json, tokenizer_config.json
    (`<|endoftext|>` its bos and eos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(stdlib_texts, trainer)
    folder = tmp_path_factory.mktemp("qwen_style_tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=EOS, eos_token=EOS)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def imported(tmp_path_factory, qwen_style_tokenizer) -> dict[str, dict]:
    """Family -> its random Hugging Face model, folder (tokenizer included), imports at TP=1
    and TP=2, and the flags convert_from_hf.py printed."""
    root = tmp_path_factory.mktemp("hf_qwen_mistral")
    vocab = len(transformers.AutoTokenizer.from_pretrained(qwen_style_tokenizer))
    found = {}
    for family in FAMILIES:
        model, hf_dir = random_hf_model(family, vocab), str(root / family / "hf")
        model.save_pretrained(hf_dir)
        for name in os.listdir(qwen_style_tokenizer):
            shutil.copy(os.path.join(qwen_style_tokenizer, name), hf_dir)
        ours, tp2 = str(root / family / "ours"), str(root / family / "ours_tp2")
        stdout = convert(convert_from_hf, "--load", hf_dir, "--save", ours)
        convert(
            convert_from_hf, "--load", hf_dir, "--save", tp2, "--target-tensor-parallel-size", "2"
        )
        found[family] = dict(model=model, hf_dir=hf_dir, ours=ours, tp2=tp2, vocab=vocab)
        found[family]["flags"] = printed_flags(stdout)
    return found


def random_tokens(vocab: int) -> torch.Tensor:
    """[2, 24] ids: three sliding windows of Mistral's."""
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_gives_the_models_logits(imported, family):
    found = imported[family]
    loaded = load_dense_checkpoint(found["ours"])
    config = model_config(loaded.args)
    expected = {**fields(ModelConfig(**{**_config_base(), **FAMILIES[family][2]}))}
    assert fields(config) == expected
    tokens = random_tokens(found["vocab"])
    with torch.no_grad():
        theirs = found["model"](tokens).logits
    ours = our_logits(loaded.state_dict, loaded.args, tokens)
    assert_close_reordered(ours, theirs, terms=forward_terms(config, tokens.numel()))


def _config_base() -> dict:
    """The LLaMA-style `ModelConfig` every family's import shares (before its options)."""
    return dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        ffn_hidden_size=96, vocab_size=1024, max_position_embeddings=64, layernorm_epsilon=1e-6,
        activation="swiglu", normalization="rmsnorm", position_embedding_type="rope",
        rotary_base=1e6, add_bias_linear=False, untie_embeddings_and_output_weights=True,
    )  # fmt: skip


def _tp2_body(rank: int, world: int, folders: dict[str, str]) -> dict[str, torch.Tensor]:
    """Each family's TP=2 import (merged from its files, split again by the same rules) in a
    TP=2 GPTModel: the gathered logits of `random_tokens`."""
    parallel_state.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(0)  # the initial weights, all replaced
    logits = {}
    for family, folder in folders.items():
        loaded = load_dense_checkpoint(folder)
        config = dataclasses.replace(
            model_config(loaded.args), vocab_size=loaded.args["padded_vocab_size"]
        )
        model = GPTModel(config)
        splits = declared_splits(model)
        state = shard_state_dict(loaded.state_dict, 2, rank, config.vocab_size, splits)
        model.load_state_dict(state)
        with torch.no_grad():
            local = model.eval()(random_tokens(loaded.true_vocab_size))
        logits[family] = torch.cat(gather_across_tensor_group(local), dim=-1)
    return logits


def test_tp2_import_splits_and_merges_biases_and_qk_norms(imported):
    """The TP=2 files merge into the TP=1 import bit for bit, and split by the same rules a
    TP=2 model computes the Hugging Face model's logits."""
    for found in imported.values():
        merged, whole = (load_dense_checkpoint(found[key]) for key in ("tp2", "ours"))
        assert sorted(merged.state_dict) == sorted(whole.state_dict)
        assert all(torch.equal(merged.state_dict[n], t) for n, t in whole.state_dict.items())
    ranks = spawn_collect(_tp2_body, 2, {family: f["tp2"] for family, f in imported.items()})
    for family, found in imported.items():
        tokens = random_tokens(found["vocab"])
        with torch.no_grad():
            theirs = found["model"](tokens).logits
        config = model_config(load_dense_checkpoint(found["ours"]).args)
        for logits in ranks:
            ours = logits[family][..., : found["vocab"]]
            assert_close_reordered(ours, theirs, terms=forward_terms(config, tokens.numel()))


def train(loaded: DenseCheckpoint, tokens: torch.Tensor, steps: int) -> tuple[dict, list]:
    """`loaded`'s weights (true vocabulary rows) after `steps` AdamW steps on `tokens` in our
    TP=1 GPTModel, and the losses."""
    config = dataclasses.replace(
        model_config(loaded.args), vocab_size=loaded.args["padded_vocab_size"]
    )
    model = GPTModel(config)
    splits = declared_splits(model)
    model.load_state_dict(shard_state_dict(loaded.state_dict, 1, 0, config.vocab_size, splits))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    rows = loaded.true_vocab_size
    vocabulary = ("word_embeddings", "output_layer")
    state = {
        name: (tensor[:rows] if any(part in name for part in vocabulary) else tensor).clone()
        for name, tensor in model.state_dict().items()
    }
    return state, losses


@pytest.fixture(scope="module")
def trained(imported, tmp_path_factory) -> dict[str, dict]:
    """Family -> the import after 3 AdamW steps (in this process), its checkpoint, its export
    and what our model reads from PROMPT (ids, logits, greedy tokens)."""
    root = tmp_path_factory.mktemp("trained_qwen_mistral")
    found = {}
    for family, source in imported.items():
        loaded, vocab = load_dense_checkpoint(source["ours"]), source["vocab"]
        state, losses = train(loaded, random_tokens(vocab), steps=3)
        dense = DenseCheckpoint(state, dict(loaded.args), 3, vocab)
        checkpoint, hf_dir = str(root / family / "checkpoint"), str(root / family / "hf")
        save_megatron_checkpoint(dense, checkpoint, 1, 1)
        convert(convert_to_hf, "--load", checkpoint, "--save", hf_dir)
        tokenizer = HFTokenizer(source["hf_dir"])
        ids = tokenizer.tokenize(PROMPT)
        assert 8 < len(ids) and len(ids) + NEW_TOKENS <= 64  # longer than Mistral's window
        ours = our_model(state, loaded.args)
        with torch.no_grad():
            logits = ours(torch.tensor([ids]))[0][:, :vocab]
        greedy = generate(
            ours, ids, NEW_TOKENS, greedy=True, eod_token_id=tokenizer.eod, vocab_size=vocab
        )
        found[family] = dict(
            dense=dense, checkpoint=checkpoint, hf_dir=hf_dir, losses=losses,
            reading=dict(ids=ids, logits=logits, greedy=greedy[0]),
        )  # fmt: skip
    return found


@pytest.fixture(scope="module")
def readings(trained, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """Release ("4", "5") -> family -> what `hf_reader.read` gives for the trained export;
    transformers 4.46.3 reads Qwen2 and Mistral in one subprocess."""
    out = str(tmp_path_factory.mktemp("read_in_4") / "read.pt")
    folders = [trained[family]["hf_dir"] for family in IN_TRANSFORMERS_4]
    run_transformers_4(READER, out, "--text", PROMPT, "--new-tokens", str(NEW_TOKENS), *folders)
    in_4 = torch.load(out)
    return {
        "4": {family: in_4[trained[family]["hf_dir"]] for family in IN_TRANSFORMERS_4},
        "5": {family: read(t["hf_dir"], PROMPT, NEW_TOKENS) for family, t in trained.items()},
    }


CASES = [(release, family) for release in "45" for family in FAMILIES]
CASES = [(r, f) for r, f in CASES if r == "5" or f in IN_TRANSFORMERS_4]


@pytest.mark.parametrize("release, family", CASES)
def test_trained_export_reads_as_our_model(trained, readings, release, family):
    """Every weight found, the same ids and greedy tokens (past Mistral's window), logits up
    to reordered sums, in transformers 4.x and 5.x."""
    ours, theirs = trained[family]["reading"], readings[release][family]
    assert trained[family]["losses"][-1] < trained[family]["losses"][0]  # it trained
    version = TRANSFORMERS_4[0].removeprefix("transformers==") if release == "4" else None
    assert theirs["version"] == (version or transformers.__version__)
    architecture = FAMILIES[family][0][1]
    assert (theirs["architecture"], theirs["dtype"]) == (architecture, torch.float32)
    assert theirs["missing"] == theirs["unexpected"] == []
    assert theirs["ids"] == ours["ids"]
    config = model_config(trained[family]["dense"].args)
    assert_close_reordered(
        theirs["logits"], ours["logits"], terms=forward_terms(config, len(ours["ids"]))
    )
    assert theirs["greedy"] == ours["greedy"]


def test_config_json_says_what_the_models_compute(trained):
    """The family's keys, RoPE base where transformers 4 and 5 look, windows explicit."""
    rope = {"rope_type": "default", "rope_theta": 1e6}
    shared = dict(hidden_size=64, num_key_value_heads=2, rms_norm_eps=1e-6, dtype="float32")
    qwen = dict(
        use_sliding_window=False, sliding_window=None, max_window_layers=2, rope_theta=1e6,
        layer_types=["full_attention"] * 2, rope_parameters=rope,
    )  # fmt: skip
    expected = {
        "qwen2": dict(model_type="qwen2", head_dim=16, tie_word_embeddings=True, **qwen),
        "qwen3": dict(
            model_type="qwen3",
            head_dim=32,
            attention_bias=False,
            tie_word_embeddings=False,
            **qwen,
        ),
        "mistral": dict(
            model_type="mistral",
            head_dim=16,
            sliding_window=8,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    }
    for family, keys in expected.items():
        config = read_config(trained[family]["hf_dir"])
        keys = {**shared, **keys, "architectures": [FAMILIES[family][0][1]]}
        assert {key: config[key] for key in keys} == keys, family


def test_export_imports_back_bit_for_bit_from_any_split(trained, tmp_path):
    """convert_from_hf.py gives the trained weights back; a TP=2 save of the trained
    checkpoint (its biases and QK norms split and merged) exports the same files."""
    for family, found in trained.items():
        back = str(tmp_path / family / "back")
        convert(convert_from_hf, "--load", found["hf_dir"], "--save", back)
        loaded, dense = load_dense_checkpoint(back), found["dense"]
        assert sorted(loaded.state_dict) == sorted(dense.state_dict)
        assert all(torch.equal(loaded.state_dict[n], t) for n, t in dense.state_dict.items())
        assert fields(model_config(loaded.args)) == fields(model_config(dense.args))
        split, hf_dir = str(tmp_path / family / "tp2"), str(tmp_path / family / "hf")
        save_megatron_checkpoint(load_dense_checkpoint(found["checkpoint"]), split, 2, 1)
        convert(convert_to_hf, "--load", split, "--save", hf_dir)
        for name in ("config.json", "model.safetensors"):
            with open(os.path.join(hf_dir, name), "rb") as mine:
                with open(os.path.join(found["hf_dir"], name), "rb") as theirs:
                    assert mine.read() == theirs.read(), (family, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_printed_flags_build_the_imported_model(imported, family):
    flags = imported[family]["flags"]
    run = "--micro-batch-size 2 --train-iters 10 --lr 1e-3".split()
    args = validate_args(build_parser().parse_args(flags + run), 1)
    args = with_settled(args, padded_vocab_size=1024)
    loaded = load_dense_checkpoint(imported[family]["ours"])
    assert fields(ModelConfig.from_args(args)) == fields(model_config(loaded.args))


def test_a_window_spanning_every_position_imports_as_none():
    """Mistral's sliding_window W is (W - 1, 0) below max_position_embeddings (64), where it
    masks something; at or above it, or null, no window."""
    keys = dict(COMMON, model_type="mistral", vocab_size=300)
    windows = {63: (62, 0), 1: (0, 0), 64: None, 4096: None, None: None}
    for window, expected in windows.items():
        args = megatron_args_from_mistral({**keys, "sliding_window": window}, 1, 1, 128)
        assert args.get("window_size") == expected, window


# config.json (on a family's keys) -> what the import's one-line refusal must name
NOT_IMPORTED = {
    "qwen2 sliding window": ("qwen2", dict(use_sliding_window=True), "use_sliding_window=true"),
    "qwen2 sliding layers": (
        "qwen2",
        dict(layer_types=["full_attention", "sliding_attention"]),
        "layer_types with 'sliding_attention'",
    ),
    "qwen2 head_dim": ("qwen2", dict(head_dim=32), "head_dim=32"),
    "qwen3 attention_bias": ("qwen3", dict(attention_bias=True), "attention_bias=true"),
    "qwen3 sliding window": ("qwen3", dict(use_sliding_window=True), "use_sliding_window=true"),
    "qwen3 yarn": (
        "qwen3",
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0)),
        "rope_parameters.rope_type='yarn'",
    ),
    "mistral window 0": ("mistral", dict(sliding_window=0), "sliding_window=0"),
    "mistral window text": ("mistral", dict(sliding_window="8"), "sliding_window='8'"),
}


@pytest.mark.parametrize("case", sorted(NOT_IMPORTED))
def test_import_refuses_what_our_model_cannot_compute_in_one_line(tmp_path, capsys, case):
    family, changes, named = NOT_IMPORTED[case]
    (tmp_path / "hf").mkdir()
    config = dict(COMMON, model_type=family, vocab_size=300, **changes)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours")]
    code = convert_from_hf.main(argv)
    assert_one_line_error(code, capsys.readouterr().err, "config.json has", named)
    assert not (tmp_path / "ours").exists()


# our options (on the LLaMA-style base) -> the family that comes closest, what it must name
NOT_EXPORTED = {
    "qkv bias and qk norm": (
        dict(add_qkv_bias=True, qk_layernorm=True), "Qwen3ForCausalLM", "--add-qkv-bias; Qwen3"
    ),
    "qk norm and window": (
        dict(qk_layernorm=True, window_size=(7, 0)), "MistralForCausalLM", "--qk-layernorm; Mistral"
    ),
    "qwen2 head width": (
        dict(add_qkv_bias=True, kv_channels=32), "Qwen2ForCausalLM", "transformers 4's Qwen2"
    ),
    "qwen3 with biases": (
        dict(qk_layernorm=True, add_bias_linear=True), "Qwen3ForCausalLM", "every linear layer"
    ),
    "gpt-2 with qk norm": (
        dict(normalization="layernorm", activation="gelu_tanh", position_embedding_type=
             "learned_absolute", add_bias_linear=True, qk_layernorm=True,
             untie_embeddings_and_output_weights=False, num_key_value_heads=4),
        "GPT2LMHeadModel", "--qk-layernorm; GPT-2: none",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(NOT_EXPORTED))
def test_export_refuses_what_no_family_computes_in_one_line(case):
    """One line; the family that differs least names the difference, alone."""
    changes, family, named = NOT_EXPORTED[case]
    config = ModelConfig(**{**_config_base(), **changes})
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    assert "\n" not in str(error.value) and "no Hugging Face model computes" in str(error.value)
    differences = {**DIFFERENCES, "GPT2LMHeadModel": gpt2_differences}[family](config)
    assert len(differences) == 1 and named in differences[0]
