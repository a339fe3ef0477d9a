"""Multi-latent attention models <-> Hugging Face `DeepseekV3ForCausalLM` and
`DeepseekV2ForCausalLM` (transformers 5; issue 57).

Export: random models of our code, every weight random (expert biases too), load with
`AutoModelForCausalLM` / `AutoTokenizer` with no missing weight and read a prompt as ours does:
the same ids and greedy tokens, logits up to the rounding of fp32 sums in another order. Two
shapes: DeepSeek-V3's (3 layers, the first dense; MLA with a query latent, YaRN at factor 4;
8 experts in 4 groups, top-4 within the best 2 groups by sigmoid score plus expert bias,
normalized, scaled by 2.5; a shared expert twice an expert's width; one multi-token prediction
module, which transformers' causal LM leaves unread: its weights, and only they, are
"unexpected") and DeepSeek-V2-Lite's (2 layers, the first dense; no query latent, plain
rotary; softmax over all 8 experts, greedy top-2 unnormalized; tied output layer). Imported
back: our weights bit for bit, MTP module included, and args building the same model.

The MTP module's logged 'mtp_1 loss' is the cross-entropy of the token two places ahead
computed by hand from the exported weights with transformers' own DeepSeek-V3 decoder layer
and norms (DeepSeek's layer-L layout: `enorm`, `hnorm`, `eh_proj`, `shared_head`).

Import: random `DeepseekV3ForCausalLM` (DeepSeek-V3's rope_scaling: YaRN factor 40, mscale 1,
mscale_all_dim 1; group-limited routing; non-zero `e_score_correction_bias`) and
`DeepseekV2ForCausalLM` (V2-Lite's shape) saved by transformers give its logits in our GPT;
whatever differs is refused in one line naming the config.json key or flag.

transformers 4.57.3 (the last 4.x) reads both exports alike and saves a DeepSeek-V3 that
imports with its logits.

End to end (the real command lines, slow): 3 `pretrain_gpt.py` iterations of each shape,
`convert_to_hf.py` (our logits in transformers), `convert_from_hf.py` back, and `pretrain_gpt.py
--finetune` with the printed flags gives the same first loss, MTP loss included.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
deepseek_v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

from megatron.checkpointing.huggingface import hf_architecture, model_config  # noqa: E402
from megatron.checkpointing.huggingface_deepseek import deepseek_differences  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    load_dense_checkpoint,
    save_megatron_checkpoint,
)
from megatron.model import GPTModel  # noqa: E402
from megatron.model.moe_aux_loss import moe_losses_of  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import (  # noqa: E402
    MERGE_FILE,
    TRANSFORMERS_4_LAST,
    VOCAB_FILE,
    run_transformers_4,
)
from tests.one_line_errors import assert_one_line_error  # noqa: E402
from tests.pretrain_runs import iteration_logs, launch, tiny_gpt_flags  # noqa: E402
from tests.tolerances import assert_close_reordered  # noqa: E402
from tests.tools.hf_reader import read  # noqa: E402
from tests.tools.hf_routed_moe import (  # noqa: E402
    LLAMA_STYLE,
    export_folder,
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
from tests.tools.test_hf_transformers4 import NEW_TOKENS, PROMPT, READER  # noqa: E402
from tools.checkpoint import convert_from_hf  # noqa: E402

MLA = dict(
    multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16,
    qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, rope_type="yarn",
    rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0, num_key_value_heads=8,
)  # fmt: skip
"""`--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 24 --qk-head-dim 16
--qk-pos-emb-head-dim 8 --v-head-dim 12 --qk-layernorm --rotary-scaling-factor 4 --mscale 1
--mscale-all-dim 1` on LLAMA_STYLE's hidden 64, 8 heads."""
VARIANT_ARGS = {
    "v3": routed_args(
        {**LLAMA_STYLE, **MLA, "num_layers": 3, "mtp_num_layers": 1,
         "mtp_loss_scaling_factor": 0.1},
        num_experts=8, moe_router_topk=4, moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64, moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32", moe_router_num_groups=4, moe_router_group_topk=2,
    ),
    "v2_lite": routed_args(
        {**LLAMA_STYLE, **MLA, "q_lora_rank": None, "rope_type": "rope",
         "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0,
         "untie_embeddings_and_output_weights": False},
        num_experts=8, moe_router_topk=2, moe_layer_freq=[0, 1], moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64, moe_router_score_function="softmax",
        moe_router_pre_softmax=True, moe_router_dtype="fp32",
    ),
}  # fmt: skip
ARCHITECTURES = {"v3": "DeepseekV3ForCausalLM", "v2_lite": "DeepseekV2ForCausalLM"}
MTP_OWN = ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head.head", "shared_head.norm")
"""DeepSeek's names of an MTP module's own weights beside its decoder layer's."""


