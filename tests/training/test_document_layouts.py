"""Packed documents (`--reset-attention-mask --reset-position-ids`) in every pipeline engine.

The batches hold many end-of-document tokens (0), so each sample packs several documents.
The document ids travel with the batch: as a keyword input of every chunk under Megatron's
schedules, beside the hidden states between DeepSpeed's pipeline stages. Each pipelined and
tensor-parallel layout trains like one plain process with the same flags (losses, gradient
norms, final weights, tolerances of tests/training/test_equivalence.py), and one plain process
without the document mask trains otherwise (the comparison has teeth). That one process gives
each document the logits it gets alone: tests/model/test_document_mask.py.
"""

from __future__ import annotations

import pytest

from tests.training.harness import GLOBAL_BATCH, ITERATIONS, Layout, spawn_jobs
from tests.training.test_equivalence import (
    assert_losses_close,
    assert_norms_close,
    assert_weights_close,
    grad_norms,
    losses,
)

DOCUMENTS = ("--reset-attention-mask", "--reset-position-ids")
REFERENCE = Layout("plain, documents", 1, micro_batch=2, flags=DOCUMENTS)
WITHOUT = Layout("plain, no document mask", 1, micro_batch=2)
LAYOUTS = [
    Layout("Megatron schedules PP=2", 2, micro_batch=1, pp=2, flags=DOCUMENTS),
    Layout("DeepSpeed pipeline PP=2", 2, micro_batch=1, pp=2, zero=0, pipeline_engine=True,
           flags=DOCUMENTS),
    Layout("plain TP=2, sequence parallel", 2, micro_batch=2, tp=2,
           flags=(*DOCUMENTS, "--sequence-parallel")),
]  # fmt: skip


@pytest.fixture(scope="module")
def records() -> dict[str, list[dict]]:
    """{layout name: [record per rank]}: one spawned world per size."""
    from tests.training.harness import dense_state_dict, sample_tokens

    samples = sample_tokens(ITERATIONS * GLOBAL_BATCH)
    samples[samples % 5 == 0] = 0  # about one token in five ends a document
    dense = dense_state_dict()
    jobs = {1: [], 2: []}
    for layout in [REFERENCE, WITHOUT, *LAYOUTS]:
        jobs[layout.world_size].append((layout.name, "steps", layout, {}))
    found = {}
    for world_size, world_jobs in jobs.items():
        found.update(spawn_jobs(world_size, world_jobs, dense, samples))
    return found


@pytest.mark.parametrize("layout", [pytest.param(x, id=x.name) for x in LAYOUTS])
def test_packed_documents_train_alike_in_every_layout(records, layout):
    reference = records[REFERENCE.name][0]
    for record in records[layout.name]:
        where = f"{layout.name}, rank {record['rank']}"
        assert record["unset"] == [], f"{where}: parameters the loader did not set"
        assert_losses_close(losses(record), losses(reference), where)
        assert_norms_close(grad_norms(record), grad_norms(reference), where)
        assert_weights_close(record["final"], reference["final"], where)


def test_the_document_mask_changes_the_training(records):
    with pytest.raises(AssertionError):
        assert_losses_close(
            losses(records[WITHOUT.name][0]), losses(records[REFERENCE.name][0]), "no mask"
        )
