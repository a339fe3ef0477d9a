"""Megatron-LM v1's flags, as DeepSpeed's Megatron-LM GPT-2 tutorial passes them, in today's terms.

DeepSpeed's tutorial runs DeepSpeedExamples' copy of Megatron-LM v1 (`scripts/pretrain_gpt2.sh`,
`ds_pretrain_gpt2.sh`, `ds_zero2_pretrain_gpt2_model_parallel.sh`) and its v1.1.5 3D-parallel
fork. Their flags parse here with v1's meanings and become today's settings before anything
else reads them, so past `validate_args` the code sees one meaning per setting:

| v1 | here |
|---|---|
| `--batch-size B` | `--micro-batch-size B` (global batch: B x data-parallel size, x `--gas`) |
| `--model-parallel-size N` | `--tensor-model-parallel-size min(N, world size)`, as v1 clamped it |
| `--pipe-parallel-size N` | `--pipeline-model-parallel-size N`; 0 (v1.1.5's default): no pipeline |
| `--gas G` | global batch = `--batch-size` x data-parallel size x G |
| `--warmup F` | `--lr-warmup-fraction F` (of `--lr-decay-iters`, else `--train-iters`) |
| `--intermediate-size` | `--ffn-hidden-size` |
| `--train-data`, `--text-key`, `--cache-dir` | loose JSON tokenized into a cached `--data-path` |

A v1 flag and today's flag for the same setting may both be given only with the same value.
A command line with any v1-only flag also gets v1's defaults where they differ from
Megatron's: a checkpoint every 5000 iterations when `--save` has no `--save-interval`, and a
1% warmup when no warmup flag is given. Each such choice is a start-up line.
"""

from __future__ import annotations

import argparse
import gzip
import os

from megatron.arguments.errors import ArgumentError
from megatron.atomic_files import nearest_existing
from megatron.data.json_corpus import JsonCorpus
from megatron.tokenizer.tokenizer import TokenizerConfig

# Megatron-LM v1's corpus names (data_utils/corpora.py), relative to the working directory.
V1_CORPORA = {
    "webtext": "data/webtext/data.json",
    "wikipedia": "data/wikipedia/wikidump_lines.json",
}
V1_SAVE_INTERVAL = 5000
V1_WARMUP = 0.01
# Today's flag -> other spellings of the same setting (Megatron-LM v1's, Megatron-DeepSpeed's)
# and v1 flags the setting fixes with it: a tool that rewrites a command line (the dry run's
# suggestions) removes these when it sets the flag, so the two cannot contradict each other.
OLDER_SPELLINGS: dict[str, tuple[str, ...]] = {
    "--micro-batch-size": ("--batch-size",),
    "--global-batch-size": ("--gas",),
    "--tensor-model-parallel-size": ("--model-parallel-size",),
    "--pipeline-model-parallel-size": ("--pipe-parallel-size",),
    "--recompute-granularity": ("--checkpoint-activations", "--recompute-activations"),
}

_WARMUP_FLAGS = ("lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_tokens")
# The v1 flags that mark a command line as v1's (and so take v1's defaults).
_V1_ONLY = (
    "batch_size",
    "model_parallel_size",
    "pipe_parallel_size",
    "gas",
    "warmup",
    "train_data",
    "text_key",
    "cache_dir",
    "loose_json",
    "lazy_loader",
    "resume_dataloader",
    "intermediate_size",
)


