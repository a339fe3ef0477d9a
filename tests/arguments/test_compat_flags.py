"""Megatron-DeepSpeed / Megatron-LM flags: every one parses; inert ones change nothing; features
we lack are refused in one line unless the value means "off"; shorthands expand."""

from __future__ import annotations

import re

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.arguments.compat_flags import INERT, REFUSED
from megatron.config import ModelConfig
from megatron.settled_args import with_settled

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3"
).split()


def validated(extra: str = "", world_size: int = 1):
    argv = BASE + extra.split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


def _typed_value(kind: str) -> str:
    return {"switch": "", "int": "3", "float": "0.5", "str": "x", "bool": "true"}.get(kind, "3")


def test_every_flag_of_theirs_is_registered_once() -> None:
    options = [flag.option for flag in INERT + REFUSED]
    assert len(options) == len(set(options))
    parser = build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    assert set(options) <= known


def test_inert_flags_parse_and_change_nothing() -> None:
    plain = vars(validated())
    typed = " ".join(f"{flag.option} {_typed_value(flag.kind)}" for flag in INERT)
    args = vars(validated(typed))
    inert = {flag.dest for flag in INERT}
    assert {name: value for name, value in args.items() if name not in inert} == {
        name: value for name, value in plain.items() if name not in inert
    }


@pytest.mark.parametrize(
    "flag", [flag for flag in REFUSED if flag.accepts is None], ids=lambda flag: flag.option
)
def test_a_feature_we_lack_is_refused_in_one_line_naming_the_flag(flag) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(f"{flag.option} {_typed_value(flag.kind)}")
    message = str(refused.value)
    assert message.startswith(flag.option) and "\n" not in message


@pytest.mark.parametrize(
    "extra",
    [
        "--num-experts 1 --moe-expert-parallel-size 1 --moe-loss-coeff 0.01 --topk 1",
        "--ds-sequence-parallel-size 1",
        "--normalization layernorm",
        "--transformer-impl local",
        "--DDP-impl torch",
        "--use-rotary-position-embeddings --no-position-embedding",
        "--position-embedding-type learned_absolute",
    ],
)
def test_the_value_that_means_off_is_accepted(extra: str) -> None:
    validated(extra)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--use-tutel", "--use-tutel: Tutel's MoE kernels are not built here"),
        ("--num-experts-switch 4", "--num-experts-switch 4: Megatron-LM's SwitchMLP"),
        ("--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt: DeepSpeed's FPDT"),
        ("--force-ds-sequence-parallel", "--force-ds-sequence-parallel: Ulysses attention"),
        ("--squared-relu", "--squared-relu: this GPT variant is not built here"),
        ("--DDP-impl FSDP", "--DDP-impl FSDP"),
        ("--tokenizer-type BertWordPieceCase", "--tokenizer-type BertWordPieceCase: not built"),
        ("--tokenizer-type NullTokenizer", "--tokenizer-type NullTokenizer needs --vocab-size"),
        ("--tokenizer-type TikTokenizer", "--tokenizer-type TikTokenizer needs --tokenizer-model"),
        (
            "--tokenizer-type Llama3Tokenizer",
            "--tokenizer-type Llama3Tokenizer: Megatron-LM removed",
        ),
        (
            "--tokenizer-type GPTSentencePieceTokenizer",
            "--tokenizer-type GPTSentencePieceTokenizer needs --tokenizer-model",
        ),
        ("--tokenizer-type HFTokenizer", "--tokenizer-type HFTokenizer needs --tokenizer-model"),
    ],
)
def test_refusals_name_the_flag_and_value(extra: str, message: str) -> None:
    with pytest.raises(ArgumentError, match="^" + message.replace("(", r"\(")):
        validated(extra)


def test_llama_tokenizer_flags_are_accepted() -> None:
    args = validated("--tokenizer-type Llama2Tokenizer --tokenizer-model ./tokenizer.model")
    assert (args.tokenizer_type, args.tokenizer_model) == ("Llama2Tokenizer", "./tokenizer.model")


