"""--log-num-zeros-in-grad: Megatron's count of zero gradient elements on every engine.

The tiny GPT of `tests.training.harness`, without biases and with a position table twice the
sequence length: the rows of the positions no sample reaches get exactly zero gradients in
every layout (a sum of nothing), and nothing else is zero. A hand count on the dense model's
gradient of the first global batch must then be what each layout reports at each iteration:
counted once over tensor-parallel copies (the position table is replicated there),
data-parallel replicas, ZeRO and FSDP2 partitions (their padding left out) and pipeline
stages (DeepSpeed's last stage holds an unused copy of the tied embedding module).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron.model import GPTModel
from megatron.training.monitor import IterationStats, format_iteration_log, parse_iteration_log
from tests.training.harness import (
    GLOBAL_BATCH,
    HEADS,
    HIDDEN,
    MODEL_SEED,
    SEQ,
    Layout,
    model_config,
    sample_tokens,
)

POSITIONS = 2 * SEQ
FLAGS = ("--max-position-embeddings", str(POSITIONS), "--disable-bias-linear")
ITERATIONS = 2

ONE_RANK = [
    (Layout("plain", 1, micro_batch=2), ()),
    (Layout("ZeRO-0 (no wrapper)", 1, micro_batch=4, zero=0), ()),
    (Layout("ZeRO-1", 1, micro_batch=4, zero=1), ()),
    (Layout("ZeRO-3", 1, micro_batch=4, zero=3), ()),
]
BF16 = [
    (Layout("bf16 ZeRO-0 (FP16_UnfusedOptimizer)", 1, micro_batch=4, zero=0), ("--bf16",)),
    (Layout("bf16 ZeRO-1 (BF16_Optimizer)", 1, micro_batch=4, zero=1), ("--bf16",)),
]
TWO_RANKS = [
    (Layout("plain DP=2", 2, micro_batch=2), ()),
    (Layout("plain TP=2", 2, micro_batch=4, tp=2), ()),
    (Layout("FSDP2 DP=2", 2, micro_batch=2), ("--use-torch-fsdp2",)),
    (Layout("Megatron schedules PP=2", 2, micro_batch=2, pp=2), ()),
    (Layout("ZeRO-2 DP=2", 2, micro_batch=2, zero=2), ()),
    (Layout("ZeRO-3 DP=2", 2, micro_batch=2, zero=3), ()),
    (
        Layout("pipeline engine PP=2 ZeRO-1", 2, micro_batch=2, pp=2, zero=1, pipeline_engine=True),
        (),
    ),
]
# A 33-wide model with 3 heads: tensors of odd sizes, so ZeRO pads its partitions (the last
# rank's) and FSDP2 shards unevenly; the padding holds zeros that belong to no parameter.
ODD_SIZES = [
    (Layout("ZeRO-2 DP=2, odd sizes", 2, micro_batch=2, zero=2), ()),
    (Layout("ZeRO-3 DP=2, odd sizes", 2, micro_batch=2, zero=3), ()),
    (Layout("FSDP2 DP=2, odd sizes", 2, micro_batch=2), ("--use-torch-fsdp2",)),
]


def _config(hidden: int, heads: int):  # noqa: ANN202 - a ModelConfig
    return dataclasses.replace(
        model_config(),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=4 * hidden,
        kv_channels=hidden // heads,
        num_key_value_heads=heads,
        max_position_embeddings=POSITIONS,
        add_bias_linear=False,
    )


def _dense(hidden: int, heads: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(MODEL_SEED)
    return {name: t.clone() for name, t in GPTModel(_config(hidden, heads)).state_dict().items()}


def _hand_count(dense: dict, samples, hidden: int, heads: int) -> int:  # noqa: ANN001
    """Zero elements of the dense model's gradient of the first global batch."""
    model = GPTModel(_config(hidden, heads))
    model.load_state_dict(dense)
    text = torch.from_numpy(samples[:GLOBAL_BATCH])
    model(text[:, :-1], labels=text[:, 1:]).mean().backward()
    return sum(int((p.grad == 0).sum()) for p in model.parameters())


def _count_in_each(
    rank: int, world_size: int, jobs: list, dense: dict, samples, tmp: str, shape: tuple
) -> dict:
    """Spawned: each layout's reported zero counts, iteration by iteration, and (DeepSpeed at
    one rank) the zeros of the gradients DeepSpeed's `safe_get_full_grad` shows before each
    update."""
    from megatron.training.loop import TrainingLoop
    from megatron.training.monitor import Timers
    from tests.training.harness import build, data_iterator, init_deepspeed_comm

    init_deepspeed_comm()
    counts = {}
    for index, (layout, extra) in enumerate(jobs):
        config_dir = os.path.join(tmp, f"job{index}-rank{rank}")
        os.makedirs(config_dir, exist_ok=True)
        flags = (*FLAGS, *shape, "--log-num-zeros-in-grad", *extra)
        args, engine, _ = build(layout, dense, config_dir, flags)
        direct = []
        if layout.zero is not None and world_size == 1:
            _count_before_each_update(engine.model, direct)
        loop = TrainingLoop(args, engine, Timers(0), None)
        batches = data_iterator(args, samples)
        reported = [loop.step(batches).num_zeros_in_grad for _ in range(ITERATIONS)]
        counts[layout.name] = {"reported": reported, "direct": direct}
    return counts