def add_v1_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM v1 (and v1.1.5) spellings, each with the setting it means here."""
    group = parser.add_argument_group(
        "Megatron-LM v1 spellings (DeepSpeed's Megatron-LM GPT-2 tutorial scripts)"
    )
    group.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="v1: --micro-batch-size, each data-parallel rank's batch; the global batch is it "
        "x data-parallel size (x --gas) unless --global-batch-size or the DeepSpeed config "
        "says otherwise.",
    )
    group.add_argument(
        "--model-parallel-size",
        type=int,
        default=None,
        help="v1: --tensor-model-parallel-size; as in v1, at most the world size.",
    )
    group.add_argument(
        "--pipe-parallel-size",
        type=int,
        default=None,
        help="v1.1.5: --pipeline-model-parallel-size on DeepSpeed's pipeline engine; 0 (v1.1.5's "
        "default) means no pipeline engine (--no-pipeline-parallel).",
    )
    group.add_argument(
        "--gas",
        type=int,
        default=None,
        help="v1.1.5: gradient accumulation steps; the global batch is --batch-size x "
        "data-parallel size x this.",
    )
    group.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="v1: the fraction (0 to 1) of --lr-decay-iters (else --train-iters) to warm the "
        "learning rate up over, v1's formula (--lr-warmup-fraction); default 0.01 on a v1 "
        "command line.",
    )
    group.add_argument("--intermediate-size", type=int, default=None, help="v1: --ffn-hidden-size.")
    group.add_argument(
        "--train-data",
        nargs="+",
        default=None,
        help="v1: loose-JSON files (one object per line, the document under --text-key) or "
        "v1's corpus names (webtext: data/webtext/data.json, wikipedia: "
        "data/wikipedia/wikidump_lines.json, under the working directory). On first use they "
        "are tokenized (all ranks share one build, with progress) into .bin/.idx files under "
        "--cache-dir, reused while the files are unchanged, then trained on as --data-path.",
    )
    group.add_argument(
        "--text-key",
        default=None,
        help="v1: the JSON key holding each --train-data document (default: text).",
    )
    group.add_argument(
        "--cache-dir",
        default=None,
        help="v1: where --train-data's tokens are cached (default: the first file's folder).",
    )
    group.add_argument(
        "--loose-json",
        action="store_true",
        help="v1: --train-data files hold one JSON object per line. Accepted: it is the one "
        "form read here (a file holding one JSON array is refused).",
    )
    group.add_argument(
        "--lazy-loader",
        action="store_true",
        help="v1: read the data lazily. Accepted: the tokenized files are always memory-mapped.",
    )
    group.add_argument(
        "--resume-dataloader",
        action="store_true",
        help="v1: resume the data position with the checkpoint. Accepted: it always resumes "
        "here (every checkpoint holds the consumed samples).",
    )
    for flag in ("--valid-data", "--test-data"):
        group.add_argument(
            flag,
            nargs="*",
            default=None,
            help="v1: separate evaluation files. Refused: --train-data is split by --split.",
        )


def _given(args: argparse.Namespace, typed: set[str] | None, dest: str) -> bool:
    value = getattr(args, dest, None)
    return value is not None and value is not False and (typed is None or dest in typed)


def _spell(args: argparse.Namespace, dest: str, spelling: str) -> None:
    """Messages about `dest` name the user's flag (see `errors.flag_name`)."""
    args.flag_spellings = {**(getattr(args, "flag_spellings", None) or {}), dest: spelling}


def _same_setting(
    args: argparse.Namespace, typed: set[str] | None, v1: str, current: str, value: object
) -> None:
    """Set `current` from v1's flag; today's flag typed with another value is an error."""
    v1_flag, flag = "--" + v1.replace("_", "-"), "--" + current.replace("_", "-")
    if _given(args, typed, current) and getattr(args, current) != value:
        raise ArgumentError(
            f"{v1_flag} {getattr(args, v1)} (Megatron-LM v1's spelling of {flag}) contradicts "
            f"{flag} {getattr(args, current)}; give one of them"
        )
    setattr(args, current, value)
    if typed is not None:
        typed.add(current)
    _spell(args, current, v1_flag)


