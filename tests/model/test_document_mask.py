"""Packed documents and sliding windows without a dense mask (megatron/model/document_mask.py).

The three kernels (FlexAttention with a block mask made from block summaries, one SDPA call
per document, the dense bool mask) give the same attention; a GPT reading a batch of packed
documents gives each document the logits it gets alone (FlexAttention in evaluation) and the
gradients of the dense mask in training (per-document SDPA on CPU); the sliding window is
Megatron-LM's (left, 0) in training and in generation with a key/value cache; and the
per-document kernel's peak memory grows linearly with the sequence where the dense mask's
grows quadratically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import attention
from megatron.model.document_mask import (
    DocumentMask,
    flex_attention_with,
    kernel_for,
    varlen_attention,
)
from megatron.model.inference_params import InferenceParams
from megatron.utils import document_ids_from_tokens, get_ltor_masks_and_position_ids
from tests.conftest import REPO_ROOT
from tests.model.helpers import build_model, tiny_config

EOD = 0
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
LLAMA = dict(
    normalization="rmsnorm", activation="swiglu", position_embedding_type="rope",
    add_bias_linear=False, num_key_value_heads=2, untie_embeddings_and_output_weights=True,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _seeded_rng_streams():
    model_parallel_cuda_manual_seed(1234)


def _document_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [
            torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)])
            for row in lengths_per_row
        ]
    )


# (sequence, document lengths per row, window): blocks of 128 cut through documents
KERNEL_CASES = {
    "two blocks": (256, [[100, 156], [30, 200, 26]], None),
    "ragged last block": (300, [[300], [1, 128, 171]], None),
    "window": (256, [[100, 156], [256]], (40, 0)),
    "window only": (200, [[200], [200]], (7, 0)),
}


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_kernels_give_the_dense_masks_attention(case, kv_heads):
    q, k, v, mask, reference = _attention_case(case, kv_heads)
    torch.testing.assert_close(flex_attention_with(mask, q, k, v, 0.25), reference)
    torch.testing.assert_close(varlen_attention(mask, q, k, v, 0.25, 0.0), reference)


def test_compiled_flex_kernel_reads_the_block_mask():
    """torch's fused FlexAttention kernel (the GPU path; inductor's CPU template here) with
    grouped-query heads, documents crossing blocks and a window."""
    q, k, v, mask, reference = _attention_case("window", 2)
    torch.testing.assert_close(flex_attention_with(mask, q, k, v, 0.25, compiled=True), reference)


def _attention_case(case: str, kv_heads: int) -> tuple:
    s, lengths, window = KERNEL_CASES[case]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, s, 16, generator=generator)
    k, v = (torch.randn(2, kv_heads, s, 16, generator=generator) for _ in range(2))
    mask = DocumentMask(_document_ids(lengths), window)
    reference = F.scaled_dot_product_attention(
        q, k, v, attn_mask=~mask.dense(s, s, q.device), scale=0.25, enable_gqa=kv_heads != 4
    )
    return q, k, v, mask, reference


def test_dense_form_is_megatrons_document_mask_and_window():
    """Brute force: may attend iff same document, k <= q and q - k <= left."""
    ids = _document_ids([[3, 5, 4]])
    for window in (None, (2, 0)):
        allowed = DocumentMask(ids, window).allowed(12, 12, ids.device)[0]
        for q in range(12):
            for k in range(12):
                expected = ids[0, q] == ids[0, k] and k <= q and (window is None or q - k <= 2)
                assert bool(allowed[q, k]) == bool(expected), (window, q, k)


def test_kernel_choice():
    assert kernel_for("unfused", torch.device("cpu")) == "dense"
    assert kernel_for("sdpa", torch.device("cpu")) == "varlen"  # no CPU FlexAttention backward
    assert kernel_for("sdpa", torch.device("cuda")) == "flex"
    # FlexAttention has no dropout: with --attention-dropout SDPA drops per document.
    assert kernel_for("sdpa", torch.device("cuda"), dropout_p=0.1) == "varlen"


def _packed_batch(lengths: list[int], vocab: int, seed: int = 3) -> list[torch.Tensor]:
    """Documents of the given lengths, each ending with EOD."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        doc = torch.randint(1, vocab, (n,), generator=generator)
        doc[-1] = EOD
        docs.append(doc)
    return docs


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_packed_document_gets_its_logits_alone(family, kernel, monkeypatch):
    """Document ids and reset positions from the batch, through FlexAttention (the GPU's
    kernel, eager here) and the per-document kernel (CPU's)."""
    monkeypatch.setattr(attention, "kernel_for", lambda backend, device, dropout_p: kernel)
    extra = LLAMA if family == "llama" else {}
    model = build_model(tiny_config(max_position_embeddings=160, **extra)).eval()
    docs = _packed_batch([37, 1, 60, 30], 64)
    tokens = torch.cat(docs)[None]
    mask, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, True, True, False)
    with torch.no_grad():
        packed = model(tokens, positions, mask)[0]
        start = 0
        for doc in docs:
            alone = model(doc[None])[0]
            torch.testing.assert_close(packed[start : start + doc.numel()], alone)
            start += doc.numel()
        # Without the document mask the later documents read the earlier ones.
        causal = model(tokens, positions)[0]
    assert (causal[38:] - packed[38:]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pipeline_stages_give_each_document_its_logits_alone(family, monkeypatch):
    """PP=2 as Megatron's schedules cut the model (both stages here, in one process): the
    document ids reach each stage as its keyword input; FlexAttention (eager on CPU)."""
    from megatron.checkpointing.pipeline_stages import chunk_state_dict
    from megatron.model import GPTModel

    monkeypatch.setattr(attention, "kernel_for", lambda backend, device, dropout_p: "flex")
    config = tiny_config(max_position_embeddings=160, **(LLAMA if family == "llama" else {}))
    model = build_model(config).eval()
    dense = model.state_dict()
    stages = []
    for stage in range(2):
        layers = range(stage + 1, stage + 2)
        chunk = GPTModel(config, stage=stage, num_stages=2, layers=layers).eval()
        chunk.load_state_dict(chunk_state_dict(dense, 2, 2, 1, stage, 0))
        stages.append(chunk)
    docs = _packed_batch([37, 1, 60, 30], 64, seed=4)
    tokens = torch.cat(docs)[None]
    ids, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, True, True, False)
    with torch.no_grad():
        hidden = stages[0](tokens, positions, document_ids=ids)
        packed = stages[1](hidden, document_ids=ids)[0]
        start = 0
        for doc in docs:
            alone = model(doc[None])[0]
            torch.testing.assert_close(packed[start : start + doc.numel()], alone)
            start += doc.numel()


