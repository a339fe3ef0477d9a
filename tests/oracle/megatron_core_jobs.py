"""Jobs run with the released megatron-core (not this project) importable as `megatron`.

Usage: python megatron_core_jobs.py JOBS.json. Each job writes its result to job["out"]:
- preprocess: Megatron-LM's preprocess_data.py loop (json.loads, GPT-2 BPE via the reference
  algorithm, `IndexedDatasetBuilder.add_document(ids, lengths)`, `finalize`), megatron-core's
  writer producing the .bin/.idx files;
- samples: the token ids of every sample of megatron-core's GPTDataset;
- sample_idx / blending: megatron-core's C++ helpers on the given inputs.
"""

import json
import os
import sys
import types

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, os.pardir, "tokenizer"))

from megatron.core.datasets import helpers  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
)
from megatron.core.datasets.utils import Split  # noqa: E402


def preprocess(job):
    """Megatron-LM tools/preprocess_data.py, document level, for every key."""
    from reference_bpe import ReferenceGPT2BPE

    tokenizer = ReferenceGPT2BPE(job["vocab_file"], job["merge_file"])
    eod = tokenizer.encoder["<|endoftext|>"]
    dtype = DType.optimal_dtype(len(tokenizer.encoder))
    builders = {
        key: IndexedDatasetBuilder(f"{job['out']}_{key}_document.bin", dtype=dtype)
        for key in job["json_keys"]
    }
    with open(job["input"], encoding="utf-8") as lines:
        for line in lines:
            data = json.loads(line)
            for key in job["json_keys"]:
                doc_ids, sentence_lens = [], []
                for sentence in [data[key]]:
                    ids = tokenizer.encode(sentence)
                    if len(ids) > 0:
                        doc_ids.extend(ids)
                        sentence_lens.append(len(ids))
                if len(doc_ids) > 0 and job["append_eod"]:
                    doc_ids.append(eod)
                    sentence_lens[-1] += 1
                builders[key].add_document(doc_ids, sentence_lens)
    for key, builder in builders.items():
        builder.finalize(f"{job['out']}_{key}_document.idx")


def samples(job):
    """Every sample's tokens from megatron-core's GPTDataset over the given documents."""
    tokenizer = types.SimpleNamespace(
        vocab_size=50257, eod=50256, pad=-1, unique_identifiers={"class": "oracle"}
    )
    config = GPTDatasetConfig(
        random_seed=job["seed"],
        sequence_length=job["seq_length"],
        blend=None,
        blend_per_split=None,
        split="1,0,0",
        path_to_cache=job["cache"],
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    dataset = GPTDataset(
        IndexedDataset(job["prefix"]),
        job["prefix"],
        numpy.arange(job["start"], job["stop"], dtype=numpy.int32),
        job["num_samples"],
        Split.train,
        config,
    )
    texts = [dataset._query_document_sample_shuffle_indices(i)[0] for i in range(len(dataset))]
    numpy.save(job["out"], numpy.stack(texts))


def sample_idx(job):
    """megatron-core's build_sample_idx (no padding: drop the last partial sample)."""
    result = helpers.build_sample_idx(
        numpy.asarray(job["sizes"], dtype=numpy.int32),
        numpy.asarray(job["doc_idx"], dtype=numpy.int32),
        job["seq_length"],
        job["num_epochs"],
        job["tokens_per_epoch"],
        True,
        1,
    )
    numpy.save(job["out"], result)


def blending(job):
    """megatron-core's build_blending_indices."""
    size = job["size"]
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
    weights = numpy.asarray(job["weights"], dtype=numpy.float64)
    helpers.build_blending_indices(
        dataset_index, dataset_sample_index, weights, len(weights), size, False
    )
    numpy.save(job["out"], numpy.stack([dataset_index.astype(numpy.int64), dataset_sample_index]))


if __name__ == "__main__":
    for job in json.load(open(sys.argv[1])):
        {
            "preprocess": preprocess,
            "samples": samples,
            "sample_idx": sample_idx,
            "blending": blending,
        }[job["kind"]](job)
    print("oracle jobs done")
