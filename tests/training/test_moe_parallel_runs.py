"""Megatron-LM's routed MoE composes with every parallelism (issue 58): whole runs of
`torchrun ... pretrain_gpt.py` on CPU against the run on one process.

The tiny LLaMA-style model of `llama_runs` with 4 layers, each MLP a routed MoE: top-2 of 8
SwiGLU experts, the load-balancing loss (coefficient 0.01), all-to-all dispatch; fp32,
dropout 0, micro-batches of 1 sample, real GPT-2-tokenized data. Every layout logs the losses
('lm loss' within fp32 reordering, 'moe loss' to the log's digits) and gradient norms of the
one-process run on the same global batch:

- TP=2 with sequence parallelism x EP=2 on 4 ranks (`--expert-tensor-parallel-size 1`: the
  experts whole, the expert-parallel group folded over the tensor-parallel ranks), saving a
  torch_dist checkpoint after iteration 3 that resumes at TP=1 x EP=4 to iterations 4-6;
- the same in Megatron's own layout (`--ckpt-format torch`: files `mp_rank_TT_EEE`, one per
  tensor and expert rank pair that occurs, as Megatron-LM names them) resumes at its layout
  to iterations 4-6, and `tools/checkpoint/reshard.py` rewrites it for TP=1 x EP=4, where it
  starts (with a fresh optimizer) from iteration 4's loss;
- CP=2 x EP=2 on 2 ranks (the expert-parallel group is the context-parallel one; the
  load-balancing loss counts the loads over the whole sequence);
- FSDP2 (`--use-torch-fsdp2`) x EP=2 on 2 ranks (experts sharded over their own ranks);
- PP=2 on Megatron's interleaved schedule (2 chunks of 1 layer per stage) x EP=2 on 4 ranks,
  resumed from the one-process run's iteration-3 checkpoint (a pipeline stage draws its
  initial weights from its own seed, as in Megatron): iterations 4-6.

With `--moe-shared-expert-overlap` (a gated shared expert computed while the dispatched tokens
travel) an EP=2 run logs the digits of the same run without it.

`--adam-eps 1e-4`: Adam moves an element whose gradient is rounding noise by about the
learning rate whatever the noise's size (m / sqrt(v) is about +-1); the layouts' fp32
reordering would then become learning-rate-sized weight differences that flip near-tied top-2
choices, a discrete change no reordering bound covers. With eps above the noise those elements
move by g / eps.
"""

from __future__ import annotations

import contextlib
import io
import math
import os

import pytest

from tests.checkpointing.compare import rolled_back
from tests.training.llama_runs import assert_same, run

MOE = dict(
    num_layers=4,
    num_experts=8,
    moe_router_topk=2,
    moe_aux_loss_coeff=0.01,
    moe_token_dispatcher_type="alltoall",
    micro_batch_size=1,
    adam_eps=1e-4,
    # The same initial weights at every TP size: drawn whole on the CPU, with a vocabulary
    # padded alike at TP 1 and 2 (50,304 rows).
    use_cpu_initialization=True,
    make_vocab_size_divisible_by=64,
    ckpt_format="torch_dist",
)
TP2_EP2 = dict(
    tensor_model_parallel_size=2,
    sequence_parallel=True,
    expert_tensor_parallel_size=1,
    expert_model_parallel_size=2,
)


def _moe_run(dataset: str, ranks: int, **flags: object) -> list[dict]:
    return run(dataset, ranks, **{**MOE, **flags})


def assert_same_moe(ours: list[dict], theirs: list[dict]) -> None:
    """`assert_same`, and the same 'moe loss' (its 7 digits, the parts summed in other
    orders)."""
    assert_same(ours, theirs)
    for mine, their in zip(ours, theirs, strict=True):
        assert math.isclose(mine["moe loss"], their["moe loss"], rel_tol=2e-6), (mine, their)


