"""tools/generate_samples_gpt.py with a SentencePiece (Llama2Tokenizer) or HF tokenizer.

The checkpoint records `--tokenizer-type Llama2Tokenizer --tokenizer-model` (the session's
trained SentencePiece model, 1,000 pieces); the tool must build that tokenizer from the
checkpoint's args, or the one the flags name, and refuse one whose size differs.
"""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.shards import DenseCheckpoint, save_megatron_checkpoint
from megatron.config import ModelConfig
from megatron.model import GPTModel
from tests.one_line_errors import assert_one_line_error
from tools.generate_samples_gpt import main

SHAPE = dict(num_layers=1, hidden_size=32, num_attention_heads=4, max_position_embeddings=64)
VOCAB = 1000
GREEDY = ["--prompt", "def main(", "--greedy", "--out-seq-length", "6"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, sentencepiece_model) -> str:
    """A random 1-layer GPT trained "with" Llama2Tokenizer, saved at TP=1."""
    torch.manual_seed(0)
    state = GPTModel(ModelConfig(vocab_size=1024, **SHAPE)).state_dict()
    embeddings = "language_model.embedding.word_embeddings.weight"
    state[embeddings] = state[embeddings][:VOCAB]
    args = dict(
        SHAPE,
        seq_length=64,
        make_vocab_size_divisible_by=128,
        tokenizer_type="Llama2Tokenizer",
        tokenizer_model=sentencepiece_model,
    )
    root = str(tmp_path_factory.mktemp("generate_llama") / "checkpoint")
    save_megatron_checkpoint(DenseCheckpoint(state, args, 3, VOCAB), root, 1, 1)
    return root


def test_the_checkpoints_tokenizer_or_the_flags(checkpoint, hf_tokenizer_json, capsys):
    assert main(["--load", checkpoint, *GREEDY]) == 0
    saved = capsys.readouterr().out
    assert "Context: def main(" in saved and "Megatron-LM: " in saved
    # The same size (1,000 tokens) from the flags: the HF tokenizer decodes the same ids.
    flags = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", hf_tokenizer_json]
    assert main(["--load", checkpoint, *flags, *GREEDY]) == 0
    assert "Context: def main(" in capsys.readouterr().out


def test_a_tokenizer_of_another_size_is_one_line(checkpoint, sentencepiece_model, capsys):
    """SentencePieceTokenizer adds <CLS> <SEP> <EOD> <MASK> <PAD>: 1,005 tokens, not 1,000."""
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sentencepiece_model]
    code = main(["--load", checkpoint, *flags, *GREEDY])
    assert_one_line_error(code, capsys.readouterr().err, "1005 tokens", "--tokenizer-model")


def test_a_missing_tokenizer_model_is_one_line(checkpoint, tmp_path, capsys):
    missing = str(tmp_path / "gone.model")
    code = main(["--load", checkpoint, "--tokenizer-model", missing, *GREEDY])
    assert_one_line_error(code, capsys.readouterr().err, f"--tokenizer-model {missing}")
