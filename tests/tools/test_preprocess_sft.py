"""tools/preprocess_data.py --sft: conversations and prompt/response records, tokens and loss mask.

Each test recomputes which tokens are the replies' by another method than the tool's (which
renders conversation prefixes and compares token lists): for GPT-2 and the built-in ChatML
template, the reply spans found by a regular expression in the whole rendered text and the
character offsets of another BPE implementation (Hugging Face `tokenizers` on the same
vocabulary); for a Hugging Face tokenizer's own template, transformers'
`return_assistant_tokens_mask` (its `{% generation %}` blocks).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from tests.conftest import MERGE_FILE, REPO_ROOT, VOCAB_FILE
from tests.one_line_errors import assert_one_line_error, snapshot

SFT_DATA = os.path.join(REPO_ROOT, "tests", "data", "sft_tiny.jsonl")
EOD = 50256
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML with transformers' {% generation %} marks around what a reply trains on.
CHATML_WITH_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _records() -> list[dict]:
    with open(SFT_DATA, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


def _conversations(messages: list[dict]) -> list[list[dict]]:
    """Megatron-LM's rule, restated: a system message starts a new conversation."""
    found: list[list[dict]] = []
    for message in messages:
        if message["role"] == "system" or not found:
            found.append([])
        found[-1].append(message)
    return found


def _preprocess(*flags: str) -> int:
    from tools import preprocess_data

    return preprocess_data.main(list(flags))


def _read(prefix: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    tokens = IndexedDataset(prefix + "_sft_document")
    masks = IndexedDataset(prefix + "_sft_document_loss_mask")
    assert masks.dtype == np.uint8
    assert np.array_equal(tokens.sizes, masks.sizes)
    return [tokens[i] for i in range(len(tokens))], [masks[i] for i in range(len(masks))]


def _offsets_bpe():
    """GPT-2's BPE as Hugging Face `tokenizers` implements it, with character offsets."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    bpe = Tokenizer(models.BPE.from_file(VOCAB_FILE, MERGE_FILE))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return bpe


def _expected_gpt2(record: dict, bpe) -> list[tuple[list[int], int]]:  # noqa: ANN001
    """(token ids, trained-token count) of a record's documents, by regex spans and offsets."""
    from megatron.data.alpaca import alpaca_prompt, is_alpaca_record

    documents = []
    if "messages" in record:
        for conversation in _conversations(record["messages"]):
            text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in conversation)
            spans = [
                m.span(1)
                for m in re.finditer(
                    rf"{re.escape(IM_START)}assistant\n(.*?{re.escape(IM_END)}\n)", text, re.S
                )
            ]
            documents.append((text, spans))
    else:
        prompt = alpaca_prompt(record) if is_alpaca_record(record) else record["prompt"]
        response = record["output"] if is_alpaca_record(record) else record["response"]
        documents.append((prompt + response, [(len(prompt), len(prompt) + len(response))]))
    expected = []
    for text, spans in documents:
        encoding = bpe.encode(text)
        inside = sum(
            any(start <= first and last <= end for start, end in spans)
            for first, last in encoding.offsets
        )
        expected.append((encoding.ids, inside + 1))  # + the end of document after the reply
    return expected


def test_gpt2_chatml_masks_the_replies(tmp_path, capsys):
    """36 documents (one line holds two conversations), each ending with EOD; the tokens are
    the whole rendered text's and the mask's ones are exactly the reply tokens, counted
    independently, per document."""
    prefix = str(tmp_path / "sft")
    code = _preprocess(
        "--input", SFT_DATA, "--output-prefix", prefix, "--sft",
        "--sft-tokenizer-prompt-format", "chatml", "--log-interval", "10",
    )  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert "Processed 26 documents" in err and "Done: 36 documents" in err  # 25 lines, 26 docs
    tokens, masks = _read(prefix)
    bpe = _offsets_bpe()
    expected = [doc for record in _records() for doc in _expected_gpt2(record, bpe)]
    assert len(tokens) == len(expected) == 36
    for document, mask, (ids, trained) in zip(tokens, masks, expected):
        assert document.tolist() == ids + [EOD]
        assert int(mask.sum()) == trained
        assert mask[-1] == 1
    total = sum(int(mask.sum()) for mask in masks)
    assert f"loss mask: {total} of {sum(map(len, tokens))} tokens trained on (uint8)" in err


