"""Checkpoint conversion tools: reshard, to/from Hugging Face GPT-2, LLaMA and Mixtral, and to
Megatron-LM's (megatron-core's) torch_dist layout."""

from __future__ import annotations

import importlib.util

from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.extensions import install_hint
from megatron.tokenizer.gpt2_bpe import TokenizerFileError

# What a bad input raises in the conversion tools, besides OSError: each becomes a one-line
# error through tools.cli_errors.run_tool. RuntimeError is torch.load's for a damaged file,
# ImportError a missing transformers / safetensors.
CONVERSION_ERRORS = (CheckpointConversionError, TokenizerFileError, RuntimeError, ImportError)


def require_hf_packages(what: str, packages: tuple[str, ...] = ("transformers", "safetensors")):
    """Stop before any work when `packages` (the `hf` extra's) are missing: an ImportError whose
    one line names them and the extra."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        names = " ".join(missing)
        raise ImportError(f"{what} needs {' and '.join(missing)}: {install_hint(names, 'hf')}")
