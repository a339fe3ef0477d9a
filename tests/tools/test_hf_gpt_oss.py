"""Megatron-LM's MoE with gpt-oss's attention sinks, sliding windows, YaRN, biases and clamped
quick-GeGLU experts <-> Hugging Face `GptOssForCausalLM`, in transformers 5 and 4.57.

Export: random models of our code (every weight, sink and bias random; the experts' first
linear three times wider than the rest, so that the clamp at 7 acts), exported at the
state-dict level, load with `AutoModelForCausalLM` / `AutoTokenizer` (eager attention, the
default of both releases) with no missing or unexpected weight and read a prompt longer than
the 8-key window as ours does: the same ids and greedy tokens, logits up to the rounding of fp32
sums in another order (`routed_forward_terms`). Two variants: YaRN (truncate false) with every
other layer windowed (`--window-attn-skip-freq 2`), top-2 of 4, untied; and plain RoPE with
windows by a pattern no N gives ([0, 1, 1]), top-1, tied. Imported back: our weights bit for
bit, args building the same model. A random `GptOssForCausalLM` saved by transformers 5 imports
with its logits over 24 ids, and prints the flags that build it. transformers 4.57.3 reads both
exports as ours, and the random gpt-oss it saves (`rope_scaling`, top-level `rope_theta`)
imports with its logits. A model trained by pretrain_gpt.py (3 iterations) exports through
convert_to_hf.py with our logits, and imports back with flags that train as it does. What
either side cannot compute is refused in one line naming it; the options only gpt-oss has are
named when another family is the closest.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.arguments import build_parser, validate_args  # noqa: E402
from megatron.checkpointing.huggingface import hf_architecture, model_config  # noqa: E402
from megatron.checkpointing.huggingface_gpt_oss import gpt_oss_differences  # noqa: E402
from megatron.checkpointing.huggingface_gpt_oss_import import (  # noqa: E402
    window_attn_skip_freq,
)
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    load_dense_checkpoint,
    save_megatron_checkpoint,
)
from megatron.config import ModelConfig  # noqa: E402
from megatron.settled_args import with_settled  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import (  # noqa: E402
    MERGE_FILE,
    TRANSFORMERS_4_LAST,
    VOCAB_FILE,
    run_transformers_4,
)
from tests.one_line_errors import assert_one_line_error  # noqa: E402
from tests.pretrain_runs import launch, tiny_gpt_flags  # noqa: E402
from tests.tolerances import assert_close_reordered  # noqa: E402
from tests.tools.hf_reader import make_gpt_oss, read  # noqa: E402
from tests.tools.hf_routed_moe import (  # noqa: E402
    LLAMA_STYLE,
    export_folder,
    first_losses,
    import_folder,
    our_reading,
    printed_flags,
    random_routed_checkpoint,
    read_config,
    routed_args,
    routed_forward_terms,
    run_checkpoint_tool,
)
from tests.tools.test_hf_conversion import (  # noqa: E402
    MODEL_FIELDS,
    TRUE_VOCAB,
    our_logits,
    same_model,
)
from tests.tools.test_hf_transformers4 import NEW_TOKENS, PROMPT  # noqa: E402
from tools.checkpoint import convert_from_hf  # noqa: E402

GPT_OSS = "GptOssForCausalLM"
READER = "tests/tools/hf_reader.py"
YARN = dict(
    position_embedding_type="yarn", use_rotary_position_embeddings=False,
    rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=256, yarn_beta_fast=8.0,
    yarn_beta_slow=1.0, yarn_correction_range_round_to_int=False, mscale=1.0, mscale_all_dim=0.0,
)  # fmt: skip
"""hf_reader's `GPT_OSS_YARN` as our args: the ramp between channels 1.4 and 3.2, unrounded."""
GPT_OSS_STYLE = dict(
    LLAMA_STYLE, num_attention_heads=4, num_key_value_heads=2, kv_channels=16, ffn_hidden_size=32,
    swiglu=False, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
    softmax_type="learnable", add_bias_linear=True, window_size=(7, 0), rope_theta=10000.0,
)  # fmt: skip
"""hidden 64, 4 heads of 16 over 2 key/value heads, sinks, biases, 8-key windows, RoPE base
10000, the clamped quick-GeGLU (the GPT-2 tokenizer of `LLAMA_STYLE`)."""
VARIANT_ARGS = {
    "yarn, every other layer windowed": routed_args(
        {**GPT_OSS_STYLE, **YARN, "num_layers": 4, "window_attn_skip_freq": 2},
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
    ),
    "rope, windows by pattern, top-1, tied": routed_args(
        {**GPT_OSS_STYLE, "num_layers": 3, "window_attn_skip_freq": [0, 1, 1],
         "untie_embeddings_and_output_weights": False},
        num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=32,
    ),
}  # fmt: skip
GPT_OSS_FIELDS = (
    "activation", "glu_linear_offset", "activation_clamp_value", "softmax_type", "yarn",
    "add_bias_linear", "position_embedding_type",
)  # fmt: skip
"""What decides gpt-oss's computation beyond `test_hf_conversion.MODEL_FIELDS` (and each
layer's window, `layer_window`)."""
ROUTED_FIELDS = ("num_experts", "moe_layers", "top_k", "ffn_hidden_size", "pre_softmax")


