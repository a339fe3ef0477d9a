"""Hugging Face exports and imports across the transformers releases we declare (>=4.45).

transformers 5 moved config.json keys (the RoPE base into `rope_parameters`, `torch_dtype` to
`dtype`); a 4.x release reading a config with only the 5.x keys takes its defaults (RoPE base
10000) and loads another model without a word. Here a random LLaMA-style checkpoint
(grouped-query attention, SwiGLU, RMSNorm, untied output layer, no biases, RoPE base 500000)
and a GPT-2 one, exported with convert_to_hf.py, are read by transformers 4.46.3 (a subprocess
with `tests.conftest.ensure_transformers_4()` on its path, fetched from PyPI once into
.cache/) and by the installed 5.x: the same token ids and greedy tokens as ours, logits equal
up to the rounding of fp32 sums in another order (`forward_terms`). The same LLaMA export
less its top-level `rope_theta` must read differently in 4.x, so the check has teeth.
convert_to_hf.py run under 4.x writes the same config.json and weights; convert_from_hf.py
imports a LLaMA saved by 4.x (top-level `rope_theta`) with its logits, and refuses in one line
naming the key a RoPE our GPT cannot compute or two disagreeing bases.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.checkpointing.huggingface import hf_config_json, model_config  # noqa: E402
from megatron.checkpointing.huggingface_llama import megatron_args_from_llama  # noqa: E402
from megatron.checkpointing.shards import load_dense_checkpoint, save_megatron_checkpoint  # noqa: E402
from megatron.text_generation import generate  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import (  # noqa: E402
    MERGE_FILE,
    REPO_ROOT,
    TRANSFORMERS_4,
    VOCAB_FILE,
    run_transformers_4,
)
from tests.one_line_errors import assert_one_line_error  # noqa: E402
from tests.tolerances import assert_close_reordered, forward_terms  # noqa: E402
from tests.tools.hf_reader import read  # noqa: E402
from tests.tools.test_hf_conversion import (  # noqa: E402
    ARGS,
    LLAMA_ARGS,
    TRUE_VOCAB,
    VARIANT_ARGS,
    export,
    our_logits,
    our_model,
    random_checkpoint,
)
from tools.checkpoint import convert_from_hf  # noqa: E402

READER = os.path.join(REPO_ROOT, "tests", "tools", "hf_reader.py")
PROMPT = "def greet(name):\n    return f'Hello, {name}!'"
NEW_TOKENS = 8
EOD = 50256
VERSIONS = {"4": TRANSFORMERS_4[0].removeprefix("transformers=="), "5": transformers.__version__}
VARIANTS = ("llama", "gelu_new")
NO_TOP_LEVEL_THETA = "llama without rope_theta"
"""The LLaMA export less its top-level `rope_theta`: what the export wrote before (5.x keys)."""


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[dict, str, str]]:
    """Variant -> (what our model reads from PROMPT, its checkpoint, its Hugging Face export)."""
    root = tmp_path_factory.mktemp("hf_releases")
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    assert len(ids) + NEW_TOKENS <= ARGS["max_position_embeddings"]
    found = {}
    for variant in VARIANTS:
        ours = random_checkpoint(variant)
        checkpoint, hf_dir = str(root / variant / "checkpoint"), str(root / variant / "hf")
        save_megatron_checkpoint(ours, checkpoint, 1, 1)
        export(checkpoint, hf_dir)
        model = our_model(ours.state_dict, ours.args)
        greedy = generate(
            model, ids, NEW_TOKENS, greedy=True, eod_token_id=EOD, vocab_size=TRUE_VOCAB
        )
        logits = our_logits(ours.state_dict, ours.args, torch.tensor([ids]))[0]
        found[variant] = (dict(ids=ids, logits=logits, greedy=greedy[0]), checkpoint, hf_dir)
    hf_dir = shutil.copytree(found["llama"][2], root / "no_top_level_theta")
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_theta", None)
    (hf_dir / "config.json").write_text(json.dumps(config))
    found[NO_TOP_LEVEL_THETA] = (found["llama"][0], found["llama"][1], str(hf_dir))
    return found


@pytest.fixture(scope="module")
def readings(exports, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """Release ("4", "5") -> variant -> what `hf_reader.read` gives for the export."""
    out = str(tmp_path_factory.mktemp("read_in_4") / "read.pt")
    folders = [hf_dir for _, _, hf_dir in exports.values()]
    args = ["--text", PROMPT, "--new-tokens", str(NEW_TOKENS), *folders]
    run_transformers_4(READER, out, *args)
    in_4 = torch.load(out)
    return {
        "4": {variant: in_4[hf_dir] for variant, (_, _, hf_dir) in exports.items()},
        "5": {v: read(exports[v][2], PROMPT, NEW_TOKENS) for v in VARIANTS},
    }


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("release", ["4", "5"])
def test_export_reads_as_our_model_in_each_release(exports, readings, release, variant):
    """The same ids and greedy tokens as ours, logits up to the rounding of sums in another
    order (another implementation of the fp32 model), in transformers 4.x and 5.x."""
    ours = exports[variant][0]
    theirs = readings[release][variant]
    assert theirs["version"] == VERSIONS[release] and VERSIONS[release].startswith(release)
    expected = {"llama": "LlamaForCausalLM", "gelu_new": "GPT2LMHeadModel"}[variant]
    assert (theirs["architecture"], theirs["dtype"]) == (expected, torch.float32)
    assert theirs["ids"] == ours["ids"]
    config = model_config({**ARGS, **VARIANT_ARGS[variant]})
    terms = forward_terms(config, len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"], terms=terms)
    assert theirs["greedy"] == ours["greedy"]


def test_transformers_4_takes_the_rope_base_from_top_level_rope_theta(exports, readings):
    """Without it, 4.x takes RoPE base 10000 instead of 500000: other logits, no error."""
    ours = exports["llama"][0]
    without = readings["4"][NO_TOP_LEVEL_THETA]
    assert without["ids"] == ours["ids"]
    assert (without["logits"] - ours["logits"]).abs().max() > 0.1


def test_export_under_transformers_4_writes_the_same_config_and_weights(exports, tmp_path):
    """convert_to_hf.py writes config.json itself: the installed release changes nothing."""
    _, checkpoint, hf_dir = exports["llama"]
    save = str(tmp_path / "hf")
    run_transformers_4("tools/checkpoint/convert_to_hf.py", "--load", checkpoint, "--save", save)
    for name in ("config.json", "model.safetensors"):
        assert filecmp.cmp(os.path.join(save, name), os.path.join(hf_dir, name), shallow=False)


def test_import_of_a_llama_saved_by_transformers_4(tmp_path):
    """Top-level `rope_theta` (no `rope_parameters`): our GPT gives the 4.x model's logits."""
    out, hf_dir, save = (str(tmp_path / name) for name in ("made.pt", "hf", "ours"))
    run_transformers_4(READER, out, "--make-llama", hf_dir)
    made = torch.load(out)[hf_dir]
    with open(os.path.join(hf_dir, "config.json")) as handle:
        config = json.load(handle)
    assert made["version"] == VERSIONS["4"] and config["rope_theta"] == 500000.0
    assert "rope_parameters" not in config and config["rope_scaling"] is None
    assert convert_from_hf.main(["--load", hf_dir, "--save", save]) == 0
    loaded = load_dense_checkpoint(save)
    assert loaded.args["rope_theta"] == 500000.0 and loaded.args["num_key_value_heads"] == 2
    ids = torch.tensor([made["ids"]])
    logits = our_logits(loaded.state_dict, loaded.args, ids)[0]
    terms = forward_terms(model_config(loaded.args), ids.numel())  # ours vs transformers 4.x
    assert_close_reordered(logits, made["logits"], terms=terms)


