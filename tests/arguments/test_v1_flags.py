"""Megatron-LM v1's flags (DeepSpeed's Megatron-LM GPT-2 tutorial) with v1's meanings: each
becomes today's setting, a v1 flag and today's flag that disagree are one line naming both, and
a v1 command line gets v1's defaults with a start-up line each."""

from __future__ import annotations

import json
import os

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.arguments.validation import SHIPPED_GPT2_MERGES, SHIPPED_GPT2_VOCAB
from megatron.layout import Engine

MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --lr 1e-3"
BASE = MODEL + " --micro-batch-size 2 --train-iters 100"
V1 = MODEL + " --batch-size 2 --train-iters 100"


def validated(argv: str, world_size: int = 1):
    tokens = argv.split()
    parser = build_parser()
    return validate_args(parser.parse_args(tokens), world_size, typed_flags(parser, tokens))


def test_today_command_line_is_unchanged_by_the_v1_group() -> None:
    args = validated(BASE)
    assert args.compat_notes == [GPT2_FILES_NOTE]  # no --vocab-file: the shipped GPT-2 files
    assert args.lr_warmup_fraction is None and args.save_interval is None


GPT2_FILES_NOTE = (
    " > GPT2BPETokenizer without --vocab-file/--merge-file: using GPT-2's files shipped in "
    + os.path.dirname(SHIPPED_GPT2_VOCAB)
)


def test_v1_flags_become_todays_settings() -> None:
    args = validated(
        V1 + " --model-parallel-size 2 --warmup .05 --lr-decay-iters 80 --intermediate-size 128",
        world_size=4,
    )
    assert args.micro_batch_size == 2
    assert args.tensor_model_parallel_size == 2 and args.data_parallel_size == 2
    assert args.global_batch_size == 4  # batch x data-parallel size, as v1
    assert args.lr_warmup_fraction == 0.05  # of the 80 decay iterations: 4 warmup iterations
    assert args.ffn_hidden_size == 128


def test_gas_multiplies_the_global_batch() -> None:
    args = validated(V1 + " --gas 3", world_size=2)
    assert (args.global_batch_size, args.gradient_accumulation_steps) == (12, 3)


def test_gas_counts_data_parallel_ranks_without_the_ulysses_ones() -> None:
    """4 ranks at DeepSpeed-Ulysses S=2 are 2 data-parallel replicas: --batch-size 2 x 2 x
    --gas 3 = 12 (issue 36, defect 7: the global batch was computed over 4 and grew S times)."""
    deepspeed = " --deepspeed --deepspeed_config " + _config({}) + " --no-pipeline-parallel"
    args = validated(V1 + " --gas 3 --ds-sequence-parallel-size 2" + deepspeed, world_size=4)
    assert (args.global_batch_size, args.data_parallel_size) == (12, 2)
    assert args.gradient_accumulation_steps == 3


def test_v1_warmup_without_the_typed_flags() -> None:
    """validate_args called without the typed-flag set (as a library caller does): v1's 1%
    default applies, and --warmup does not contradict today's default --lr-warmup-iters 0
    (issue 36, defect 9)."""
    parser = build_parser()
    args = validate_args(parser.parse_args(V1.split()), 1)
    assert args.lr_warmup_fraction == 0.01
    args = validate_args(parser.parse_args((V1 + " --warmup .05").split()), 1)
    assert args.lr_warmup_fraction == 0.05
    with pytest.raises(ArgumentError, match="contradicts --lr-warmup-iters 5"):
        validate_args(parser.parse_args((V1 + " --warmup .05 --lr-warmup-iters 5").split()), 1)


def test_pipe_parallel_size_picks_the_pipeline_engine() -> None:
    deepspeed = " --deepspeed --deepspeed_config " + _config({"train_batch_size": 4})
    args = validated(V1 + " --pipe-parallel-size 2" + deepspeed, world_size=4)
    assert args.pipeline_model_parallel_size == 2 and args.layout.engine is Engine.DEEPSPEED_PIPE
    args = validated(V1 + " --pipe-parallel-size 0" + deepspeed, world_size=2)
    assert args.pipeline_model_parallel_size == 1
    assert args.layout.engine is not Engine.DEEPSPEED_PIPE


