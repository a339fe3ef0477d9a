"""Merge several `.bin/.idx` datasets into one, keeping every document boundary.

    python tools/merge_datasets.py --input data/shards --output-prefix data/all_text_document
    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document

`--input` is a folder (every `.bin/.idx` pair in it, in sorted order, as Megatron-LM's
merge_datasets.py does) or one or more dataset prefixes (globs allowed), in the order given.
All inputs must share a token dtype. The output appears under its name only when complete.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.atomic_files import atomic_outputs  # noqa: E402
from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    dataset_exists,
)
from tools.cli_errors import ToolArgumentParser, check_output_path, run_tool  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = ToolArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="a folder of .bin/.idx pairs, or dataset prefixes (globs allowed)",
    )
    parser.add_argument(
        "--output-prefix", required=True, help="prefix of the merged dataset, without .bin/.idx"
    )
    args = parser.parse_args(argv)
    if args.output_prefix.endswith(("/", os.sep)):  # would write the hidden files `.bin/.idx`
        parser.error(
            f"--output-prefix {args.output_prefix} names a folder; give a prefix such as "
            f"{os.path.join(args.output_prefix, 'merged_text_document')}"
        )
    check_output_path(args.output_prefix, "--output-prefix")
    return args


def _prefixes_in_folder(folder: str) -> list[str]:
    names = sorted(os.listdir(folder))
    bins = {n[: -len(".bin")] for n in names if n.endswith(".bin")}
    idxs = {n[: -len(".idx")] for n in names if n.endswith(".idx")}
    for orphan in sorted(bins ^ idxs):
        suffix = ".idx" if orphan in bins else ".bin"
        raise IndexedDatasetError(
            f"{os.path.join(folder, orphan)}{suffix}: missing; every "
            ".bin needs its .idx and the other way round"
        )
    return [os.path.join(folder, prefix) for prefix in sorted(bins)]


def _expand_glob(pattern: str) -> list[str]:
    if not pattern.endswith((".bin", ".idx")):
        pattern += ".idx"
    return sorted({path[: -len(".idx")] for path in glob.glob(pattern)})


def resolve_inputs(inputs: list[str], output_prefix: str) -> list[str]:
    """Dataset prefixes to merge, in order; the output itself is never one of them."""
    output = os.path.abspath(output_prefix)
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            # An earlier merge output in the same folder is not an input.
            found = [p for p in _prefixes_in_folder(item) if os.path.abspath(p) != output]
        elif glob.has_magic(item):
            found = _expand_glob(item)
        else:
            found = [item[: -len(".bin")] if item.endswith((".bin", ".idx")) else item]
        if not found:
            raise IndexedDatasetError(f"--input {item}: no .bin/.idx datasets found")
        prefixes.extend(found)
    for prefix in prefixes:
        if os.path.abspath(prefix) == output:
            raise IndexedDatasetError(f"--output-prefix {output_prefix} is also an input")
        if not dataset_exists(prefix):
            raise IndexedDatasetError(f"--input {prefix}: no {prefix}.bin/.idx pair")
    return prefixes


def merge(prefixes: list[str], output_prefix: str) -> IndexedDatasetBuilder:
    """Write the merged dataset under temporary names, then rename both files."""
    first = IndexedDataset(prefixes[0])
    datasets = [first] + [IndexedDataset(p) for p in prefixes[1:]]  # validates every input
    for prefix, dataset in zip(prefixes, datasets):
        if dataset.dtype != first.dtype:
            raise IndexedDatasetError(
                f"{prefix}.idx holds {dataset.dtype.name} tokens but {prefixes[0]}.idx holds "
                f"{first.dtype.name}; datasets made with different vocabularies cannot be merged"
            )
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    start = time.time()
    with atomic_outputs(output_prefix + ".bin", output_prefix + ".idx") as (bin_path, idx_path):
        builder = IndexedDatasetBuilder(bin_path, dtype=first.dtype)
        try:
            for number, prefix in enumerate(prefixes, start=1):
                builder.add_index(prefix)
                elapsed = max(time.time() - start, 1e-9)
                print(
                    f"merged {number}/{len(prefixes)}: {prefix} ({builder.num_documents} "
                    f"documents, {builder.num_tokens} tokens so far, {elapsed:.1f} s)",
                    file=sys.stderr,
                )
            builder.finalize(idx_path)
        finally:
            builder.close()
    return builder


def run(argv: list[str] | None) -> int:
    """Parse, merge, report; raises on bad input."""
    args = get_args(argv)
    prefixes = resolve_inputs(args.input, args.output_prefix)
    builder = merge(prefixes, args.output_prefix)
    print(
        f"wrote {args.output_prefix}.bin/.idx: {builder.num_documents} documents, "
        f"{builder.num_sequences} sequences, {builder.num_tokens} tokens from "
        f"{len(prefixes)} datasets",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; 1 with a one-line error for a bad input."""
    return run_tool(lambda: run(argv), (IndexedDatasetError,), note="nothing was written")


if __name__ == "__main__":
    sys.exit(main())