def _count_before_each_update(engine, counts: list) -> None:  # noqa: ANN001 - DeepSpeedEngine
    """Append the zeros of every parameter's whole gradient to `counts` before each update."""
    from deepspeed.utils import safe_get_full_grad

    step = engine.step

    def counted_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if engine.is_gradient_accumulation_boundary():
            grads = [safe_get_full_grad(param) for param in engine.module.parameters()]
            counts.append(sum(int((grad == 0).sum()) for grad in grads if grad is not None))
        return step(*args, **kwargs)

    engine.step = counted_step


def _spawn(world_size: int, jobs: list, hidden: int = HIDDEN, heads: int = HEADS) -> tuple:
    """(the hand count, {layout name: [each rank's record]}) of a `hidden` x `heads` model."""
    import tempfile

    from tests.model.helpers import spawn_collect

    dense = _dense(hidden, heads)
    samples = sample_tokens(GLOBAL_BATCH * ITERATIONS)
    shape = ("--hidden-size", str(hidden), "--num-attention-heads", str(heads))
    with tempfile.TemporaryDirectory() as tmp:
        ranks = spawn_collect(_count_in_each, world_size, jobs, dense, samples, tmp, shape)
    records = {name: [r[name] for r in ranks] for name in ranks[0]}
    return _hand_count(dense, samples, hidden, heads), records


@pytest.mark.parametrize(
    "world_size, jobs, hidden, heads",
    [(1, ONE_RANK, HIDDEN, HEADS), (2, TWO_RANKS, HIDDEN, HEADS), (2, ODD_SIZES, 33, 3)],
    ids=["1 rank", "2 ranks", "2 ranks, odd sizes"],
)
def test_the_count_is_the_dense_models_on_every_engine(
    world_size: int, jobs: list, hidden: int, heads: int
) -> None:
    expected, records = _spawn(world_size, jobs, hidden, heads)
    # Only the unreached position rows: (POSITIONS - SEQ) x hidden.
    assert expected == (POSITIONS - SEQ) * hidden
    for layout, _ in jobs:
        for record in records[layout.name]:
            assert record["reported"] == [expected] * ITERATIONS, layout.name
            if record["direct"]:  # DeepSpeed's own view of the same gradients
                assert record["direct"] == [expected] * ITERATIONS, layout.name


def test_bf16_wrappers_count_the_gradients_deepspeed_holds() -> None:
    """bf16 rounds a few more gradient elements to zero than fp32: the count is then what
    DeepSpeed's `safe_get_full_grad` shows before the update (FP16_UnfusedOptimizer, then
    BF16_Optimizer's fp32 accumulation buffer), the unreached positions among them."""
    expected, records = _spawn(1, BF16)
    for layout, _ in BF16:
        (record,) = records[layout.name]
        assert len(record["direct"]) == ITERATIONS, layout.name
        assert record["reported"] == record["direct"], layout.name
        assert all(expected <= count < expected + 50 for count in record["direct"]), record


def test_the_log_line_prints_megatrons_field_after_the_grad_norm() -> None:
    stats = dict(
        iteration=5,
        train_iters=10,
        consumed_samples=40,
        consumed_tokens=1280,
        elapsed_ms_per_iteration=12.5,
        learning_rate=1e-3,
        global_batch_size=8,
        losses={"lm loss": 3.5},
        loss_scale=1.0,
        grad_norm=1.0,
        actual_seqlen=32,
        skipped_iterations=0,
        nan_iterations=0,
        samples_per_second=640.0,
        tokens_per_gpu_per_second=20480.0,
        tflops=0.25,
        params_norm=2.0,
    )
    without = format_iteration_log(IterationStats(**stats))
    line = format_iteration_log(IterationStats(**stats, num_zeros=512.0))
    assert "num zeros" not in without
    assert " grad norm: 1.000 | num zeros: 512.0 | params norm: 2.000 |" in line
    assert parse_iteration_log(line)["num zeros"] == 512.0


def test_tensorboard_gets_megatrons_num_zeros_tags() -> None:
    """'num-zeros/num-zeros' at the iteration, and its 'vs samples' / 'vs tokens' curves, as
    Megatron-DeepSpeed writes them after the grad norm; nothing when not counted."""
    import argparse

    from megatron.checkpointing import TrainState
    from megatron.training.step import StepResult
    from megatron.training.training_log import write_training_scalars

    class Recorder:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalar(self, name: str, value: float, step: int, x_axis: object = None) -> None:
            self.scalars.append((name, value, step))

        def add_scalars(self, values: dict, step: int, x_axis: object = None) -> None:
            for name, value in values.items():
                self.add_scalar(name, value, step)

    args = argparse.Namespace(
        fp16=False,
        log_learning_rate_to_tensorboard=False,
        log_batch_size_to_tensorboard=False,
        log_loss_scale_to_tensorboard=False,
        log_world_size_to_tensorboard=False,
        log_memory_to_tensorboard=False,
        seq_length=8,
    )
    state = TrainState(iteration=3, consumed_train_samples=12, consumed_train_tokens=96)
    for zeros in (512.0, None):
        recorder = Recorder()
        result = StepResult({"lm loss": 2.0}, False, False, 1.5, None, num_zeros_in_grad=zeros)
        write_training_scalars(recorder, args, state, result, 1e-3, 4, None)
        written = [(tag, value, step) for tag, value, step in recorder.scalars if "zeros" in tag]
        if zeros is None:
            assert written == []
            continue
        assert written == [
            ("num-zeros/num-zeros", 512.0, 3),
            ("num-zeros/num-zeros vs samples", 512.0, 12),
            ("num-zeros/num-zeros vs tokens", 512.0, 96),
        ]
        tags = [tag for tag, _, _ in recorder.scalars]
        assert tags.index("num-zeros/num-zeros") == tags.index("grad-norm/grad-norm vs tokens") + 1