@pytest.fixture(scope="module")
def one_process(stdlib_dataset: str, tmp_path_factory) -> tuple[list[dict], str]:
    """The one-process run, and a copy of its checkpoint of iteration 3."""
    save = str(tmp_path_factory.mktemp("moe_one") / "save")
    logged = _moe_run(stdlib_dataset, 1, save=save, save_interval=3)
    assert [log["iteration"] for log in logged] == [1, 2, 3, 4, 5, 6]
    assert all(0 < log["moe loss"] < 1 for log in logged), logged
    return logged, rolled_back(save, 3, str(tmp_path_factory.mktemp("moe_one_3")))


@pytest.mark.slow
def test_tp2_ep2_equals_one_process_and_resumes_at_tp1_ep4(
    stdlib_dataset: str, one_process, tmp_path
) -> None:
    logged, _ = one_process
    save = str(tmp_path / "tp2_ep2")
    first = _moe_run(stdlib_dataset, 4, **TP2_EP2, save=save, save_interval=3, exit_interval=3)
    assert_same_moe(first, logged[:3])
    resumed = _moe_run(
        stdlib_dataset,
        4,
        expert_model_parallel_size=4,
        load=save,
        save=str(tmp_path / "ep4"),
        save_interval=100,
    )
    assert_same_moe(resumed, logged[3:])


@pytest.mark.slow
def test_tp2_ep2_megatron_layout_resumes_and_reshards_to_tp1_ep4(
    stdlib_dataset: str, one_process, tmp_path
) -> None:
    logged, _ = one_process
    save, saved = str(tmp_path / "tp2_ep2"), dict(ckpt_format="torch", save_interval=3)
    first = _moe_run(stdlib_dataset, 4, **TP2_EP2, **saved, save=save, exit_interval=3)
    assert_same_moe(first, logged[:3])
    files = sorted(os.listdir(os.path.join(save, "iter_0000003")))
    assert files == ["mp_rank_00_000", "mp_rank_01_001"], files  # (tp, ep) of ranks 0 and 1
    resumed = _moe_run(
        stdlib_dataset, 4, **TP2_EP2, **saved, load=save, save=str(tmp_path / "again")
    )
    assert_same_moe(resumed, logged[3:])

    from tools.checkpoint import reshard

    resharded = str(tmp_path / "ep4")
    target = "--target-tensor-parallel-size 1 --target-expert-model-parallel-size 4".split()
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert reshard.main(["--load", save, "--save", resharded, *target]) == 0
    assert "x expert-parallel 4 (4 files)" in printed.getvalue(), printed.getvalue()
    started = _moe_run(
        stdlib_dataset,
        4,
        expert_model_parallel_size=4,
        ckpt_format="torch",
        load=resharded,
        save=str(tmp_path / "ep4_run"),
        save_interval=100,
        train_iters=4,
    )
    assert_same_moe(started, logged[3:4])


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        dict(context_parallel_size=2, expert_model_parallel_size=2),
        dict(use_torch_fsdp2=True, expert_model_parallel_size=2),
    ],
    ids=["cp2_ep2", "fsdp2_ep2"],
)
def test_two_rank_layouts_equal_one_process(stdlib_dataset: str, one_process, layout) -> None:
    logged, _ = one_process
    assert_same_moe(_moe_run(stdlib_dataset, 2, **layout), logged)


@pytest.mark.slow
def test_interleaved_pp2_ep2_resumes_the_one_process_checkpoint(
    stdlib_dataset: str, one_process, tmp_path
) -> None:
    logged, iteration_3 = one_process
    resumed = _moe_run(
        stdlib_dataset,
        4,
        pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=1,
        expert_model_parallel_size=2,
        load=iteration_3,
        save=str(tmp_path / "pp2"),
        save_interval=100,
    )
    assert_same_moe(resumed, logged[3:])


@pytest.mark.slow
def test_shared_expert_overlap_logs_the_same_digits(stdlib_dataset: str) -> None:
    shared = dict(
        moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True, train_iters=3
    )
    layout = dict(expert_model_parallel_size=2, **shared)
    plain = _moe_run(stdlib_dataset, 2, **layout)
    overlapped = _moe_run(stdlib_dataset, 2, moe_shared_expert_overlap=True, **layout)
    keys = ("lm loss", "moe loss", "grad norm")
    assert [[log[k] for k in keys] for log in overlapped] == [
        [log[k] for k in keys] for log in plain
    ]
