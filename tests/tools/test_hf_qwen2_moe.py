"""Megatron-LM's MoE with Qwen2's attention and a gated shared expert <-> Hugging Face
`Qwen2MoeForCausalLM` (issue 58), and both Qwen MoE families under transformers 4.57.

Export: random models of our code (every weight random, the shared expert's gate included),
exported at the state-dict level, load with `AutoModelForCausalLM` / `AutoTokenizer` with no
missing or unexpected weight and read a prompt as ours does: the same ids and greedy tokens,
logits up to the rounding of fp32 sums in another order. Two variants: top-2 of 8 renormalized
(`norm_topk_prob`) with the first layer dense (`mlp_only_layers`), grouped-query attention;
and top-3 of 4 unnormalized (`--moe-router-pre-softmax`) in every layer, tied. Imported back:
our weights bit for bit, args building the same model. A random `Qwen2MoeForCausalLM` saved by
transformers 5 (every other layer an MoE layer by `decoder_sparse_step` 2) imports with its
logits. transformers 4.57.3 (the last 4.x) reads the exports of both Qwen MoE families (Qwen3-MoE's
from test_hf_qwen3_moe's variants) as ours, and the random Qwen2-MoE and Qwen3-MoE it saves
import with its logits. A model trained by pretrain_gpt.py (3 iterations) in either family
exports through convert_to_hf.py with our logits. What either side cannot compute is refused in
one line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.checkpointing.huggingface import hf_architecture, model_config  # noqa: E402
from megatron.checkpointing.huggingface_qwen3_moe import qwen2_moe_differences  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    load_dense_checkpoint,
)
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
from tests.tools.hf_reader import read  # noqa: E402
from tests.tools.hf_routed_moe import (  # noqa: E402
    LLAMA_STYLE,
    export_folder,
    import_folder,
    our_reading,
    random_routed_checkpoint,
    read_config,
    routed_args,
    routed_forward_terms,
    run_checkpoint_tool,
)
from tests.tools.test_hf_conversion import TRUE_VOCAB, our_logits, same_model  # noqa: E402
from tests.tools.test_hf_qwen3_moe import VARIANT_ARGS as QWEN3_VARIANTS  # noqa: E402
from tests.tools.test_hf_transformers4 import NEW_TOKENS, PROMPT  # noqa: E402
from tools.checkpoint import convert_from_hf  # noqa: E402

QWEN2_MOE, QWEN3_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
READER = "tests/tools/hf_reader.py"
QWEN2_ATTENTION = {**LLAMA_STYLE, "add_qkv_bias": True}
SHARED = dict(moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)
VARIANT_ARGS = {
    "first dense, top-2": routed_args(
        {**QWEN2_ATTENTION, "num_layers": 3},
        num_experts=8, moe_router_topk=2, moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=32,
        **SHARED,
    ),
    "all MoE, top-3 unnormalized, tied": routed_args(
        {**QWEN2_ATTENTION, "untie_embeddings_and_output_weights": False},
        num_experts=4, moe_router_topk=3, moe_ffn_hidden_size=48, moe_router_pre_softmax=True,
        **SHARED,
    ),
}  # fmt: skip
ROUTED_FIELDS = (
    "num_experts", "moe_layers", "top_k", "ffn_hidden_size", "pre_softmax",
    "shared_expert_ffn_hidden_size", "shared_expert_gate",
)  # fmt: skip


def _exported(args: dict, folder: str, architecture: str, ids: list[int]) -> tuple:
    dense = random_routed_checkpoint(args)
    assert export_folder(dense, folder) == architecture
    return dense, our_reading(dense, ids), folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple]:
    """Variant -> (our random checkpoint, what our model reads from PROMPT, its export)."""
    root = tmp_path_factory.mktemp("hf_qwen2_moe")
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    return {
        variant: _exported(args, str(root / f"variant{index}"), QWEN2_MOE, ids)
        for index, (variant, args) in enumerate(VARIANT_ARGS.items())
    }


def _assert_reads_as_ours(theirs: dict, dense, ours: dict, architecture: str) -> None:
    assert (theirs["architecture"], theirs["dtype"]) == (architecture, torch.float32)
    assert theirs["missing"] == theirs["unexpected"] == []
    assert theirs["ids"] == ours["ids"]
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"], terms=terms)
    assert theirs["greedy"] == ours["greedy"]


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_reads_as_our_model_in_transformers(exports, variant):
    dense, ours, hf_dir = exports[variant]
    _assert_reads_as_ours(read(hf_dir, PROMPT, NEW_TOKENS), dense, ours, QWEN2_MOE)


def test_config_json_says_what_the_model_computes(exports):
    config = read_config(exports["first dense, top-2"][2])
    expected = dict(
        model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=40, intermediate_size=96, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[0], num_key_value_heads=2, qkv_bias=True,
        use_sliding_window=False, tie_word_embeddings=False,
    )  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    other = read_config(exports["all MoE, top-3 unnormalized, tied"][2])
    assert (other["norm_topk_prob"], other["mlp_only_layers"]) == (False, [])


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_then_import_gives_our_model_back(exports, tmp_path, variant):
    dense, ours, hf_dir = exports[variant]
    back = import_folder(hf_dir, str(tmp_path / "back"))
    assert set(back.state_dict) == set(dense.state_dict)
    assert all(torch.equal(back.state_dict[name], t) for name, t in dense.state_dict.items())
    assert same_model(back.args, dense.args)
    moe, expected = model_config(back.args).routed_moe, model_config(dense.args).routed_moe
    assert all(getattr(moe, f) == getattr(expected, f) for f in ROUTED_FIELDS)
    logits = our_logits(back.state_dict, back.args, torch.tensor([ours["ids"]]))[0]
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(logits, ours["logits"], terms=terms)


def _assert_imports_with_its_logits(folder: str, ids, logits, tmp_path) -> dict:
    loaded = import_folder(folder, str(tmp_path / "ours"))
    assert loaded.args["moe_layer_freq"] == [0, 1, 0, 1] and loaded.args["moe_router_topk"] == 3
    ours = our_logits(loaded.state_dict, loaded.args, ids)
    terms = routed_forward_terms(model_config(loaded.args), ids.numel())
    assert_close_reordered(ours, logits, terms=terms)
    return loaded.args


def test_import_of_a_qwen2_moe_saved_by_transformers(tmp_path):
    """Every other layer an MoE layer (decoder_sparse_step 2), top-3 of 8 renormalized."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=300, max_position_embeddings=32, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(("norm" in name) + torch.randn_like(tensor) * 0.2)
    model.save_pretrained(str(tmp_path / "hf"))
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
    args = _assert_imports_with_its_logits(str(tmp_path / "hf"), tokens, expected, tmp_path)
    assert args["add_qkv_bias"] and args["moe_shared_expert_gate"]
    assert args["moe_shared_expert_intermediate_size"] == 48
    printed = convert_from_hf.model_flags(args)  # what the tool tells the user to train with
    assert "--moe-shared-expert-intermediate-size 48 " in printed
    assert "--moe-shared-expert-gate" in printed and "--add-qkv-bias" in printed


