"""SFT data in training: the loss mask beside the tokens, cut into GPT samples and into the batch.

The SFT set is tests/data/sft_tiny.jsonl (a few dozen conversations, Alpaca and prompt/response
records) through `tools/preprocess_data.py --sft` with GPT-2 and the built-in ChatML template.
"""

from __future__ import annotations

import argparse
import os
import shutil

import numpy as np
import pytest
import torch

from megatron.config import DataConfig
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from tests.conftest import REPO_ROOT, run_oracle

SFT_DATA = os.path.join(REPO_ROOT, "tests", "data", "sft_tiny.jsonl")
EOD = 50256
SEQ = 32


@pytest.fixture(scope="module")
def sft_prefix(tmp_path_factory) -> str:
    """tests/data/sft_tiny.jsonl preprocessed with --sft (GPT-2, ChatML): the tokens' prefix."""
    from tools import preprocess_data

    folder = tmp_path_factory.mktemp("sft_data")
    argv = ["--input", SFT_DATA, "--output-prefix", str(folder / "tiny"), "--sft"]
    assert preprocess_data.main([*argv, "--sft-tokenizer-prompt-format", "chatml"]) == 0
    return str(folder / "tiny_sft_document")


def _config(data_path: list[str], cache: str, **overrides) -> DataConfig:
    fields = dict(seq_length=SEQ, seed=5, split="100,0,0", data_cache_path=cache, vocab_size=50257)
    return DataConfig(data_path=data_path, **{**fields, **overrides})