def random_gpt_oss(args: dict):  # noqa: ANN201 - a DenseCheckpoint
    """`random_routed_checkpoint` with the experts' first linear 3x wider: the clamp acts."""
    dense = random_routed_checkpoint(args)
    for name, tensor in dense.state_dict.items():
        if name.endswith("experts.weight1"):
            tensor.mul_(3)
    return dense


def _windows(args: dict) -> list:
    config = model_config(args)
    return [config.layer_window(number) for number in range(1, config.num_layers + 1)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple]:
    """Variant -> (our random checkpoint, what our model reads from PROMPT, its export)."""
    root = tmp_path_factory.mktemp("hf_gpt_oss")
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    assert len(ids) > 8  # longer than the window: windowed and full layers differ
    found = {}
    for index, (variant, args) in enumerate(VARIANT_ARGS.items()):
        dense = random_gpt_oss(args)
        folder = str(root / f"variant{index}")
        assert export_folder(dense, folder) == GPT_OSS
        found[variant] = (dense, our_reading(dense, ids), folder)
    return found


def _assert_reads_as_ours(theirs: dict, dense, ours: dict) -> None:
    assert (theirs["architecture"], theirs["dtype"]) == (GPT_OSS, torch.float32)
    assert theirs["missing"] == theirs["unexpected"] == []
    assert theirs["ids"] == ours["ids"]
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"], terms=terms)
    assert theirs["greedy"] == ours["greedy"]


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_reads_as_our_model_in_transformers(exports, variant):
    dense, ours, hf_dir = exports[variant]
    _assert_reads_as_ours(read(hf_dir, PROMPT, NEW_TOKENS), dense, ours)


def test_config_json_says_what_the_model_computes(exports):
    config = read_config(exports["yarn, every other layer windowed"][2])
    yarn = dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=8.0,
        beta_slow=1.0, truncate=False,
    )  # fmt: skip
    expected = dict(
        model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        head_dim=16, num_key_value_heads=2, attention_bias=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=7.0,
        swiglu_alpha=1.702, rope_theta=10000.0, rope_scaling=yarn,
        rope_parameters=dict(yarn, rope_theta=10000.0), tie_word_embeddings=False,
    )  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    other = read_config(exports["rope, windows by pattern, top-1, tied"][2])
    assert other["layer_types"] == ["full_attention"] + ["sliding_attention"] * 2
    assert other["rope_scaling"] == {"rope_type": "default"} and other["tie_word_embeddings"]


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_then_import_gives_our_model_back(exports, tmp_path, variant):
    dense, ours, hf_dir = exports[variant]
    back = import_folder(hf_dir, str(tmp_path / "back"))
    assert set(back.state_dict) == set(dense.state_dict)
    assert all(torch.equal(back.state_dict[name], t) for name, t in dense.state_dict.items())
    assert same_model(back.args, dense.args)
    config, expected = model_config(back.args), model_config(dense.args)
    assert all(getattr(config, f) == getattr(expected, f) for f in GPT_OSS_FIELDS)
    assert _windows(back.args) == _windows(dense.args)
    assert all(
        getattr(config.routed_moe, f) == getattr(expected.routed_moe, f) for f in ROUTED_FIELDS
    )
    logits = our_logits(back.state_dict, back.args, torch.tensor([ours["ids"]]))[0]
    terms = routed_forward_terms(expected, len(ours["ids"]))
    assert_close_reordered(logits, ours["logits"], terms=terms)


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_printed_flags_build_the_imported_model(exports, tmp_path, variant):
    """convert_from_hf.py's printed flags, through our parser and validation, build the model
    the import's args do (the pattern's list form quoted for the shell)."""
    back = import_folder(exports[variant][2], str(tmp_path / "back"))
    flags = shlex.split(convert_from_hf.model_flags(back.args))
    run = "--micro-batch-size 2 --train-iters 10 --lr 1e-3".split()
    args = with_settled(
        validate_args(build_parser().parse_args(flags + run), 1), padded_vocab_size=1
    )
    config, imported = ModelConfig.from_args(args), model_config(back.args)
    for field in (*MODEL_FIELDS, *GPT_OSS_FIELDS):
        assert getattr(config, field) == getattr(imported, field), field
    for field in ROUTED_FIELDS:
        assert getattr(config.routed_moe, field) == getattr(imported.routed_moe, field), field
    layers = range(1, config.num_layers + 1)
    assert [config.layer_window(n) for n in layers] == [imported.layer_window(n) for n in layers]


