"""Megatron-LM's DeepSeek-style MoE <-> Hugging Face `Glm4MoeForCausalLM` (transformers 5).

Export: random models of our code, every weight random (expert biases too), exported at the
state-dict level, load with `AutoModelForCausalLM` / `AutoTokenizer` with no missing or
unexpected weight and read a prompt as ours does: the same ids and greedy tokens, logits up
to the rounding of fp32 sums in another order (`routed_forward_terms`). Two variants: the
DeepSeek-V3 shape (3 layers, the first dense, 8 experts, top-2 of sigmoid scores plus expert
bias, normalised and scaled by 2.5, a shared expert twice an expert's width, RoPE over half
of each head, grouped-query attention, untied output layer) and a plain one (2 layers, all
MoE, 4 experts, top-1 unnormalised, no expert bias: zeros exported, whole-head RoPE, tied
output layer). Imported back: our weights bit for bit (the import adds zero expert biases
where we had none), args building the same model. A random `Glm4MoeForCausalLM` saved by
transformers 5 (top-4 within the best 2 of 4 groups, a non-zero `e_score_correction_bias`,
partial RoPE by GLM's default) imports with its logits. Whatever GLM-4-MoE or our model cannot
compute is refused in one line naming it, and so is a Qwen3-MoE's sliding window.

End to end (the real command lines): 3 `pretrain_gpt.py` iterations of the DeepSeek-V3 shape
with aux-loss-free balancing (the expert biases move), `convert_to_hf.py` exports it (our
logits in transformers), `convert_from_hf.py` imports the export, and `pretrain_gpt.py --load
... --finetune` with the flags it printed trains from the import exactly as the trained
checkpoint does with the flags it was trained with: the same first loss.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron.checkpointing.huggingface import hf_architecture, model_config  # noqa: E402
from megatron.checkpointing.huggingface_glm4_moe import (  # noqa: E402
    from_glm4_moe_state_dict,
    glm4_moe_differences,
    megatron_args_from_glm4_moe,
)
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    load_dense_checkpoint,
    save_megatron_checkpoint,
)
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import MERGE_FILE, VOCAB_FILE  # noqa: E402
from tests.one_line_errors import assert_one_line_error  # noqa: E402
from tests.pretrain_runs import launch, tiny_gpt_flags  # noqa: E402
from tests.tolerances import assert_close_reordered  # noqa: E402
from tests.tools.hf_reader import read  # noqa: E402
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
from tests.tools.test_hf_conversion import TRUE_VOCAB, our_logits, same_model  # noqa: E402
from tests.tools.test_hf_transformers4 import NEW_TOKENS, PROMPT  # noqa: E402
from tools.checkpoint import convert_from_hf  # noqa: E402

GLM = "Glm4MoeForCausalLM"
DEEPSEEK_MOE = dict(
    num_experts=8, moe_router_topk=2, moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=64, moe_router_score_function="sigmoid",
    moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
    moe_router_dtype="fp32",
)  # fmt: skip
"""`--num-experts 8 --moe-router-topk 2 --moe-layer-freq "([0]*1+[1]*2)" --moe-ffn-hidden-size
32 --moe-shared-expert-intermediate-size 64 --moe-router-score-function sigmoid
--moe-router-topk-scaling-factor 2.5 --moe-router-enable-expert-bias --moe-router-dtype fp32`."""
VARIANT_ARGS = {
    "deepseek": routed_args(
        {**LLAMA_STYLE, "num_layers": 3, "rotary_percent": 0.5}, **DEEPSEEK_MOE
    ),
    "plain": routed_args(
        {**LLAMA_STYLE, "num_attention_heads": 4, "num_key_value_heads": 4,
         "untie_embeddings_and_output_weights": False},
        num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=48, moe_router_score_function="sigmoid",
    ),
}  # fmt: skip
ROUTED_FIELDS = (
    "num_experts", "moe_layers", "top_k", "ffn_hidden_size", "shared_expert_ffn_hidden_size",
    "score_function", "topk_scaling_factor", "capacity_factor",
)  # fmt: skip
"""The `RoutedMoEConfig` fields that decide what the MoE layers compute (besides the expert
bias, on for every import, and the router's precision, fp32 for every import)."""


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple]:
    """Variant -> (our random checkpoint, what our model reads from PROMPT, its export)."""
    root = tmp_path_factory.mktemp("hf_glm4_moe")
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    found = {}
    for variant, args in VARIANT_ARGS.items():
        dense = random_routed_checkpoint(args)
        assert export_folder(dense, str(root / variant)) == GLM
        found[variant] = (dense, our_reading(dense, ids), str(root / variant))
    return found


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_reads_as_our_model_in_transformers(exports, variant):
    """Every weight found, the same ids and greedy tokens, logits up to reordered sums."""
    dense, ours, hf_dir = exports[variant]
    theirs = read(hf_dir, PROMPT, NEW_TOKENS)
    assert (theirs["architecture"], theirs["dtype"]) == (GLM, torch.float32)
    assert theirs["missing"] == theirs["unexpected"] == []
    assert theirs["ids"] == ours["ids"]
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"], terms=terms)
    assert theirs["greedy"] == ours["greedy"]


