"""Megatron-LM's MoE (routed: `--moe-router-topk` ...) <-> Hugging Face `MixtralForCausalLM`.

Export: a random model of Megatron-LM's MoE with Mixtral's routing (4 experts in both layers,
top-2 of the softmax over the chosen logits, grouped-query attention, untied output layer),
every weight random, exported at the state-dict level, loads in transformers 5 with no missing
or unexpected weight and reads a prompt as ours does (the same greedy tokens, logits up to the
rounding of fp32 sums in another order). `convert_from_hf.py` imports a Mixtral as Megatron-
LM's MoE by default (`--moe-family megatron`; `deepspeed` keeps DeepSpeed-MoE): the export
comes back bit for bit with args building the same model and the same logits, and a random
Mixtral saved by transformers 5 at top-3 (which DeepSpeed-MoE cannot hold) gives its logits.
What Mixtral's router does not compute is refused in one line naming the flag.

End to end (the real command lines): 3 `pretrain_gpt.py` iterations with Megatron-LM's flags,
`convert_to_hf.py` (our logits in transformers), `convert_from_hf.py`, and `pretrain_gpt.py
--load ... --finetune` with the printed flags trains from the import exactly as the trained
checkpoint does with its own flags.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron.checkpointing.huggingface import hf_architecture, model_config  # noqa: E402
from megatron.checkpointing.huggingface_mixtral import mixtral_differences  # noqa: E402
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
    export_folder,
    first_losses,
    import_folder,
    our_reading,
    printed_flags,
    random_routed_checkpoint,
    routed_args,
    routed_forward_terms,
    run_checkpoint_tool,
)
from tests.tools.test_hf_conversion import TRUE_VOCAB, our_logits, same_model  # noqa: E402
from tests.tools.test_hf_transformers4 import NEW_TOKENS, PROMPT  # noqa: E402
from tools.checkpoint import convert_from_hf  # noqa: E402

MIXTRAL = "MixtralForCausalLM"
ROUTED = routed_args(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=[0.01])
"""What a run with `--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01` (and the
LLaMA-style flags of `test_hf_conversion`) saves."""
ROUTED_FIELDS = ("num_experts", "moe_layers", "top_k", "score_function", "pre_softmax")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple:
    """(our random checkpoint, what our model reads from PROMPT, its Mixtral export)."""
    hf_dir = str(tmp_path_factory.mktemp("hf_mixtral_routed") / "hf")
    dense = random_routed_checkpoint(ROUTED)
    assert export_folder(dense, hf_dir) == MIXTRAL
    ids = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).tokenize(PROMPT)
    return dense, our_reading(dense, ids), hf_dir


def test_export_reads_as_our_model_in_transformers(exported):
    """Every weight found, the same ids and greedy tokens, logits up to reordered sums; the
    aux-loss weight carried as `router_aux_loss_coef`."""
    dense, ours, hf_dir = exported
    theirs = read(hf_dir, PROMPT, NEW_TOKENS)
    assert (theirs["architecture"], theirs["missing"], theirs["unexpected"]) == (MIXTRAL, [], [])
    assert theirs["ids"] == ours["ids"] and theirs["greedy"] == ours["greedy"]
    terms = routed_forward_terms(model_config(dense.args), len(ours["ids"]))
    assert_close_reordered(theirs["logits"], ours["logits"], terms=terms)
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert config.router_aux_loss_coef == 0.01


def test_export_then_import_is_our_routed_model_by_default(exported, tmp_path):
    """Megatron-LM's MoE back (the default family): our weights and logits bit for bit (the
    same model, weights and kernels), the same MoE settings and loss weight."""
    dense, ours, hf_dir = exported
    back = import_folder(hf_dir, str(tmp_path / "back"))
    assert sorted(back.state_dict) == sorted(dense.state_dict)
    assert all(torch.equal(back.state_dict[n], t) for n, t in dense.state_dict.items())
    assert same_model(back.args, dense.args) and back.args["routed_moe"]
    moe, expected = model_config(back.args).routed_moe, model_config(dense.args).routed_moe
    assert moe == expected and moe.aux_loss_coeff == 0.01
    logits = our_logits(back.state_dict, back.args, torch.tensor([ours["ids"]]))[0]
    assert torch.equal(logits, ours["logits"])


def test_the_family_decides_the_printed_flags(exported, tmp_path, capsys):
    """By default Megatron-LM's flags (`--moe-router-topk` picks its MoE; no DeepSpeed), with
    `--moe-family deepspeed` DeepSpeed-MoE's and its engine."""
    hf_dir = exported[2]
    assert convert_from_hf.main(["--load", hf_dir, "--save", str(tmp_path / "routed")]) == 0
    routed = capsys.readouterr().out
    assert "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01" in routed
    assert "--topk" not in routed and "--deepspeed" not in routed
    argv = ["--load", hf_dir, "--save", str(tmp_path / "ds"), "--moe-family", "deepspeed"]
    assert convert_from_hf.main(argv) == 0
    deepspeed = capsys.readouterr().out
    assert "--num-experts 4 --expert-interval 1 --topk 2" in deepspeed
    assert "--deepspeed --deepspeed_config FILE" in deepspeed
    assert "mlp.deepspeed_moe" in str(
        sorted(load_dense_checkpoint(str(tmp_path / "ds")).state_dict)
    )


