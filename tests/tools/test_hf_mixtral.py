"""Mixture-of-Experts checkpoints <-> Hugging Face `MixtralForCausalLM`, in transformers 4 and 5.

A random LLaMA-style MoE GPT (2 layers, hidden 64, 4 SwiGLU experts in every layer, top-2,
RoPE base 500000; grouped-query attention with an untied output layer, and plain attention with
a tied one), every weight random and each expert its own, is built with our model code in a
one-process gloo world (DeepSpeed's expert groups made as its engine makes them) and run in
evaluation without token dropping or second-expert sampling. Exported at the state-dict level
(the dense state dict `load_dense_checkpoint` gives, experts numbered globally), it loads in the
installed transformers 5 and in 4.46.3 (a subprocess, `tests.conftest.run_transformers_4`) as
`MixtralForCausalLM` with no missing or unexpected weight, the same token ids and greedy tokens
as ours, logits equal up to the rounding of fp32 sums in another order (`forward_terms`);
imported back it gives our weights bit for bit, our model's args and (the same model, the same
kernels) our logits bit for bit. A random Mixtral saved by transformers 5 imports with its
logits. DeepSpeed's top-2 gate and Mixtral's router pick the same experts in the same order
with the same weights; on exact ties both weigh the tied experts alike (DeepSpeed takes the
lowest-numbered). What Mixtral cannot compute is refused in one line naming it.

End to end: 3 `pretrain_gpt.py` iterations at EP=2 with DeepSpeed's defaults (token dropping,
second-expert sampling), read back from DeepSpeed's per-expert files by `load_dense_checkpoint`:
convert_to_hf.py refuses the checkpoint in one line naming `--disable-moe-token-dropping` and
`--disable-moe-top2-2nd-expert-sampling`, exports it with them (read like the random ones: as
our model with those flags), and convert_from_hf.py imports the export at TP=2 with its weights.
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
from megatron.checkpointing.huggingface_mixtral import mixtral_differences  # noqa: E402
from megatron.checkpointing.shapes import WORD_EMBEDDINGS  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    CheckpointConversionError,
    DenseCheckpoint,
    load_dense_checkpoint,
)
from megatron.core import parallel_state  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.text_generation import generate  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE, run_transformers_4  # noqa: E402
from tests.distributed import free_port  # noqa: E402
from tests.one_line_errors import assert_one_line_error  # noqa: E402
from tests.pretrain_runs import launch, shared_memory_left_by, tiny_gpt_flags  # noqa: E402
from tests.tolerances import assert_close_reordered, forward_terms  # noqa: E402
from tests.tools.hf_reader import read  # noqa: E402
from tests.tools.test_hf_conversion import ARGS, LLAMA_ARGS, TRUE_VOCAB, same_model  # noqa: E402
from tests.tools.test_hf_transformers4 import EOD, NEW_TOKENS, PROMPT, READER, VERSIONS  # noqa: E402
from tools.checkpoint import convert_from_hf, convert_to_hf  # noqa: E402
from tools.checkpoint.hf_tokenizer import tokenizer_source  # noqa: E402

MIXTRAL = "MixtralForCausalLM"
MOE_ARGS = dict(
    num_experts=[4], expert_interval=1, topk=2, moe_expert_parallel_size=1,
    moe_train_capacity_factor=1.0, moe_eval_capacity_factor=1.0, moe_min_capacity=4,
    moe_token_dropping=False, moe_top2_2nd_expert_sampling=False, moe_loss_coeff=0.01,
    mlp_type="standard", enable_expert_tensor_parallelism=False,
)  # fmt: skip
"""What a run with `--num-experts 4 --expert-interval 1 --topk 2 --disable-moe-token-dropping
--disable-moe-top2-2nd-expert-sampling --moe-loss-coeff 0.01` saves in its args."""
VARIANT_ARGS = {
    "untied": {**ARGS, **LLAMA_ARGS, **MOE_ARGS},  # grouped-query attention, untied output
    "tied": {
        **ARGS, **LLAMA_ARGS, **MOE_ARGS, "num_attention_heads": 4, "num_key_value_heads": 4,
        "untie_embeddings_and_output_weights": False,
    },
}  # fmt: skip
VARIANTS = (*VARIANT_ARGS, "trained")
DEEPSPEED_FAMILY = ["--moe-family", "deepspeed"]
"""convert_from_hf.py's choice of DeepSpeed-MoE for a Mixtral (Megatron-LM's MoE by default)."""
DISABLE_FLAGS = ["--disable-moe-token-dropping", "--disable-moe-top2-2nd-expert-sampling"]
TRAINED_FLAGS = (
    "--num-attention-heads 8 --num-key-value-heads 2 --ffn-hidden-size 96 --normalization "
    "rmsnorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
    "--use-rotary-position-embeddings --no-position-embedding "
    "--rotary-position-embeddings-theta 500000 --num-experts 4 --expert-interval 1 --topk 2 "
    "--moe-expert-parallel-size 2 --moe-loss-coeff 0.01 --train-iters 3 --global-batch-size 4 "
    f"--save-interval 3 --deepspeed --deepspeed_config {REPO_ROOT}/examples/ds_configs/"
    "ds_zero2.json --no-pipeline-parallel"
).split()
MOE_FIELDS = ("experts_per_layer", "top_k", "drop_tokens", "top2_2nd_expert_sampling", "residual")


@pytest.fixture(scope="module")
def moe_world():
    """A one-process gloo world with `groups.mpu` set, as DeepSpeed's engine sets it for MoE
    layers; torn down (DeepSpeed's cached expert groups too) after this module."""
    import deepspeed
    from deepspeed.utils import groups

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    env["LOCAL_RANK"] = "0"
    saved = {name: os.environ.get(name) for name in env}
    assert not torch.distributed.is_initialized()
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="gloo")
    groups.mpu = parallel_state.mpu
    try:
        yield
    finally:
        deepspeed.comm.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def our_moe_model(state: dict[str, torch.Tensor], args: dict) -> GPTModel:
    """Our TP=1, EP=1 GPTModel holding `state` (full logits, eval mode), each MoE layer's
    expert group set up (`set_deepspeed_parallelism`, what DeepSpeed's engine calls)."""
    from deepspeed.moe.layer import MoE

    config = model_config(args)
    config = dataclasses.replace(
        config,
        vocab_size=state[WORD_EMBEDDINGS].size(0),
        parallel_output=False,
        moe=dataclasses.replace(config.moe, expert_parallel_size=1),
    )
    model = GPTModel(config)
    model.load_state_dict(state)
    for module in model.modules():
        if isinstance(module, MoE):
            module.set_deepspeed_parallelism()
    return model.eval()


