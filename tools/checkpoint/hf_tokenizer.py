"""The tokenizer files of a Hugging Face export, and the tokenizer flags of an import.

Export (`convert_to_hf.py`) writes, for the checkpoint's `--tokenizer-type`, a tokenizer whose
ids are our tokenizer's (`megatron.tokenizer`) and whose eos token is our end of document:

- `GPT2BPETokenizer`: vocab.json and merges.txt, as `GPT2TokenizerFast` saves them;
- `GPTSentencePieceTokenizer`, `Llama2Tokenizer`, `SentencePieceTokenizer`: the SentencePiece
  model as a `tokenizers` pipeline (tokenizer.json: its normalizer, BPE or unigram pieces and
  byte fallback, so ids equal SentencePiece's), plus the original tokenizer.model.
  `Llama2Tokenizer` prepends bos; the first two read special-token text as text, as
  SentencePiece does; `SentencePieceTokenizer` adds its special tokens (`<CLS>`, `<EOD>`...)
  after the pieces, and reads their text as them, as ours;
- `HFTokenizer`: the tokenizer folder or tokenizer.json `--tokenizer-model` names, saved again.

Whatever transformers 5 saves its generic fast tokenizer as (`TokenizersBackend`) is named
`PreTrainedTokenizerFast` in tokenizer_config.json, the class transformers 4 has too.

Import (`convert_from_hf.py`): vocab.json + merges.txt is `GPT2BPETokenizer`; tokenizer.model
is `Llama2Tokenizer` when the folder's tokenizer prepends bos, else `GPTSentencePieceTokenizer`;
a tokenizer.json alone is `HFTokenizer` on the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from megatron.checkpointing.layouts import CheckpointConversionError
from megatron.tokenizer import Tokenizer, TokenizerConfig, create_tokenizer


@dataclass
class TokenizerSource:
    """The tokenizer a checkpoint was trained with: its flags, and ours built from them."""

    config: TokenizerConfig
    tokenizer: Tokenizer


def tokenizer_source(flags: argparse.Namespace, args: dict[str, Any]) -> TokenizerSource:
    """The tokenizer of checkpoint `args`, files from the flags first; raises naming the flag."""
    config = TokenizerConfig(
        tokenizer_type=args.get("tokenizer_type") or "GPT2BPETokenizer",
        vocab_file=flags.vocab_file or args.get("vocab_file"),
        merge_file=flags.merge_file or args.get("merge_file"),
        tokenizer_model=flags.tokenizer_model or args.get("tokenizer_model"),
        vocab_extra_ids=args.get("vocab_extra_ids") or 0,
    )
    if config.tokenizer_type == "GPT2BPETokenizer":
        for flag, key in (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")):
            path = getattr(config, key)
            if not path or not os.path.isfile(path):
                raise CheckpointConversionError(
                    f"{flag} {path}: no such file (the checkpoint's {key}); pass {flag}"
                )
    elif not config.tokenizer_model:
        raise CheckpointConversionError(
            f"--tokenizer-model: the checkpoint names none for its --tokenizer-type "
            f"{config.tokenizer_type}; pass --tokenizer-model"
        )
    try:
        # Read once by our tokenizer: a bad file is an error naming it, where transformers
        # would fail with a bare Exception deep inside the export.
        return TokenizerSource(config, create_tokenizer(config))
    except ValueError as error:  # TokenizerFileError, or an unsupported --tokenizer-type
        raise CheckpointConversionError(str(error)) from None


def _read_sentencepiece(path: str):  # noqa: ANN202 - sentencepiece's ModelProto
    """The ModelProto of SentencePiece model `path` (already read once by our tokenizer)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as handle:
        proto.ParseFromString(handle.read())
    return proto


def sentencepiece_tokenizer(path: str):  # noqa: ANN201 - tokenizers.Tokenizer
    """SentencePiece model `path` as a `tokenizers.Tokenizer` giving SentencePiece's ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from transformers.tokenization_utils_base import generate_merges

    proto = _read_sentencepiece(path)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(piece.piece, piece.score) for piece in proto.pieces]
    if spec.model_type == spec.UNIGRAM:
        tokenizer = Tokenizer(models.Unigram(pieces, spec.unk_id, spec.byte_fallback))
    elif spec.model_type == spec.BPE:
        vocab = {piece: number for number, (piece, _) in enumerate(pieces)}
        unk = proto.pieces[spec.unk_id].piece
        model = models.BPE(
            vocab, generate_merges(vocab), unk_token=unk, fuse_unk=True,
            byte_fallback=spec.byte_fallback,
        )  # fmt: skip
        tokenizer = Tokenizer(model)
    else:
        raise CheckpointConversionError(
            f"--tokenizer-model {path}: SentencePiece model type {spec.model_type} (only BPE "
            "and unigram convert)"
        )
    # SentencePiece's order: character map (NFKC...), extra whitespace, dummy prefix, "▁".
    steps = (
        [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    )
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("▁", " ")]
    decode += [decoders.ByteFallback()] if spec.byte_fallback else []
    decode += [decoders.Fuse()]
    decode += [decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []
    tokenizer.decoder = decoders.Sequence(decode)
    special = (proto.pieces[0].CONTROL, proto.pieces[0].USER_DEFINED)
    tokenizer.add_tokens(
        [
            AddedToken(p.piece, normalized=False, special=p.type == p.CONTROL)
            for p in proto.pieces
            if p.type in special
        ]
    )
    return tokenizer


def _special_token(ours: Tokenizer, name: str) -> str | None:
    """The text of our tokenizer's `bos`/`eod`/... id, None where it has none."""
    token_id = getattr(ours, name, None)
    return None if token_id is None or token_id < 0 else ours.inv_vocab[token_id]