def test_llama_architecture_flags_reach_the_model_config() -> None:
    args = validated(
        "--normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 "
        "--untie-embeddings-and-output-weights --disable-bias-linear "
        "--position-embedding-type rope --rotary-base 500000 --norm-epsilon 1e-6"
    )
    args = with_settled(args, padded_vocab_size=128)
    config = ModelConfig.from_args(args)
    assert (config.normalization, config.activation) == ("rmsnorm", "swiglu")
    assert config.num_key_value_heads == 2 and config.untie_embeddings_and_output_weights
    assert not config.add_bias_linear and config.position_embedding_type == "rope"
    assert config.rotary_base == 500000.0 and config.layernorm_epsilon == 1e-6
    # Megatron-DeepSpeed's SwiGLU width rule: int(8h / 3 / 64) * 64.
    assert config.ffn_hidden_size == int(4 * args.hidden_size * 2 / 3 / 64) * 64
    nope = validated("--no-position-embedding")
    nope = with_settled(nope, padded_vocab_size=128)
    assert ModelConfig.from_args(nope).position_embedding_type == "none"


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--num-key-value-heads 3", "--num-attention-heads (4) is not a multiple of"),
        ("--group-query-attention", "--group-query-attention needs --num-query-groups"),
        (
            "--num-key-value-heads 2 --group-query-attention --num-query-groups 1",
            "--num-query-groups (1) contradicts --num-key-value-heads (2)",
        ),
        (
            "--use-rotary-position-embeddings --position-embedding-type none",
            "--position-embedding-type none contradicts --use-rotary-position-embeddings",
        ),
    ],
)
def test_llama_flag_mistakes_are_refused_in_one_line(extra: str, message: str) -> None:
    with pytest.raises(ArgumentError, match="^" + re.escape(message)):
        validated(extra)


def test_megatron_spellings_map_onto_ours() -> None:
    args = validated(
        "--override-opt_param-scheduler --recompute-activations --encoder-num-layers 2 "
        "--no-query-key-layer-scaling --rotary-position-embeddings-theta 500000 "
        "--use-rotary-position-embeddings --distributed-timeout-minutes 3"
    )
    assert args.override_lr_scheduler and args.recompute_granularity == "selective"
    assert args.num_layers == 2 and args.apply_query_key_layer_scaling is False
    assert args.distributed_timeout_minutes == 3
    args = with_settled(args, padded_vocab_size=128)  # set from the tokenizer at start-up
    assert ModelConfig.from_args(args).rotary_base == 500000.0
    args = validated(
        "--use-checkpoint-opt_param-scheduler --checkpoint-activations "
        "--activations-checkpoint-method block"
    )
    assert args.use_checkpoint_lr_scheduler and args.recompute_method == "block"


def test_megatron_lm_2s_activations_checkpoint_method_turns_full_recomputation_on() -> None:
    """Megatron-LM 2.x (its sc21 scripts, Megatron-DeepSpeed's GPT-3 examples): the method
    alone meant activation checkpointing, not merely which method a later flag would use."""
    args = validated("--activations-checkpoint-method uniform")
    assert (args.recompute_granularity, args.recompute_method) == ("full", "uniform")
    assert args.recompute_num_layers == 1
    args = validated("--activations-checkpoint-method block --activations-checkpoint-num-layers 2")
    assert (args.recompute_method, args.recompute_num_layers) == ("block", 2)
    with pytest.raises(ArgumentError, match="means --recompute-granularity full"):
        validated("--activations-checkpoint-method uniform --recompute-granularity selective")


def test_weight_decay_increment_flags() -> None:
    args = validated(
        "--weight-decay-incr-style linear --start-weight-decay 0.0 --end-weight-decay 0.1"
    )
    assert (args.start_weight_decay, args.end_weight_decay) == (0.0, 0.1)
    with pytest.raises(ArgumentError, match="needs --start-weight-decay and --end-weight-decay"):
        validated("--weight-decay-incr-style cosine")
    with pytest.raises(ArgumentError, match="need --weight-decay-incr-style linear or cosine"):
        validated("--start-weight-decay 0.0 --end-weight-decay 0.1")
