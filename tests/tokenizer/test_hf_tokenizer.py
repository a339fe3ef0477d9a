"""HFTokenizer against the `tokenizers` and `transformers` libraries, offline.

The tokenizer is the session's byte-level BPE (tests/conftest.py `hf_tokenizer_json`,
`hf_tokenizer_dir`): 1,000 tokens, `<|endoftext|>` id 0.
"""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace

import numpy as np
import pytest

from megatron.tokenizer import HFTokenizer, TokenizerConfig, TokenizerFileError, build_tokenizer
from megatron.tokenizer import create_tokenizer as create
from tests.conftest import REPO_ROOT


def test_tokenizer_json_is_the_library_encoding(hf_tokenizer_json, stdlib_texts):
    from tokenizers import Tokenizer

    oracle = Tokenizer.from_file(hf_tokenizer_json)
    tokenizer = HFTokenizer(hf_tokenizer_json)
    # A bare tokenizer.json names no eos token: <|endoftext|> is found among the candidates.
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.eos) == (1000, 0, 0)
    assert tokenizer.bos is None and tokenizer.pad is None
    assert tokenizer.vocab["<|endoftext|>"] == 0 and tokenizer.inv_vocab[0] == "<|endoftext|>"
    for text in stdlib_texts[::2]:  # tools/test_preprocess_tokenizers.py checks them all
        ids = oracle.encode(text).ids
        assert tokenizer.tokenize(text) == ids
        array = tokenizer.tokenize_to_array(text)
        assert array.dtype == np.int32 and array.tolist() == ids
        assert tokenizer.detokenize(ids) == text
    # Special-token text is the special token, as the library encodes it.
    assert tokenizer.tokenize("a<|endoftext|>b") == oracle.encode("a<|endoftext|>b").ids
    assert 0 in tokenizer.tokenize("a<|endoftext|>b")
    assert tokenizer.detokenize(np.array([0])) == "<|endoftext|>"


def test_folder_is_autotokenizer(hf_tokenizer_dir, stdlib_texts):
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir, local_files_only=True)
    tokenizer = HFTokenizer(hf_tokenizer_dir)
    assert tokenizer.vocab_size == len(oracle) == 1000
    assert (tokenizer.eod, tokenizer.bos) == (oracle.eos_token_id, oracle.bos_token_id) == (0, 0)
    for text in stdlib_texts[:20]:
        ids = oracle.encode(text)
        assert tokenizer.tokenize(text) == ids
        assert tokenizer.detokenize(ids) == oracle.decode(ids)


def test_build_tokenizer_pads_len_tokenizer(hf_tokenizer_json):
    args = Namespace(
        tokenizer_type="HFTokenizer",
        tokenizer_model=hf_tokenizer_json,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=2,
        rank=1,
    )
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, HFTokenizer)
    assert (args.tokenizer_vocab_size, args.padded_vocab_size) == (1000, 1024)


def test_added_tokens_count_in_the_vocabulary(tmp_path, hf_tokenizer_json):
    """len(tokenizer), as Megatron-LM: added tokens get ids past the model's vocabulary."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(hf_tokenizer_json)
    tokenizer.add_special_tokens(["<pad>", "<|im_start|>"])
    path = str(tmp_path / "added.json")
    tokenizer.save(path)
    ours = HFTokenizer(path)
    assert (ours.vocab_size, ours.pad, ours.eod) == (1002, 1000, 0)
    assert ours.tokenize("<|im_start|>") == [1001]


def test_errors_name_the_flag_and_path(tmp_path, sentencepiece_model):
    def build(model: str) -> HFTokenizer:
        return create(TokenizerConfig("HFTokenizer", tokenizer_model=model))

    missing = str(tmp_path / "missing.json")
    with pytest.raises(TokenizerFileError, match=f"^--tokenizer-model {missing}: no such file$"):
        build(missing)
    with pytest.raises(TokenizerFileError, match="not a Hugging Face tokenizer.json"):
        build(sentencepiece_model)
    with pytest.raises(ValueError, match="HFTokenizer needs --tokenizer-model"):
        create(TokenizerConfig("HFTokenizer"))
    from tokenizers import Tokenizer, models

    no_eos = str(tmp_path / "no_eos.json")
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(no_eos)
    with pytest.raises(TokenizerFileError, match=f"--tokenizer-model {no_eos}: .* no eos token"):
        build(no_eos)
    with_eos = str(tmp_path / "eos.json")
    Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).save(with_eos)
    tokenizer = build(with_eos)
    assert (tokenizer.vocab_size, tokenizer.eod) == (2, 1)  # </s>, the second candidate
    with pytest.raises(ValueError, match="token id 2 is not in the vocabulary"):
        tokenizer.detokenize([0, 2])


def test_a_folder_without_a_tokenizer_is_one_error(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(TokenizerFileError, match=f"--tokenizer-model {tmp_path}: no Hugging"):
        HFTokenizer(str(tmp_path))
    with pytest.raises(TokenizerFileError, match="no such file or folder, and no Hugging Face"):
        HFTokenizer(str(tmp_path / "not-there"))


def test_importing_the_tokenizers_loads_no_tokenizer_library():
    """sentencepiece, tokenizers and transformers load when a tokenizer is built, not before."""
    code = (
        "import sys, megatron.tokenizer, megatron.data.document_encoder; "
        "print(sorted({'sentencepiece', 'tokenizers', 'transformers'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
