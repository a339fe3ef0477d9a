"""The SentencePiece tokenizers of Megatron: SentencePiece, GPTSentencePiece and Llama2.

All three read a SentencePiece `.model` file (--tokenizer-model) and keep the token ids,
special tokens and end-of-document id of Megatron's classes of the same names:

- `GPTSentencePieceTokenizer`: the model's own pieces; end of document is the model's
  `</s>` (eos), and `tokenize` is the model's plain encode.
- `Llama2Tokenizer`: the same, with the model's `<s>` (bos) before every tokenized text, as
  Megatron-LM's `tokenize(text, bos=True, eos=False)`; a preprocessed document is then
  `<s> text </s>` with --append-eod.
- `SentencePieceTokenizer`: the pieces plus Megatron's special tokens `<CLS>`, `<SEP>`,
  `<EOD>`, `<MASK>`, the pad, bos and eos pieces (`<PAD>`, `<BOS>`, `<EOS>` when the model has
  none) and --vocab-extra-ids `<extra_id_N>` sentinels, each given the next free id unless it
  is a piece already. Their text inside a document becomes their id; end of document is
  `<EOD>`.

`sentencepiece` is imported when a tokenizer is built, not with this module.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

from megatron.tokenizer.base import TokenizerFileError, checked_ids


def load_sentencepiece(model_file: str, tokenizer_type: str) -> Any:
    """A `sentencepiece.SentencePieceProcessor` of `model_file`; errors name --tokenizer-model."""
    flag = f"--tokenizer-model {model_file}"
    try:
        with open(model_file, "rb") as stream:
            proto = stream.read()
    except IsADirectoryError:
        raise TokenizerFileError(
            f"{flag}: is a folder; --tokenizer-type {tokenizer_type} reads a SentencePiece "
            ".model file"
        ) from None
    except FileNotFoundError:
        raise TokenizerFileError(f"{flag}: no such file") from None
    except OSError as error:
        raise TokenizerFileError(f"{flag}: cannot read it ({error.strerror})") from None
    try:
        import sentencepiece
    except ImportError:
        raise ImportError(
            f"--tokenizer-type {tokenizer_type} needs sentencepiece: pip install sentencepiece"
        ) from None
    try:
        return sentencepiece.SentencePieceProcessor(model_proto=proto)
    except (RuntimeError, OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "unreadable"
        raise TokenizerFileError(f"{flag}: not a SentencePiece model ({reason})") from None


class _SentencePieceModel:
    """What the three tokenizers share: the processor, its pieces and special ids."""

    tokenizer_type = "SentencePiece"

    def __init__(self, model_file: str) -> None:
        self.model_file = model_file
        self.processor = load_sentencepiece(model_file, self.tokenizer_type)
        self.num_pieces: int = self.processor.get_piece_size()

    def _piece_id(self, piece: str) -> int | None:
        """Id of `piece` if the model has it (unknown pieces map to <unk>), else None."""
        piece_id = self.processor.piece_to_id(piece)
        return piece_id if self.processor.id_to_piece(piece_id) == piece else None

    def _model_piece(self, piece_id: int) -> str | None:
        """The piece of a special id the model defines (-1: undefined), else None."""
        return self.processor.id_to_piece(piece_id) if 0 <= piece_id < self.num_pieces else None

    def _require(self, piece_id: int, role: str) -> int:
        """`piece_id`, or TokenizerFileError if the model does not define it (-1)."""
        if not 0 <= piece_id < self.num_pieces:
            raise TokenizerFileError(
                f"--tokenizer-model {self.model_file}: the SentencePiece model has no {role} "
                f"piece (id {piece_id}), which --tokenizer-type {self.tokenizer_type} needs"
            )
        return piece_id

    @cached_property
    def _pieces(self) -> dict[str, int]:
        return {self.processor.id_to_piece(i): i for i in range(self.num_pieces)}

    @property
    def vocab(self) -> dict[str, int]:
        """Piece (token string) to id."""
        return self._pieces

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Id to piece."""
        return {token_id: piece for piece, token_id in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        """Number of token ids (before padding)."""
        return self.num_pieces

    def tokenize_to_array(self, text: str) -> np.ndarray:
        """`tokenize` as an int32 numpy array (the preprocessing path)."""
        return np.asarray(self.tokenize(text), dtype=np.int32)

    def tokenize(self, text: str) -> list[int]:  # noqa: D102 - each class documents its own
        raise NotImplementedError


class GPTSentencePieceTokenizer(_SentencePieceModel):
    """Megatron's GPTSentencePieceTokenizer: plain SentencePiece, end of document = eos."""

    tokenizer_type = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        self.bos_id: int = self.processor.bos_id()
        self.eos_id: int = self._require(self.processor.eos_id(), "end-of-sentence (eos)")
        self.pad_id: int = self.processor.pad_id()

    @property
    def eod(self) -> int:
        """The eos id (`</s>`): the end-of-document token."""
        return self.eos_id

    @property
    def eos(self) -> int:
        """The model's end-of-sentence id."""
        return self.eos_id

    @property
    def bos(self) -> int:
        """The model's beginning-of-sentence id (-1 if it has none)."""
        return self.bos_id

    @property
    def pad(self) -> int:
        """The model's pad id (-1 if it has none, as LLaMA's)."""
        return self.pad_id

    @property
    def cls(self) -> int:
        """-1: no CLS token, as Megatron."""
        return -1

    @property
    def sep(self) -> int:
        """-1: no SEP token, as Megatron."""
        return -1

    @property
    def mask(self) -> int:
        """-1: no MASK token, as Megatron."""
        return -1

    @property
    def additional_special_tokens_ids(self) -> None:
        """None: no sentinel tokens, as Megatron."""
        return None

    def tokenize(self, text: str) -> list[int]:
        """The model's encoding of `text`."""
        return self.processor.encode_as_ids(text)

    def detokenize(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """The model's decoding of the ids (ValueError for an id outside the vocabulary)."""
        return self.processor.decode_ids(checked_ids(token_ids, self.num_pieces))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: GPTSentencePiece with bos before every tokenized text."""

    tokenizer_type = "Llama2Tokenizer"

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        self._require(self.bos_id, "beginning-of-sentence (bos)")

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """`[bos] + encoding + [eos]`, each end as asked (default: bos only, for completion)."""
        ids = self.processor.encode_as_ids(text)
        return [self.bos_id] * bos + ids + [self.eos_id] * eos


class SentencePieceTokenizer(_SentencePieceModel):
    """Megatron's SentencePieceTokenizer: the pieces plus its special and sentinel tokens."""

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file)
        # Special token -> id, in Megatron's order (which also breaks ties when splitting).
        self._special_ids: dict[str, int] = {}
        self._added: list[str] = []  # tokens past the model's pieces, in id order
        self.cls_id = self._add_special("<CLS>")
        self.sep_id = self._add_special("<SEP>")
        self.eod_id = self._add_special("<EOD>")
        self.mask_id = self._add_special("<MASK>")
        self.pad_id = self._add_special(self._model_piece(self.processor.pad_id()) or "<PAD>")
        self.bos_id = self._add_special(self._model_piece(self.processor.bos_id()) or "<BOS>")
        self.eos_id = self._add_special(self._model_piece(self.processor.eos_id()) or "<EOS>")
        self._extra_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._extra_tokens:
            self._add_special(token)
        self._special_by_id = {token_id: token for token, token_id in self._special_ids.items()}
        # At each position the first token in Megatron's order wins, as its scan does.
        self._special_pattern = re.compile("|".join(map(re.escape, self._special_ids)))

    def _add_special(self, token: str) -> int:
        """Id of `token`: its piece id, or the next free id; marks it special."""
        token_id = self._piece_id(token)
        if token_id is None:
            token_id = self._special_ids.get(token)
        if token_id is None:
            token_id = self.num_pieces + len(self._added)
            self._added.append(token)
        self._special_ids[token] = token_id
        return token_id

    @cached_property
    def _pieces(self) -> dict[str, int]:
        pieces = {self.processor.id_to_piece(i): i for i in range(self.num_pieces)}
        pieces.update((token, self.num_pieces + i) for i, token in enumerate(self._added))
        return pieces

    @property
    def vocab_size(self) -> int:
        """The model's pieces plus the special tokens it lacked (before padding)."""
        return self.num_pieces + len(self._added)

    @property
    def eod(self) -> int:
        """The id of `<EOD>`: the end-of-document token."""
        return self.eod_id

    @property
    def cls(self) -> int:
        """The id of `<CLS>`."""
        return self.cls_id

    @property
    def sep(self) -> int:
        """The id of `<SEP>`."""
        return self.sep_id

    @property
    def mask(self) -> int:
        """The id of `<MASK>`."""
        return self.mask_id

    @property
    def pad(self) -> int:
        """The id of the model's pad piece, else of `<PAD>`."""
        return self.pad_id

    @property
    def bos(self) -> int:
        """The id of the model's bos piece, else of `<BOS>`."""
        return self.bos_id

    @property
    def eos(self) -> int:
        """The id of the model's eos piece, else of `<EOS>`."""
        return self.eos_id

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """The ids of the --vocab-extra-ids sentinels `<extra_id_N>`."""
        return [self._special_ids[token] for token in self._extra_tokens]

    def tokenize(self, text: str) -> list[int]:
        """Ids of `text`: special tokens' text becomes their id, the rest the model's encoding."""
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids.extend(self.processor.encode_as_ids(text[start : match.start()]))
            ids.append(self._special_ids[match.group()])
            start = match.end()
        ids.extend(self.processor.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """Text of the ids; each special token is written with a space either side, as Megatron."""
        ids = checked_ids(token_ids, self.vocab_size)
        parts = []
        start = 0
        for index, token_id in enumerate(ids):
            if token_id in self._special_by_id:
                parts.append(self.processor.decode_ids(ids[start:index]) + " ")
                parts.append(self._special_by_id[token_id] + " ")
                start = index + 1
        parts.append(self.processor.decode_ids(ids[start:]))
        return "".join(parts)
