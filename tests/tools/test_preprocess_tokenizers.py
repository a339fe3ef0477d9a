"""tools/preprocess_data.py with the SentencePiece and Hugging Face tokenizers.

Every document of the stdlib corpus, read back with our indexed-dataset reader, must be the
tokenizer library's own encoding (`sentencepiece` encode, `tokenizers` encode().ids), plus
bos for Llama2Tokenizer, plus the end-of-document id (--append-eod): exact equality.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from tests.conftest import run_cli
from tests.tokenizer.trained_tokenizers import write_jsonl


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, stdlib_texts) -> str:
    """The stdlib texts as JSON lines, key "text"."""
    return write_jsonl(stdlib_texts, str(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"))


def _library_encodings(kind: str, model: str, texts: list[str]) -> list[list[int]]:
    """Each text as the library encodes it, with Megatron's bos and eod around it."""
    if kind == "HFTokenizer":
        from tokenizers import Tokenizer

        library = Tokenizer.from_file(model)
        eod = library.token_to_id("<|endoftext|>")
        return [library.encode(text).ids + [eod] for text in texts]
    import sentencepiece

    library = sentencepiece.SentencePieceProcessor(model_file=model)
    bos = [library.bos_id()] if kind == "Llama2Tokenizer" else []
    return [bos + library.encode(text) + [library.eos_id()] for text in texts]


def _preprocess(corpus: str, prefix: str, *flags: str) -> IndexedDataset:
    result = run_cli(
        "tools/preprocess_data.py",
        *("--input", corpus, "--output-prefix", prefix, "--json-keys", "text"),
        *("--append-eod", "--workers", "2", *flags),
    )
    assert result.returncode == 0, result.stderr
    return IndexedDataset(prefix + "_text_document")


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer", "HFTokenizer"])
def test_every_document_is_the_library_encoding(
    kind, corpus, stdlib_texts, sentencepiece_model, hf_tokenizer_json, tmp_path
):
    model = hf_tokenizer_json if kind == "HFTokenizer" else sentencepiece_model
    flags = ("--tokenizer-type", kind, "--tokenizer-model", model)
    dataset = _preprocess(corpus, str(tmp_path / "out"), *flags)
    assert dataset.dtype == np.uint16  # 1,000 tokens: under Megatron's 65,500
    documents = [sequence.tolist() for sequence in dataset]
    expected = _library_encodings(kind, model, stdlib_texts)
    assert len(documents) == len(expected) == len(stdlib_texts)
    for index, (ours, theirs) in enumerate(zip(documents, expected)):
        assert ours == theirs, f"document {index} differs"


def test_a_large_vocabulary_is_stored_as_int32(tmp_path):
    """65,500 tokens or more: int32 tokens, as Megatron chooses."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    words["</s>"] = len(words)
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model = str(tmp_path / "big.json")
    tokenizer.save(model)
    corpus = write_jsonl(["w1 w69999", "w65535 w65536 w7"], str(tmp_path / "big.jsonl"))
    flags = ("--tokenizer-type", "HFTokenizer", "--tokenizer-model", model)
    dataset = _preprocess(corpus, str(tmp_path / "big"), *flags)
    assert dataset.dtype == np.int32
    assert [s.tolist() for s in dataset] == [[1, 69999, 70000], [65535, 65536, 7, 70000]]
