"""Tokenizers: Megatron's `build_tokenizer`, the GPT-2 byte-level BPE, SentencePiece and HF."""

from megatron.tokenizer.base import Tokenizer, TokenizerFileError
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
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
    "SUPPORTED_TOKENIZERS",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "TokenizerFileError",
    "build_tokenizer",
    "create_tokenizer",
    "vocab_size_with_padding",
]