def terms_of(args: dict, tokens: int) -> int:
    """Sums another implementation adds in another order: `routed_forward_terms` plus MLA's
    latent projections (the hidden, then the latent widths)."""
    config = model_config(args)
    mla = config.mla
    extra = config.num_layers * (config.hidden_size + (mla.q_lora_rank or 0) + mla.kv_lora_rank)
    return routed_forward_terms(config, tokens) + extra


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple]:
    """Variant -> (our random checkpoint, what our model reads from PROMPT, its export)."""
    root = tmp_path_factory.mktemp("hf_deepseek")
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    found = {}
    for variant, args in VARIANT_ARGS.items():
        dense = random_routed_checkpoint(args)
        assert export_folder(dense, str(root / variant)) == ARCHITECTURES[variant]
        found[variant] = (dense, our_reading(dense, ids), str(root / variant))
    return found


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_reads_as_our_model_in_transformers(exports, variant):
    """Every weight found (the MTP module's alone unread), the same ids and greedy tokens,
    logits up to reordered sums."""
    dense, ours, hf_dir = exports[variant]
    theirs = read(hf_dir, PROMPT, NEW_TOKENS)
    assert (theirs["architecture"], theirs["dtype"]) == (ARCHITECTURES[variant], torch.float32)
    assert theirs["missing"] == []
    assert all(name.startswith("model.layers.3.") for name in theirs["unexpected"])
    assert bool(theirs["unexpected"]) == (variant == "v3")
    assert theirs["ids"] == ours["ids"]
    terms = terms_of(dense.args, len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"], terms=terms)
    assert theirs["greedy"] == ours["greedy"]


def test_config_json_says_what_the_model_computes(exports):
    """MLA's shapes, YaRN, the router and MTP where transformers 4 and 5 look."""
    config = read_config(exports["v3"][2])
    yarn = dict(
        rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0,
        beta_slow=1.0, original_max_position_embeddings=4096, truncate=True,
    )  # fmt: skip
    expected = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=32,
        kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        num_key_value_heads=8, rope_interleave=True, rope_scaling=yarn,
        rope_parameters=dict(yarn, rope_theta=500000.0), n_routed_experts=8,
        num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, n_shared_experts=2, moe_intermediate_size=32,
        first_k_dense_replace=1, num_nextn_predict_layers=1, tie_word_embeddings=False,
    )  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    lite = read_config(exports["v2_lite"][2])
    expected = dict(
        model_type="deepseek_v2", q_lora_rank=None, topk_method="greedy", n_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, rope_scaling=None,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
    )  # fmt: skip
    assert {key: lite[key] for key in expected} == expected


def test_mtp_module_in_deepseeks_layout(exports):
    """Layer L holds the module: its own weights (the embedding and head copies included) and
    its decoder layer's, MoE like the last layer."""
    dense, _, hf_dir = exports["v3"]
    written = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    own = {name.removeprefix("model.layers.3.").removesuffix(".weight")
           for name in written if name.startswith("model.layers.3.")}  # fmt: skip
    assert set(MTP_OWN) <= own and "mlp.experts.7.down_proj" in own and "mlp.gate" in own
    state = dense.state_dict
    assert torch.equal(
        written["model.layers.3.eh_proj.weight"], state["mtp.layers.0.eh_proj.weight"]
    )
    assert torch.equal(
        written["model.layers.3.shared_head.norm.weight"],
        state["mtp.layers.0.final_layernorm.weight"],
    )
    assert torch.equal(
        written["model.layers.3.embed_tokens.weight"], written["model.embed_tokens.weight"]
    )
    assert torch.equal(written["model.layers.3.shared_head.head.weight"], written["lm_head.weight"])