def test_model_parallel_size_is_clamped_to_the_world_as_v1_did() -> None:
    args = validated(V1 + " --model-parallel-size 4", world_size=2)
    assert args.tensor_model_parallel_size == 2
    assert any(
        "--model-parallel-size 4 is more than the 2 process(es)" in n for n in args.compat_notes
    )


def test_a_v1_command_line_gets_v1_defaults_with_a_line_each(tmp_path) -> None:
    args = validated(V1 + f" --save {tmp_path}/ckpt")
    assert args.save_interval == 5000
    assert args.lr_warmup_fraction == 0.01
    assert any("v1's default --save-interval" in note for note in args.compat_notes)
    assert any("v1's default --warmup" in note for note in args.compat_notes)
    # Given explicitly, today's flags stand.
    args = validated(V1 + f" --save {tmp_path}/ckpt --save-interval 7 --lr-warmup-iters 3")
    assert (args.save_interval, args.lr_warmup_iters, args.lr_warmup_fraction) == (7, 3, None)


def test_accepted_v1_switches_say_what_they_mean_here() -> None:
    args = validated(V1 + " --resume-dataloader --lazy-loader --loose-json")
    assert any(
        "--resume-dataloader: the data position always resumes" in n for n in args.compat_notes
    )


def test_gpt2_tokenizer_without_files_uses_the_shipped_ones() -> None:
    args = validated(BASE + " --tokenizer-type GPT2BPETokenizer")
    assert (args.vocab_file, args.merge_file) == (SHIPPED_GPT2_VOCAB, SHIPPED_GPT2_MERGES)
    assert os.path.isfile(args.vocab_file) and os.path.isfile(args.merge_file)


def _config(config: dict, directory: str | None = None) -> str:
    import tempfile

    directory = directory or tempfile.mkdtemp()
    path = os.path.join(directory, "ds_config.json")
    with open(path, "w") as file:
        json.dump(config, file)
    return path


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (
            " --micro-batch-size 4",
            1,
            "--batch-size 2 (Megatron-LM v1's spelling of --micro-batch-size) contradicts "
            "--micro-batch-size 4; give one of them",
        ),
        (
            " --model-parallel-size 2 --tensor-model-parallel-size 1",
            2,
            "--model-parallel-size 2 (Megatron-LM v1's spelling of --tensor-model-parallel-size) "
            "contradicts --tensor-model-parallel-size 1",
        ),
        (
            " --warmup .01 --lr-warmup-iters 5",
            1,
            "--warmup 0.01 (Megatron-LM v1's --lr-warmup-fraction) contradicts --lr-warmup-iters 5",
        ),
        (
            " --warmup 2000",
            1,
            "--warmup 2000: Megatron-LM v1's --warmup is the fraction (0 to 1) of the decay "
            "iterations to warm up over; for a number of iterations use --lr-warmup-iters",
        ),
        (
            " --gas 2 --global-batch-size 6",
            1,
            "--gas 2 x --batch-size 2 x data-parallel size 1 = 4 contradicts --global-batch-size 6",
        ),
        (" --gas 0", 1, "--gas 0: must be at least 1"),
        (
            " --pipe-parallel-size 0 --pipeline-model-parallel-size 2",
            2,
            "--pipe-parallel-size 0 (no pipeline) contradicts --pipeline-model-parallel-size 2",
        ),
        (
            " --valid-data val.json",
            1,
            "--valid-data: separate evaluation files are not built here; --train-data is split",
        ),
        (
            " --model-parallel-size 2 --pipe-parallel-size 2",
            3,
            "world size (3) is not divisible by --model-parallel-size (2) x --pipe-parallel-size "
            "(2) = 4",
        ),
    ],
)
def test_contradictions_are_one_line_naming_both(extra: str, world_size: int, message: str) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(V1 + extra, world_size)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value)