def _hf_tokenizer(source: TokenizerSource, folder: str, max_length: int):  # noqa: ANN202
    """A transformers tokenizer giving our tokenizer's ids (SentencePiece: model copied)."""
    from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

    config, ours = source.config, source.tokenizer
    if config.tokenizer_type == "GPT2BPETokenizer":
        shutil.copyfile(config.vocab_file, os.path.join(folder, "vocab.json"))
        shutil.copyfile(config.merge_file, os.path.join(folder, "merges.txt"))
        # Built from the folder: GPT2TokenizerFast(vocab_file=...) ignores the files in
        # transformers 5 (it takes `vocab`/`merges` contents instead).
        return GPT2TokenizerFast.from_pretrained(folder, model_max_length=max_length)
    if os.path.isdir(config.tokenizer_model):  # HFTokenizer on a folder
        return AutoTokenizer.from_pretrained(
            config.tokenizer_model, local_files_only=True, model_max_length=max_length
        )
    specials = dict(bos_token=_special_token(ours, "bos"), eos_token=_special_token(ours, "eod"))
    specials["pad_token"] = _special_token(ours, "pad")
    if config.tokenizer_type == "HFTokenizer":  # a tokenizer.json file
        return PreTrainedTokenizerFast(
            tokenizer_file=config.tokenizer_model, model_max_length=max_length, **specials
        )
    from tokenizers import AddedToken

    backend = sentencepiece_tokenizer(config.tokenizer_model)
    proto = _read_sentencepiece(config.tokenizer_model)
    pieces = backend.get_vocab_size(with_added_tokens=False)
    # SentencePieceTokenizer's special tokens past the pieces (<CLS>, <EOD>...), in id order.
    added = [ours.inv_vocab[i] for i in range(pieces, ours.vocab_size)]
    backend.add_special_tokens([AddedToken(token, normalized=False) for token in added])
    shutil.copyfile(config.tokenizer_model, os.path.join(folder, "tokenizer.model"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=backend.id_to_token(proto.trainer_spec.unk_id),
        add_bos_token=config.tokenizer_type == "Llama2Tokenizer",
        add_eos_token=False,
        # SentencePiece reads "<s>" in a text as text; SentencePieceTokenizer as the token.
        split_special_tokens=config.tokenizer_type != "SentencePieceTokenizer",
        model_max_length=max_length,
        **specials,
    )


def write_tokenizer(
    folder: str, source: TokenizerSource, max_length: int, vocab_size: int
) -> tuple[int | None, int]:
    """Save the tokenizer of `source` into `folder`; its (bos, eos) ids for config.json.

    eos is our end-of-document id; bos our tokenizer's (GPT-2: `<|endoftext|>` for both),
    None where it has none.
    """
    tokenizer = _hf_tokenizer(source, folder, max_length)
    if len(tokenizer) > vocab_size:
        raise CheckpointConversionError(
            f"the tokenizer {source.config.tokenizer_model or source.config.vocab_file} has "
            f"{len(tokenizer)} tokens, the model only {vocab_size}"
        )
    tokenizer.save_pretrained(folder)
    _name_class_for_transformers_4(folder)
    ours = source.tokenizer
    bos = getattr(ours, "bos", ours.eod)
    return (None if bos is None or bos < 0 else bos), ours.eod


def _name_class_for_transformers_4(folder: str) -> None:
    """transformers 5 saves its generic fast tokenizer (over tokenizer.json) as
    `TokenizersBackend`, a class 4.x lacks; 4.x's name for it, `PreTrainedTokenizerFast`, 5.x
    reads as the same class."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, ensure_ascii=False)
            handle.write("\n")


def imported_tokenizer_args(folder: str) -> dict[str, Any]:
    """The tokenizer flags (`tokenizer_type`, files) for a checkpoint imported from `folder`.

    A tokenizer.model whose Hugging Face tokenizer has exactly its pieces is read by our
    SentencePiece types (LLaMA's convention); any other tokenizer folder by `HFTokenizer`.
    """
    path = lambda name: os.path.abspath(os.path.join(folder, name))  # noqa: E731
    if os.path.isfile(path("vocab.json")) and os.path.isfile(path("merges.txt")):
        return dict(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=path("vocab.json"),
            merge_file=path("merges.txt"),
        )
    if not os.path.isfile(path("tokenizer.model")) and not os.path.isfile(path("tokenizer.json")):
        return dict(tokenizer_type=None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if os.path.isfile(path("tokenizer.model")):
        pieces = len(_read_sentencepiece(path("tokenizer.model")).pieces)
        if len(tokenizer) == pieces:
            ids = tokenizer("a")["input_ids"]
            bos = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
            kind = "Llama2Tokenizer" if bos else "GPTSentencePieceTokenizer"
            return dict(tokenizer_type=kind, tokenizer_model=path("tokenizer.model"))
    return dict(tokenizer_type="HFTokenizer", tokenizer_model=os.path.abspath(folder))
