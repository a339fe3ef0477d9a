"""Oracle script (run with megatron-core 0.16.1 as `megatron`): its TikTokenTokenizer's ids.

    python megatron_core_tiktoken.py CASES.json OUT.json

Each case names a tiktoken JSON vocabulary, the tokenizer's keyword arguments (pattern,
vocab_size, num_special_tokens, special_tokens) and texts; OUT holds, per case, the ids of
every text (`text_to_ids`, what Megatron-LM's `tokenize` calls), the text of those ids, and
the tokenizer's vocab_size and eod.
"""

from __future__ import annotations

import json
import sys

from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer


def main(cases_path: str, out_path: str) -> None:
    """Tokenize every case's texts with megatron-core's TikTokenTokenizer."""
    with open(cases_path) as file:
        cases = json.load(file)
    results = []
    for case in cases:
        tokenizer = TikTokenTokenizer(case["vocab"], **case["kwargs"])
        ids = [tokenizer.text_to_ids(text) for text in case["texts"]]
        results.append(
            {
                "ids": ids,
                "texts": [tokenizer.tokenizer.decode(i) for i in ids],
                "vocab_size": tokenizer.vocab_size,
                "eod": tokenizer.eod,
            }
        )
    with open(out_path, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