PRINTED = (
    "--normalization rmsnorm --quick-geglu --glu-linear-offset 1.0 "
    "--activation-func-clamp-value 7.0 --softmax-type learnable --position-embedding-type yarn "
    "--rotary-scaling-factor 4.0 --yarn-original-max-position-embeddings 256 "
    "--yarn-beta-fast 8.0 --yarn-beta-slow 1.0 --no-yarn-correction-range-round-to-int "
    "--mscale 1.0 --mscale-all-dim 0.0 --rotary-position-embeddings-theta 10000 "
    "--no-position-embedding --untie-embeddings-and-output-weights --window-size 7,0 "
    "--window-attn-skip-freq 2 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32"
)
"""What convert_from_hf.py prints for hf_reader's random gpt-oss, after its sizes."""


def _assert_imports_with_its_logits(folder: str, saved: dict, tmp_path) -> dict:
    """Import `folder` (hf_reader's `make_gpt_oss`); our logits of its ids are `saved`'s."""
    loaded = import_folder(folder, str(tmp_path / "ours"))
    ids = torch.tensor([saved["ids"]])
    ours = our_logits(loaded.state_dict, loaded.args, ids)[0]
    terms = routed_forward_terms(model_config(loaded.args), ids.numel())
    assert_close_reordered(ours, saved["logits"], terms=terms)
    return loaded.args


def test_import_of_a_gpt_oss_saved_by_transformers(tmp_path):
    """hf_reader's random gpt-oss (transformers 5's `rope_parameters`), 24 ids over 8-key
    windows on layers 1 and 3, YaRN unrounded."""
    saved = make_gpt_oss(str(tmp_path / "hf"))
    args = _assert_imports_with_its_logits(str(tmp_path / "hf"), saved, tmp_path)
    assert args["window_size"] == (7, 0) and args["window_attn_skip_freq"] == 2
    assert args["position_embedding_type"] == "yarn" and args["rotary_scaling_factor"] == 4.0
    assert model_config(args).activation == "quick_geglu"
    assert PRINTED in convert_from_hf.model_flags(args)  # what the tool tells the user


def test_transformers_4_reads_our_exports_and_saves_what_we_import(exports, tmp_path):
    """transformers 4.57.3 (its own `rope_scaling` and top-level `rope_theta`, limit and alpha
    fixed): our exports read as ours, and the random gpt-oss it saves imports with its
    logits."""
    out, made = str(tmp_path / "read.pt"), str(tmp_path / "made")
    folders = [folder for _, _, folder in exports.values()]
    flags = ["--text", PROMPT, "--new-tokens", str(NEW_TOKENS), *folders, "--make-gpt-oss", made]
    run_transformers_4(READER, out, *flags, release=TRANSFORMERS_4_LAST)
    results = torch.load(out)
    for dense, reading, folder in exports.values():
        theirs = results[folder]
        assert theirs["version"] == TRANSFORMERS_4_LAST[0].removeprefix("transformers==")
        _assert_reads_as_ours(theirs, dense, reading)
    assert "rope_scaling" in read_config(made) and "rope_parameters" not in read_config(made)
    args = _assert_imports_with_its_logits(made, results[made], tmp_path)
    assert args["window_attn_skip_freq"] == 2 and args["yarn_original_max_position_embeddings"]