def _stream(prefix: str, doc_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and mask of the documents in doc_idx order, back to back."""
    tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + "_loss_mask")
    return (
        np.concatenate([tokens[int(d)] for d in doc_idx]),
        np.concatenate([masks[int(d)] for d in doc_idx]),
    )


@pytest.mark.parametrize("sft", [True, False])
def test_samples_carry_the_mask_of_their_labels(sft_prefix, tmp_path, sft):
    """Sample k is tokens k*s .. (k+1)*s of the shuffled documents back to back; its loss mask
    is the mask of its labels, tokens k*s + 1 .. (k+1)*s (read with or without --sft)."""
    config = _config([sft_prefix], str(tmp_path), sft=sft)
    train, valid, test = build_train_valid_test_datasets(config, [60, 0, 0])
    assert valid is None and test is None
    stream, stream_mask = _stream(sft_prefix, train.doc_idx)
    for index in range(len(train)):
        sample = train[index]
        k = int(train.shuffle_idx[index])
        assert sample["text"].dtype == np.int64 and sample["loss_mask"].dtype == np.float32
        np.testing.assert_array_equal(sample["text"], stream[k * SEQ : (k + 1) * SEQ + 1])
        np.testing.assert_array_equal(
            sample["loss_mask"], stream_mask[k * SEQ + 1 : (k + 1) * SEQ + 1]
        )
    masks = np.stack([train[i]["loss_mask"] for i in range(len(train))])
    assert 0 < masks.mean() < 0.5  # the replies only


def test_the_index_cache_is_shared_with_plain_runs(sft_prefix, tmp_path):
    """The indices depend on the sizes alone: without its mask, the dataset reuses them."""
    prefix = str(tmp_path / "tiny")
    for suffix in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx"):
        shutil.copy(sft_prefix + suffix, prefix + suffix)
    (train, *_) = build_train_valid_test_datasets(_config([prefix], str(tmp_path)), [20, 0, 0])
    assert "loss_mask" in train[0]
    cached = sorted(os.listdir(tmp_path))
    for suffix in ("_loss_mask.bin", "_loss_mask.idx"):
        os.remove(prefix + suffix)
    (train, *_) = build_train_valid_test_datasets(_config([prefix], str(tmp_path)), [20, 0, 0])
    assert "loss_mask" not in train[0]
    assert sorted(os.listdir(tmp_path)) == [n for n in cached if "_loss_mask." not in n]


def test_a_blend_trains_plain_data_on_every_token(sft_prefix, tmp_path):
    """An SFT dataset blended with plain text: every sample has a mask; the plain one's is ones."""
    plain = str(tmp_path / "plain")
    shutil.copy(sft_prefix + ".bin", plain + ".bin")
    shutil.copy(sft_prefix + ".idx", plain + ".idx")
    config = _config(["0.5", sft_prefix, "0.5", plain], str(tmp_path))
    (train, *_) = build_train_valid_test_datasets(config, [40, 0, 0])
    assert isinstance(train, BlendableDataset)
    seen = set()
    for index in range(len(train)):
        source = int(train.dataset_index[index])
        all_ones = bool(train[index]["loss_mask"].all())
        assert all_ones if source == 1 else True
        seen.add((source, all_ones))
    assert (0, False) in seen and (1, True) in seen


def test_sft_needs_the_mask(sft_prefix, tmp_path):
    """--sft with a dataset that has no mask beside it: the error names the missing files."""
    plain = str(tmp_path / "plain")
    shutil.copy(sft_prefix + ".bin", plain + ".bin")
    shutil.copy(sft_prefix + ".idx", plain + ".idx")
    with pytest.raises(IndexedDatasetError, match=f"--sft: {plain} has no loss mask.*"
                       f"{plain}_loss_mask.bin/.idx"):  # fmt: skip
        build_train_valid_test_datasets(_config([plain], str(tmp_path), sft=True), [8, 0, 0])


def test_a_mask_of_other_sizes_is_refused(sft_prefix, tmp_path):
    """A mask whose documents are not the tokens' is refused, naming both index files."""
    prefix = str(tmp_path / "odd")
    shutil.copy(sft_prefix + ".bin", prefix + ".bin")
    shutil.copy(sft_prefix + ".idx", prefix + ".idx")
    builder = IndexedDatasetBuilder(prefix + "_loss_mask.bin", dtype=np.uint8)
    builder.add_document(np.ones(5, np.uint8), [5])
    builder.finalize(prefix + "_loss_mask.idx")
    with pytest.raises(IndexedDatasetError, match="odd_loss_mask.idx: its 1 sequences"):
        build_train_valid_test_datasets(_config([prefix], str(tmp_path)), [8, 0, 0])


def test_the_batch_multiplies_the_mask_in():
    """pretrain_gpt's batch: the sample's loss mask times --eod-mask-loss's."""
    from pretrain_gpt import tokens_and_labels

    text = torch.tensor([[5, 6, EOD, 7, 8, 9]])
    sample_mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
    args = argparse.Namespace(
        eod_token_id=EOD, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=True
    )
    loss_mask = tokens_and_labels({"text": text, "loss_mask": sample_mask}, args, "cpu")[2]
    assert loss_mask.tolist() == [[0.0, 1.0, 0.0, 0.0, 1.0]]


ORACLE_READER = """
import sys
import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

prefix, out = sys.argv[1:]
tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + "_loss_mask")
np.savez(out, token_sizes=tokens.sequence_lengths, mask_sizes=masks.sequence_lengths,
         tokens=np.concatenate([tokens[i] for i in range(len(tokens))]),
         masks=np.concatenate([masks[i] for i in range(len(masks))]))
"""


def test_megatron_core_reads_tokens_and_mask(sft_prefix, tmp_path):
    """megatron-core 0.16.1's IndexedDataset reads both files: same sizes, ids and mask bytes."""
    script = tmp_path / "read.py"
    script.write_text(ORACLE_READER)
    run_oracle(str(script), sft_prefix, str(tmp_path / "out.npz"))
    theirs = np.load(tmp_path / "out.npz")
    tokens, masks = IndexedDataset(sft_prefix), IndexedDataset(sft_prefix + "_loss_mask")
    np.testing.assert_array_equal(theirs["token_sizes"], tokens.sizes)
    np.testing.assert_array_equal(theirs["mask_sizes"], tokens.sizes)
    np.testing.assert_array_equal(theirs["tokens"], tokens.tokens())
    assert theirs["masks"].dtype == np.uint8
    np.testing.assert_array_equal(theirs["masks"], masks.tokens())


def test_the_sft_flag_reaches_the_data_config_and_refuses_mock_data(sft_prefix):
    """--sft validates into DataConfig.sft; with --mock-data it is a one-line ArgumentError."""
    from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args

    def validated(extra: str) -> argparse.Namespace:
        argv = (
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            f"--micro-batch-size 2 --train-iters 10 --lr 1e-3 {extra}"
        ).split()
        parser = build_parser()
        return validate_args(parser.parse_args(argv), 1, typed_flags(parser, argv))

    assert DataConfig.from_args(validated(f"--sft --data-path {sft_prefix}")).sft
    assert not DataConfig.from_args(validated(f"--data-path {sft_prefix}")).sft
    with pytest.raises(ArgumentError, match="--sft with --mock-data: the synthetic documents"):
        validated("--sft --mock-data --tokenizer-type NullTokenizer --vocab-size 100")