def test_transformers_4_reads_both_qwen_moe_families_and_saves_what_we_import(exports, tmp_path):
    """transformers 4.57.3: our Qwen2-MoE and Qwen3-MoE exports read as ours (its per-expert
    modules), and the random Qwen2-MoE and Qwen3-MoE it saves import with its logits."""
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    qwen3_args = QWEN3_VARIANTS["first dense, top-2"]
    ours = {
        QWEN2_MOE: exports["first dense, top-2"],
        QWEN3_MOE: _exported(qwen3_args, str(tmp_path / "qwen3"), QWEN3_MOE, ids),
    }
    out = str(tmp_path / "read.pt")
    made = {kind: str(tmp_path / f"made_{kind}") for kind in ("qwen2", "qwen3")}
    folders = [folder for _, _, folder in ours.values()]
    flags = ["--text", PROMPT, "--new-tokens", str(NEW_TOKENS), *folders]
    flags += ["--make-qwen2-moe", made["qwen2"], "--make-qwen3-moe", made["qwen3"]]
    run_transformers_4(READER, out, *flags, release=TRANSFORMERS_4_LAST)
    results = torch.load(out)
    for architecture, (dense, reading, folder) in ours.items():
        theirs = results[folder]
        assert theirs["version"] == TRANSFORMERS_4_LAST[0].removeprefix("transformers==")
        _assert_reads_as_ours(theirs, dense, reading, architecture)
    for kind, folder in made.items():
        saved = results[folder]
        ids_made = torch.tensor([saved["ids"]])
        logits = saved["logits"].unsqueeze(0)
        args = _assert_imports_with_its_logits(folder, ids_made, logits, tmp_path / kind)
        assert args["moe_shared_expert_gate"] == (kind == "qwen2")