def test_window_attn_skip_freq_of_layer_types():
    """N when the full layers are those N divides, None when all are windowed, else the list."""
    assert window_attn_skip_freq([True, False] * 3) == 2
    assert window_attn_skip_freq([True, True, False] * 2) == 3
    assert window_attn_skip_freq([True] * 4) is None
    assert window_attn_skip_freq([False, True, True]) == [0, 1, 1]
    assert window_attn_skip_freq([True, False, False, True]) == [1, 0, 0, 1]


TRAINED_FLAGS = (
    "--num-layers 2 --num-attention-heads 4 --num-key-value-heads 2 --kv-channels 16 "
    "--ffn-hidden-size 32 --normalization rmsnorm --quick-geglu --glu-linear-offset 1.0 "
    "--activation-func-clamp-value 7.0 --softmax-type learnable --window-size 7,0 "
    "--window-attn-skip-freq 2 --position-embedding-type yarn --rotary-scaling-factor 4.0 "
    "--yarn-original-max-position-embeddings 256 --yarn-beta-fast 8 --yarn-beta-slow 1 "
    "--no-yarn-correction-range-round-to-int --mscale 1.0 --mscale-all-dim 0.0 "
    "--rotary-position-embeddings-theta 10000 --no-position-embedding "
    "--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 32 --moe-aux-loss-coeff 0.01"
).split()
"""A gpt-oss as pretrain_gpt.py flags (on tiny_gpt_flags' hidden 64, 64 tokens)."""


@pytest.mark.slow
def test_a_model_trained_here_exports_with_our_logits(stdlib_dataset, tmp_path):
    """pretrain_gpt.py (3 iterations) -> convert_to_hf.py -> transformers reads our logits ->
    convert_from_hf.py -> pretrain_gpt.py --finetune with the printed flags: the same first
    loss as a finetune from the trained checkpoint itself."""
    names = ("trained", "hf", "back", "reference")
    trained, hf_dir, back, reference = (str(tmp_path / name) for name in names)
    data = [*tiny_gpt_flags(stdlib_dataset), "--global-batch-size", "4"]
    training = ["--train-iters", "3", "--save-interval", "3", "--save", trained]
    run = launch(1, [*data, *TRAINED_FLAGS, *training])
    assert run.returncode == 0, run.stdout[-4000:]
    dense = load_dense_checkpoint(trained)
    tool = run_checkpoint_tool("convert_to_hf.py", "--load", trained, "--save", hf_dir)
    assert GPT_OSS in tool.stdout, tool.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, local_files_only=True, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, TRUE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = our_logits(dense.state_dict, dense.args, tokens)
    terms = routed_forward_terms(model_config(dense.args), tokens.numel())
    assert_close_reordered(theirs, ours, terms=terms)
    flags = printed_flags(
        run_checkpoint_tool("convert_from_hf.py", "--load", hf_dir, "--save", back).stdout
    )
    assert "--softmax-type" in flags and "--no-yarn-correction-range-round-to-int" in flags
    imported = load_dense_checkpoint(back)
    assert all(torch.equal(imported.state_dict[n], t) for n, t in dense.state_dict.items())
    # The printed flags build the trained model: from the import they train as the trained
    # checkpoint does with the flags it was trained with, once its vocabulary padding rows
    # (random, in the loss's softmax; not exported) are zeros as the import's.
    dense.vocab_padding = dense.output_layer_padding = None
    save_megatron_checkpoint(dense, reference, 1, 1)
    assert first_losses(flags, data, [back]) == first_losses(TRAINED_FLAGS, data, [reference])


