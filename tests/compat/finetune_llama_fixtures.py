"""What Megatron-DeepSpeed's LLaMA fine-tuning example needs, made small and offline: Alpaca
records, a LLaMA-style tokenizer folder and a random tiny Hugging Face LLaMA.

Used by tests/compat/test_finetune_llama.py (the script's three stages) and
tests/data/test_prompt_dataset.py (the samples).
"""

from __future__ import annotations

import json
import os

import torch

from megatron.data.alpaca import alpaca_prompt

RECORDS = 40
HF_MAX_POSITIONS = 256


def alpaca_records(count: int = RECORDS) -> list[dict]:
    """Alpaca records with a pattern a tiny model learns in a few steps (odd ones have an
    input, so both prompt templates occur)."""
    words = ["red", "green", "blue", "black", "white"]
    records = []
    for number in range(count):
        a, b = number % 7, number % 5
        record = {"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a + b}"}
        if number % 2:
            record = {
                "instruction": "Name the colour.",
                "input": f"the colour {words[b]}",
                "output": f"It is {words[b]}.",
            }
        records.append(record)
    return records


def write_alpaca_json(path: str, records: list[dict]) -> str:
    """`records` as an Alpaca JSON file (one list); returns `path`."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(records, file)
    return path


def build_tokenizer_folder(folder: str, records: list[dict]) -> str:
    """A byte-level BPE trained on the rendered records, with LLaMA's specials (<unk> 0, <s> 1,
    </s> 2) and <s> prepended, saved as a folder `AutoTokenizer` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [alpaca_prompt(record) + record["output"] for record in records]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": HF_MAX_POSITIONS,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file)
    return folder


def build_hf_llama(folder: str, vocab_size: int) -> None:
    """A random tiny `LlamaForCausalLM` (finetune_llama.sh's kind: multi-head attention, untied
    output layer, no biases) saved in two safetensors shards, as the script's 2 shards."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=HF_MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="300KB")
