"""Megatron-DeepSpeed's SupervisedDataset (`megatron.data.prompt_dataset`): Alpaca records as
prompt + response samples trained on the response only, and finetune_llama.py's provider."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron.data.alpaca import alpaca_prompt
from megatron.data.corpus_reader import InputError
from megatron.data.prompt_dataset import build_supervised_dataset
from megatron.tokenizer import HFTokenizer
from tests.compat.finetune_llama_fixtures import (
    RECORDS,
    alpaca_records,
    build_tokenizer_folder,
    write_alpaca_json,
)

SEQ = 128


@pytest.fixture(scope="module")
def alpaca(tmp_path_factory) -> tuple[str, str]:
    """(the Alpaca JSON file, a LLaMA-style tokenizer folder)."""
    root = tmp_path_factory.mktemp("alpaca")
    records = alpaca_records()
    data = write_alpaca_json(str(root / "alpaca_data.json"), records)
    return data, build_tokenizer_folder(str(root / "tokenizer"), records)


def test_samples_are_prompt_and_response_trained_on_the_response(alpaca) -> None:
    """Each record: <s> prompt response </s>, padded to --seq-length + 1; the loss mask keeps
    the labels from the first response token to </s> and nothing else."""
    data, folder = alpaca
    tokenizer = HFTokenizer(folder)
    dataset = build_supervised_dataset(data, tokenizer, SEQ, "HFTokenizer")
    assert len(dataset) == RECORDS and dataset.left_out == 0
    for index in (0, 1):  # without and with an input
        record = alpaca_records()[index]
        sample = dataset[index]
        text, mask = sample["text"], sample["loss_mask"]
        assert text.shape == (SEQ + 1,) and mask.shape == (SEQ,)
        prompt = tokenizer.tokenize(alpaca_prompt(record))
        whole = tokenizer.tokenize(alpaca_prompt(record) + record["output"] + "</s>")
        assert whole[0] == 1 and whole[-1] == 2 and text[: len(whole)].tolist() == whole
        assert text[len(whole) :].tolist() == [2] * (SEQ + 1 - len(whole))  # padded with </s>
        trained = [label for label, keep in zip(text[1:].tolist(), mask.tolist()) if keep]
        assert trained == whole[len(prompt) :]  # the response and its </s>, which is trained


def test_records_without_room_for_their_response_are_left_out(alpaca, tmp_path) -> None:
    data, folder = alpaca
    tokenizer = HFTokenizer(folder)
    long = dict(alpaca_records()[0], instruction="word " * 200)
    path = write_alpaca_json(str(tmp_path / "long.json"), [long, *alpaca_records(3)])
    dataset = build_supervised_dataset(path, tokenizer, SEQ, "HFTokenizer")
    assert (len(dataset), dataset.left_out) == (3, 1)
    with pytest.raises(InputError, match="no record has a response token within --seq-length 8"):
        build_supervised_dataset(data, tokenizer, 8, "HFTokenizer")


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a JSON file"),
        ("[]", "expected a non-empty JSON list"),
        (json.dumps([{"instruction": "x"}]), "record 0 is not an Alpaca record"),
    ],
)
def test_bad_files_are_one_line_naming_the_flag(alpaca, tmp_path, content, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message) as refused:
        build_supervised_dataset(str(path), HFTokenizer(alpaca[1]), SEQ, "HFTokenizer")
    assert str(refused.value).startswith(f"--data-path {path}") and "\n" not in str(refused.value)


def test_finetune_provider_needs_repeated_dataloader_for_more_samples_than_records(alpaca):
    """finetune_llama.py refuses before training what would run out of records, unless
    --repeated-dataloader reads them again."""
    from finetune_llama import datasets_provider

    data, folder = alpaca
    args = argparse.Namespace(
        tokenizer_type="HFTokenizer",
        tokenizer_model=folder,
        data_path=[data],
        seq_length=SEQ,
        train_iters=12,
        global_batch_size=8,
        repeated_dataloader=False,
    )
    with pytest.raises(InputError, match="pass --repeated-dataloader"):
        datasets_provider(args, [96, 0, 0])
    args.repeated_dataloader = True
    train, valid, test = datasets_provider(args, [96, 0, 0])
    assert len(train) == RECORDS and valid is None and test is None