def translate_v1_flags(args: argparse.Namespace, typed: set[str] | None, world_size: int) -> None:
    """Turn the v1 flags given into today's settings (see the module docstring)."""
    args.compat_notes = getattr(args, "compat_notes", None) or []
    for dest in (*_V1_ONLY, "valid_data", "test_data"):
        if not hasattr(args, dest):  # a namespace built in code, without this group
            setattr(args, dest, None)
    for flag in ("valid_data", "test_data"):
        if getattr(args, flag, None) is not None:
            raise ArgumentError(
                f"--{flag.replace('_', '-')}: separate evaluation files are not built here; "
                "--train-data is split into training, validation and test by --split"
            )
    if not any(_given(args, typed, dest) for dest in _V1_ONLY):
        return
    if _given(args, typed, "batch_size"):
        _same_setting(args, typed, "batch_size", "micro_batch_size", args.batch_size)
    if _given(args, typed, "intermediate_size"):
        _same_setting(args, typed, "intermediate_size", "ffn_hidden_size", args.intermediate_size)
    _parallel_layout(args, typed, world_size)
    _gradient_accumulation(args, typed, world_size)
    _warmup(args, typed)
    if _given(args, typed, "train_data") and _given(args, typed, "data_path"):
        raise ArgumentError(
            "--train-data (v1's loose-JSON files) and --data-path (.bin/.idx prefixes) cannot "
            "both be given"
        )
    unused = [
        f"--{dest.replace('_', '-')}" for dest in ("text_key", "cache_dir") if getattr(args, dest)
    ]
    if unused and not args.train_data:
        args.compat_notes.append(
            f" > {' and '.join(unused)}: not used without --train-data (they name the key and the "
            "token cache of its loose-JSON files)"
        )
    if getattr(args, "save", None) and getattr(args, "save_interval", None) is None:
        args.save_interval = V1_SAVE_INTERVAL
        args.compat_notes.append(
            f" > Megatron-LM v1 command line: --save every {V1_SAVE_INTERVAL} iterations (v1's "
            "default --save-interval)"
        )
    if args.resume_dataloader:
        args.compat_notes.append(
            " > --resume-dataloader: the data position always resumes with the checkpoint here"
        )


def _parallel_layout(args: argparse.Namespace, typed: set[str] | None, world_size: int) -> None:
    if _given(args, typed, "model_parallel_size"):
        size = args.model_parallel_size
        if size < 1:
            raise ArgumentError(f"--model-parallel-size {size}: must be at least 1")
        if size > world_size:
            args.compat_notes.append(
                f" > --model-parallel-size {size} is more than the {world_size} process(es): "
                f"tensor-parallel size {world_size}, as Megatron-LM v1 clamped it"
            )
        _same_setting(
            args, typed, "model_parallel_size", "tensor_model_parallel_size", min(size, world_size)
        )
    if args.pipe_parallel_size is None:
        return
    stages = args.pipe_parallel_size
    if stages < 0:
        raise ArgumentError(f"--pipe-parallel-size {stages}: must be 0 (no pipeline) or more")
    if stages == 0:
        if args.pipeline_model_parallel_size > 1:
            raise ArgumentError(
                "--pipe-parallel-size 0 (no pipeline) contradicts --pipeline-model-parallel-size "
                f"{args.pipeline_model_parallel_size}"
            )
        args.no_pipeline_parallel = True
        return
    _same_setting(args, typed, "pipe_parallel_size", "pipeline_model_parallel_size", stages)


def _gradient_accumulation(
    args: argparse.Namespace, typed: set[str] | None, world_size: int
) -> None:
    if args.gas is None:
        return
    if args.gas < 1:
        raise ArgumentError(f"--gas {args.gas}: must be at least 1")
    if args.micro_batch_size is None:
        raise ArgumentError("--gas needs --batch-size (the global batch is their product x DP)")
    # A data-parallel replica spans TP x PP ranks, and the sequence split's (Ulysses' or
    # context parallelism's) on top.
    split = (getattr(args, "ds_sequence_parallel_size", None) or 1) * (
        getattr(args, "context_parallel_size", None) or 1
    )
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * split
    if world_size % model_parallel != 0:
        return  # the layout's own check names the sizes
    data_parallel = world_size // model_parallel
    total = args.micro_batch_size * data_parallel * args.gas
    if _given(args, typed, "global_batch_size") and args.global_batch_size != total:
        raise ArgumentError(
            f"--gas {args.gas} x --batch-size {args.micro_batch_size} x data-parallel size "
            f"{data_parallel} = {total} contradicts --global-batch-size {args.global_batch_size}"
        )
    args.global_batch_size = total
    if typed is not None:
        typed.add("global_batch_size")
    _spell(args, "global_batch_size", "--batch-size x data-parallel size x --gas")


