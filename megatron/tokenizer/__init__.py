"""Tokenizers: Megatron's `build_tokenizer` and the GPT-2 byte-level BPE."""

from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer, TokenizerFileError
from megatron.tokenizer.tokenizer import build_tokenizer, vocab_size_with_padding

__all__ = ["GPT2BPETokenizer", "TokenizerFileError", "build_tokenizer", "vocab_size_with_padding"]
