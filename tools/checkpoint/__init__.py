"""Checkpoint conversion tools: reshard, to/from Hugging Face GPT-2, LLaMA and Mixtral, and to
Megatron-LM's (megatron-core's) torch_dist layout."""

from __future__ import annotations

from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.tokenizer.gpt2_bpe import TokenizerFileError

# What a bad input raises in the conversion tools, besides OSError: each becomes a one-line
# error through tools.cli_errors.run_tool. RuntimeError is torch.load's for a damaged file,
# ImportError a missing transformers / safetensors.
CONVERSION_ERRORS = (CheckpointConversionError, TokenizerFileError, RuntimeError, ImportError)
