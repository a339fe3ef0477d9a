"""Tokenize a loose-JSON corpus (or Parquet, or a saved HF dataset) into Megatron's `.bin/.idx`.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --vocab-file dataset/gpt2-vocab.json --merge-file dataset/gpt2-merges.txt \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 8
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/llama \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model \\
        --append-eod --workers 8
    python tools/preprocess_data.py --input chats.jsonl alpaca.parquet --output-prefix data/sft \\
        --sft --sft-tokenizer-prompt-format chatml --workers 8

--input also takes Parquet files (`.parquet`), Arrow files and folders written by Hugging Face
`datasets`' `save_to_disk`, read locally with pyarrow (`pip install pyarrow`): each row is read
as the JSON object of its columns, so the same text gives the same bytes (see
`megatron/data/corpus_reader.py`; error positions `path:N` count rows there).

--sft reads SFT records instead of --json-keys documents: conversations (`{"messages":
[{"role", "content"}, ...]}`, rendered with the tokenizer's chat template, or a built-in one
named by --sft-tokenizer-prompt-format, or a Jinja file given by --chat-template), Alpaca
records (`{"instruction", "input", "output"}`) and `{"prompt", "response"}` records. It writes
`{output_prefix}_sft_document.bin/.idx` (the tokens, each conversation or record one document
ending with the end-of-document token) and `{output_prefix}_sft_document_loss_mask.bin/.idx`
beside it (uint8, 1 on the reply tokens to train on), which `pretrain_gpt.py --data-path
{output_prefix}_sft_document` reads. See `megatron/data/sft_encoder.py` for how the reply
tokens are found.

--tokenizer-type SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer read a
SentencePiece `.model` file, HFTokenizer a Hugging Face tokenizer folder or `tokenizer.json`,
TikTokenizer a tiktoken JSON vocabulary (with --vocab-size, --tiktoken-pattern,
--tiktoken-num-special-tokens, --tokenizer-special-tokens as Megatron-LM), all given with
--tokenizer-model; NullTokenizer --vocab-size N reads text that is already integer ids. Token
ids are stored as uint16 when the vocabulary has fewer than 65,500 tokens, else int32, as
Megatron does.

Writes `{output_prefix}_{key}_document.bin/.idx` (`_sentence` with --split-sentences) for
every --json-keys key, byte for byte what Megatron-LM's preprocess_data.py writes for the
same input and vocabulary. Input is streamed (memory stays bounded), progress goes to stderr,
and output appears under its final name only once it is complete: a bad line stops the run
(or is skipped and counted with --skip-bad-lines) and leaves earlier output untouched.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import numpy as np  # noqa: E402

from megatron.data.chat_templates import (  # noqa: E402
    PROMPT_FORMATS,
    TOKENIZER_TEMPLATE,
    template_problem,
)
from megatron.data.corpus_reader import InputError, expand_inputs  # noqa: E402
from megatron.data.corpus_tokenizer import TokenizeOptions, tokenize_corpus  # noqa: E402
from megatron.data.document_encoder import EncoderConfig  # noqa: E402
from megatron.data.loss_mask import LOSS_MASK_DTYPE, LOSS_MASK_SUFFIX  # noqa: E402
from megatron.data.sft_encoder import SFTConfig  # noqa: E402
from megatron.tokenizer.base import TokenizerFileError  # noqa: E402
from megatron.tokenizer.flags import add_vocabulary_flags  # noqa: E402
from megatron.tokenizer.tokenizer import (  # noqa: E402
    SUPPORTED_TOKENIZERS,
    TokenizerConfig,
    tokenizer_flag_problem,
)
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
DEFAULT_VOCAB = os.path.join(REPO_ROOT, "dataset", "gpt2-vocab.json")
DEFAULT_MERGES = os.path.join(REPO_ROOT, "dataset", "gpt2-merges.txt")


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse Megatron's preprocess_data flags (plus --skip-bad-lines)."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="loose-JSON files (one object per line; .gz read too), Parquet or Arrow files, or "
        "folders of a Hugging Face dataset saved with save_to_disk; globs allowed",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to extract from each JSON object (default: text)",
    )
    group.add_argument(
        "--split-sentences", action="store_true", help="split documents into sentences (NLTK punkt)"
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="keep newlines between sentences when splitting",
    )
    group.add_argument(
        "--sft",
        action="store_true",
        help="records are SFT data (conversations under 'messages', Alpaca's instruction/input/"
        "output, or prompt/response): write the tokens as {output-prefix}_sft_document (each "
        "conversation or record one document ending with the end-of-document token, as with "
        "--append-eod) and their loss mask (1 on the replies) beside them as "
        "..._sft_document_loss_mask",
    )
    group.add_argument(
        "--sft-tokenizer-prompt-format",
        default=TOKENIZER_TEMPLATE,
        choices=PROMPT_FORMATS,
        help="chat template of --sft conversations: default is the tokenizer's own (a Hugging "
        "Face tokenizer folder's); or a built-in one (default: %(default)s)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file (as Hugging Face's chat_template) for --sft "
        "conversations, instead of --sft-tokenizer-prompt-format",
    )
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=SUPPORTED_TOKENIZERS,
        help="tokenizer to use (default: %(default)s)",
    )
    group.add_argument("--vocab-file", default=DEFAULT_VOCAB, help="GPT-2 vocab JSON")
    group.add_argument("--merge-file", default=DEFAULT_MERGES, help="GPT-2 BPE merges")
    group.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece .model file (SentencePieceTokenizer, GPTSentencePieceTokenizer, "
        "Llama2Tokenizer), Hugging Face tokenizer folder or tokenizer.json (HFTokenizer), or "
        "tiktoken JSON vocabulary (TikTokenizer)",
    )
    add_vocabulary_flags(group)
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token (<|endoftext|> for GPT-2) to each document",
    )
    group.add_argument("--lang", default="english", help="language of the NLTK punkt model")
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", required=True, help="prefix of the output files, without _{key}_document"
    )
    group.add_argument(
        "--dataset-impl",
        default="mmap",
        choices=["lazy", "cached", "mmap"],
        help="only mmap, Megatron's default, is supported",
    )
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    group.add_argument(
        "--chunk-size", type=int, default=25, help="lines sent to a worker at a time"
    )
    group.add_argument(
        "--log-interval", type=int, default=100, help="report progress every this many documents"
    )
    group.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip unusable lines (bad JSON or UTF-8, missing key, empty "
        "document) and count them, instead of stopping at the first",
    )
    args = parser.parse_args(argv)
    for flag in ("workers", "chunk_size", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
            )
    problem = tokenizer_flag_problem(TokenizerConfig.from_args(args))
    if problem:
        parser.error(problem)
    if args.dataset_impl != "mmap":
        parser.error(f"--dataset-impl {args.dataset_impl} is not supported; use mmap")
    problem = _sft_flag_problem(args, parser.get_default("json_keys"))
    if problem:
        parser.error(problem)
    if args.keep_newlines and not args.split_sentences:
        print(
            "note: --keep-newlines only matters with --split-sentences; newlines inside "
            "documents are always kept",
            file=sys.stderr,
        )
    check_output_path(args.output_prefix, "--output-prefix")
    args.input_files = expand_inputs(args.input)  # InputError names a missing file
    return args


def _sft_flag_problem(args: argparse.Namespace, default_keys: list[str]) -> str | None:
    """What is wrong with the SFT flags (None when nothing is)."""
    template_flags = args.chat_template or args.sft_tokenizer_prompt_format != TOKENIZER_TEMPLATE
    if not args.sft:
        return (
            "--sft-tokenizer-prompt-format and --chat-template need --sft"
            if template_flags
            else None
        )
    if args.split_sentences:
        return "--split-sentences does not apply to --sft records (a conversation is a document)"
    if args.json_keys != default_keys:
        return (
            f"--json-keys {' '.join(args.json_keys)}: --sft reads records by their keys "
            "(messages; instruction, input, output; prompt, response)"
        )
    return template_problem(args.sft_tokenizer_prompt_format, args.chat_template)


def preprocess(args: argparse.Namespace) -> int:
    """Run the conversion; returns the process exit code."""
    config = EncoderConfig(
        json_keys=args.json_keys,
        tokenizer=TokenizerConfig.from_args(args),
        append_eod=args.append_eod,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
        sft=SFTConfig(args.sft_tokenizer_prompt_format, args.chat_template) if args.sft else None,
    )
    options = TokenizeOptions(
        workers=args.workers,
        chunk_size=args.chunk_size,
        log_interval=args.log_interval,
        skip_bad_lines=args.skip_bad_lines,
        input_label=f"--input {' '.join(args.input)}",
    )
    try:
        summary = tokenize_corpus(args.input_files, args.output_prefix, config, options)
    except KeyboardInterrupt:
        print("\ninterrupted: no output was written", file=sys.stderr)
        return 130
    for prefix, builder in summary.outputs.items():
        if prefix.endswith(LOSS_MASK_SUFFIX):
            trained = int(np.memmap(prefix + ".bin", dtype=LOSS_MASK_DTYPE, mode="r").sum())
            what = f"loss mask: {trained} of {builder.num_tokens} tokens trained on"
        else:
            what = (
                f"{builder.num_documents} documents, {builder.num_sequences} sequences, "
                f"{builder.num_tokens} tokens"
            )
        print(f"wrote {prefix}.bin/.idx: {what} ({builder.dtype.name})", file=sys.stderr)
    return 0


def run(argv: list[str] | None) -> int:
    """Parse the flags, then preprocess; raises on bad input."""
    args = get_args(argv)
    print(f"Opening {', '.join(args.input_files)}", file=sys.stderr)
    return preprocess(args)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input, nothing written."""
    return run_tool(
        lambda: run(argv),
        (InputError, TokenizerFileError, ImportError),
        note="no output was written (earlier files under that --output-prefix are untouched)",
    )


if __name__ == "__main__":
    sys.exit(main())
