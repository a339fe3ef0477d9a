"""Megatron's flags parse with Megatron's defaults; each bad combination names its flags."""

from __future__ import annotations

import pytest

from megatron.arguments import ArgumentError, build_parser, parse_args, typed_flags, validate_args
from megatron.arguments.validation import batch_arithmetic, format_arguments
from megatron.config import ModelConfig
from megatron.settled_args import with_settled

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3"
).split()


def validated(extra: str = "", world_size: int = 1):
    """Parse BASE plus `extra` and validate for `world_size` ranks."""
    args = build_parser().parse_args(BASE + extra.split())
    return validate_args(args, world_size)


def test_megatron_defaults_and_deepspeed_flags():
    """Defaults are Megatron's; DeepSpeed's config flags are on the same parser."""
    args = validated()
    assert args.make_vocab_size_divisible_by == 128
    assert args.attention_dropout == args.hidden_dropout == 0.1
    assert (args.weight_decay, args.clip_grad, args.adam_beta2) == (0.01, 1.0, 0.999)
    assert args.split == "969, 30, 1" and args.seed == 1234 and args.lr_decay_style == "linear"
    assert args.initial_loss_scale == 2.0**32 and args.hysteresis == 2
    assert args.max_position_embeddings == 32
    assert args.deepspeed is False and args.deepspeed_config is None
    assert args.distributed_backend == "gloo"  # no GPU on the test machine
    assert args.bias_gelu_fusion and args.masked_softmax_fusion and args.bias_dropout_fusion


def test_derived_batch_arithmetic():
    """micro x accumulation x data-parallel = global, printed as one line."""
    args = validated("--global-batch-size 16 --tensor-model-parallel-size 2", world_size=4)
    assert args.data_parallel_size == 2 and args.gradient_accumulation_steps == 4
    assert batch_arithmetic(args) == (
        " > batch: micro-batch 2 x gradient accumulation 4 x data-parallel 2 = "
        "global batch 16 samples (512 tokens per iteration)"
    )


def test_train_samples_sets_iterations_and_local_rank_aliases():
    """--train-samples becomes iterations; --local_rank (deepspeed) and --local-rank both parse."""
    argv = [a for a in BASE if a not in ("--train-iters", "10")]
    args = validate_args(build_parser().parse_args(argv + ["--train-samples", "40"]), 1)
    assert args.train_iters == 20
    for flag in ("--local_rank", "--local-rank"):
        assert build_parser().parse_args(BASE + [flag, "3"]).local_rank == 3


def test_iteration_schedule_flags_are_refused_with_train_samples():
    """As Megatron: with --train-samples the LR schedule is in samples, never silently dropped."""
    argv = [a for a in BASE if a not in ("--train-iters", "10")] + ["--train-samples", "40"]
    with pytest.raises(ArgumentError, match="--lr-decay-iters and --lr-warmup-iters cannot be"):
        validate_args(
            build_parser().parse_args(argv + ["--lr-decay-iters", "9", "--lr-warmup-iters", "2"]),
            1,
        )


def test_checkpoint_activations_means_full_uniform_recompute():
    """Megatron's deprecated flag maps onto the recompute flags and into ModelConfig."""
    args = validated("--checkpoint-activations --checkpoint-num-layers 2")
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == (
        "full",
        "uniform",
        2,
    )
    args = with_settled(args, padded_vocab_size=128)
    config = ModelConfig.from_args(args)
    assert config.recompute_granularity == "full" and config.recompute_num_layers == 2
    assert config.params_dtype == "float32" and config.attention_backend == "sdpa"


def test_check_labels_flag_reaches_model_config():
    """--check-labels (off by default) becomes ModelConfig.check_labels."""
    for extra, expected in (("", False), ("--check-labels", True)):
        args = validated(extra)
        args = with_settled(args, padded_vocab_size=128)
        assert ModelConfig.from_args(args).check_labels is expected


def test_sequence_parallel_is_dropped_without_tensor_parallelism():
    """As Megatron: --sequence-parallel with one TP rank has nothing to split."""
    assert validated("--sequence-parallel").sequence_parallel is False
    assert validated("--sequence-parallel --tensor-model-parallel-size 2", 2).sequence_parallel


