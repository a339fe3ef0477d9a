"""GPT pretraining samples cut from an indexed dataset, with Megatron's exact index mappings.

A split (train/valid/test) is a contiguous range of documents. To serve `num_samples`
samples of `seq_length + 1` tokens, the range is repeated for as many epochs as needed and
three arrays are built (and cached as .npy files):

- doc_idx: the documents of every epoch, shuffled (the last epoch shuffled separately when
  it is needed for less than 80% of its samples, so that its documents do not crowd out
  earlier epochs in the global shuffle: Megatron's "separate last epoch" rule);
- sample_idx: where each sample starts, as (position in doc_idx, token offset), computed by
  the C++ helper `build_sample_idx`; sample i spans tokens start_i .. start_{i+1} inclusive,
  so consecutive samples share one token (the last label of one is the first input of next);
- shuffle_idx: a permutation of the samples (again with the last epoch kept apart).

Same data, split, sample count, sequence length and seed give the same samples, run after run,
identical to Megatron-LM and Megatron-DeepSpeed.

SFT data (`tools/preprocess_data.py --sft`) has a loss mask beside its tokens
(`megatron.data.loss_mask`): where a run's datasets have one (or with `--sft`), each sample also
carries `loss_mask`, one value per label, cut from the mask exactly as the tokens are. The
indices depend on the document sizes alone, which tokens and mask share, so they are cached
once for both.

`build_train_valid_test_datasets` builds the three splits from one of Megatron-LM's data
sources: `--data-path` cut by `--split`; `--train-data-path` / `--valid-data-path` /
`--test-data-path`, each split the whole of its own datasets (blended by weight); or
`--mock-data`, megatron-core's synthetic documents (`mock_dataset`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time

import numpy as np
import torch

from megatron.config import DataConfig
from megatron.data.blendable_dataset import BlendableDataset, parse_data_path, samples_per_dataset
from megatron.data.cpp_helpers import load_helpers
from megatron.data.index_cache import load_or_build_arrays
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError, make_dataset
from megatron.data.loss_mask import UnmaskedDocuments, has_loss_mask, loss_masks_of
from megatron.data.mock_dataset import MOCK_DOCUMENTS, MockDocuments, mock_split_bounds
from megatron.data.token_check import check_token_ids
from megatron.utils import print_rank_0

# Below this share of an epoch's samples, the last epoch gets its own shuffle.
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80
SPLIT_NAMES = ("train", "valid", "test")
PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def get_train_valid_test_split_(splits_string: str, size: int) -> list[int]:
    """Document boundaries [0, a, b, size] for `--split` weights such as '949,50,1'.

    Quotes around the weights are ignored, as Megatron-LM's parser ignores them: its Llama-3
    recipe passes `"--split '99,1,0'"` inside a bash array, so the quotes reach the program.
    """
    splits_string = splits_string.strip("'\"")
    separator = "," if "," in splits_string else "/"
    try:
        splits = [float(s) for s in splits_string.split(separator)]
    except ValueError:
        raise ValueError(
            f"--split {splits_string!r}: expected up to three numbers separated by ',' or '/', "
            "such as 949,50,1"
        ) from None
    if len(splits) > 3 or not all(math.isfinite(s) and s >= 0 for s in splits) or sum(splits) <= 0:
        raise ValueError(
            f"--split {splits_string!r}: expected up to three non-negative weights with a "
            "positive sum, such as 949,50,1"
        )
    splits = (splits + [0.0, 0.0])[:3]
    total = sum(splits)
    bounds = [0]
    for weight in splits:
        bounds.append(bounds[-1] + int(round(weight / total * float(size))))
    # Rounding may overshoot or fall short; Megatron moves every boundary by the difference.
    difference = bounds[-1] - size
    return [bounds[0]] + [bound - difference for bound in bounds[1:]]


def train_valid_test_num_samples(
    global_batch_size: int,
    eval_iters: int,
    eval_interval: int,
    train_iters: int | None = None,
    train_samples: int | None = None,
) -> list[int]:
    """Samples each split must provide for a run, as Megatron computes them."""
    if train_samples is None:
        if train_iters is None:
            raise ValueError("give --train-iters or --train-samples")
        train_samples = train_iters * global_batch_size
    else:
        train_iters = train_samples // global_batch_size
    evaluations = train_iters // eval_interval + 1
    return [
        train_samples,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    ]


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` (or more) samples of seq_length + 1 tokens from a range of documents."""

    def __init__(
        self,
        name: str,
        data_prefix: str | None,
        documents: np.ndarray,
        indexed_dataset: IndexedDataset | MockDocuments,
        num_samples: int,
        seq_length: int,
        seed: int,
        data_cache_path: str | None = None,
        group: torch.distributed.ProcessGroup | None = None,
        loss_masks: IndexedDataset | UnmaskedDocuments | None = None,
    ) -> None:
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.loss_masks = loss_masks
        """The SFT loss masks beside the tokens (same sizes), or None."""
        label = data_prefix or "--mock-data"
        if len(documents) == 0:
            raise ValueError(f"{label}: the {name} split has no documents")
        if documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise ValueError(f"{label}: {name} documents out of range")
        self.doc_idx, self.sample_idx, self.shuffle_idx = build_index_mappings(
            name,
            data_prefix,
            documents,
            indexed_dataset.sizes,
            num_samples,
            seq_length,
            seed,
            data_cache_path,
            group,
        )

    def __len__(self) -> int:
        # sample i is [sample_idx[i], sample_idx[i + 1]], hence one row fewer.
        return self.shuffle_idx.shape[0]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """{'text': seq_length + 1 token ids (int64)} of sample `idx`; with loss masks also
        {'loss_mask': seq_length floats}, one per label (the mask of tokens 1 .. seq_length)."""
        idx = int(self.shuffle_idx[idx])
        sample = {"text": self._cut(self.indexed_dataset, idx).astype(np.int64)}
        if self.loss_masks is not None:
            sample["loss_mask"] = self._cut(self.loss_masks, idx)[1:].astype(np.float32)
        return sample

    def _cut(
        self, documents: IndexedDataset | MockDocuments | UnmaskedDocuments, idx: int
    ) -> np.ndarray:
        """The seq_length + 1 values of sample `idx` (unshuffled) from `documents`."""
        doc_first, offset_first = (int(v) for v in self.sample_idx[idx])
        doc_last, offset_last = (int(v) for v in self.sample_idx[idx + 1])
        if doc_first == doc_last:
            return documents.get(
                self.doc_idx[doc_first], offset=offset_first, length=offset_last - offset_first + 1
            )
        parts = [documents.get(self.doc_idx[doc_first], offset=offset_first)]
        parts += [documents.get(self.doc_idx[i]) for i in range(doc_first + 1, doc_last)]
        parts.append(documents.get(self.doc_idx[doc_last], length=offset_last + 1))
        return np.concatenate(parts)