def random_moe_checkpoint(args: dict) -> DenseCheckpoint:
    """A dense (TP=1, global expert numbers) MoE checkpoint, every weight random (norms around
    1): DeepSpeed starts every expert as a copy of one, which would hide an expert mix-up."""
    torch.manual_seed(1)
    config = dataclasses.replace(model_config(args), vocab_size=TRUE_VOCAB)
    state = {}
    for name, tensor in GPTModel(config).state_dict().items():
        noise = torch.randn_like(tensor) * 0.2
        state[name] = 1 + noise if "layernorm.weight" in name else noise
    return DenseCheckpoint(state, dict(args), 7, TRUE_VOCAB)


def export_folder(dense: DenseCheckpoint, folder: str) -> str:
    """convert_to_hf.py's writing of `dense` (the GPT-2 tokenizer of its args) into `folder`."""
    os.makedirs(folder)
    cli = convert_to_hf.get_args(["--load", "unused", "--save", folder])
    return convert_to_hf.write_folder(folder, dense, tokenizer_source(cli, dense.args))


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory, stdlib_dataset) -> str:
    """3 `pretrain_gpt.py` iterations of the untied variant with DeepSpeed's defaults (token
    dropping, second-expert sampling) at DP=2, EP=2 (each rank holds 2 of a layer's 4 experts),
    ZeRO-2, on 2 CPU ranks under the deepspeed launcher; its checkpoint directory."""
    save = str(tmp_path_factory.mktemp("trained_moe") / "checkpoint")
    flags = [*tiny_gpt_flags(stdlib_dataset), *TRAINED_FLAGS, "--save", save]
    run = launch(2, flags, launcher="deepspeed")
    assert run.returncode == 0, run.stdout[-5000:]
    assert shared_memory_left_by(run) == []
    # Nor did a rank JIT-load DeepSpeed's CPU inference all-reduce op (it prints this line).
    assert "deepspeed_shm_comm_op built successfully" not in run.stdout
    return save


