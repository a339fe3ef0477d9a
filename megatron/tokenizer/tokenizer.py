"""`build_tokenizer(args)` and vocabulary padding, as in Megatron.

`create_tokenizer(TokenizerConfig)` builds one of Megatron's tokenizer types from its files:
GPT2BPETokenizer (--vocab-file, --merge-file), the SentencePiece types SentencePieceTokenizer,
GPTSentencePieceTokenizer and Llama2Tokenizer, HFTokenizer and TikTokenizer (--tokenizer-model
for those), and NullTokenizer (no file: --vocab-size integer ids).
"""

from __future__ import annotations

import importlib.util
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass

from megatron.tokenizer.base import (
    MODEL_FILE_TOKENIZERS,
    Tokenizer,
    TokenizerFileError,
    missing_tokenizer_model,
)
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.tokenizer.tiktoken_tokenizer import (
    DEFAULT_VOCAB_SIZE,
    PIP_HINT,
    TikTokenizer,
    special_token_list,
)

SUPPORTED_TOKENIZERS = ("GPT2BPETokenizer", *MODEL_FILE_TOKENIZERS, "NullTokenizer")


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer to build, from which files (Megatron's tokenizer flags)."""

    tokenizer_type: str = "GPT2BPETokenizer"
    """--tokenizer-type: one of SUPPORTED_TOKENIZERS."""
    vocab_file: str | None = None
    """--vocab-file: GPT-2's vocab.json (GPT2BPETokenizer)."""
    merge_file: str | None = None
    """--merge-file: GPT-2's merges.txt (GPT2BPETokenizer)."""
    tokenizer_model: str | None = None
    """--tokenizer-model: the SentencePiece model or Hugging Face tokenizer of the other types."""
    vocab_extra_ids: int = 0
    """--vocab-extra-ids: `<extra_id_N>` sentinels SentencePieceTokenizer adds (T5 style)."""
    vocab_size: int | None = None
    """--vocab-size: NullTokenizer's ids, or TikTokenizer's whole vocabulary (default 2**17)."""
    null_tokenizer_eod_id: int | None = None
    """--null-tokenizer-eod-id: NullTokenizer's end of document (default vocab_size - 1)."""
    tiktoken_pattern: str | None = None
    """--tiktoken-pattern: TikTokenizer's pre-tokenizer regex, v1 or v2 (the default)."""
    tiktoken_num_special_tokens: int = 1000
    """--tiktoken-num-special-tokens: TikTokenizer's ids before the file's tokens."""
    tokenizer_special_tokens: tuple[str, ...] | None = None
    """--tokenizer-special-tokens: TikTokenizer's named special tokens, in id order."""

    @classmethod
    def from_args(cls, args: Namespace) -> TokenizerConfig:
        """The tokenizer flags of a parsed namespace (absent ones take the defaults)."""
        return cls(
            tokenizer_type=getattr(args, "tokenizer_type", None) or "GPT2BPETokenizer",
            vocab_file=getattr(args, "vocab_file", None),
            merge_file=getattr(args, "merge_file", None),
            tokenizer_model=getattr(args, "tokenizer_model", None),
            vocab_extra_ids=getattr(args, "vocab_extra_ids", None) or 0,
            vocab_size=getattr(args, "vocab_size", None),
            null_tokenizer_eod_id=getattr(args, "null_tokenizer_eod_id", None),
            tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
            tiktoken_num_special_tokens=_or_default(args, "tiktoken_num_special_tokens", 1000),
            tokenizer_special_tokens=_tuple_or_none(
                getattr(args, "tokenizer_special_tokens", None)
            ),
        )


def _or_default(args: Namespace, name: str, default: int) -> int:
    value = getattr(args, name, None)
    return default if value is None else value


def _tuple_or_none(values: list[str] | None) -> tuple[str, ...] | None:
    return tuple(values) if values else None


_MODEL_FILE_BUILDERS: dict[str, Callable[[TokenizerConfig], Tokenizer]] = {
    "SentencePieceTokenizer": lambda config: SentencePieceTokenizer(
        config.tokenizer_model, config.vocab_extra_ids
    ),
    "GPTSentencePieceTokenizer": lambda config: GPTSentencePieceTokenizer(config.tokenizer_model),
    "Llama2Tokenizer": lambda config: Llama2Tokenizer(config.tokenizer_model),
    "HFTokenizer": lambda config: HFTokenizer(config.tokenizer_model),
    "TikTokenizer": lambda config: TikTokenizer(
        config.tokenizer_model,
        config.tiktoken_pattern,
        config.vocab_size,
        config.tiktoken_num_special_tokens,
        config.tokenizer_special_tokens,
    ),
}


def tokenizer_flag_problem(config: TokenizerConfig) -> str | None:
    """The one-line problem with the tokenizer flags, found before any file is read, or None."""
    kind = config.tokenizer_type
    if kind == "NullTokenizer":
        if config.vocab_size is None or config.vocab_size < 1:
            return (
                "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 1): its text is "
                "integer token ids below N, end of document N - 1"
            )
        eod = config.null_tokenizer_eod_id
        if eod is not None and not 0 <= eod < config.vocab_size:
            return (
                f"--null-tokenizer-eod-id {eod}: must be an id below --vocab-size "
                f"{config.vocab_size}"
            )
    if kind == "TikTokenizer":
        vocab_size = config.vocab_size or DEFAULT_VOCAB_SIZE
        special = config.tiktoken_num_special_tokens
        if not 0 <= special < vocab_size:
            return (
                f"--tiktoken-num-special-tokens {special} must be at least 0 and below "
                f"--vocab-size {vocab_size}"
            )
        try:
            special_token_list(config.tokenizer_special_tokens, special)
        except ValueError as error:
            return str(error)
        if importlib.util.find_spec("tiktoken") is None:
            return f"--tokenizer-type TikTokenizer needs tiktoken: {PIP_HINT}"
    return missing_tokenizer_model(kind, config.tokenizer_model)


def create_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """The tokenizer `config` names; ValueError naming the flag for a missing or bad file."""
    kind = config.tokenizer_type
    if kind not in SUPPORTED_TOKENIZERS:
        raise ValueError(
            f"--tokenizer-type {kind} is not supported; choose one of "
            f"{', '.join(SUPPORTED_TOKENIZERS)}"
        )
    if kind == "GPT2BPETokenizer":
        if not config.vocab_file or not config.merge_file:
            raise ValueError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file "
                "(the GPT-2 files are in dataset/gpt2-vocab.json and dataset/gpt2-merges.txt)"
            )
        return GPT2BPETokenizer(config.vocab_file, config.merge_file)
    if kind == "NullTokenizer":
        return NullTokenizer(config.vocab_size, config.null_tokenizer_eod_id)
    problem = missing_tokenizer_model(kind, config.tokenizer_model)
    if problem:
        raise ValueError(problem)
    return _MODEL_FILE_BUILDERS[kind](config)


