"""`build_tokenizer(args)` and vocabulary padding, as in Megatron."""

from __future__ import annotations

from argparse import Namespace

from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

SUPPORTED_TOKENIZERS = ("GPT2BPETokenizer",)


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


def build_tokenizer(args: Namespace) -> GPT2BPETokenizer:
    """Build the tokenizer named by --tokenizer-type and set `args.padded_vocab_size`.

    Reads `tokenizer_type`, `vocab_file`, `merge_file`, and optionally `rank` (only rank 0
    logs), `make_vocab_size_divisible_by` (default 128) and `tensor_model_parallel_size`.
    """
    verbose = getattr(args, "rank", 0) == 0
    if verbose:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    if args.tokenizer_type not in SUPPORTED_TOKENIZERS:
        raise ValueError(
            f"--tokenizer-type {args.tokenizer_type} is not supported; "
            f"choose one of {', '.join(SUPPORTED_TOKENIZERS)}"
        )
    if not args.vocab_file or not args.merge_file:
        raise ValueError(
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file "
            "(the GPT-2 files are in dataset/gpt2-vocab.json and dataset/gpt2-merges.txt)"
        )
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    args.tokenizer_vocab_size = tokenizer.vocab_size  # the dataset's token ids must be below
    args.padded_vocab_size = vocab_size_with_padding(
        tokenizer.vocab_size,
        getattr(args, "make_vocab_size_divisible_by", 128),
        getattr(args, "tensor_model_parallel_size", 1),
        verbose=verbose,
    )
    return tokenizer