def test_config_json_carries_the_keys_of_both_releases():
    """RoPE base at top level (4.x) and in `rope_parameters` (5.x); dtype as both names."""
    config = model_config(dict(ARGS, **LLAMA_ARGS))
    written = hf_config_json(config, TRUE_VOCAB, 1, 2, torch.bfloat16)
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == 500000.0
    assert written["rope_parameters"]["rope_type"] == "default" and "rope_scaling" not in written
    assert written["torch_dtype"] == written["dtype"] == "bfloat16"
    assert (written["head_dim"], written["rms_norm_eps"]) == (8, 1e-5)
    assert not (written["tie_word_embeddings"] or written["attention_bias"] or written["mlp_bias"])
    gpt2 = hf_config_json(model_config(ARGS), TRUE_VOCAB, EOD, EOD, torch.float32)
    assert gpt2["model_type"] == "gpt2" and gpt2["torch_dtype"] == gpt2["dtype"] == "float32"


LLAMA_CONFIG = dict(
    model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
    num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32, vocab_size=300,
)  # fmt: skip
# what config.json says about RoPE -> the base our import reads from it
READ_ROPE = {
    "transformers 4": (dict(rope_theta=500000.0, rope_scaling=None), 500000.0),
    "transformers 5": (dict(rope_parameters=dict(rope_type="default", rope_theta=5e5)), 5e5),
    "both": (dict(rope_theta=5e5, rope_parameters=dict(rope_type="default", rope_theta=5e5)), 5e5),
    "4.x default scaling": (dict(rope_theta=5e5, rope_scaling=dict(type="default")), 5e5),
    "neither": ({}, 10000.0),
}


@pytest.mark.parametrize("case", sorted(READ_ROPE))
def test_import_reads_the_rope_base_as_either_release_wrote_it(case):
    rope, theta = READ_ROPE[case]
    assert megatron_args_from_llama({**LLAMA_CONFIG, **rope}, 1, 1, 128)["rope_theta"] == theta


# what config.json says about RoPE -> what the one-line refusal must name
REFUSED_ROPE = {
    "4.x linear scaling": (
        dict(rope_theta=5e5, rope_scaling=dict(type="linear", factor=2.0)),
        "rope_scaling.type='linear'",
    ),
    "4.x llama3 scaling": (
        dict(rope_theta=5e5, rope_scaling=dict(rope_type="llama3", factor=8.0)),
        "rope_scaling.rope_type='llama3'",
    ),
    "5.x yarn": (
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=5e5, factor=4.0)),
        "rope_parameters.rope_type='yarn'",
    ),
    "bases disagree": (
        dict(rope_theta=10000.0, rope_parameters=dict(rope_type="default", rope_theta=5e5)),
        "rope_theta=10000 but rope_parameters.rope_theta=500000",
    ),
    "partial rotary": (
        dict(rope_theta=5e5, partial_rotary_factor=0.5),
        "partial_rotary_factor=0.5",
    ),
    "scaling not an object": (dict(rope_scaling="linear"), "rope_scaling='linear'"),
    "base not a number": (dict(rope_theta="5e5"), "rope_theta='5e5'; not a number"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_ROPE))
def test_import_refuses_rope_our_gpt_cannot_compute_naming_the_key(tmp_path, capsys, case):
    rope, named = REFUSED_ROPE[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **rope}))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours")]
    code = convert_from_hf.main(argv)
    assert_one_line_error(code, capsys.readouterr().err, "config.json has", named)
    assert not (tmp_path / "ours").exists()
