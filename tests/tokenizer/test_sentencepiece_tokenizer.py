"""The SentencePiece tokenizers against the `sentencepiece` library and Megatron's semantics.

The model is the session's LLaMA-style BPE (tests/conftest.py `sentencepiece_model`): 1,000
pieces, <unk> 0, <s> 1, </s> 2, no pad piece, byte fallback.
"""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import pytest

from megatron.tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
    TokenizerConfig,
    TokenizerFileError,
    build_tokenizer,
    create_tokenizer,
)
from tests.tokenizer.trained_tokenizers import EXTRA_TEXTS

SPECIAL_TEXT = ("<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>", "<s>", "</s>", "<extra_id_")


@pytest.fixture(scope="module")
def processor(sentencepiece_model):
    """The `sentencepiece` library's own processor of the model: the oracle."""
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)


def test_gpt_sentencepiece_is_the_library_encoding(sentencepiece_model, processor, stdlib_texts):
    tokenizer = GPTSentencePieceTokenizer(sentencepiece_model)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.eos, tokenizer.bos) == (1000, 2, 2, 1)
    assert (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (-1, -1, -1, -1)
    assert tokenizer.additional_special_tokens_ids is None
    assert tokenizer.vocab["</s>"] == 2 and tokenizer.inv_vocab[1] == "<s>"
    assert len(tokenizer.vocab) == 1000
    for text in stdlib_texts:
        ids = processor.encode(text)
        assert tokenizer.tokenize(text) == ids
        array = tokenizer.tokenize_to_array(text)
        assert array.dtype == np.int32 and array.tolist() == ids
        assert tokenizer.detokenize(ids) == text  # identity normalization + byte fallback
    assert tokenizer.detokenize(np.array(processor.encode("x = 1"))) == "x = 1"


def test_llama2_prepends_bos(sentencepiece_model, processor, stdlib_texts):
    """Megatron-LM's Llama2Tokenizer.tokenize(text, bos=True, eos=False)."""
    tokenizer = Llama2Tokenizer(sentencepiece_model)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.bos, tokenizer.pad) == (1000, 2, 1, -1)
    for text in stdlib_texts[:10] + EXTRA_TEXTS:
        ids = processor.encode(text)
        assert tokenizer.tokenize(text) == [1, *ids]
        assert tokenizer.tokenize_to_array(text).tolist() == [1, *ids]
        assert tokenizer.tokenize(text, bos=False, eos=True) == [*ids, 2]
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.tokenize("") == [1]


def test_sentencepiece_adds_megatrons_special_tokens(sentencepiece_model, processor):
    tokenizer = SentencePieceTokenizer(sentencepiece_model, vocab_extra_ids=12)
    # <CLS> <SEP> <EOD> <MASK> <PAD> get the next ids; <s> and </s> are the model's pieces.
    ids = (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask, tokenizer.pad)
    assert ids == (1000, 1001, 1002, 1003, 1004)
    assert (tokenizer.bos, tokenizer.eos) == (1, 2)
    assert tokenizer.additional_special_tokens_ids == list(range(1005, 1017))
    assert tokenizer.vocab_size == 1017 == len(tokenizer.vocab)
    assert tokenizer.vocab["<EOD>"] == 1002 and tokenizer.inv_vocab[1016] == "<extra_id_11>"
    encode = processor.encode
    text = "a<EOD>b <s>x</s><extra_id_10><extra_id_1>ab<EO<MASK>D>"
    expected = [
        *encode("a"), 1002, *encode("b "), 1, *encode("x"), 2, 1015, 1006,
        *encode("ab<EO"), 1003, *encode("D>"),
    ]  # fmt: skip
    assert tokenizer.tokenize(text) == expected
    assert tokenizer.tokenize_to_array(text).tolist() == expected
    # Megatron writes each special token with a space either side.
    assert tokenizer.detokenize([*encode("a"), 1002, *encode("b")]) == "a <EOD> b"
    assert tokenizer.detokenize([1000]) == " <CLS> "


