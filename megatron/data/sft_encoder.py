"""SFT records as token documents and loss masks (`tools/preprocess_data.py --sft`).

A record (one JSON line, or one row of a Parquet file or saved dataset) is one of:

- a conversation, as Megatron-LM's `--sft` data: `{"messages": [{"role": "system" | "user" |
  "assistant" | "tool", "content": ...}, ...]}`. As in Megatron-LM, a line may hold several
  conversations back to back: each system message starts a new one. The conversation is
  rendered with the chat template (`megatron.data.chat_templates`);
- an Alpaca record `{"instruction", "input" (optional), "output"}`: the prompt is Alpaca's
  template, the response its output (`megatron.data.alpaca`);
- a prompt/response record `{"prompt", "response"}`: the two texts back to back.

Each conversation or record is one document, ending with the end-of-document token. Its loss
mask (`megatron.data.loss_mask`) is 1 on the tokens trained on as labels: an assistant
message's tokens (its content and what the template closes it with, such as `<|im_end|>`, but
not the header the template opens it with) or a response's, and the end-of-document token
when a reply ends the document, so the model learns to stop.

Which tokens are the assistant's is found by rendering prefixes, as Stanford Alpaca masks its
prompts: the reply of message i spans, in the whole conversation's tokens, from the length of
the tokens of `template(messages[:i], add_generation_prompt=True)` to the length of those of
`template(messages[:i + 1])`. Each prefix's text must begin the whole conversation's text
(else the template is not prefix-stable, e.g. one that drops earlier replies' reasoning, and
the record is refused naming the message). The whole text is tokenized once, so its tokens
are exactly the template's; where a token straddles a boundary (a BPE merge across it), the
boundary falls before it, by the longest common prefix of the token lists.

Template text is tokenized as documents are, except that a Hugging Face tokenizer adds no
special tokens of its own there (its templates write them, as `apply_chat_template` does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron.data.alpaca import alpaca_prompt, alpaca_response, is_alpaca_record
from megatron.data.chat_templates import (
    BUILTIN_TEMPLATES,
    TOKENIZER_TEMPLATE,
    Renderer,
    jinja_renderer,
    read_template_file,
)
from megatron.data.corpus_reader import BadLineError, InputError
from megatron.data.loss_mask import LOSS_MASK_DTYPE
from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer

SFT_KEYS = ("messages", "instruction", "input", "output", "prompt", "response")
"""The record keys SFT reads (a table input reads only these columns)."""
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class SFTConfig:
    """How SFT records are rendered; from preprocess_data's flags."""

    prompt_format: str = TOKENIZER_TEMPLATE
    """`default` (the tokenizer's own chat template) or a built-in template's name
    (`--sft-tokenizer-prompt-format`)."""
    chat_template_file: str | None = None
    """A Jinja chat template file that renders conversations instead (`--chat-template`)."""


@dataclass
class SFTDocument:
    """One conversation or record: its tokens and the loss mask beside them."""

    tokens: np.ndarray
    loss_mask: np.ndarray


def common_prefix_length(first: np.ndarray, second: np.ndarray) -> int:
    """How many leading tokens two token arrays share."""
    length = min(len(first), len(second))
    differ = np.flatnonzero(first[:length] != second[:length])
    return int(differ[0]) if len(differ) else length


def split_conversations(messages: list[dict]) -> list[tuple[int, list[dict]]]:
    """Megatron-LM's rule: each system message starts a new conversation; (offset, messages)."""
    conversations: list[tuple[int, list[dict]]] = []
    for index, message in enumerate(messages):
        if message["role"] == "system" or not conversations:
            conversations.append((index, []))
        conversations[-1][1].append(message)
    return conversations


def _checked_messages(value: object) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadLineError("'messages' must be a non-empty list of {role, content} objects")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not all(
            isinstance(message.get(key), str) for key in ("role", "content")
        ):
            raise BadLineError(f"messages[{index}] is not an object with string role and content")
        if message["role"] not in ROLES:
            raise BadLineError(
                f"messages[{index}]: role {message['role']!r} is not one of {', '.join(ROLES)}"
            )
        if message["role"] == "assistant":
            if index == 0 or value[index - 1]["role"] not in ("user", "tool"):
                raise BadLineError(
                    f"messages[{index}]: an assistant message must follow a user or tool message"
                )
            if not message["content"]:
                raise BadLineError(f"messages[{index}]: empty assistant message")
    return value