def build_index_mappings(
    name: str,
    data_prefix: str | None,
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    data_cache_path: str | None = None,
    group: torch.distributed.ProcessGroup | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx, loaded from the cache or built once and cached.

    `data_prefix` None means --mock-data: cached only in `data_cache_path`, else built here.
    """
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch <= 1:
        raise ValueError(
            f"{data_prefix or '--mock-data'}: the {name} split (documents {documents[0]}.."
            f"{documents[-1]}) has {tokens_per_epoch} tokens; at least 2 are needed to make a "
            "sample"
        )
    num_epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    description = {
        "class": "GPTDataset",
        "format": 1,
        "data_prefix": os.path.abspath(data_prefix) if data_prefix else "mock",
        "split": name,
        "documents": [int(documents[0]), int(documents[-1]) + 1],
        "num_documents_in_dataset": len(sizes),
        "tokens_per_epoch": tokens_per_epoch,
        "num_samples": num_samples,
        "seq_length": seq_length,
        "seed": seed,
    }
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()[:10]
    folder = data_cache_path or os.path.dirname(os.path.abspath(data_prefix or "."))
    stem = os.path.join(
        folder,
        f"{os.path.basename(data_prefix or 'mock_gpt')}_{name}_indexmap_{num_samples}ns_"
        f"{seq_length}sl_{seed}s_{digest}",
    )

    def build() -> dict[str, np.ndarray]:
        start = time.time()
        arrays = _build_arrays(
            documents, sizes, num_samples, seq_length, seed, tokens_per_epoch, num_epochs
        )
        print_rank_0(f" > built {name} index mappings in {time.time() - start:.2f} s")
        return arrays

    if data_prefix is None and data_cache_path is None:
        arrays, cached = build(), "not cached (no --data-cache-path)"
    else:
        arrays = load_or_build_arrays(
            stem,
            ("doc_idx", "sample_idx", "shuffle_idx"),
            build,
            json.dumps(description, indent=2),
            group,
        )
        cached = f"cached as {stem}_*.npy"
    print_rank_0(
        f"    {name}: {arrays['shuffle_idx'].shape[0]} samples over {num_epochs} "
        f"epoch(s) of {len(documents)} documents, {cached}"
    )
    return arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs needed so that (epochs * tokens - 1) // seq_length >= num_samples."""
    needed_tokens = num_samples * seq_length + 1
    return max(1, -(-needed_tokens // tokens_per_epoch))


def _build_arrays(
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    tokens_per_epoch: int,
    num_epochs: int,
) -> dict[str, np.ndarray]:
    separate_last_epoch = False
    samples_before_last = 0
    if num_epochs > 1:
        samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_samples = num_samples - samples_before_last
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = last_epoch_samples < int(
            SEPARATE_LAST_EPOCH_THRESHOLD * samples_per_epoch
        )
    rng = np.random.RandomState(seed=seed)
    doc_idx = _build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
    sample_idx = load_helpers().build_sample_idx(
        np.ascontiguousarray(sizes, dtype=np.int32),
        doc_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
    )
    total = sample_idx.shape[0] - 1
    shuffled_first = samples_before_last if separate_last_epoch else total
    shuffle_idx = _build_shuffle_idx(shuffled_first, total, rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def _build_doc_idx(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    """Every epoch's documents, shuffled together (or the last epoch shuffled on its own)."""
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = _build_doc_idx(documents, num_epochs - 1, rng, False)
    last = _build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def _build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_train_valid_test_datasets(
    config: DataConfig,
    train_valid_test_num_samples: list[int],
    group: torch.distributed.ProcessGroup | None = None,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets of the run's data source (see the module docstring).

    `group` holds the ranks that build datasets together (rank 0 of it writes the index
    cache while the others wait); the default is all ranks.
    """
    if config.mock_data:
        if config.sft:
            raise ValueError("--sft with --mock-data: synthetic documents have no loss masks")
        return _build_mock_splits(config, train_valid_test_num_samples, group)
    paths = (config.train_data_path, config.valid_data_path, config.test_data_path)
    if not (config.data_path or any(paths)):
        raise ValueError(
            "no data: give --data-path, --train-data-path (and --valid-data-path, "
            "--test-data-path) or --mock-data"
        )
    flags = ("--data-path", *PER_SPLIT_FLAGS)
    given = [(path, flag) for path, flag in zip((config.data_path, *paths), flags) if path]
    prefixes = [prefix for path, flag in given for prefix in parse_data_path(path, flag)[0]]
    masked = config.sft or any(has_loss_mask(prefix) for prefix in prefixes)
    if config.data_path:
        return _build_blend_with_split(config, train_valid_test_num_samples, group, masked)
    return tuple(
        _build_whole_blend(index, path, config, count, group, masked) if path else None
        for index, (path, count) in enumerate(zip(paths, train_valid_test_num_samples))
    )


def _build_blend_with_split(
    config: DataConfig,
    train_valid_test_num_samples: list[int],
    group: torch.distributed.ProcessGroup | None,
    masked: bool = False,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """`--data-path`: every dataset cut by `--split`, each split blended by weight."""
    prefixes, weights = parse_data_path(config.data_path)
    if len(prefixes) == 1:
        return _build_splits(prefixes[0], config, train_valid_test_num_samples, group, masked)
    per_dataset = samples_per_dataset(weights, train_valid_test_num_samples)
    splits = [
        _build_splits(prefix, config, counts, group, masked)
        for prefix, counts in zip(prefixes, per_dataset)
    ]
    blended = []
    for index, size in enumerate(train_valid_test_num_samples):
        parts = [datasets[index] for datasets in splits]
        if all(part is None for part in parts):
            blended.append(None)
            continue
        if any(part is None for part in parts):
            empty = [p for p, part in zip(prefixes, parts) if part is None]
            raise ValueError(
                f"--split {config.split!r} leaves the {SPLIT_NAMES[index]} split of "
                f"{', '.join(empty)} empty, so it cannot be blended; change --split"
            )
        blended.append(BlendableDataset(parts, weights, size))
    return tuple(blended)


def _build_whole_blend(
    index: int,
    data_path: list[str],
    config: DataConfig,
    num_samples: int,
    group: torch.distributed.ProcessGroup | None,
    masked: bool = False,
) -> torch.utils.data.Dataset:
    """One split from its own flag (`--train-data-path` ...): all documents of each dataset,
    blended by weight, as Megatron-LM's `blend_per_split` (--split is not read)."""
    name, flag = SPLIT_NAMES[index], PER_SPLIT_FLAGS[index]
    prefixes, weights = parse_data_path(data_path, flag)
    counts = [num_samples]  # a blend asks each dataset for its share, plus a margin
    if len(prefixes) > 1:
        counts = [split_counts[0] for split_counts in samples_per_dataset(weights, [num_samples])]
    parts = []
    for prefix, count in zip(prefixes, counts):
        indexed, loss_masks = _open_indexed(prefix, config, masked)
        print_rank_0(f" > {flag} {prefix}: all {len(indexed)} documents for {name}")
        documents = np.arange(len(indexed), dtype=np.int32)
        parts.append(
            GPTDataset(
                name,
                prefix,
                documents,
                indexed,
                count,
                config.seq_length,
                config.seed,
                config.data_cache_path,
                group,
                loss_masks,
            )
        )
    return parts[0] if len(parts) == 1 else BlendableDataset(parts, weights, num_samples)


def _build_mock_splits(
    config: DataConfig,
    train_valid_test_num_samples: list[int],
    group: torch.distributed.ProcessGroup | None,
) -> tuple[GPTDataset, ...]:
    """`--mock-data`: megatron-core's synthetic documents, split evenly (`mock_dataset`)."""
    if config.vocab_size is None or config.eod_token_id is None:
        raise ValueError("--mock-data needs the tokenizer's vocabulary size and end of document")
    documents = MockDocuments(config.vocab_size, config.eod_token_id)
    bounds = mock_split_bounds()
    print_rank_0(
        f" > --mock-data: {MOCK_DOCUMENTS} synthetic documents (megatron-core's "
        f"MockGPTLowLevelDataset), split 1,1,1 as Megatron-LM splits mock data"
    )
    return tuple(
        GPTDataset(
            name,
            None,
            np.arange(bounds[index], bounds[index + 1], dtype=np.int32),
            documents,
            train_valid_test_num_samples[index],
            config.seq_length,
            config.seed,
            config.data_cache_path,
            group,
        )
        for index, name in enumerate(SPLIT_NAMES)
    )


def _open_indexed(
    prefix: str, config: DataConfig, masked: bool = False
) -> tuple[IndexedDataset, IndexedDataset | UnmaskedDocuments | None]:
    """The indexed dataset at `prefix`, its ids checked against the vocabulary, and, when the
    run reads loss masks (`masked`), its mask (all ones where it has none but --sft is off)."""
    indexed = make_dataset(prefix, config.data_impl, skip_warmup=not config.mmap_warmup)
    # Like Megatron, GPT samples treat each sequence of the index as a document.
    num_documents = len(indexed)
    if num_documents > np.iinfo(np.int32).max:
        # The document and sample indices (and Megatron's helpers) hold 32-bit document ids.
        raise IndexedDatasetError(
            f"{prefix}: {num_documents:,} sequences, more than the 2,147,483,647 one dataset "
            "may hold (32-bit document ids); split it into several --data-path prefixes"
        )
    if config.vocab_size is not None:
        check_token_ids(indexed, prefix, config.vocab_size, config.data_cache_path)
    return indexed, (loss_masks_of(prefix, indexed, config.sft) if masked else None)


def _build_splits(
    prefix: str,
    config: DataConfig,
    num_samples: list[int],
    group: torch.distributed.ProcessGroup | None,
    masked: bool = False,
) -> tuple[GPTDataset | None, ...]:
    indexed, loss_masks = _open_indexed(prefix, config, masked)
    num_documents = len(indexed)
    bounds = get_train_valid_test_split_(config.split, num_documents)
    print_rank_0(f" > {prefix}: {num_documents} documents, split {config.split!r}:")
    datasets = []
    for index, name in enumerate(SPLIT_NAMES):
        start, stop = bounds[index], bounds[index + 1]
        print_rank_0(
            f"    {name}: document indices in [{start}, {stop}) total of {stop - start} documents"
        )
        if stop <= start:
            datasets.append(None)
            continue
        documents = np.arange(start, stop, dtype=np.int32)
        datasets.append(
            GPTDataset(
                name,
                prefix,
                documents,
                indexed,
                num_samples[index],
                config.seq_length,
                config.seed,
                config.data_cache_path,
                group,
                loss_masks,
            )
        )
    return tuple(datasets)