def test_sentencepiece_plain_text_is_the_library_encoding(
    sentencepiece_model, processor, stdlib_texts
):
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    assert tokenizer.vocab_size == 1005 and tokenizer.additional_special_tokens_ids == []
    plain = [t for t in stdlib_texts if not any(s in t for s in SPECIAL_TEXT)]
    assert len(plain) > 50
    for text in plain:
        ids = processor.encode(text)
        assert tokenizer.tokenize(text) == ids
        assert tokenizer.detokenize(ids) == text


def train_sentencepiece_without_bos_eos(folder: str) -> str:
    """A tiny model with neither <s> nor </s>."""
    import sentencepiece

    prefix = f"{folder}/no_bos_eos"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["def add(a, b):", "    return a + b", "print(add(1, 2))"] * 5),
        model_prefix=prefix,
        vocab_size=40,
        hard_vocab_limit=False,
        model_type="bpe",
        bos_id=-1,
        eos_id=-1,
        minloglevel=2,
    )
    return prefix + ".model"


def test_a_model_without_bos_and_eos(tmp_path):
    """GPTSentencePiece and Llama2 need the eos (and bos) piece; SentencePieceTokenizer adds
    <BOS> and <EOS>, as Megatron."""
    model = train_sentencepiece_without_bos_eos(str(tmp_path))
    with pytest.raises(TokenizerFileError, match=f"--tokenizer-model {model}: .* no end-of-s"):
        GPTSentencePieceTokenizer(model)
    with pytest.raises(TokenizerFileError, match="no end-of-sentence"):
        Llama2Tokenizer(model)
    tokenizer = SentencePieceTokenizer(model)
    pieces = tokenizer.vocab_size - 7
    assert (tokenizer.pad, tokenizer.bos, tokenizer.eos) == (pieces + 4, pieces + 5, pieces + 6)
    assert tokenizer.inv_vocab[pieces + 6] == "<EOS>"


@pytest.mark.parametrize(
    "kind, tensor_parallel, padded",
    [
        ("GPTSentencePieceTokenizer", 1, 1024),
        ("Llama2Tokenizer", 4, 1024),
        ("SentencePieceTokenizer", 16, 2048),  # 1005 tokens, a multiple of 128 x 16
    ],
)
def test_build_tokenizer_pads_the_vocabulary(sentencepiece_model, kind, tensor_parallel, padded):
    args = Namespace(
        tokenizer_type=kind,
        tokenizer_model=sentencepiece_model,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tensor_parallel,
        rank=1,
    )
    tokenizer = build_tokenizer(args)
    assert type(tokenizer).__name__ == kind
    assert args.tokenizer_vocab_size == tokenizer.vocab_size
    assert args.padded_vocab_size == padded


def test_errors_name_the_flag_and_file(sentencepiece_model, tmp_path):
    def build(kind: str, model: str | None):
        return create_tokenizer(TokenizerConfig(kind, tokenizer_model=model))

    missing = str(tmp_path / "missing.model")
    with pytest.raises(TokenizerFileError, match=f"^--tokenizer-model {missing}: no such file$"):
        build("GPTSentencePieceTokenizer", missing)
    with pytest.raises(TokenizerFileError, match=f"--tokenizer-model {tmp_path}: is a folder"):
        build("Llama2Tokenizer", str(tmp_path))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\xffnot a model")
    with pytest.raises(TokenizerFileError, match=f"{garbage}: not a SentencePiece model"):
        build("SentencePieceTokenizer", str(garbage))
    with pytest.raises(ValueError, match="Llama2Tokenizer needs --tokenizer-model"):
        build("Llama2Tokenizer", None)
    with pytest.raises(ValueError, match="--tokenizer-type Foo is not supported"):
        build("Foo", sentencepiece_model)
    tokenizer = build("GPTSentencePieceTokenizer", sentencepiece_model)
    with pytest.raises(ValueError, match="token id 1000 is not in the vocabulary"):
        tokenizer.detokenize([5, 1000])
    with pytest.raises(ValueError, match="token id -1 is not in the vocabulary"):
        SentencePieceTokenizer(sentencepiece_model).detokenize([-1])