def _text_fields(record: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if key in record and not isinstance(record[key], str):
            raise BadLineError(
                f"key {key!r} holds a {type(record[key]).__name__}, expected a string"
            )


class SFTEncoder:
    """Renders and tokenizes SFT records; one per encoder process."""

    def __init__(self, tokenizer: Tokenizer, config: SFTConfig, dtype: np.dtype) -> None:
        if isinstance(tokenizer, NullTokenizer):
            raise InputError(
                "--sft: NullTokenizer reads token ids, not text; give the tokenizer the "
                "conversations are to be rendered for"
            )
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.eod = tokenizer.eod
        # Template text: a Hugging Face tokenizer adds no special tokens (the template writes them).
        self._encode_template_text: Callable[[str], np.ndarray] = (
            tokenizer.tokenize_without_special_tokens
            if isinstance(tokenizer, HFTokenizer)
            else tokenizer.tokenize_to_array
        )
        self._render, self._no_template = self._renderer(config)

    def _renderer(self, config: SFTConfig) -> tuple[Renderer | None, str]:
        tokenizer = self.tokenizer
        special = {
            "bos_token": tokenizer.inv_vocab.get(getattr(tokenizer, "bos", None), ""),
            "eos_token": tokenizer.inv_vocab.get(tokenizer.eod, ""),
        }
        if config.chat_template_file:
            template = read_template_file(config.chat_template_file)
            label = f"--chat-template {config.chat_template_file}"
            return jinja_renderer(template, label=label, **special), ""
        if config.prompt_format != TOKENIZER_TEMPLATE:
            label = f"--sft-tokenizer-prompt-format {config.prompt_format}"
            return jinja_renderer(
                BUILTIN_TEMPLATES[config.prompt_format], label=label, **special
            ), ""
        if isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template:
            return tokenizer.apply_chat_template, ""
        return None, (
            f"conversations need a chat template and the tokenizer ({type(tokenizer).__name__}) "
            f"has none; choose one with --sft-tokenizer-prompt-format "
            f"({', '.join(BUILTIN_TEMPLATES)}) or --chat-template FILE"
        )

    def encode_record(self, record: dict) -> list[SFTDocument]:
        """The documents of one record (several for a line of several conversations)."""
        record = {key: value for key, value in record.items() if value is not None}
        if "messages" in record:
            messages = _checked_messages(record["messages"])
            return [
                self._conversation(offset, conversation)
                for offset, conversation in split_conversations(messages)
            ]
        if is_alpaca_record(record):
            _text_fields(record, ("instruction", "input", "output"))
            return [self._prompt_response(alpaca_prompt(record), alpaca_response(record, ""))]
        if "prompt" in record and "response" in record:
            _text_fields(record, ("prompt", "response"))
            return [self._prompt_response(record["prompt"], record["response"])]
        keys = ", ".join(list(record)[:8]) or "none"
        raise BadLineError(
            f"not an SFT record (keys: {keys}); expected 'messages', Alpaca's 'instruction' "
            "and 'output', or 'prompt' and 'response'"
        )

    def _document(self, tokens: np.ndarray, loss_mask: np.ndarray, reply_last: bool) -> SFTDocument:
        tokens = np.append(tokens.astype(self.dtype), np.array(self.eod, self.dtype))
        loss_mask = np.append(loss_mask, np.array(int(reply_last), LOSS_MASK_DTYPE))
        return SFTDocument(tokens, loss_mask)

    def _prompt_response(self, prompt: str, response: str) -> SFTDocument:
        if not response:
            raise BadLineError("empty response")
        tokens = np.asarray(self.tokenizer.tokenize_to_array(prompt + response))
        start = common_prefix_length(np.asarray(self.tokenizer.tokenize_to_array(prompt)), tokens)
        loss_mask = np.zeros(len(tokens), LOSS_MASK_DTYPE)
        loss_mask[start:] = 1
        return self._document(tokens, loss_mask, reply_last=True)

    def _conversation(self, offset: int, messages: list[dict]) -> SFTDocument:
        if self._render is None:
            raise BadLineError(self._no_template)
        if not any(message["role"] == "assistant" for message in messages):
            raise BadLineError(
                f"the conversation at messages[{offset}] has no assistant message to train on"
            )
        text = self._rendered(messages, False, offset)
        tokens = np.asarray(self._encode_template_text(text))
        loss_mask = np.zeros(len(tokens), LOSS_MASK_DTYPE)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._rendered(messages[:index], True, offset)
            through = self._rendered(messages[: index + 1], False, offset)
            if not (text.startswith(before) and text.startswith(through)):
                raise BadLineError(
                    f"messages[{offset + index}]: the chat template does not render the "
                    "conversation up to this reply as the start of the whole (it is not "
                    "prefix-stable), so the reply's tokens cannot be found; use another template"
                )
            start = common_prefix_length(np.asarray(self._encode_template_text(before)), tokens)
            end = common_prefix_length(np.asarray(self._encode_template_text(through)), tokens)
            loss_mask[start:end] = 1
        return self._document(tokens, loss_mask, messages[-1]["role"] == "assistant")

    def _rendered(self, messages: list[dict], add_generation_prompt: bool, offset: int) -> str:
        try:
            return self._render(messages, add_generation_prompt)
        except Exception as error:  # noqa: BLE001 - a template is code: any failure names the line
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise BadLineError(
                f"the chat template failed on the conversation at messages[{offset}] ({first})"
            ) from None