def test_save_interval_without_save_saves_nothing_and_says_so():
    """As Megatron-DeepSpeed (finetune_llama.sh passes --save-interval without --save)."""
    args = validated("--save-interval 5")
    assert args.save is None
    assert any("--save-interval 5 without --save" in note for note in args.compat_notes)


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (
            "--tensor-model-parallel-size 4",
            6,
            r"world size \(6\).*--tensor-model-parallel-size \(4\)",
        ),
        ("--global-batch-size 10", 2, r"--global-batch-size \(10\).*--micro-batch-size \(2\)"),
        ("--fp16 --bf16", 1, "--fp16 and --bf16"),
        ("--tensor-model-parallel-size 3", 3, r"--num-attention-heads \(4\).*size \(3\)"),
        ("--save /tmp/x", 1, "--save needs --save-interval"),
        ("--max-position-embeddings 16", 1, r"--seq-length \(32\).*--max-position-embeddings"),
        ("--train-samples 8", 1, "exactly one of --train-iters and --train-samples"),
        ("--min-lr 1", 1, r"--min-lr \(1.0\) is larger than --lr"),
        (
            "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2",
            2,
            "is not divisible by --pipeline-model-parallel-size 2 x 2 virtual",
        ),
        ("--distributed-backend nccl", 1, "nccl needs CUDA"),
        ("--lr-warmup-fraction 0.1 --lr-warmup-iters 5", 1, "--lr-warmup-fraction"),
        ("--lr-decay-samples 100", 1, "--lr-decay-samples cannot be combined with --train-iters"),
        ("--zero-stage 2", 1, "--zero-stage 2 needs --deepspeed"),
        ("--checkpoint-activations --recompute-granularity selective", 1, "--checkpoint-act"),
        (
            "--sequence-parallel --tensor-model-parallel-size 2 --partition-activations",
            2,
            "--sequence-parallel",
        ),
    ],
)
def test_inconsistent_flags_are_named(extra, world_size, message):
    """Each contradiction raises ArgumentError naming the flags and numbers involved."""
    with pytest.raises(ArgumentError, match=message):
        validated(extra, world_size)


def test_missing_flags_are_named_and_parse_args_exits(capsys):
    """parse_args exits with status 2 and one `error:` line naming the missing flag."""
    argv = [a for a in BASE if a not in ("--lr", "1e-3")]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=1)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: missing required flag(s): --lr"


def test_argument_block_is_sorted_megatron_style():
    """The start-up block lists every argument, sorted, with Megatron's dotted layout."""
    block = format_arguments(validated()).splitlines()
    assert block[0] == "------------------------ arguments ------------------------"
    assert block[-1] == "-------------------- end of arguments ---------------------"
    names = [line.split()[0] for line in block[1:-1]]
    assert names == sorted(names, key=str.lower)
    assert "  num_layers " + "." * 38 + " 2" in block


def test_typed_flags_are_only_those_on_the_command_line():
    """Defaults (argparse's, set_defaults', the env-based --local-rank) are not typed."""
    parser = build_parser()
    parser.set_defaults(tokenizer_type="GPT2BPETokenizer", seed=7)
    argv = BASE + ["--fp16", "--no-bias-gelu-fusion", "--local_rank", "0", "--seed", "7"]
    assert typed_flags(parser, argv) == {
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "lr",
        "fp16",
        "bias_gelu_fusion",
        "local_rank",
        "seed",
    }
    assert parser.parse_args(BASE).clip_grad == 1.0  # the parser itself keeps its defaults


def test_missing_data_and_tokenizer_files_are_named(tmp_path):
    """A --data-path prefix without .bin/.idx, or a missing vocab file, fails at start-up."""
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "a.idx").write_bytes(b"")
    present, missing = str(tmp_path / "a"), str(tmp_path / "b")
    assert validated(f"--data-path {present}").data_path == [present]
    with pytest.raises(ArgumentError, match=f"--data-path {missing}: no dataset there"):
        validated(f"--data-path 0.5 {present} 0.5 {missing}")
    with pytest.raises(ArgumentError, match="should be the weight"):
        validated(f"--data-path {present} {present}")
    with pytest.raises(ArgumentError, match=f"--vocab-file {tmp_path}/v.json: no such file"):
        validated(f"--vocab-file {tmp_path}/v.json")


def test_unusable_run_directories_are_refused_before_training(tmp_path):
    """A --save, --tensorboard-dir or --load that cannot work is named at start-up."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    for extra, message in [
        (f"--save {a_file}/ckpt --save-interval 1", "cannot be created, .* is a file"),
        (f"--save {a_file} --save-interval 1", "--save .*: a file, not a directory"),
        (f"--tensorboard-dir {a_file}/tb", "--tensorboard-dir .*: cannot be created"),
        (f"--load {a_file}", "--load .*: a file, not a checkpoint directory"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            validated(extra)
    validated(f"--save {tmp_path}/new/ckpt --save-interval 1")  # creatable