def test_logged_mtp_loss_is_the_exported_modules_cross_entropy(exports):
    """Our 'mtp_1 loss' = the mean cross-entropy of the token two places ahead through layer
    L's module, computed from the export with transformers' DeepSeek-V3 layer and norms."""
    dense, _, hf_dir = exports["v3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    written = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    module = {name.removeprefix("model.layers.3."): tensor for name, tensor in written.items()
              if name.startswith("model.layers.3.")}  # fmt: skip
    layer = deepseek_v3.DeepseekV3DecoderLayer(hf.config, 3).eval()
    layer_weights = {k: v for k, v in module.items() if not k.startswith(MTP_OWN)}
    hf_layer_state = hf.model.layers[2].state_dict()  # the fused expert form transformers 5 holds
    stacked = {k: v for k, v in layer_weights.items() if ".experts." not in k}
    for kind, rows in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        stacked[f"mlp.experts.{kind}"] = torch.stack(
            [torch.cat([module[f"mlp.experts.{e}.{row}.weight"] for row in rows]) for e in range(8)]
        )
    assert set(stacked) == set(hf_layer_state)
    layer.load_state_dict(stacked)

    def norm(name: str) -> torch.nn.Module:
        rms = deepseek_v3.DeepseekV3RMSNorm(64, eps=hf.config.rms_norm_eps)
        rms.weight.data.copy_(module[f"{name}.weight"])
        return rms

    text = torch.randint(0, TRUE_VOCAB, (1, 25), generator=torch.Generator().manual_seed(3))
    tokens, labels = text[:, :24], text[:, 1:]
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state  # after the final norm, as megatron-core
        ahead = torch.roll(tokens, -1, dims=1)
        joined = torch.cat([norm("enorm")(hf.model.embed_tokens(ahead)), norm("hnorm")(hidden)], -1)
        x = F.linear(joined, module["eh_proj.weight"])
        positions = torch.arange(24)[None]
        rotary = hf.model.rotary_emb(x, positions)
        mask = torch.full((24, 24), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        logits = F.linear(norm("shared_head.norm")(x), module["shared_head.head.weight"])
        # Position i predicts text[i + 2]; the last input position has none.
        expected = F.cross_entropy(logits[0, :23], text[0, 2:])

        # The checkpoint's own rows (no vocabulary padding in the loss's softmax).
        # Training mode (the loss is logged while training), without dropout.
        config = dataclasses.replace(
            model_config(dense.args), vocab_size=TRUE_VOCAB, hidden_dropout=0.0,
            attention_dropout=0.0,
        )  # fmt: skip
        model = GPTModel(config).train()
        model.load_state_dict(dense.state_dict)
        tracker = moe_losses_of(model)
        tracker.start()
        model(tokens, labels=labels, loss_mask=torch.ones_like(labels))
        logged = tracker.pop()["mtp_1 loss"]
    terms = terms_of(dense.args, tokens.numel())
    assert_close_reordered(torch.as_tensor(logged), expected, terms=terms)


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_export_then_import_gives_our_model_back(exports, tmp_path, variant):
    """Our weights bit for bit (MTP module included), args building the same model, the same
    logits bit for bit."""
    dense, ours, hf_dir = exports[variant]
    back = import_folder(hf_dir, str(tmp_path / "back"))
    assert set(back.state_dict) == set(dense.state_dict)
    assert all(torch.equal(back.state_dict[name], t) for name, t in dense.state_dict.items())
    assert same_model(back.args, dense.args)
    config, expected = model_config(back.args), model_config(dense.args)
    assert (config.mla, config.routed_moe, config.mtp) == (
        expected.mla,
        expected.routed_moe,
        expected.mtp,
    )
    logits = our_logits(back.state_dict, back.args, torch.tensor([ours["ids"]]))[0]
    assert torch.equal(logits, ours["logits"])


def _randomize(model: torch.nn.Module) -> None:
    """Every weight and buffer random (norms around 1)."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(("norm" in name) + torch.randn_like(tensor) * 0.2)


SAVED_BY_TRANSFORMERS = {
    "v3": lambda: transformers.DeepseekV3Config(
        vocab_size=300, max_position_embeddings=64, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, tie_word_embeddings=False, num_nextn_predict_layers=1,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
        ),
    ),
    "v2_lite": lambda: transformers.DeepseekV2Config(
        vocab_size=300, max_position_embeddings=64, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, topk_method="greedy", norm_topk_prob=False, tie_word_embeddings=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(SAVED_BY_TRANSFORMERS))
def test_import_of_a_model_saved_by_transformers(tmp_path, capsys, variant):
    """Random DeepSeek-V3 (DeepSeek's YaRN settings, group-limited routing, expert biases;
    config.json announcing an MTP module its weights lack: imported without, said) and
    DeepSeek-V2-Lite-shaped models give their logits in our GPT."""
    config = SAVED_BY_TRANSFORMERS[variant]()
    model = getattr(transformers, ARCHITECTURES[variant])(config).eval()
    _randomize(model)
    model.save_pretrained(str(tmp_path / "hf"))
    loaded = import_folder(str(tmp_path / "hf"), str(tmp_path / "ours"))
    if variant == "v3":
        assert "num_nextn_predict_layers=1 but the weights hold 0" in capsys.readouterr().out
        assert loaded.args["rotary_scaling_factor"] == 40.0 and loaded.args["mscale"] == 1.0
        assert (loaded.args["moe_router_num_groups"], loaded.args["moe_router_group_topk"]) == (
            4,
            2,
        )
    assert "mtp_num_layers" not in loaded.args
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
    ours = our_logits(loaded.state_dict, loaded.args, tokens)
    assert_close_reordered(ours, expected, terms=terms_of(loaded.args, tokens.numel()))


def test_transformers_4_reads_the_exports_and_saves_what_we_import(exports, tmp_path):
    """transformers 4.57.3 (the last 4.x; 4.46 has neither DeepSeek class) reads both exports
    as ours (its per-expert modules, `rope_scaling`), and a random DeepSeek-V3 it saves (YaRN
    as DeepSeek's config.json writes it, group-limited routing, expert biases) imports with
    its logits. Its V3 router masks the groups left out with 0 where DeepSeek's code, megatron-
    core, transformers 5 and ours mask with -inf: the same choice wherever score + expert bias
    is positive, so the V3 checkpoints here have positive biases."""
    out, made = str(tmp_path / "read.pt"), str(tmp_path / "made")
    v3, _, _ = exports["v3"]
    positive = dict(v3.state_dict)
    positive.update({n: t.abs() for n, t in v3.state_dict.items() if n.endswith("expert_bias")})
    v3 = dataclasses.replace(v3, state_dict=positive)
    assert export_folder(v3, str(tmp_path / "v3")) == ARCHITECTURES["v3"]
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    ours = {"v3": (v3, our_reading(v3, ids)), "v2_lite": exports["v2_lite"][:2]}
    folders = {"v3": str(tmp_path / "v3"), "v2_lite": exports["v2_lite"][2]}
    text = ["--text", PROMPT, "--new-tokens", str(NEW_TOKENS)]
    flags = [*text, *folders.values(), "--make-deepseek-v3", made]
    run_transformers_4(READER, out, *flags, release=TRANSFORMERS_4_LAST)
    results = torch.load(out)
    for variant, folder in folders.items():
        dense, reading = ours[variant]
        theirs = results[folder]
        assert theirs["version"] == TRANSFORMERS_4_LAST[0].removeprefix("transformers==")
        assert theirs["architecture"] == ARCHITECTURES[variant] and theirs["missing"] == []
        assert all(name.startswith("model.layers.3.") for name in theirs["unexpected"])
        assert theirs["ids"] == reading["ids"]
        terms = terms_of(dense.args, len(reading["ids"]))
        assert_close_reordered(theirs["logits"], reading["logits"], terms=terms)
        assert theirs["greedy"] == reading["greedy"], variant
    saved = results[made]
    loaded = import_folder(made, str(tmp_path / "ours"))
    assert loaded.args["rotary_scaling_factor"] == 40.0
    assert loaded.args["moe_router_group_topk"] == 2
    logits = our_logits(loaded.state_dict, loaded.args, torch.tensor([saved["ids"]]))[0]
    assert_close_reordered(logits, saved["logits"], terms=terms_of(loaded.args, len(saved["ids"])))


# args on top of the exportable V3 shape -> what the one-line refusal must name
NOT_DEEPSEEK = {
    "unnormalized latents": (dict(qk_layernorm=False), "unnormalized latents"),
    "groups ranked by one score": (
        dict(moe_router_topk=2),
        "--moe-router-topk 2 over --moe-router-group-topk 2: groups ranked by their best 1",
    ),
    "no shared expert": (dict(moe_shared_expert_intermediate_size=None), "shared expert width"),
    "dense layer after an MoE one": (dict(moe_layer_freq=[1, 0, 1]), "dense layers after MoE"),
    "biases": (dict(add_bias_linear=True), "linear biases (DeepseekV3: none"),
    "layernorm": (dict(normalization="layernorm"), "normalization 'layernorm'"),
    "rope with mscale": (
        dict(rope_type="rope"),
        "--rope-type rope with --mscale-all-dim 1 scaling the softmax",
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_DEEPSEEK))
def test_what_deepseek_cannot_compute_is_refused_in_one_line(case):
    changes, named = NOT_DEEPSEEK[case]
    config = model_config({**VARIANT_ARGS["v3"], **changes})
    assert len(deepseek_differences(config, ARCHITECTURES["v3"])) == 1
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    message = str(error.value)
    assert "\n" not in message and "no Hugging Face model computes" in message
    assert named in message


def test_v2_has_no_mtp_and_v3_no_softmax_router():
    """V2-Lite's shape with an MTP module: neither class computes it, each refusal names why."""
    config = model_config({**VARIANT_ARGS["v2_lite"], "mtp_num_layers": 1,
                           "mtp_loss_scaling_factor": 0.1})  # fmt: skip
    assert deepseek_differences(config, ARCHITECTURES["v2_lite"]) == [
        "multi-token prediction (--mtp-num-layers; DeepseekV2: none)"
    ]
    assert deepseek_differences(config, ARCHITECTURES["v3"]) == [
        "--moe-router-score-function softmax (DeepseekV3: sigmoid)"
    ]
    with pytest.raises(CheckpointConversionError, match="no Hugging Face model computes"):
        hf_architecture(config)


DEEPSEEK_CONFIG = dict(
    model_type="deepseek_v3", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
    intermediate_size=96, moe_intermediate_size=32, max_position_embeddings=64, vocab_size=300,
    n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=24,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    first_k_dense_replace=1, norm_topk_prob=True,
)  # fmt: skip
# config.json changes, or flags -> what the import's one-line refusal must name
NOT_IMPORTED = {
    "rope not interleaved": (dict(rope_interleave=False), [], "rope_interleave=false"),
    "attention biases": (dict(attention_bias=True), [], "attention_bias=true"),
    "key/value heads": (dict(num_key_value_heads=2), [], "num_key_value_heads=2 of 4 heads"),
    "groups by one score": (dict(topk_group=4), [], "n_group=4, topk_group=4"),
    "unnormalized top-4": (dict(norm_topk_prob=False), [], "norm_topk_prob=False"),
    "v2 normalized": (
        dict(model_type="deepseek_v2", n_group=1, topk_group=1),
        [],
        "norm_topk_prob=true; DeepSeek-V2's softmax router",
    ),
    "v2 noaux": (dict(model_type="deepseek_v2", topk_method="noaux_tc"), [], "noaux_tc"),
    "other yarn window": (
        dict(rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=2048)),
        [],
        "original_max_position_embeddings=2048 under YaRN",
    ),
    "linear rope": (dict(rope_scaling=dict(type="linear", factor=2.0)), [], "'linear'"),
    "tensor parallel": ({}, ["--target-tensor-parallel-size", "2"], "--target-tensor-parallel"),
    "deepspeed family": ({}, ["--moe-family", "deepspeed"], "--moe-family deepspeed"),
}


@pytest.mark.parametrize("case", sorted(NOT_IMPORTED))
def test_import_refuses_what_our_model_cannot_compute_in_one_line(tmp_path, capsys, case):
    changes, flags, named = NOT_IMPORTED[case]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**DEEPSEEK_CONFIG, **changes}))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours"), *flags]
    assert_one_line_error(convert_from_hf.main(argv), capsys.readouterr().err, named)
    assert not (tmp_path / "ours").exists()


