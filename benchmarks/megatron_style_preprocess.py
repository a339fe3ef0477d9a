"""The baseline: Megatron-LM's preprocess_data.py loop, with Megatron's tokenizers.

This reproduces what Megatron does for a JSON-lines corpus, step for step: a
`multiprocessing.Pool` whose workers `json.loads` each line and tokenize it,
`pool.imap(encode, lines, 25)`, and the main process adding each document to the `.bin/.idx`
builder. It writes the same format, so its output must be byte-identical to
`tools/preprocess_data.py`'s.

The tokenizer is what Megatron's class of --tokenizer-type calls: for GPT2BPETokenizer the
word-cached pure-Python BPE (`tests/tokenizer/reference_bpe.py`, the same algorithm as
Megatron's `gpt2_tokenization.py`); for GPTSentencePieceTokenizer and Llama2Tokenizer the
`sentencepiece` library's `encode_as_ids` (Llama2: after the bos id); for HFTokenizer the
`tokenizers` library's `encode(text).ids` of a tokenizer.json (the Rust encoder Megatron's
Hugging Face class also ends in, without the `transformers` wrapper's per-call cost).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO_ROOT)

from megatron.data.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from tests.tokenizer.reference_bpe import ReferenceGPT2BPE  # noqa: E402


def megatron_tokenizer(args: argparse.Namespace) -> tuple[Callable[[str], list[int]], int, int]:
    """(tokenize, eod id, vocabulary size) of Megatron's tokenizer class for --tokenizer-type."""
    kind = args.tokenizer_type
    if kind == "GPT2BPETokenizer":
        bpe = ReferenceGPT2BPE(args.vocab_file, args.merge_file)
        return bpe.encode, bpe.encoder["<|endoftext|>"], len(bpe.encoder)
    if kind == "HFTokenizer":
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer_model)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eod = next(vocab[t] for t in ("<|endoftext|>", "</s>", "<|end_of_text|>") if t in vocab)
        return (lambda text: tokenizer.encode(text).ids), eod, len(vocab)
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model)
    bos = [processor.bos_id()] if kind == "Llama2Tokenizer" else []
    return (lambda text: bos + processor.encode_as_ids(text)), processor.eos_id(), len(processor)


class Encoder:
    """Megatron's per-process encoder: one tokenizer per worker, built in the initializer."""

    tokenize: Callable[[str], list[int]]
    eod: int

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def initializer(self) -> None:
        """Build the worker's tokenizer (Megatron's `Encoder.initializer`)."""
        Encoder.tokenize, Encoder.eod, _ = megatron_tokenizer(self.args)

    def encode(self, json_line: str) -> tuple[dict, dict, int]:
        """Megatron's `Encoder.encode`: token ids and sentence lengths of every key."""
        data = json.loads(json_line)
        ids, lens = {}, {}
        for key in self.args.json_keys:
            doc_ids: list[int] = []
            sentence_lens: list[int] = []
            for sentence in [data[key]]:
                sentence_ids = Encoder.tokenize(sentence)
                if len(sentence_ids) > 0:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if len(doc_ids) > 0 and self.args.append_eod:
                doc_ids.append(Encoder.eod)
                sentence_lens[-1] += 1
            ids[key], lens[key] = doc_ids, sentence_lens
        return ids, lens, len(json_line)


def main(argv: list[str] | None = None) -> None:
    """Convert --input to --output-prefix the way Megatron-LM does."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--vocab-file", default=os.path.join(REPO_ROOT, "dataset/gpt2-vocab.json"))
    parser.add_argument("--merge-file", default=os.path.join(REPO_ROOT, "dataset/gpt2-merges.txt"))
    parser.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=["GPT2BPETokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HFTokenizer"],
    )
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument("--append-eod", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=1000)
    args = parser.parse_args(argv)

    encoder = Encoder(args)
    _, _, vocab_size = megatron_tokenizer(args)
    dtype = DType.optimal_dtype(vocab_size)
    start = time.time()
    # The platform's default start method, as Megatron uses (fork on Linux).
    with (
        open(args.input, encoding="utf-8") as lines,
        multiprocessing.Pool(args.workers, initializer=encoder.initializer) as pool,
    ):
        builders = {
            key: IndexedDatasetBuilder(f"{args.output_prefix}_{key}_document.bin", dtype=dtype)
            for key in args.json_keys
        }
        total_bytes = 0
        for i, (doc, sentence_lens, num_bytes) in enumerate(
            pool.imap(encoder.encode, lines, 25), start=1
        ):
            total_bytes += num_bytes
            for key in doc:
                builders[key].add_document(doc[key], sentence_lens[key])
            if i % args.log_interval == 0:
                elapsed = time.time() - start
                print(
                    f"Processed {i} documents ({i / elapsed:.1f} docs/s, "
                    f"{total_bytes / elapsed / 1e6:.2f} MB/s).",
                    file=sys.stderr,
                    flush=True,
                )
        for key, builder in builders.items():
            builder.finalize(f"{args.output_prefix}_{key}_document.idx")


if __name__ == "__main__":
    main()
