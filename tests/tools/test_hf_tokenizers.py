"""The tokenizer of a Hugging Face export gives our tokenizer's ids, and an import names it.

For each non-GPT-2 `--tokenizer-type` (GPT-2's is covered in test_hf_conversion.py) a tiny
LLaMA-style checkpoint trained "with" that tokenizer is exported: `AutoTokenizer` (offline)
must encode texts exactly as `megatron.tokenizer` does (bos for Llama2Tokenizer, special-token
text, whitespace runs, bytes outside the pieces) and end documents with our eod; importing
the export back records a tokenizer that encodes the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from megatron.checkpointing.huggingface import model_config  # noqa: E402
from megatron.checkpointing.shards import (  # noqa: E402
    DenseCheckpoint,
    load_dense_checkpoint,
    save_megatron_checkpoint,
)
from megatron.model import GPTModel  # noqa: E402
from megatron.tokenizer import TokenizerConfig, create_tokenizer  # noqa: E402
from tests.pretrain_runs import LLAMA_ARCHITECTURE  # noqa: E402
from tools.checkpoint import convert_from_hf, convert_to_hf  # noqa: E402

TEXTS = [
    "def greet(name):\n    return f'Hello, {name}!'  # ünïcödé, naïve café 多",
    "  two leading spaces, then  a run\t\tof tabs\n\n",
    "literal <s> and </s> and <EOD> in a text",
    "",
]
MODEL = dict(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=48,
    max_position_embeddings=16,
    seq_length=16,
    make_vocab_size_divisible_by=8,
    **LLAMA_ARCHITECTURE,
)
# case -> (--tokenizer-type, which fixture gives --tokenizer-model, the type an import records)
CASES = {
    "gpt_sentencepiece": ("GPTSentencePieceTokenizer", "sentencepiece_model", None),
    "llama2": ("Llama2Tokenizer", "sentencepiece_model", None),
    "sentencepiece_specials": ("SentencePieceTokenizer", "sentencepiece_model", "HFTokenizer"),
    "hf_folder": ("HFTokenizer", "hf_tokenizer_dir", None),
    "hf_json": ("HFTokenizer", "hf_tokenizer_json", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_tokenizer_encodes_as_ours(case, request, tmp_path):
    kind, fixture, imported_kind = CASES[case]
    tokenizer_config = TokenizerConfig(kind, tokenizer_model=request.getfixturevalue(fixture))
    ours = create_tokenizer(tokenizer_config)
    vocab = ours.vocab_size
    args = dict(MODEL, tokenizer_type=kind, tokenizer_model=tokenizer_config.tokenizer_model)
    config = dataclasses.replace(model_config(args), vocab_size=vocab)
    torch.manual_seed(0)
    state = dict(GPTModel(config).state_dict())
    save_megatron_checkpoint(DenseCheckpoint(state, args, 2, vocab), str(tmp_path / "ckpt"), 1, 1)
    hf_dir = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", str(tmp_path / "ckpt"), "--save", hf_dir]) == 0

    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.tokenize(text), (case, text)
    hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert theirs.eos_token_id == ours.eod == hf_config["eos_token_id"]
    assert hf_config["vocab_size"] == vocab >= len(theirs)

    back = str(tmp_path / "back")
    assert convert_from_hf.main(["--load", hf_dir, "--save", back]) == 0
    loaded = load_dense_checkpoint(back)
    assert loaded.args["tokenizer_type"] == (imported_kind or kind)
    again = create_tokenizer(TokenizerConfig.from_args(argparse.Namespace(**loaded.args)))
    for text in TEXTS:
        assert again.tokenize(text) == ours.tokenize(text), (case, text)


def test_a_missing_tokenizer_model_is_a_one_line_error(tmp_path, capsys):
    args = dict(MODEL, tokenizer_type="Llama2Tokenizer", tokenizer_model=str(tmp_path / "x"))
    config = dataclasses.replace(model_config(args), vocab_size=64)
    state = dict(GPTModel(config).state_dict())
    save_megatron_checkpoint(DenseCheckpoint(state, args, 2, 64), str(tmp_path / "ckpt"), 1, 1)
    argv = ["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf")]
    assert convert_to_hf.main(argv) == 1
    error = capsys.readouterr().err.splitlines()
    assert len(error) == 1 and f"--tokenizer-model {tmp_path / 'x'}" in error[0]
    assert not (tmp_path / "hf").exists()