def test_trained_text_of_a_conversation(tmp_path):
    """The first conversation trains on its reply and ChatML's closing marker, nothing else."""
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    prefix = str(tmp_path / "sft")
    assert _preprocess(
        "--input", SFT_DATA, "--output-prefix", prefix, "--sft",
        "--sft-tokenizer-prompt-format", "chatml",
    ) == 0  # fmt: skip
    tokens, masks = _read(prefix)
    gpt2 = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)
    trained = gpt2.detokenize(tokens[0][masks[0] == 1])
    assert trained == "Paris.<|im_end|>\n<|endoftext|>"
    assert gpt2.detokenize(tokens[0]).startswith("<|im_start|>system\nYou are a concise")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE trained on the SFT data with ChatML's special tokens, saved as a
    folder whose tokenizer_config.json has CHATML_WITH_GENERATION as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("chat_tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(SFT_DATA, encoding="utf-8") as file:
        tokenizer.train_from_iterator(file.read().splitlines(), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "chat_template": CHATML_WITH_GENERATION,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def test_tokenizer_template_matches_transformers_assistant_mask(chat_tokenizer, tmp_path):
    """HFTokenizer's own template (the default format): the tokens are apply_chat_template's,
    and the mask's ones are its assistant token mask's, plus the end of document."""
    from transformers import AutoTokenizer

    conversations = tmp_path / "conversations.jsonl"
    records = [record for record in _records() if "messages" in record]
    conversations.write_text("".join(json.dumps(record) + "\n" for record in records))
    prefix = str(tmp_path / "hf")
    assert _preprocess(
        "--input", str(conversations), "--output-prefix", prefix, "--sft",
        "--tokenizer-type", "HFTokenizer", "--tokenizer-model", chat_tokenizer,
    ) == 0  # fmt: skip
    tokens, masks = _read(prefix)
    reference = AutoTokenizer.from_pretrained(chat_tokenizer)
    expected = []
    for record in records:
        for conversation in _conversations(record["messages"]):
            out = reference.apply_chat_template(
                conversation, return_dict=True, return_assistant_tokens_mask=True
            )
            expected.append((list(out["input_ids"]), sum(out["assistant_masks"]) + 1))
    assert len(tokens) == len(expected)
    eos = reference.eos_token_id
    for document, mask, (ids, trained) in zip(tokens, masks, expected):
        assert document.tolist() == ids + [eos]
        assert int(mask.sum()) == trained


NOT_PREFIX_STABLE = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"

# case -> (lines of the input, extra flags, fragments the error line names)
BAD_SFT = {
    "no_template": (
        [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}],
        [],
        ["{src}:1: conversations need a chat template", "--sft-tokenizer-prompt-format"],
    ),
    "not_prefix_stable": (
        [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}],
        ["--chat-template", "{template}"],
        ["{src}:1: messages[1]: the chat template does not render", "prefix-stable"],
    ),
    "not_an_sft_record": ([{"text": "plain"}], [], ["{src}:1: not an SFT record (keys: text)"]),
    "assistant_first": (
        [{"messages": [{"role": "assistant", "content": "Yo"}]}],
        ["--sft-tokenizer-prompt-format", "chatml"],
        ["{src}:1: messages[0]: an assistant message must follow a user or tool message"],
    ),
    "bad_role": (
        [{"messages": [{"role": "robot", "content": "Yo"}]}],
        [],
        ["{src}:1: messages[0]: role 'robot' is not one of"],
    ),
    "json_keys": ([{"prompt": "a", "response": "b"}], ["--json-keys", "title"], ["--json-keys"]),
    "template_without_sft": (
        [{"prompt": "a", "response": "b"}],
        ["--chat-template", "{template}", "--no-sft"],
        ["--chat-template need --sft"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SFT))
def test_sft_errors_are_one_line(tmp_path, capsys, case):
    """One last `error:` line naming the file and line (or the flag); nothing written."""
    lines, flags, named = BAD_SFT[case]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    template = tmp_path / "t.jinja"
    template.write_text(NOT_PREFIX_STABLE)
    paths = {"src": source, "template": template}
    sft = [] if "--no-sft" in flags else ["--sft"]
    flags = [f.format(**paths) for f in flags if f != "--no-sft"]
    before = snapshot(tmp_path)
    code = _preprocess("--input", str(source), "--output-prefix", str(tmp_path / "o"), *sft, *flags)
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(**paths) for n in named])
    assert snapshot(tmp_path) == before