def _warmup(args: argparse.Namespace, typed: set[str] | None) -> None:
    # Without the typed set a flag counts as given when not None/False, but today's warmup
    # flags default to 0 (no warmup): only a nonzero one is the user's.
    others = [
        flag
        for flag in _WARMUP_FLAGS
        if _given(args, typed, flag) and (typed is not None or getattr(args, flag))
    ]
    if args.warmup is None:
        if not others:
            args.lr_warmup_fraction = V1_WARMUP
            args.compat_notes.append(
                f" > Megatron-LM v1 command line: warming up over {V1_WARMUP:g} of the decay "
                "iterations (v1's default --warmup)"
            )
        return
    if not 0 <= args.warmup <= 1:
        raise ArgumentError(
            f"--warmup {args.warmup:g}: Megatron-LM v1's --warmup is the fraction (0 to 1) of "
            "the decay iterations to warm up over; for a number of iterations use "
            "--lr-warmup-iters"
        )
    if others:
        other = "--" + others[0].replace("_", "-")
        raise ArgumentError(
            f"--warmup {args.warmup:g} (Megatron-LM v1's --lr-warmup-fraction) contradicts "
            f"{other} {getattr(args, others[0])}; give one of them"
        )
    args.lr_warmup_fraction = args.warmup


def train_data_corpus(args: argparse.Namespace) -> JsonCorpus:
    """`--train-data` as a `JsonCorpus`: its files, the key, the cache folder, the tokenizer."""
    files = train_data_files(args)
    cache_dir = os.path.abspath(args.cache_dir or os.path.dirname(files[0]))
    named = f"--cache-dir {args.cache_dir}" if args.cache_dir else f"the folder of {files[0]}"
    existing = nearest_existing(cache_dir)
    if not os.path.isdir(existing):
        raise ArgumentError(f"{named}: cannot be created, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        hint = "" if args.cache_dir else " (give --cache-dir DIR for the tokenized --train-data)"
        raise ArgumentError(f"{named}: not writable by this user{hint}")
    return JsonCorpus(
        sources=tuple(files),
        json_key=args.text_key or "text",
        cache_dir=cache_dir,
        tokenizer=TokenizerConfig.from_args(args),
        label=f"--train-data {' '.join(args.train_data)}",
    )


def train_data_files(args: argparse.Namespace) -> list[str]:
    """The files `--train-data` names, v1's corpus names resolved; each checked to be readable
    loose JSON (its first line), so a wrong path fails before anything starts."""
    files = []
    for entry in args.train_data:
        path = V1_CORPORA.get(entry, entry)
        named = f"--train-data {entry}"
        if entry in V1_CORPORA and not os.path.isfile(path):
            raise ArgumentError(
                f"{named}: Megatron-LM v1's name for {path}, which is not in the working "
                f"directory {os.getcwd()}"
            )
        if os.path.isdir(path):
            raise ArgumentError(f"{named}: a folder; give loose-JSON files")
        if not os.path.isfile(path):
            raise ArgumentError(f"{named}: no such file")
        if path.endswith((".csv", ".tsv")):
            raise ArgumentError(f"{named}: only loose-JSON files (one object per line) are read")
        _check_first_line(path, named)
        files.append(os.path.abspath(path))
    return files


def _check_first_line(path: str, named: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as stream:
            start = stream.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError as error:
        raise ArgumentError(f"{named}: cannot be read ({error})") from None
    if start.startswith(b"["):
        raise ArgumentError(
            f"{named}: holds one JSON array (v1's tight JSON); only loose JSON is read here: "
            "write one object per line"
        )