MODEL_FLAGS = {
    "v3": (
        "--num-layers 3 --num-attention-heads 8 --ffn-hidden-size 96 --normalization rmsnorm "
        "--swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
        "--position-embedding-type rope --multi-latent-attention --q-lora-rank 32 "
        "--kv-lora-rank 24 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 12 "
        "--qk-layernorm --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 1.0 "
        "--mtp-num-layers 1 --num-experts 8 --moe-router-topk 4 --moe-layer-freq ([0]*1+[1]*2) "
        "--moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 64 "
        "--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5 "
        "--moe-router-enable-expert-bias --moe-router-dtype fp32 --moe-router-num-groups 4 "
        "--moe-router-group-topk 2 --moe-router-bias-update-rate 0.01"
    ).split(),
    "v2_lite": (
        "--num-layers 2 --num-attention-heads 8 --ffn-hidden-size 96 --normalization rmsnorm "
        "--swiglu --disable-bias-linear --position-embedding-type rope "
        "--multi-latent-attention --kv-lora-rank 24 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
        "--v-head-dim 12 --qk-layernorm --rope-type rope --num-experts 8 --moe-router-topk 2 "
        "--moe-layer-freq ([0]*1+[1]*1) --moe-ffn-hidden-size 32 "
        "--moe-shared-expert-intermediate-size 64 --moe-router-pre-softmax "
        "--moe-router-dtype fp32 --moe-aux-loss-coeff 0.01"
    ).split(),
}
"""The V3 and V2-Lite shapes as pretrain_gpt.py flags (on tiny_gpt_flags' hidden 64, 64
tokens); V3's expert biases move fast enough to be seen."""


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(MODEL_FLAGS))
def test_trained_model_through_both_command_lines(stdlib_dataset, tmp_path, variant):
    """pretrain_gpt.py -> convert_to_hf.py -> transformers reads our logits ->
    convert_from_hf.py -> pretrain_gpt.py --finetune with the printed flags: the same first
    losses (lm, and V3's MTP) as a finetune from the trained checkpoint itself."""
    names = ("trained", "hf", "back", "reference")
    trained, hf_dir, back, reference = (str(tmp_path / name) for name in names)
    data = [*tiny_gpt_flags(stdlib_dataset), "--global-batch-size", "4"]
    training = ["--train-iters", "3", "--save-interval", "3", "--save", trained]
    model_flags = MODEL_FLAGS[variant]
    run = launch(1, [*data, *model_flags, *training])
    assert run.returncode == 0, run.stdout[-4000:]
    dense = load_dense_checkpoint(trained)
    assert dense.iteration == 3
    tool = run_checkpoint_tool("convert_to_hf.py", "--load", trained, "--save", hf_dir)
    assert ARCHITECTURES[variant] in tool.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tokens = torch.randint(0, TRUE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = our_logits(dense.state_dict, dense.args, tokens)
    assert_close_reordered(theirs, ours, terms=terms_of(dense.args, tokens.numel()))
    flags = printed_flags(
        run_checkpoint_tool("convert_from_hf.py", "--load", hf_dir, "--save", back).stdout
    )
    expected = ("--mtp-num-layers", "--moe-router-group-topk")
    if variant == "v2_lite":
        expected = ("--moe-router-pre-softmax",)
    assert all(flag in flags for flag in expected), flags
    imported = load_dense_checkpoint(back)
    assert all(torch.equal(imported.state_dict[n], t) for n, t in dense.state_dict.items()
               if "local_tokens" not in n)  # fmt: skip
    # The vocabulary padding rows (random, in the loss's softmax; not exported) as zeros.
    dense.vocab_padding = dense.output_layer_padding = None
    save_megatron_checkpoint(dense, reference, 1, 1)
    logged_names = ("lm loss", "mtp_1 loss") if variant == "v3" else ("lm loss",)
    firsts = []
    for load, flags_used in ((back, flags), (reference, model_flags)):
        run = launch(1, [*data, *flags_used, "--load", load, "--finetune", "--train-iters", "2"])
        assert run.returncode == 0, run.stdout[-4000:]
        logged = iteration_logs(run.stdout)[0]
        firsts.append(tuple(logged[name] for name in logged_names))
    assert firsts[0] == firsts[1]