TRAINED_FLAGS = {
    QWEN2_MOE: "--add-qkv-bias --moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate",
    QWEN3_MOE: "--qk-layernorm --moe-router-pre-softmax",
}
"""On a LLaMA-style MoE (`TRAINED_MOE`): what makes it each Qwen MoE family."""
TRAINED_MOE = (
    "--num-layers 2 --num-attention-heads 8 --num-key-value-heads 2 --ffn-hidden-size 96 "
    "--normalization rmsnorm --swiglu --disable-bias-linear --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 32 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall"
)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", [QWEN2_MOE, QWEN3_MOE])
def test_a_model_trained_here_exports_with_our_logits(stdlib_dataset, tmp_path, architecture):
    """pretrain_gpt.py (3 iterations) -> convert_to_hf.py -> transformers reads our logits."""
    trained, hf_dir = str(tmp_path / "trained"), str(tmp_path / "hf")
    flags = [*tiny_gpt_flags(stdlib_dataset), "--global-batch-size", "4"]
    flags += [*TRAINED_MOE.split(), *TRAINED_FLAGS[architecture].split()]
    run = launch(1, [*flags, "--train-iters", "3", "--save-interval", "3", "--save", trained])
    assert run.returncode == 0, run.stdout[-4000:]
    dense = load_dense_checkpoint(trained)
    tool = run_checkpoint_tool("convert_to_hf.py", "--load", trained, "--save", hf_dir)
    assert architecture in tool.stdout, tool.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tokens = torch.randint(0, TRUE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = our_logits(dense.state_dict, dense.args, tokens)
    terms = routed_forward_terms(model_config(dense.args), tokens.numel())
    assert_close_reordered(theirs, ours, terms=terms)


NOT_QWEN2_MOE = {
    "no shared expert": (
        dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False),
        "no shared expert (Qwen2-MoE: a gated one",
    ),
    "ungated": (dict(moe_shared_expert_gate=False), "an ungated shared expert"),
    "no qkv bias": (dict(add_qkv_bias=False), "no query/key/value biases"),
    "qk norm": (dict(qk_layernorm=True), "--qk-layernorm; Qwen2-MoE: none"),
    "biases": (dict(add_bias_linear=True), "linear biases (Qwen2-MoE: none"),
}


@pytest.mark.parametrize("case", sorted(NOT_QWEN2_MOE))
def test_what_qwen2_moe_cannot_compute_is_named(case):
    changes, named = NOT_QWEN2_MOE[case]
    config = model_config({**VARIANT_ARGS["first dense, top-2"], **changes})
    differences = qwen2_moe_differences(config)
    assert any(named.lower() in text.lower() for text in differences), differences
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    assert "\n" not in str(error.value)


QWEN2_MOE_CONFIG = dict(
    model_type="qwen2_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
    num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32, vocab_size=300,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)  # fmt: skip
NOT_IMPORTED = {
    "sliding window": (dict(use_sliding_window=True), [], "use_sliding_window=true"),
    "no qkv bias": (dict(qkv_bias=False), [], "qkv_bias=False"),
    "no shared expert": (
        dict(shared_expert_intermediate_size=0),
        [],
        "shared_expert_intermediate_size=0",
    ),
    "no MoE layer": (dict(mlp_only_layers=[0, 1]), [], "import it as model_type 'qwen2'"),
    "deepspeed family": ({}, ["--moe-family", "deepspeed"], "Qwen2-MoE's top-k"),
}


@pytest.mark.parametrize("case", sorted(NOT_IMPORTED))
def test_import_refuses_what_our_model_cannot_compute_in_one_line(tmp_path, capsys, case):
    changes, flags, named = NOT_IMPORTED[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**QWEN2_MOE_CONFIG, **changes}))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours"), *flags]
    assert_one_line_error(convert_from_hf.main(argv), capsys.readouterr().err, named)
    assert not (tmp_path / "ours").exists()
