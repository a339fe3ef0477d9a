"""`--tokenizer-type HFTokenizer`: a Hugging Face tokenizer, loaded offline.

--tokenizer-model is a `tokenizer.json` file (read with the `tokenizers` library alone) or a
folder `AutoTokenizer` loads (or a model name already in the local Hugging Face cache; nothing
is downloaded), which needs `transformers`. Token ids are the tokenizer's own `encode` with
its special tokens (a LLaMA tokenizer's `<s>` included), as Megatron's HFTokenizer;
`vocab_size` is `len(tokenizer)`, added tokens included, as Megatron-LM's. End of document is
the tokenizer's eos token; a bare `tokenizer.json` names none, so the first of
`EOS_CANDIDATES` it has is taken.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from megatron.extensions import install_hint
from megatron.tokenizer.base import TokenizerFileError, checked_ids

# End-of-text tokens of common tokenizer families (GPT-2/NeoX, LLaMA 1-2, LLaMA 3, Gemma...),
# tried in this order when the tokenizer does not name its eos token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<EOS>", "[EOS]")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "<BOS>", "[BOS]")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "<PAD>", "[PAD]")
SPECIAL_NAMES = ("eos", "bos", "pad", "cls", "sep", "mask")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _load_tokenizer_json(path: str) -> Any:
    """`tokenizers.Tokenizer` of a tokenizer.json file; errors name --tokenizer-model."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(
            "--tokenizer-type HFTokenizer needs tokenizers: pip install tokenizers"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # the Rust loader raises a bare Exception for every failure
        raise TokenizerFileError(
            f"--tokenizer-model {path}: not a Hugging Face tokenizer.json ({_first_line(error)}); "
            "give a tokenizer.json file or a tokenizer folder"
        ) from None


def _load_pretrained(name_or_folder: str) -> Any:
    """`AutoTokenizer.from_pretrained(..., local_files_only=True)`; errors name the flag."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(
            f"--tokenizer-model {name_or_folder}: loading a Hugging Face tokenizer folder needs "
            f"transformers (a tokenizer.json file needs only tokenizers): "
            f"{install_hint('transformers', 'hf')}"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(name_or_folder, local_files_only=True)
    except Exception as error:  # OSError, ValueError, ...: whatever the folder's class raises
        where = "" if os.path.isdir(name_or_folder) else "no such file or folder, and "
        raise TokenizerFileError(
            f"--tokenizer-model {name_or_folder}: {where}no Hugging Face tokenizer could be "
            f"loaded from it offline ({_first_line(error)})"
        ) from None


class HFTokenizer:
    """Megatron's HFTokenizer API over a Hugging Face tokenizer (`tokenize`, `eod`, ...)."""

    def __init__(self, tokenizer_model: str) -> None:
        self.tokenizer_model = tokenizer_model
        named: dict[str, int | None] = {}
        self._pretrained: Any = None  # the transformers tokenizer of a folder (chat template)
        if tokenizer_model.endswith(".json") and not os.path.exists(tokenizer_model):
            raise TokenizerFileError(f"--tokenizer-model {tokenizer_model}: no such file")
        if os.path.isfile(tokenizer_model):
            backend = _load_tokenizer_json(tokenizer_model)
            self._decode: Callable[[list[int]], str] = lambda ids: backend.decode(
                ids, skip_special_tokens=False
            )
            length = backend.get_vocab_size(with_added_tokens=True)
        else:
            pretrained = self._pretrained = _load_pretrained(tokenizer_model)
            backend = (
                pretrained.backend_tokenizer if getattr(pretrained, "is_fast", False) else None
            )
            self._decode = pretrained.decode
            length = len(pretrained)
            named = {name: getattr(pretrained, f"{name}_token_id", None) for name in SPECIAL_NAMES}
        if backend is not None:  # a fast tokenizer's encode is its Rust backend's, less overhead
            self._encode: Callable[[str], list[int]] = lambda text: backend.encode(text).ids
            self._encode_plain: Callable[[str], list[int]] = lambda text: (
                backend.encode(text, add_special_tokens=False).ids
            )
            self._vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        else:
            self._encode, self._vocab = pretrained.encode, pretrained.get_vocab()
            self._encode_plain = lambda text: pretrained.encode(text, add_special_tokens=False)
        # len(tokenizer), as Megatron-LM; larger only if some added id leaves a gap below it.
        self._vocab_size = max(length, max(self._vocab.values(), default=-1) + 1)
        self.eos_id = self._special(named.get("eos"), EOS_CANDIDATES)
        self.bos_id = self._special(named.get("bos"), BOS_CANDIDATES)
        self.pad_id = self._special(named.get("pad"), PAD_CANDIDATES)
        self.cls_id, self.sep_id, self.mask_id = (named.get(n) for n in ("cls", "sep", "mask"))
        if self.eos_id is None:
            raise TokenizerFileError(
                f"--tokenizer-model {tokenizer_model}: the tokenizer names no eos token and has "
                f"none of {', '.join(EOS_CANDIDATES)}; HFTokenizer ends documents with it (set "
                "eos_token in its tokenizer_config.json)"
            )

    def _special(self, named: int | None, candidates: Sequence[str]) -> int | None:
        """The id the tokenizer names, else that of the first candidate it has, else None."""
        if named is not None:
            return named
        return next((self._vocab[t] for t in candidates if t in self._vocab), None)

    @property
    def vocab_size(self) -> int:
        """`len(tokenizer)`: the base vocabulary and added tokens (before padding)."""
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        """Token string to id, added tokens included."""
        return self._vocab

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token string."""
        return {token_id: token for token, token_id in self._vocab.items()}

    @property
    def eod(self) -> int:
        """The eos token's id: the end-of-document token."""
        return self.eos_id

    @property
    def eos(self) -> int:
        """The eos token's id."""
        return self.eos_id

    @property
    def bos(self) -> int | None:
        """The bos token's id (None if the tokenizer has none)."""
        return self.bos_id

    @property
    def pad(self) -> int | None:
        """The pad token's id (None if the tokenizer has none)."""
        return self.pad_id

    @property
    def cls(self) -> int | None:
        """The cls token's id (None if the tokenizer has none)."""
        return self.cls_id

    @property
    def sep(self) -> int | None:
        """The sep token's id (None if the tokenizer has none)."""
        return self.sep_id

    @property
    def mask(self) -> int | None:
        """The mask token's id (None if the tokenizer has none)."""
        return self.mask_id

    def tokenize(self, text: str) -> list[int]:
        """The tokenizer's encoding of `text`, with the special tokens it adds."""
        return self._encode(text)

    def tokenize_to_array(self, text: str) -> np.ndarray:
        """`tokenize` as an int32 numpy array (the preprocessing path)."""
        return np.asarray(self._encode(text), dtype=np.int32)

    def detokenize(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """The tokenizer's decoding of the ids, special tokens kept."""
        return self._decode(checked_ids(token_ids, self._vocab_size))

    def tokenize_without_special_tokens(self, text: str) -> np.ndarray:
        """Ids of `text` without the special tokens the tokenizer adds around a text (a
        LLaMA's `<s>`); special-token text inside it still becomes those tokens. A chat
        template's text is tokenized so, as `apply_chat_template` does: it writes them."""
        return np.asarray(self._encode_plain(text), dtype=np.int32)

    @property
    def chat_template(self) -> str | dict | None:
        """The tokenizer's own chat template (a folder's); None for a bare tokenizer.json."""
        return getattr(self._pretrained, "chat_template", None)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The text of `messages` rendered with the tokenizer's own chat template."""
        return self._pretrained.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