def our_reading(dense: DenseCheckpoint, ids: list[int]) -> dict:
    """What our model of `dense` reads from `ids`: logits [s, v] and greedy tokens."""
    model = our_moe_model(dense.state_dict, dense.args)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    greedy = generate(model, ids, NEW_TOKENS, greedy=True, eod_token_id=EOD, vocab_size=TRUE_VOCAB)
    return dict(ids=ids, logits=logits, greedy=greedy[0])


@pytest.fixture(scope="module")
def exports(moe_world, trained_moe, tmp_path_factory) -> dict[str, tuple]:
    """Variant -> (our checkpoint, what our model reads from PROMPT, its Mixtral export): the
    random ones written at the state-dict level, the trained one by convert_to_hf.py with the
    `--disable-moe-*` flags (its args changed alike: what the export computes)."""
    root = tmp_path_factory.mktemp("hf_mixtral")
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    found = {}
    for variant, args in VARIANT_ARGS.items():
        dense = random_moe_checkpoint(args)
        assert export_folder(dense, str(root / variant)) == MIXTRAL
        found[variant] = (dense, our_reading(dense, ids), str(root / variant))
    hf_dir = str(root / "trained")
    assert convert_to_hf.main(["--load", trained_moe, "--save", hf_dir, *DISABLE_FLAGS]) == 0
    dense = load_dense_checkpoint(trained_moe)
    assert dense.args["moe_expert_parallel_size"] == 2 and dense.iteration == 3
    dense.args.update(moe_token_dropping=False, moe_top2_2nd_expert_sampling=False)
    found["trained"] = (dense, our_reading(dense, ids), hf_dir)
    return found


