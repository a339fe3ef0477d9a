"""Single-threaded speed of three GPT-2 BPE encoders on ~30 MB of Python stdlib source.

Compares the pure-Python reference (tests/tokenizer/reference_bpe.py), tiktoken's
`encode_ordinary` (built offline from the same files; `pip install tiktoken`) and the native
C++ engine (megatron/tokenizer/native_bpe.py), one file at a time, and checks that all three produce
identical token ids on the whole corpus. Prints MB/s (of UTF-8 bytes) and ratios.

    python benchmarks/bpe_engine_speed.py [--mb 30] [--skip-reference]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time

import numpy as np

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO_ROOT)

from megatron.tokenizer.byte_encoding import bytes_to_unicode  # noqa: E402
from megatron.tokenizer.gpt2_bpe import _load_merges  # noqa: E402
from megatron.tokenizer.native_bpe import build_native_engine  # noqa: E402
from tests.tokenizer.reference_bpe import ReferenceGPT2BPE  # noqa: E402

VOCAB = os.path.join(REPO_ROOT, "dataset", "gpt2-vocab.json")
MERGES = os.path.join(REPO_ROOT, "dataset", "gpt2-merges.txt")


def stdlib_corpus(limit_bytes: int) -> list[str]:
    """Python stdlib .py files (no site-packages), in sorted path order, up to limit_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d != "site-packages"]
        paths.extend(os.path.join(directory, name) for name in files if name.endswith(".py"))
    for path in sorted(paths):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text.encode("utf-8", "surrogatepass"))
        if total >= limit_bytes:
            break
    return texts


def tiktoken_encoder(vocab_file: str):  # noqa: ANN201 (tiktoken is an optional import)
    """tiktoken's GPT-2 encoding built offline from the files (GPT-2's ids are its ranks)."""
    try:
        import tiktoken
    except ImportError:
        sys.exit("this benchmark compares with tiktoken: pip install tiktoken")
    byte_decoder = {char: byte for byte, char in bytes_to_unicode().items()}
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    ranks = {
        bytes(byte_decoder[c] for c in token): i
        for token, i in vocab.items()
        if token != "<|endoftext|>"
    }
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    encoding = tiktoken.Encoding(
        "gpt2-local",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": vocab["<|endoftext|>"]},
    )
    return encoding.encode_ordinary


def timed(encode, texts: list[str]) -> tuple[float, list[np.ndarray]]:
    """Seconds to encode every text, and the ids of each (as int32 arrays, converted after
    the clock stops: the native engine returns arrays, the others lists)."""
    start = time.perf_counter()
    ids = [encode(text) for text in texts]
    seconds = time.perf_counter() - start
    return seconds, [np.asarray(x, dtype=np.int32) for x in ids]


def main() -> None:
    """Build the three encoders, time them on the corpus and compare their ids."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=30.0, help="corpus size in MB")
    parser.add_argument("--skip-reference", action="store_true", help="skip the slow reference")
    args = parser.parse_args()

    texts = stdlib_corpus(int(args.mb * 1e6))
    megabytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) / 1e6
    print(f"corpus: {len(texts)} stdlib files, {megabytes:.1f} MB")

    start = time.perf_counter()
    tiktoken_encode = tiktoken_encoder(VOCAB)
    print(f"tiktoken build: {time.perf_counter() - start:.3f} s")
    with open(VOCAB, encoding="utf-8") as f:
        encoder = json.load(f)
    merges = _load_merges(MERGES)
    start = time.perf_counter()
    engine = build_native_engine(encoder, merges)
    print(f"native build:   {time.perf_counter() - start:.3f} s (fast merge: {engine.fast_merge})")

    results: dict[str, tuple[float, list[list[int]]]] = {}
    if not args.skip_reference:
        reference = ReferenceGPT2BPE(VOCAB, MERGES)
        results["reference"] = timed(reference.encode, texts)
    results["tiktoken"] = timed(tiktoken_encode, texts)
    results["native"] = timed(engine.encode, texts)
    # Second pass with a warm word cache (the steady state when encoding many documents).
    results["native (warm)"] = timed(engine.encode, texts)

    for name, (seconds, _) in results.items():
        print(f"{name:14s} {megabytes / seconds:8.2f} MB/s  ({seconds:.2f} s)")
    base = results["tiktoken"][0]
    for name, (seconds, _) in results.items():
        if name != "tiktoken":
            print(f"{name} / tiktoken speed: {base / seconds:.2f}x")

    expected = results["native"][1]
    for name, (_, ids) in results.items():
        if name == "native":
            continue
        mismatches = [i for i, (a, b) in enumerate(zip(ids, expected)) if not np.array_equal(a, b)]
        status = "identical" if not mismatches else f"{len(mismatches)} files differ"
        print(f"{name} vs native: {status}")
        for i in mismatches[:3]:
            print(f"  first differing file index {i}")
    same = all(
        all(np.array_equal(a, b) for a, b in zip(ids, expected)) for _, ids in results.values()
    )
    print("ALL IDENTICAL" if same else "MISMATCH")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