def test_config_json_says_what_the_model_computes(exports):
    """The MoE keys, RoPE base and rotated fraction where transformers 4 and 5 look."""
    config = read_config(exports["deepseek"][2])
    rope = {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5}
    expected = dict(
        architectures=[GLM], model_type="glm4_moe", num_hidden_layers=3, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1,
        topk_group=1, use_qk_norm=False, attention_bias=False, num_nextn_predict_layers=0,
        head_dim=8, num_key_value_heads=2, rope_theta=500000.0, partial_rotary_factor=0.5,
        rope_parameters=rope, tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    plain = read_config(exports["plain"][2])
    assert (plain["first_k_dense_replace"], plain["norm_topk_prob"]) == (0, False)
    assert (plain["n_shared_experts"], plain["routed_scaling_factor"]) == (1, 1.0)
    assert plain["rope_parameters"]["partial_rotary_factor"] == 1.0


def test_weights_as_transformers_4_names_them(exports):
    """Per-expert gate / up / down rows (our weight1 columns transposed), the router, its
    bias, the shared expert; transformers 4's in-memory names import as well."""
    dense, _, hf_dir = exports["deepseek"]
    written = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    ours = "language_model.encoder.layers.2.mlp."
    weight1, weight2 = (dense.state_dict[f"{ours}experts.weight{i}"] for i in (1, 2))
    hf = "model.layers.2.mlp."
    assert torch.equal(written[f"{hf}experts.5.gate_proj.weight"], weight1[5][:, :32].t())
    assert torch.equal(written[f"{hf}experts.5.up_proj.weight"], weight1[5][:, 32:].t())
    assert torch.equal(written[f"{hf}experts.5.down_proj.weight"], weight2[5].t())
    bias = dense.state_dict[f"{ours}router.expert_bias"]
    assert torch.equal(written[f"{hf}gate.e_score_correction_bias"], bias)
    shared = dense.state_dict[f"{ours}shared_experts.dense_h_to_4h.weight"]
    assert torch.equal(written[f"{hf}shared_experts.up_proj.weight"], shared[64:])
    assert "model.layers.0.mlp.gate_proj.weight" in written  # the dense first layer
    back = from_glm4_moe_state_dict(written, model_config(dense.args))
    assert all(torch.equal(back[name], tensor) for name, tensor in dense.state_dict.items())


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_then_import_gives_our_model_back(exports, tmp_path, variant):
    """Our weights bit for bit (plus zero expert biases where we had none), args building
    the same model; the same logits (bit for bit where the MoE settings are ours exactly)."""
    dense, ours, hf_dir = exports[variant]
    back = import_folder(hf_dir, str(tmp_path / "back"))
    added = sorted(set(back.state_dict) - set(dense.state_dict))
    assert all("router.expert_bias" in n or "local_tokens" in n for n in added), added
    assert all(not back.state_dict[name].any() for name in added)
    assert all(torch.equal(back.state_dict[name], t) for name, t in dense.state_dict.items())
    assert same_model(back.args, dense.args)
    moe, expected = model_config(back.args).routed_moe, model_config(dense.args).routed_moe
    assert all(getattr(moe, f) == getattr(expected, f) for f in ROUTED_FIELDS)
    assert moe.expert_bias and moe.router_dtype == "fp32"
    assert back.args["tokenizer_type"] == "GPT2BPETokenizer"
    logits = our_logits(back.state_dict, back.args, torch.tensor([ours["ids"]]))[0]
    if moe == expected:  # the same model, weights and kernels: the same arithmetic
        assert torch.equal(logits, ours["logits"])
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(logits, ours["logits"], terms=terms)


def test_import_of_a_glm4_moe_saved_by_transformers(tmp_path):
    """A random `Glm4MoeForCausalLM` (3 layers, the first dense, 8 experts, top-4 within the
    best 2 of 4 groups, a shared expert, expert biases, scaling 2.5, GLM's default RoPE over
    half of each head) saved by
    transformers 5 gives its logits in our GPT (up to reordered sums)."""
    config = transformers.Glm4MoeConfig(
        vocab_size=300, max_position_embeddings=32, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=500000.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(("norm" in name) + torch.randn_like(tensor) * 0.2)
    model.save_pretrained(str(tmp_path / "hf"))
    loaded = import_folder(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert loaded.args["rotary_percent"] == 0.5 and loaded.args["moe_layer_freq"] == [0, 1, 1]
    assert loaded.args["moe_router_topk_scaling_factor"] == 2.5
    assert (loaded.args["moe_router_num_groups"], loaded.args["moe_router_group_topk"]) == (4, 2)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
    ours = our_logits(loaded.state_dict, loaded.args, tokens)
    terms = routed_forward_terms(model_config(loaded.args), tokens.numel())
    assert_close_reordered(ours, expected, terms=terms)


def test_import_takes_glm_defaults_for_keys_config_json_leaves_out():
    """GLM-4-MoE's own defaults, as transformers takes them: half of each head rotated, the
    first layer dense, one shared expert, top-k normalised, no scaling."""
    args = megatron_args_from_glm4_moe(GLM_CONFIG, 1, 1, 128)
    assert (args["rotary_percent"], args["rope_theta"]) == (0.5, 10000.0)
    assert args["moe_layer_freq"] == [0, 1] and args["moe_shared_expert_intermediate_size"] == 32
    assert args["moe_router_topk_scaling_factor"] is None and args["layernorm_epsilon"] == 1e-5
    assert (args["num_experts"], args["moe_router_topk"], args["moe_ffn_hidden_size"]) == (
        [4],
        2,
        32,
    )
    assert args["moe_router_enable_expert_bias"] and args["moe_router_dtype"] == "fp32"


# args on top of the exportable DeepSeek-V3 shape -> what the one-line refusal must name
NOT_GLM = {
    "softmax router": (
        dict(moe_router_score_function="softmax"),
        "--moe-router-score-function softmax (GLM-4-MoE: sigmoid)",
    ),
    "no shared expert": (
        dict(moe_shared_expert_intermediate_size=None),
        "no shared expert (--moe-shared-expert-intermediate-size",
    ),
    "shared expert not a multiple": (
        dict(moe_shared_expert_intermediate_size=48),
        "--moe-shared-expert-intermediate-size 48 not a multiple of the routed experts' 32",
    ),
    "dense layer after an MoE one": (dict(moe_layer_freq=[1, 0, 1]), "dense layers after MoE"),
    "capacity": (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
    "biases": (
        dict(add_bias_linear=True),
        "linear biases (GLM-4-MoE: none on the output projection",
    ),
    "layernorm": (dict(normalization="layernorm"), "normalization 'layernorm'"),
}


@pytest.mark.parametrize("case", sorted(NOT_GLM))
def test_what_glm4_moe_cannot_compute_is_refused_in_one_line(case):
    changes, named = NOT_GLM[case]
    config = model_config({**VARIANT_ARGS["deepseek"], **changes})
    assert len(glm4_moe_differences(config)) == 1
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    message = str(error.value)
    assert "\n" not in message and "no Hugging Face model computes" in message
    assert named in message


# config.json changes, or flags -> what the import's one-line refusal must name
GLM_CONFIG = dict(
    model_type="glm4_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
    num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
    max_position_embeddings=32, vocab_size=300, n_routed_experts=4, num_experts_per_tok=2,
)  # fmt: skip
NOT_IMPORTED = {
    "qk norm": (dict(use_qk_norm=True), [], "config.json has use_qk_norm=true"),
    "q/k/v biases": (dict(attention_bias=True), [], "config.json has attention_bias=true"),
    "groups ranked by three scores": (
        dict(n_group=2, topk_group=1, num_experts_per_tok=3),
        [],
        "config.json has n_group=2, topk_group=1 with num_experts_per_tok=3: ours ranks groups",
    ),
    "unnormalised top-2": (dict(norm_topk_prob=False), [], "norm_topk_prob=False"),
    "no shared expert": (dict(n_shared_experts=0), [], "n_shared_experts=0"),
    "one rotated channel": (
        dict(partial_rotary_factor=0.125),
        [],
        "partial_rotary_factor=0.125 of head_dim 8: 1 rotated",
    ),
    "rotary fractions disagree": (
        dict(partial_rotary_factor=0.5, rope_parameters=dict(partial_rotary_factor=1.0)),
        [],
        "partial_rotary_factor=0.5 but rope_parameters.partial_rotary_factor=1",
    ),
    "deepspeed family": ({}, ["--moe-family", "deepspeed"], "--moe-family deepspeed"),
    "tensor parallel": ({}, ["--target-tensor-parallel-size", "2"], "--target-tensor-parallel"),
    "qwen3_moe with a sliding window": (
        dict(model_type="qwen3_moe", use_sliding_window=True),
        [],
        "use_sliding_window=true",
    ),
    "deepseek_v3 without its attention keys": (
        dict(model_type="deepseek_v3", num_key_value_heads=8),
        [],
        "config.json has no 'kv_lora_rank'",
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_IMPORTED))
def test_import_refuses_what_our_model_cannot_compute_in_one_line(tmp_path, capsys, case):
    changes, flags, named = NOT_IMPORTED[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**GLM_CONFIG, **changes}))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours"), *flags]
    assert_one_line_error(convert_from_hf.main(argv), capsys.readouterr().err, named)
    assert not (tmp_path / "ours").exists()


MODEL_FLAGS = (
    "--num-layers 3 --num-attention-heads 8 --num-key-value-heads 2 --ffn-hidden-size 96 "
    "--normalization rmsnorm --swiglu --untie-embeddings-and-output-weights "
    "--disable-bias-linear --use-rotary-position-embeddings --no-position-embedding "
    "--rotary-percent 0.5 --num-experts 8 --moe-router-topk 2 --moe-layer-freq ([0]*1+[1]*2) "
    "--moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 64 "
    "--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5 "
    "--moe-router-enable-expert-bias --moe-router-dtype fp32"
).split()
"""The DeepSeek-V3 shape as pretrain_gpt.py flags (on tiny_gpt_flags' hidden 64, 64 tokens)."""


@pytest.mark.slow
def test_trained_model_through_both_command_lines(stdlib_dataset, tmp_path):
    """pretrain_gpt.py -> convert_to_hf.py -> transformers reads our logits ->
    convert_from_hf.py -> pretrain_gpt.py --finetune with the printed flags: the same first
    loss as a finetune from the trained checkpoint itself."""
    names = ("trained", "hf", "back", "reference")
    trained, hf_dir, back, reference = (str(tmp_path / name) for name in names)
    data = [*tiny_gpt_flags(stdlib_dataset), "--global-batch-size", "4"]
    training = ["--train-iters", "3", "--save-interval", "3", "--save", trained]
    # A fast bias update, so that aux-loss-free balancing visibly moves the expert biases.
    run = launch(1, [*data, *MODEL_FLAGS, "--moe-router-bias-update-rate", "0.01", *training])
    assert run.returncode == 0, run.stdout[-4000:]
    dense = load_dense_checkpoint(trained)
    bias = dense.state_dict["language_model.encoder.layers.1.mlp.router.expert_bias"]
    assert dense.iteration == 3 and bias.abs().max() > 0  # aux-loss-free balancing moved it
    assert (
        GLM in run_checkpoint_tool("convert_to_hf.py", "--load", trained, "--save", hf_dir).stdout
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tokens = torch.randint(0, TRUE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = our_logits(dense.state_dict, dense.args, tokens)
    terms = routed_forward_terms(model_config(dense.args), tokens.numel())
    assert_close_reordered(theirs, ours, terms=terms)
    flags = printed_flags(
        run_checkpoint_tool("convert_from_hf.py", "--load", hf_dir, "--save", back).stdout
    )
    assert "--moe-layer-freq" in flags and "([0]*1+[1]*2)" in flags
    imported = load_dense_checkpoint(back)
    assert all(torch.equal(imported.state_dict[n], t) for n, t in dense.state_dict.items()
               if "local_tokens" not in n)  # fmt: skip
    # The printed flags build the trained model: from the import they train as the trained
    # checkpoint does with the flags it was trained with, once its vocabulary padding rows
    # (random, in the loss's softmax; not exported) are zeros as the import's.
    dense.vocab_padding = dense.output_layer_padding = None
    save_megatron_checkpoint(dense, reference, 1, 1)
    assert first_losses(flags, data, [back]) == first_losses(MODEL_FLAGS, data, [reference])