@pytest.fixture(scope="module")
def readings(exports, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """Release ("4", "5") -> variant -> what `hf_reader.read` gives for the export."""
    out = str(tmp_path_factory.mktemp("mixtral_in_4") / "read.pt")
    folders = [hf_dir for _, _, hf_dir in exports.values()]
    run_transformers_4(READER, out, "--text", PROMPT, "--new-tokens", str(NEW_TOKENS), *folders)
    in_4 = torch.load(out)
    return {
        "4": {variant: in_4[hf_dir] for variant, (_, _, hf_dir) in exports.items()},
        "5": {
            variant: read(hf_dir, PROMPT, NEW_TOKENS) for variant, (_, _, hf_dir) in exports.items()
        },
    }


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("release", ["4", "5"])
def test_export_reads_as_our_model_in_each_release(exports, readings, release, variant):
    """Every weight found, the same ids and greedy tokens as ours, logits up to the rounding of
    sums in another order (transformers' implementation of the same fp32 model)."""
    dense, ours, _ = exports[variant]
    theirs = readings[release][variant]
    assert theirs["version"] == VERSIONS[release] and VERSIONS[release].startswith(release)
    assert (theirs["architecture"], theirs["dtype"]) == (MIXTRAL, torch.float32)
    assert theirs["missing"] == theirs["unexpected"] == []
    assert theirs["ids"] == ours["ids"]
    terms = forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"][:, :TRUE_VOCAB], terms=terms)
    assert theirs["greedy"] == ours["greedy"]


def test_config_json_is_a_top2_mixtral_both_releases_read(exports):
    """The MoE keys, the RoPE base where 4.x and 5.x look, no sliding window."""
    with open(os.path.join(exports["untied"][2], "config.json")) as handle:
        config = json.load(handle)
    expected = dict(
        architectures=[MIXTRAL], model_type="mixtral", num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.01, output_router_logits=False,
        router_jitter_noise=0.0, sliding_window=None, intermediate_size=96, head_dim=8,
        num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        tie_word_embeddings=False, torch_dtype="float32", dtype="float32",
    )  # fmt: skip
    assert {key: config[key] for key in expected} == expected
    assert "attention_bias" not in config and "mlp_bias" not in config


def test_expert_weights_as_each_release_names_them(exports):
    """Written as 4.x names them (w1 = gate rows, w3 = up rows, w2 = down); transformers 5
    holds them fused: `gate_up_proj[e]` is our [gate; up], `down_proj[e]` our down."""
    dense, _, hf_dir = exports["untied"]
    ours = "language_model.encoder.layers.1.mlp.deepspeed_moe."
    h_to_4h = dense.state_dict[f"{ours}experts.deepspeed_experts.3.dense_h_to_4h.weight"]
    down = dense.state_dict[f"{ours}experts.deepspeed_experts.3.dense_4h_to_h.weight"]
    written = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    four = "model.layers.1.block_sparse_moe."
    assert torch.equal(written[f"{four}experts.3.w1.weight"], h_to_4h[:96])
    assert torch.equal(written[f"{four}experts.3.w3.weight"], h_to_4h[96:])
    assert torch.equal(written[f"{four}experts.3.w2.weight"], down)
    assert torch.equal(written[f"{four}gate.weight"], dense.state_dict[f"{ours}gate.wg.weight"])
    assert not any(".mlp." in name for name in written)
    _, in_5 = convert_from_hf.read_hf_model(hf_dir, "mixtral")
    assert torch.equal(in_5["model.layers.1.mlp.experts.gate_up_proj"][3], h_to_4h)
    assert torch.equal(in_5["model.layers.1.mlp.experts.down_proj"][3], down)
    assert torch.equal(in_5["model.layers.1.mlp.gate.weight"], written[f"{four}gate.weight"])


def import_folder(hf_dir: str, save: str) -> DenseCheckpoint:
    """What convert_from_hf.py reads from `hf_dir` as DeepSpeed-MoE (before writing the
    checkpoint; Megatron-LM's MoE, the default family, is `test_hf_mixtral_routed.py`'s)."""
    return convert_from_hf.read_hf_folder(
        convert_from_hf.get_args(["--load", hf_dir, "--save", save, *DEEPSPEED_FAMILY])
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_then_import_gives_our_model_back(exports, tmp_path, variant):
    """Our weights bit for bit (experts by global number), args building the same model: the
    same attention and MoE settings, top-2 without dropping or sampling, our loss weight."""
    dense, ours, hf_dir = exports[variant]
    back = import_folder(hf_dir, str(tmp_path / "back"))
    assert sorted(back.state_dict) == sorted(dense.state_dict)
    for name, tensor in dense.state_dict.items():
        assert torch.equal(back.state_dict[name], tensor), name
    assert same_model(back.args, dense.args) and back.args["moe_loss_coeff"] == 0.01
    config, expected = model_config(back.args).moe, model_config(dense.args).moe
    assert all(getattr(config, f) == getattr(expected, f) for f in MOE_FIELDS)
    assert back.args["tokenizer_type"] == "GPT2BPETokenizer"
    with torch.no_grad():
        logits = our_moe_model(back.state_dict, back.args)(torch.tensor([ours["ids"]]))[0]
    # Bit for bit on purpose: the same weights in the same model (same_model, the same MoE
    # settings) on the same ids run the same kernels in the same order.
    assert torch.equal(logits, ours["logits"])


def test_import_of_a_mixtral_saved_by_transformers(moe_world, tmp_path):
    """A random `MixtralForCausalLM` (grouped-query, untied, 4 experts) saved by transformers 5
    gives its logits in our GPT (up to the rounding of sums in another order)."""
    config = transformers.MixtralConfig(
        vocab_size=300, max_position_embeddings=32, hidden_size=48, intermediate_size=80,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(("norm" in name) + torch.randn_like(param) * 0.2)
    model.save_pretrained(str(tmp_path / "hf"))
    loaded = import_folder(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert loaded.args["rope_theta"] == 1e6 and loaded.args["num_experts"] == [4]
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
        ours = our_moe_model(loaded.state_dict, loaded.args)(tokens)
    terms = forward_terms(model_config(loaded.args), tokens.numel())  # ours vs transformers
    assert_close_reordered(ours, expected, terms=terms)


def test_deepspeed_top2_gate_is_mixtrals_router(moe_world):
    """In evaluation without sampling or dropping: the same two experts, most probable first,
    with bit-identical renormalized weights (bitwise on purpose: both take the same `F.linear`
    of the same fp32 rows and the same `softmax`, pick the chosen weights exactly and divide
    them by the same two-term sum: the same kernels on both sides). With exact ties (experts 1
    and 2 share a gate row) the weights are still identical and the tied experts
    interchangeable: DeepSpeed takes the lowest-numbered, Mixtral's `torch.topk` either."""
    from deepspeed.moe.sharded_moe import TopKGate
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    hidden, experts = 16, 4
    config = transformers.MixtralConfig(hidden_size=hidden, num_local_experts=experts)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randn(256, hidden, generator=generator)
    for tied in (False, True):
        weight = torch.randn(experts, hidden, generator=generator)
        if tied:
            weight[2] = weight[1]
        gate = TopKGate(hidden, experts, k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
        router = MixtralTopKRouter(config)
        with torch.no_grad():
            gate.wg.weight.copy_(weight)
            router.weight.copy_(weight)
            *_, indices, _, weights, _ = gate.eval()(tokens, None, True)  # [2, s] each
            _, their_weights, their_indices = router(tokens)  # [s, 2] each
        indices = indices.t().long()  # [s, 2]: first choice, second choice
        assert torch.equal(weights.t(), their_weights)
        assert (their_weights[:, 0] >= their_weights[:, 1]).all()
        if not tied:
            assert torch.equal(indices, their_indices)
            continue
        as_one = {"ours": indices.where(indices != 2, 1), "theirs": their_indices.clone()}
        as_one["theirs"][their_indices == 2] = 1
        assert torch.equal(as_one["ours"], as_one["theirs"])
        assert torch.equal(indices[:, 1] == 2, indices[:, 0] == 1)  # 2 only after 1
        both = (as_one["ours"] == 1).all(dim=1)  # the tied pair first: weights 1/2 each
        assert both.any() and (~both & (as_one["ours"][:, 1] == 1)).any()
        assert (their_weights[both] == 0.5).all()


# args on top of the exportable MoE -> what the one-line refusal must name
NOT_MIXTRAL = {
    "gelu experts": (dict(swiglu=False), "activation 'gelu_tanh' (Mixtral: 'swiglu')"),
    "top-1": (dict(topk=1), "--topk 1 (DeepSpeed's top-1 weighs its expert by the gate"),
    "token dropping": (
        dict(moe_token_dropping=True),
        "token dropping in evaluation (--moe-eval-capacity-factor 1 x top-2 < 4 experts; "
        "Mixtral computes every token: --disable-moe-token-dropping",
    ),
    "second expert sampled": (
        dict(moe_top2_2nd_expert_sampling=True),
        "the second expert sampled (DeepSpeed adds Gumbel noise in evaluation too",
    ),
    "PR-MoE": (dict(mlp_type="residual"), "PR-MoE (--mlp-type residual"),
    "biases": (dict(add_bias_linear=True), "linear biases (Mixtral has none"),
    "dense layers": (
        dict(expert_interval=2),
        "1 of 2 layers without experts (--expert-interval above 1",
    ),
    "expert counts differ": (dict(num_experts=[4, 8]), "expert counts 4, 8 differ"),
    "learned positions": (
        dict(use_rotary_position_embeddings=False, add_position_embedding=True),
        "position_embedding_type 'learned_absolute' (Mixtral: 'rope')",
    ),
    "layernorm": (
        dict(normalization="layernorm"),
        "normalization 'layernorm' (Mixtral: 'rmsnorm')",
    ),
    "head width": (
        dict(num_attention_heads=4, num_key_value_heads=2, kv_channels=8),
        "kv_channels 8 x num_attention_heads 4 != hidden_size 64",
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_MIXTRAL))
def test_what_mixtral_cannot_compute_is_refused_in_one_line(case):
    changes, named = NOT_MIXTRAL[case]
    config = model_config({**VARIANT_ARGS["untied"], **changes})
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    message = str(error.value)
    assert "\n" not in message and f"the closest, {MIXTRAL}, differs in: " in message
    assert named in message and len(mixtral_differences(config)) == 1


def test_capacity_that_never_drops_exports(exports):
    """Token dropping with room for every token (eval capacity factor x 2 >= 4 experts) is the
    model without dropping: accepted, and our logits do not change beyond rounding. The two
    paths dispatch and combine through capacity buffers of other sizes (the configured capacity
    vs the largest expert load), so their sums run in other orders: on some CPUs and thread
    counts they differ in the last bits."""
    dense, ours, _ = exports["untied"]
    args = {**dense.args, "moe_token_dropping": True, "moe_eval_capacity_factor": 2.0}
    assert hf_architecture(model_config(args)) == MIXTRAL
    with torch.no_grad():
        logits = our_moe_model(dense.state_dict, args)(torch.tensor([ours["ids"]]))[0]
    terms = forward_terms(model_config(args), len(ours["ids"]))
    assert_close_reordered(logits, ours["logits"], terms=terms)


def test_trained_checkpoint_through_both_command_lines(exports, trained_moe, tmp_path, capsys):
    """Without the `--disable-moe-*` flags the trained checkpoint (DeepSpeed's sampling and
    capacity) is refused in one line naming both, nothing written; its export imports at TP=2
    into a checkpoint holding the trained weights."""
    save = str(tmp_path / "hf")
    code = convert_to_hf.main(["--load", trained_moe, "--save", save])
    assert_one_line_error(code, capsys.readouterr().err, *DISABLE_FLAGS, MIXTRAL)
    assert not os.path.exists(save)
    dense, _, hf_dir = exports["trained"]
    argv = [
        "--load",
        hf_dir,
        "--save",
        str(tmp_path / "back"),
        "--target-tensor-parallel-size",
        "2",
        *DEEPSPEED_FAMILY,
    ]
    assert convert_from_hf.main(argv) == 0
    assert "--num-experts 4 --expert-interval 1 --topk 2" in capsys.readouterr().out
    back = load_dense_checkpoint(str(tmp_path / "back"))
    assert back.args["tensor_model_parallel_size"] == 2
    assert sorted(back.state_dict) == sorted(dense.state_dict)
    assert all(torch.equal(back.state_dict[name], t) for name, t in dense.state_dict.items())


# config.json changes, or flags -> what the import's one-line refusal must name
NOT_IMPORTED = {
    "top-1": (dict(num_experts_per_tok=1), [], "config.json has num_experts_per_tok=1"),
    "sliding window": (
        dict(sliding_window=16),
        [],
        "config.json has sliding_window=16 < max_position_embeddings",
    ),
    "pipeline stages": ({}, ["--target-pipeline-parallel-size", "2"], "--target-pipeline"),
    "activation": (dict(hidden_act="gelu"), [], "config.json has hidden_act='gelu'; only 'silu'"),
}


@pytest.mark.parametrize("case", sorted(NOT_IMPORTED))
def test_import_refuses_what_our_moe_cannot_compute_in_one_line(tmp_path, capsys, case):
    changes, flags, named = NOT_IMPORTED[case]
    config = dict(
        model_type="mixtral", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32,
        vocab_size=300, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **changes}))
    argv = ["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours"), *flags]
    argv += DEEPSPEED_FAMILY
    assert_one_line_error(convert_from_hf.main(argv), capsys.readouterr().err, named)
    assert not (tmp_path / "ours").exists()
