"""Tokenizers: Megatron's `build_tokenizer`, the GPT-2 byte-level BPE, SentencePiece, HF,
tiktoken (TikTokenizer) and NullTokenizer."""

from megatron.tokenizer.base import Tokenizer, TokenizerFileError
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.tokenizer.tiktoken_tokenizer import TikTokenizer
from megatron.tokenizer.tokenizer import (
    SUPPORTED_TOKENIZERS,
    TokenizerConfig,
    build_tokenizer,
    create_tokenizer,
    vocab_size_with_padding,
)

__all__ = [
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HFTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SUPPORTED_TOKENIZERS",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "TokenizerFileError",
    "build_tokenizer",
    "create_tokenizer",
    "vocab_size_with_padding",
]
