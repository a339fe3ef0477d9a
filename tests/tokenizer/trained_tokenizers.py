"""Small LLaMA-style tokenizers trained offline on standard-library source, for the tests.

`train_sentencepiece` trains a SentencePiece BPE model as LLaMA's was trained (identity
normalization, whitespace kept, digits split, byte fallback, so any text encodes and decodes
back exactly); `train_hf_bpe` a Hugging Face byte-level BPE with `<|endoftext|>` as its
special token, saved as a tokenizer.json file and as a folder `AutoTokenizer` loads (with
`eos_token` set). Each takes about a second on 100 files; the session fixtures in
tests/conftest.py train them once per run, under pytest's temporary directory.
"""

from __future__ import annotations

import glob
import json
import os

EOS_TOKEN = "<|endoftext|>"
# Text the stdlib lacks, so that byte fallback and multi-byte characters are exercised.
EXTRA_TEXTS = [
    "Ünïcödé façade — naïve café, Ωμέγα, Привет мир, 東京タワー, 한국어, עברית, العربية",
    "Emoji 🙂🚀👩\u200d💻 flags 🇫🇷, combining e\u0301 a\u0308, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Tabs\tand\r\nWindows newlines\r\n  trailing spaces   ",
    "   leading whitespace, a control \x07 bell, NUL-free \u2028 separators \u0085 done",
]


def stdlib_texts(count: int = 100, max_chars: int = 20_000) -> list[str]:
    """The first `count` standard-library modules of 500+ characters (each cut at
    `max_chars`), then `EXTRA_TEXTS`."""
    texts = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read(max_chars)
        if len(text) > 500:
            texts.append(text)
        if len(texts) == count:
            break
    return texts + EXTRA_TEXTS


def train_sentencepiece(texts: list[str], folder: str, vocab_size: int = 1000) -> str:
    """Train a LLaMA-style SentencePiece BPE model on `texts`; the path of its .model file.

    Ids: <unk> 0, <s> 1, </s> 2, no pad piece (pad id -1), as LLaMA's tokenizer.model.
    """
    import sentencepiece

    prefix = os.path.join(folder, "spm")
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        num_threads=2,
        minloglevel=2,
    )
    return prefix + ".model"


def train_hf_bpe(texts: list[str], folder: str, vocab_size: int = 1000) -> tuple[str, str]:
    """Train a byte-level BPE (`<|endoftext|>` special, id 0) on `texts`.

    Returns (the tokenizer.json file, a folder with it and a tokenizer_config.json naming
    `<|endoftext|>` as bos and eos token, which `AutoTokenizer.from_pretrained` loads).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    json_file = os.path.join(folder, "bpe.json")
    tokenizer.save(json_file)
    pretrained = os.path.join(folder, "hf_tokenizer")
    os.makedirs(pretrained)
    tokenizer.save(os.path.join(pretrained, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 1024,
    }
    with open(os.path.join(pretrained, "tokenizer_config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    return json_file, pretrained


def write_jsonl(texts: list[str], path: str, key: str = "text") -> str:
    """Write one `{key: text}` JSON object per line; returns `path`."""
    with open(path, "w", encoding="utf-8") as file:
        for text in texts:
            file.write(json.dumps({key: text}) + "\n")
    return path