YARN_VARIANT = "yarn, every other layer windowed"
NOT_GPT_OSS = {
    "no sinks": (dict(softmax_type="vanilla"), "--softmax-type vanilla"),
    "swiglu": (dict(quick_geglu=False, swiglu=True), "activation 'swiglu'"),
    "no offset": (dict(glu_linear_offset=0.0), "--glu-linear-offset 0"),
    "clamp 5": (dict(activation_func_clamp_value=5.0), "--activation-func-clamp-value 5.0"),
    "no biases": (dict(add_bias_linear=False), "no linear biases"),
    "pre-softmax": (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
    "mscale": (dict(mscale=0.5), "--mscale 0.5 --mscale-all-dim 0: cos and sin"),
    "a dense layer": (dict(moe_layer_freq=[0, 1, 1, 1]), "dense layers (--moe-layer-freq"),
    "window after": (dict(window_size=(7, 2)), "keys after the query"),
    "qk norm": (dict(qk_layernorm=True), "--qk-layernorm"),
}


@pytest.mark.parametrize("case", sorted(NOT_GPT_OSS))
def test_what_gpt_oss_cannot_compute_is_named(case):
    changes, named = NOT_GPT_OSS[case]
    config = model_config({**VARIANT_ARGS[YARN_VARIANT], **changes})
    differences = gpt_oss_differences(config)
    assert any(named in text for text in differences), differences
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    assert "\n" not in str(error.value)


OTHERS_LACK = {
    "LLaMA with sinks": (dict(softmax_type="learnable"), "--softmax-type learnable"),
    "LLaMA with an offset": (dict(glu_linear_offset=1.0), "--glu-linear-offset 1"),
    "LLaMA with a clamp": (dict(activation_func_clamp_value=7.0), "--activation-func-clamp"),
    "Mistral windowing some layers": (
        dict(window_size=(7, 0), window_attn_skip_freq=2),
        "--window-attn-skip-freq",
    ),
}


@pytest.mark.parametrize("case", sorted(OTHERS_LACK))
def test_gpt_oss_options_are_named_for_other_families(case):
    """A LLaMA-style model with one of gpt-oss's options: no other family computes it."""
    changes, named = OTHERS_LACK[case]
    with pytest.raises(CheckpointConversionError, match=named) as error:
        hf_architecture(model_config({**LLAMA_STYLE, **changes}))
    assert "\n" not in str(error.value)


GPT_OSS_CONFIG = dict(
    model_type="gpt_oss", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=32, max_position_embeddings=64,
    vocab_size=300, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
)  # fmt: skip
NOT_IMPORTED = {
    "another alpha": (dict(swiglu_alpha=1.5), [], "swiglu_alpha=1.5"),
    "attention factor": (
        dict(rope_parameters=dict(rope_type="yarn", factor=4.0, attention_factor=2.0)),
        [],
        "rope_parameters.attention_factor scale cos and sin by 2",
    ),
    "mscale pair": (
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0)),
        [],
        "rope_scaling.mscale and mscale_all_dim",
    ),
    "linear rope": (
        dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
        [],
        "rope_scaling.rope_type='linear'",
    ),
    "bases disagree": (
        dict(rope_theta=10000.0, rope_scaling=dict(rope_type="default", rope_theta=20000.0)),
        [],
        "rope_theta=10000 but rope_scaling.rope_theta=20000",
    ),
    "null rope_scaling": (dict(rope_scaling=None), [], "rope_scaling=null"),
    "partial rope": (dict(partial_rotary_factor=0.5), [], "partial_rotary_factor=0.5"),
    "no attention bias": (dict(attention_bias=False), [], "attention_bias=False"),
    "no window": (dict(sliding_window=None), [], "sliding_window=None"),
    "chunked layers": (
        dict(layer_types=["chunked_attention", "full_attention"]),
        [],
        "layer_types=['chunked_attention'",
    ),
    "deepspeed family": ({}, ["--moe-family", "deepspeed"], "--moe-family deepspeed"),
    "tensor parallel": ({}, ["--target-tensor-parallel-size", "2"], "--target-tensor-parallel"),
}


@pytest.mark.parametrize("case", sorted(NOT_IMPORTED))
def test_import_refuses_what_our_model_cannot_compute_in_one_line(tmp_path, capsys, case):
    changes, flags, named = NOT_IMPORTED[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**GPT_OSS_CONFIG, **changes}))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours"), *flags]
    assert_one_line_error(convert_from_hf.main(argv), capsys.readouterr().err, named)
    assert not (tmp_path / "ours").exists()
