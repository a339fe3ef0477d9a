"""Alpaca-style prompt/response records, rendered as Stanford Alpaca and Megatron-DeepSpeed do.

A record is `{"instruction", "input" (optional), "output"}` (tatsu-lab/stanford_alpaca's
alpaca_data.json, read by Megatron-DeepSpeed's `megatron/data/prompt_dataset.py`). The prompt
is one of the two templates below; the response is the output followed by the tokenizer's
end-of-sequence text. Only the response's tokens are trained on.
"""

from __future__ import annotations

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def is_alpaca_record(record: dict) -> bool:
    """Whether `record` has Alpaca's keys (instruction and output)."""
    return isinstance(record, dict) and "instruction" in record and "output" in record


def alpaca_prompt(record: dict) -> str:
    """The prompt text of an Alpaca record: the template with or without its input."""
    if record.get("input", "") != "":
        return PROMPT_WITH_INPUT.format_map(record)
    return PROMPT_WITHOUT_INPUT.format_map(record)


def alpaca_response(record: dict, eos_text: str) -> str:
    """The response text of an Alpaca record: its output and the end-of-sequence text."""
    return f"{record['output']}{eos_text}"