def test_deepspeed_errors_name_the_v1_flag(tmp_path) -> None:
    config = _config({"train_batch_size": 16, "gradient_accumulation_steps": 1}, str(tmp_path))
    with pytest.raises(ArgumentError) as refused:
        validated(
            V1.replace("--batch-size 2", "--batch-size 8")
            + f" --deepspeed --deepspeed_config {config}",
            4,
        )
    assert str(refused.value).endswith(
        "train_micro_batch_size_per_gpu (--batch-size) x gradient_accumulation_steps x "
        "data-parallel size, but 16 != 8 x 1 x 4"
    )
    config = _config({"train_micro_batch_size_per_gpu": 4}, str(tmp_path))
    with pytest.raises(ArgumentError, match=r"^--batch-size \(2\) contradicts "):
        validated(V1 + f" --deepspeed --deepspeed_config {config}")


def test_deepspeed_without_a_config_builds_one_from_the_flags() -> None:
    args = validated(V1 + " --deepspeed --clip-grad 0.5", world_size=2)
    config = args.deepspeed_config_dict
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["train_batch_size"] == 4
    assert config["gradient_clipping"] == 0.5 and config["zero_optimization"]["stage"] == 0
    assert any("--deepspeed without --deepspeed_config" in n for n in args.compat_notes)


# ---------------------------------------------------------------------------- --train-data


@pytest.fixture
def in_work_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _write(path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_train_data_corpus_names_resolve_under_the_working_directory(in_work_dir) -> None:
    _write(in_work_dir / "data/webtext/data.json", [json.dumps({"text": "hello"})])
    args = validated(V1 + " --train-data webtext --cache-dir cache")
    corpus = args.train_data_corpus
    assert corpus.sources == (str(in_work_dir / "data/webtext/data.json"),)
    assert corpus.cache_dir == str(in_work_dir / "cache") and corpus.json_key == "text"
    assert args.data_path == [corpus.data_prefix]
    assert corpus.data_prefix.startswith(str(in_work_dir / "cache" / "data-"))
    assert corpus.tokenizer.vocab_file == SHIPPED_GPT2_VOCAB
    # Without --cache-dir the tokens go beside the file, as v1's lazy loader wrote them.
    args = validated(V1 + " --train-data webtext --text-key body")
    assert args.train_data_corpus.cache_dir == str(in_work_dir / "data/webtext")
    assert args.train_data_corpus.json_key == "body"


@pytest.mark.parametrize(
    "files, entry, message",
    [
        (
            {},
            "webtext",
            "--train-data webtext: Megatron-LM v1's name for data/webtext/data.json, "
            "which is not in the working directory",
        ),
        ({}, "missing.json", "--train-data missing.json: no such file"),
        ({"corpus.csv": "a,b"}, "corpus.csv", "--train-data corpus.csv: only loose-JSON files"),
        (
            {"tight.json": '[{"text": "a"}]'},
            "tight.json",
            "--train-data tight.json: holds one "
            "JSON array (v1's tight JSON); only loose JSON is read here",
        ),
    ],
)
def test_bad_train_data_is_one_line(in_work_dir, files: dict, entry: str, message: str) -> None:
    for name, text in files.items():
        (in_work_dir / name).write_text(text + "\n")
    with pytest.raises(ArgumentError) as refused:
        validated(V1 + f" --train-data {entry}")
    assert str(refused.value).startswith(message), str(refused.value)


def test_train_data_and_data_path_are_one_or_the_other(in_work_dir) -> None:
    _write(in_work_dir / "a.json", [json.dumps({"text": "hello"})])
    with pytest.raises(ArgumentError, match="^--train-data .* and --data-path .* cannot both"):
        validated(V1 + " --train-data a.json --data-path somewhere")


def test_a_cache_folder_that_cannot_be_created_is_named(in_work_dir) -> None:
    _write(in_work_dir / "a.json", [json.dumps({"text": "hello"})])
    (in_work_dir / "plain_file").write_text("not a folder")
    with pytest.raises(ArgumentError, match="^--cache-dir plain_file/cache: cannot be created, "):
        validated(V1 + " --train-data a.json --cache-dir plain_file/cache")