def test_import_of_a_top3_mixtral_saved_by_transformers(tmp_path):
    """A random `MixtralForCausalLM` (4 experts, top-3: beyond DeepSpeed-MoE's top-2) saved by
    transformers 5 gives its logits in our GPT as Megatron-LM's MoE."""
    config = transformers.MixtralConfig(
        vocab_size=300, max_position_embeddings=32, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=3, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(("norm" in name) + torch.randn_like(param) * 0.2)
    model.save_pretrained(str(tmp_path / "hf"))
    loaded = import_folder(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert loaded.args["moe_router_topk"] == 3 and loaded.args["num_experts"] == [4]
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
    ours = our_logits(loaded.state_dict, loaded.args, tokens)
    terms = routed_forward_terms(model_config(loaded.args), tokens.numel())
    assert_close_reordered(ours, expected, terms=terms)


# args on top of the exportable routed model -> what the one-line refusal must name
NOT_MIXTRAL = {
    "pre-softmax top-2": (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
    "pre-softmax top-1": (
        dict(moe_router_pre_softmax=True, moe_router_topk=1),
        "--moe-router-pre-softmax",
    ),
    "scaling factor": (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling"),
    "capacity": (dict(moe_expert_capacity_factor=1.0), "token dropping"),
    "narrower experts": (dict(moe_ffn_hidden_size=48), "--moe-ffn-hidden-size other than"),
    "dense first layer": (dict(moe_layer_freq=[0, 1]), "layers without experts"),
}


@pytest.mark.parametrize("case", sorted(NOT_MIXTRAL))
def test_what_mixtral_cannot_compute_is_refused_in_one_line(case):
    changes, named = NOT_MIXTRAL[case]
    config = model_config({**ROUTED, **changes})
    assert len(mixtral_differences(config)) == 1
    with pytest.raises(CheckpointConversionError) as error:
        hf_architecture(config)
    message = str(error.value)
    assert "\n" not in message and f"the closest, {MIXTRAL}, differs in: " in message
    assert named in message


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--target-tensor-parallel-size", "2"], "--target-tensor-parallel-size 2"),
        (["--moe-family", "deepspeed", "--target-pipeline-parallel-size", "2"], "pipeline"),
    ],
)
def test_import_refuses_a_split_the_family_cannot_train(exported, tmp_path, capsys, flags, named):
    argv = ["--load", exported[2], "--save", str(tmp_path / "ours"), *flags]
    assert_one_line_error(convert_from_hf.main(argv), capsys.readouterr().err, named)
    assert not (tmp_path / "ours").exists()


MODEL_FLAGS = (
    "--num-attention-heads 8 --num-key-value-heads 2 --ffn-hidden-size 96 --normalization "
    "rmsnorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
    "--use-rotary-position-embeddings --no-position-embedding "
    "--rotary-position-embeddings-theta 500000 --num-experts 4 --moe-router-topk 2 "
    "--moe-aux-loss-coeff 0.01"
).split()
"""A Mixtral-shaped model in Megatron-LM's flags (on tiny_gpt_flags' 2 layers, hidden 64)."""


@pytest.mark.slow
def test_trained_model_through_both_command_lines(stdlib_dataset, tmp_path):
    """pretrain_gpt.py -> convert_to_hf.py -> transformers reads our logits ->
    convert_from_hf.py -> pretrain_gpt.py --finetune with the printed flags: the first loss of
    the trained checkpoint with its own flags (its random vocabulary padding rows zeroed, as
    the export drops them)."""
    names = ("trained", "hf", "back", "reference")
    trained, hf_dir, back, reference = (str(tmp_path / name) for name in names)
    data = [*tiny_gpt_flags(stdlib_dataset), "--global-batch-size", "4"]
    training = ["--train-iters", "3", "--save-interval", "3", "--save", trained]
    run = launch(1, [*data, *MODEL_FLAGS, *training])
    assert run.returncode == 0, run.stdout[-4000:]
    assert (
        MIXTRAL
        in run_checkpoint_tool("convert_to_hf.py", "--load", trained, "--save", hf_dir).stdout
    )
    dense = load_dense_checkpoint(trained)
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
    assert "--moe-router-topk" in flags and "--deepspeed" not in flags
    dense.vocab_padding = dense.output_layer_padding = None
    save_megatron_checkpoint(dense, reference, 1, 1)
    assert first_losses(flags, data, [back]) == first_losses(MODEL_FLAGS, data, [reference])
