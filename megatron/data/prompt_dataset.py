"""Megatron-DeepSpeed's SupervisedDataset: Alpaca records as fixed-length prompt/response samples.

finetune_llama.py's `--data-path` is one JSON file holding a list of `{instruction, input,
output}` records (tatsu-lab/stanford_alpaca's alpaca_data.json). As Megatron-DeepSpeed's
`megatron/data/prompt_dataset.py` does, each record is one sample:

- the prompt is Alpaca's template (`megatron.data.alpaca`), the response the output followed
  by the tokenizer's end-of-sequence text; the sample is the tokens of prompt + response
  (with whatever special tokens the tokenizer adds, a LLaMA tokenizer's `<s>`), cut or padded
  to `seq_length + 1` tokens;
- only the response is trained on: the labels of the prompt's tokens (as many as the prompt
  alone tokenizes to) and of the padding are masked out of the loss. Megatron-DeepSpeed marks
  them by writing the pad id into its labels and masks `labels != pad`; here the mask is kept
  beside the tokens (`loss_mask`, one per label), so an end-of-sequence token that doubles as
  padding is still trained where it ends a response.

Padding positions hold the tokenizer's pad id, or its end-of-sequence id when it has none
(they come after the response and are masked, so under causal attention their ids change
nothing). A record whose response has no token within the `seq_length + 1` would train
nothing (and make a micro-batch of such records a 0/0 loss): it is left out, and counted.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from megatron.data.alpaca import alpaca_prompt, alpaca_response, is_alpaca_record
from megatron.data.corpus_reader import InputError
from megatron.tokenizer.base import Tokenizer


def read_alpaca_records(path: str) -> list[dict[str, Any]]:
    """The records of an Alpaca JSON file; `InputError` naming --data-path and the record."""
    try:
        with open(path, encoding="utf-8") as handle:
            records = json.load(handle)
    except OSError as error:
        raise InputError(f"--data-path {path}: {error.strerror}") from None
    except ValueError as error:  # bad JSON, or not UTF-8
        raise InputError(f"--data-path {path}: not a JSON file ({error})") from None
    if not isinstance(records, list) or not records:
        raise InputError(
            f"--data-path {path}: expected a non-empty JSON list of Alpaca records "
            "({instruction, input, output})"
        )
    for number, record in enumerate(records):
        if not is_alpaca_record(record):
            raise InputError(
                f"--data-path {path}: record {number} is not an Alpaca record (needs "
                "'instruction' and 'output')"
            )
    return records


def end_of_sequence_text(tokenizer: Tokenizer, tokenizer_type: str) -> str:
    """The text of the tokenizer's end-of-sequence token, checked to tokenize back to it."""
    text = tokenizer.inv_vocab.get(tokenizer.eod)
    ids = tokenizer.tokenize(text) if text else []
    if not ids or ids[-1] != tokenizer.eod:
        raise InputError(
            f"--tokenizer-type {tokenizer_type}: its end-of-sequence text {text!r} does not "
            f"tokenize to its id {tokenizer.eod}, so a response cannot end with it; use "
            "HFTokenizer (as Megatron-DeepSpeed's finetune_llama.py)"
        )
    return text


class SupervisedDataset(torch.utils.data.Dataset):
    """Alpaca records as `{"text": [seq_length + 1] ids, "loss_mask": [seq_length]}` samples."""

    def __init__(
        self,
        records: list[dict[str, Any]],
        tokenizer: Tokenizer,
        seq_length: int,
        eos_text: str,
        pad_id: int | None = None,
    ) -> None:
        self.sample_length = seq_length + 1
        self.pad_id = tokenizer.eod if pad_id is None else pad_id
        self.tokens: list[np.ndarray] = []  # each record's ids, cut to sample_length
        self.prompt_lengths: list[int] = []
        self.left_out = 0
        """Records whose response has no token within the sample (they would train nothing)."""
        for record in records:
            prompt = alpaca_prompt(record)
            ids = tokenizer.tokenize(prompt + alpaca_response(record, eos_text))
            ids = ids[: self.sample_length]
            prompt_length = len(tokenizer.tokenize(prompt))
            if max(prompt_length, 1) >= len(ids):
                self.left_out += 1
                continue
            self.tokens.append(np.asarray(ids, dtype=np.int64))
            self.prompt_lengths.append(prompt_length)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]
        text = np.full(self.sample_length, self.pad_id, dtype=np.int64)
        text[: len(ids)] = ids
        # Label i is token i + 1: trained from the first response token to the last real one.
        positions = np.arange(1, self.sample_length)
        trained = (positions >= self.prompt_lengths[index]) & (positions < len(ids))
        return {
            "text": torch.from_numpy(text),
            "loss_mask": torch.from_numpy(trained.astype(np.float32)),
        }


def build_supervised_dataset(
    path: str, tokenizer: Tokenizer, seq_length: int, tokenizer_type: str
) -> SupervisedDataset:
    """The `SupervisedDataset` of the Alpaca JSON file `path` (finetune_llama.py's --data-path)."""
    if not os.path.isfile(path):
        raise InputError(f"--data-path {path}: no such file")
    records = read_alpaca_records(path)
    eos_text = end_of_sequence_text(tokenizer, tokenizer_type)
    dataset = SupervisedDataset(
        records, tokenizer, seq_length, eos_text, getattr(tokenizer, "pad", None)
    )
    if len(dataset) == 0:
        raise InputError(
            f"--data-path {path}: no record has a response token within --seq-length "
            f"{seq_length} + 1 tokens (every prompt fills the sequence); raise --seq-length"
        )
    return dataset
