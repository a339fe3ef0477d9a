"""Megatron-LM's combined 1F1B (`--overlap-moe-expert-parallel-comm`, `--delay-wgrad-compute`)
changes no bit of a run (issue 58): `torchrun ... pretrain_gpt.py` with and without the flags,
each layout's two checkpoints compared tensor by tensor (weights, Adam's moments, RNG states:
equal bits, not within a tolerance), their log lines to every digit.

The routed MoE model of `test_moe_parallel_runs` (4 layers, top-2 of 8 SwiGLU experts, aux
loss, fp32 unless said), 2 iterations of 2 micro-batches per rank, so each step runs one
micro-batch's backward beside the next one's forward:

- EP=2, all-to-all dispatcher, both flags;
- EP=2, all-gather dispatcher (beyond Megatron-LM, which takes all-to-all and flex only), bf16
  with the grouped matmul, both flags;
- EP=2, fp16 with loss scaling, both flags;
- TP=2 with sequence parallelism x EP=2 folded over the tensor-parallel ranks, 4 ranks, the
  overlap alone.
"""

from __future__ import annotations

import pytest

from tests.checkpointing.compare import differences
from tests.training.test_moe_parallel_runs import TP2_EP2, _moe_run

TIMING = (
    "elapsed time per iteration (ms)",
    "samples per second",
    "tokens per gpu per second",
    "TFLOPs",
    "ETA",
)
FLAGS = dict(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)


def _logged(lines: list[dict]) -> list[dict]:
    """The iteration lines without their timings."""
    return [
        {
            key: value
            for key, value in line.items()
            if not key.startswith(TIMING + ("TFLOPs", "ETA"))
        }
        for line in lines
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "layout", "overlap"),
    [
        (2, dict(expert_model_parallel_size=2), FLAGS),
        (
            2,
            dict(
                expert_model_parallel_size=2,
                moe_token_dispatcher_type="allgather",
                bf16=True,
                moe_grouped_gemm=True,
            ),
            FLAGS,
        ),
        # fp16 with Megatron's loss scaling (a scale the first steps do not overflow).
        (2, dict(expert_model_parallel_size=2, fp16=True, initial_loss_scale=1024), FLAGS),
        (4, TP2_EP2, dict(overlap_moe_expert_parallel_comm=True)),
    ],
    ids=["ep2-alltoall", "ep2-allgather-bf16", "ep2-fp16", "tp2-sp-ep2"],
)
def test_the_overlap_changes_no_bit(
    stdlib_dataset: str, tmp_path, ranks: int, layout: dict, overlap: dict
) -> None:
    runs = {}
    for name, flags in (("plain", {}), ("overlap", overlap)):
        save = str(tmp_path / name)
        logged = _moe_run(
            stdlib_dataset,
            ranks,
            **layout,
            **flags,
            train_iters=2,
            ckpt_format="torch",
            save=save,
            save_interval=2,
        )
        runs[name] = (_logged(logged), save)
    (plain, plain_save), (overlapped, overlap_save) = runs["plain"], runs["overlap"]
    assert [line["iteration"] for line in plain] == [1, 2]
    assert overlapped == plain
    assert differences(plain_save, overlap_save) == []