def test_training_gradients_equal_the_dense_mask():
    """Per-document SDPA (the CPU training kernel) against the unfused dense reference."""
    tokens = torch.cat(_packed_batch([20, 44, 30, 34], 64))[None].repeat(2, 1)
    tokens[1] = tokens[1].roll(17)
    labels = tokens.roll(-1, dims=1)
    ids = document_ids_from_tokens(tokens, EOD)
    grads = {}
    for backend in ("sdpa", "unfused"):
        config = tiny_config(max_position_embeddings=128, attention_backend=backend, **LLAMA)
        model = build_model(config).train()
        loss = model(tokens, None, ids, labels=labels).mean()
        loss.backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["sdpa"].items():
        torch.testing.assert_close(grad, grads["unfused"][name], msg=name)


def test_window_in_training_and_generation_with_a_cache():
    """A 5-token window over 24 tokens: the model's logits equal the dense windowed mask's,
    and a key/value cache fed one token at a time gives the same last logits."""
    config = tiny_config(max_position_embeddings=32, window_size=(4, 0), **LLAMA)
    model = build_model(config).eval()
    reference = build_model(tiny_config(max_position_embeddings=32, **LLAMA)).eval()
    tokens = torch.randint(1, 64, (1, 24), generator=torch.Generator().manual_seed(5))
    dense = DocumentMask(None, (4, 0)).dense(24, 24, tokens.device)
    with torch.no_grad():
        windowed = model(tokens)[0]
        torch.testing.assert_close(windowed, reference(tokens, None, dense)[0])
        assert (windowed - reference(tokens)[0]).abs().max() > 1e-3  # the window matters
        cache = InferenceParams(max_batch_size=1, max_sequence_length=24)
        model(tokens[:, :10], inference_params=cache)
        cache.sequence_len_offset = 10
        for position in range(10, 24):
            last = model(tokens[:, position : position + 1], inference_params=cache)[0, -1]
            cache.sequence_len_offset += 1
        torch.testing.assert_close(last, windowed[-1])


MEMORY_PROBE = r"""
import json, sys, torch
import torch.nn.functional as F
from megatron.model.document_mask import DocumentMask, varlen_attention

def peak_kib(fn):
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak resident size
    before = rss("VmRSS")
    fn()
    return rss("VmHWM") - before

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

kernel, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
torch.set_num_threads(1)
out = {}
for s in sizes:
    ids = torch.arange(s).div(512, rounding_mode="floor")[None]  # 512-token documents
    mask = DocumentMask(ids)
    q, k, v = (torch.randn(1, 2, s, 32, requires_grad=True) for _ in range(3))
    def step():
        if kernel == "varlen":
            o = varlen_attention(mask, q, k, v, 0.2, 0.0)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask.dense(s, s, q.device))
        o.sum().backward()
    out[s] = peak_kib(step)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_document_attention_memory_grows_linearly():
    """Peak resident memory of one attention forward and backward at 2k, 4k, 8k tokens: about
    x2 per doubling for the per-document kernel, x4 for the dense mask (to 4k only)."""

    def probe(kernel: str, sizes: str) -> dict[int, int]:
        env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
        done = subprocess.run(
            [sys.executable, "-c", MEMORY_PROBE, kernel, sizes],
            capture_output=True, text=True, env=env, timeout=300, check=True,
        )  # fmt: skip
        return {int(s): kib for s, kib in json.loads(done.stdout.splitlines()[-1]).items()}

    varlen = probe("varlen", "2048,4096,8192")
    dense = probe("dense", "2048,4096")
    # 8k dense: 2 heads x 8k x 8k fp32 scores alone would be 512 MiB.
    assert varlen[8192] < 64 * 1024, varlen
    assert varlen[8192] / varlen[2048] < 6, varlen  # linear: 4, quadratic: 16
    assert dense[4096] / dense[2048] > 3, dense  # the quadratic mask, as a check of the probe
