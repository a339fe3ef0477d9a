"""`torchrun ... pretrain_gpt.py --context-parallel-size C` on CPU: whole runs against the same
run without context parallelism.

A tiny LLaMA-style model (RMSNorm, SwiGLU, rotary positions, 2 key/value heads for 4 query
heads, untied output layer), fp32, dropout 0, real GPT-2-tokenized data. What must hold:

- C=2 logs the losses and gradient norms of the run without it, equal up to fp32 sums in other
  orders (`assert_losses_reordered`; norms to the log's 3 decimals), with the same token
  counts: on the plain engine (DDP over data x context ranks; ring attention, and per layer
  all-to-all and all-gathered keys and values), on DeepSpeed's engine at ZeRO-1
  and ZeRO-3, at TP=2 with sequence parallelism on 4 ranks, and on Megatron's pipeline
  schedules at PP=2 on 4 ranks;
- checkpoints do not depend on C: saved at C=2 (plain engine) after iteration 3, the run
  resumes at C=4 (2 key/value heads over 4 ranks, where DeepSpeed-Ulysses is refused) to
  iterations 4-6 of the run that never stopped;
- a sliding window (`--window-size (20, 0)`, chunks of 16 tokens: the ring skips, splits and
  masks blocks) at C=2 logs the run at C=1 with the window (ring attention, then all-to-all),
  which is not the run without it;
- packed documents (`--reset-attention-mask --reset-position-ids --eod-mask-loss`, documents
  of about 30 tokens, learned positions that restart per document) at C=2 log the run at C=1
  with them (ring attention, then all-gathered keys and values).
"""

from __future__ import annotations

import json

import pytest

from tests.training.llama_runs import GLOBAL_BATCH, ITERATIONS, SEQ, assert_same, run


@pytest.fixture(scope="module")
def one_process(stdlib_dataset: str) -> list[dict]:
    """The run without any parallelism: the reference of every C=2 run at TP = PP = 1."""
    logged = run(stdlib_dataset, 1)
    assert [log["iteration"] for log in logged] == list(range(1, ITERATIONS + 1))
    assert logged[-1]["lm loss"] < logged[0]["lm loss"] - 0.2  # it trains
    return logged


@pytest.mark.slow
def test_plain_engine_c2_equals_one_process_and_resumes_at_c1_and_c4(
    stdlib_dataset: str, one_process: list[dict], tmp_path
) -> None:
    save = str(tmp_path / "save")
    # Stopped (and saved) after iteration 3, as a run that lost its nodes.
    # Per layer: all-to-all (DeepSpeed's, over deepspeed.comm without --deepspeed), then
    # all-gathered keys and values; the resume at C=4 runs ring attention (the default), at
    # C=1 plain attention.
    logged = run(
        stdlib_dataset,
        2,
        context_parallel_size=2,
        cp_comm_type="a2a allgather",
        save=save,
        save_interval=100,
        exit_interval=3,
    )
    assert_same(logged, one_process[:3])
    for size in (1, 4):
        resumed = run(
            stdlib_dataset,
            size,
            context_parallel_size=size,
            load=save,
            save=str(tmp_path / f"r{size}"),
            save_interval=100,
        )
        assert_same(resumed, one_process[3:])


def _deepspeed_config(tmp_path, stage: int) -> str:
    path = tmp_path / f"ds_zero{stage}.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": GLOBAL_BATCH,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": stage},
            }
        )
    )
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_zero_c2_equals_one_process(
    stdlib_dataset: str, one_process: list[dict], tmp_path, stage: int
) -> None:
    logged = run(
        stdlib_dataset,
        2,
        context_parallel_size=2,
        deepspeed=True,
        deepspeed_config=_deepspeed_config(tmp_path, stage),
        zero_stage=stage,
        no_pipeline_parallel=True,
    )
    assert_same(logged, one_process)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes",
    [
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(pipeline_model_parallel_size=2),
    ],
    ids=["tp2-sp", "pp2-megatron-schedules"],
)
def test_c2_on_four_ranks_equals_two(stdlib_dataset: str, sizes: dict) -> None:
    """TP=2 with sequence parallelism, and Megatron's schedules at PP=2: C=2 on 4 ranks logs
    what the same layout logs on 2 (whose initial weights are those of its TP/PP split)."""
    assert_same(
        run(stdlib_dataset, 4, context_parallel_size=2, **sizes),
        run(stdlib_dataset, 2, **sizes),
    )


@pytest.mark.slow
def test_sliding_window_c2_equals_one_process(stdlib_dataset: str, one_process: list[dict]) -> None:
    window = dict(window_size="(20,0)")
    reference = run(stdlib_dataset, 1, **window)
    assert_same(run(stdlib_dataset, 2, context_parallel_size=2, cp_comm_type="p2p a2a", **window),
                reference)  # fmt: skip
    with pytest.raises(AssertionError):  # the window changes the training
        assert_same(reference, one_process)


@pytest.fixture(scope="module")
def paragraphs_dataset(tmp_path_factory) -> str:
    """The standard-library files' paragraphs as documents: several in every sample."""
    from megatron.data.indexed_dataset import make_dataset
    from tests.pretrain_runs import build_stdlib_dataset

    prefix = build_stdlib_dataset(str(tmp_path_factory.mktemp("paragraphs")), paragraphs=True)
    assert make_dataset(prefix).sizes.mean() < SEQ / 2
    return prefix


@pytest.mark.slow
def test_packed_documents_c2_equals_one_process(paragraphs_dataset: str) -> None:
    documents = dict(
        reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True,
        use_rotary_position_embeddings=None, no_position_embedding=None,
    )  # fmt: skip
    assert_same(
        run(paragraphs_dataset, 2, context_parallel_size=2, cp_comm_type="p2p allgather",
            **documents),
        run(paragraphs_dataset, 1, **documents),
    )  # fmt: skip