def vocab_size_with_padding(
    orig_vocab_size: int,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
    verbose: bool = True,
) -> int:
    """Smallest multiple of divisible_by x TP size that holds the vocabulary, logged like Megatron.

    Padding keeps every tensor-parallel shard of the embedding the same, GEMM-friendly size.
    """
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            "--make-vocab-size-divisible-by and --tensor-model-parallel-size must be >= 1, got "
            f"{make_vocab_size_divisible_by} and {tensor_model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    padded = -(-orig_vocab_size // multiple) * multiple
    if verbose:
        print(
            f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy "
            f"tokens (new size: {padded})",
            flush=True,
        )
    return padded


def embedding_rows(config: TokenizerConfig, tokenizer_ids: int, verbose: bool = False) -> int:
    """The embedding's rows before padding: the tokenizer's ids, or `--vocab-size` where a
    tokenizer that reads its vocabulary from files is given one (a published model's rows,
    more than its tokenizer's ids; Megatron-LM's Llama-3 recipe passes the tokenizer's own
    count). Fewer rows than the files give ids is refused (`TokenizerFileError`, one line)."""
    asked = config.vocab_size
    if asked is None or config.tokenizer_type in ("NullTokenizer", "TikTokenizer"):
        return tokenizer_ids  # those two are built from --vocab-size itself
    if asked < tokenizer_ids:
        raise TokenizerFileError(
            f"--vocab-size {asked:,} is below the {tokenizer_ids:,} ids of --tokenizer-type "
            f"{config.tokenizer_type}: every id needs an embedding row (drop --vocab-size, or "
            f"give at least {tokenizer_ids:,})"
        )
    if verbose and asked > tokenizer_ids:
        print(
            f" > --vocab-size {asked:,}: the embedding's rows (the tokenizer has "
            f"{tokenizer_ids:,} ids)",
            flush=True,
        )
    return asked


def tokenizer_with_sizes(
    args: Namespace, verbose: bool | None = None
) -> tuple[Tokenizer, dict[str, int]]:
    """The tokenizer named by --tokenizer-type, and the vocabulary sizes it gives the run:
    `tokenizer_vocab_size` (the tokenizer's size: the dataset's token ids must be below it)
    and `padded_vocab_size` (the embedding's rows: `embedding_rows`, padded). Nothing is set
    on `args`.

    Reads the `TokenizerConfig` fields (`tokenizer_type`, `vocab_file`, `merge_file`,
    `tokenizer_model`, `vocab_extra_ids`, `vocab_size`, ...), and optionally
    `make_vocab_size_divisible_by` (default 128) and `tensor_model_parallel_size`. `verbose`
    (default: on rank 0 only, `args.rank` as Megatron's, else torch.distributed's) prints what
    is built and the padding.
    """
    if verbose is None and getattr(args, "rank", None) is not None:
        verbose = args.rank == 0  # Megatron's `args.rank`
    elif verbose is None:
        import torch.distributed as dist  # here: the data tools tokenize without torch

        verbose = not dist.is_initialized() or dist.get_rank() == 0
    config = TokenizerConfig.from_args(args)
    if verbose:
        print(f"> building {config.tokenizer_type} tokenizer ...", flush=True)
    tokenizer = create_tokenizer(config)
    padded = vocab_size_with_padding(
        embedding_rows(config, tokenizer.vocab_size, verbose),
        getattr(args, "make_vocab_size_divisible_by", 128),
        getattr(args, "tensor_model_parallel_size", 1),
        verbose=verbose,
    )
    return tokenizer, {"tokenizer_vocab_size": tokenizer.vocab_size, "padded_vocab_size": padded}


def build_tokenizer(args: Namespace, verbose: bool | None = None) -> Tokenizer:
    """Megatron's `build_tokenizer`: `tokenizer_with_sizes`, setting the two sizes on `args`
    (a namespace of one's own; a validated run's is read-only and takes them with
    `megatron.settled_args.with_settled`)."""
    tokenizer, sizes = tokenizer_with_sizes(args, verbose)
    for name, value in sizes.items():
        setattr(args, name, value)
    return tokenizer
