"""megatron.core.tensor_parallel.random: RNG streams and activation checkpointing.

- a tracker's `fork` draws from its own stream and leaves the default generator's sequence
  exactly as if the fork had not happened;
- `model_parallel_cuda_manual_seed` makes the tracker stream differ across tensor-parallel
  ranks while the default stream (dropout on replicated activations) agrees (2 ranks);
- `checkpoint(fn, distribute, x)` of a block with dropout on both streams gives the output
  and input / parameter gradients of running the block plainly from the same RNG state, and
  leaves the RNG states after backward as they were after forward (single process, and at
  tp 2 with and without `distribute_saved_activations`);
- with `distribute_saved_activations` each rank keeps only its 1/tp share of the input's
  memory for backward;
- the recompute runs under the forward's autocast state (fp16/bf16 mixed precision), although
  backward runs outside the caller's autocast region.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG_TRACKER_NAME, RNGStatesTracker
from tests.core.spawn_checks import BODY

SEQ, BATCH, HIDDEN, FFN = 8, 2, 8, 16
_EXACT = {"atol": 0.0, "rtol": 0.0}
# The device whose generator the tracker drives (the CUDA one wherever a GPU is visible).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rand(count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """`count` uniform numbers on DEVICE, from its default generator or `generator`."""
    return torch.rand(count, device=DEVICE, generator=generator).cpu()


def _generator(seed: int) -> torch.Generator:
    """A fresh generator on DEVICE seeded with `seed`."""
    return torch.Generator(DEVICE).manual_seed(seed)


def _rng_snapshot() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The default generator's state and every tracker stream's state."""
    return torch.get_rng_state(), get_cuda_rng_tracker().get_states()


def _restore(snapshot: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    """Put back a `_rng_snapshot`."""
    torch.set_rng_state(snapshot[0])
    get_cuda_rng_tracker().set_states(snapshot[1])


def _assert_same_snapshot(a, b, what: str) -> None:
    """Two RNG snapshots are identical (default state and every stream)."""
    assert torch.equal(a[0], b[0]), f"{what}: default generator differs"
    assert a[1].keys() == b[1].keys(), what
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), f"{what}: stream {name!r} differs"


def test_fork_is_independent_of_the_default_stream():
    """Fork draws from its seeded stream; the default sequence is as if no fork happened."""
    tracker = RNGStatesTracker()
    # The same draws (a CUDA generator's sequence depends on how it is split into calls).
    torch.manual_seed(1)
    expected_default = torch.cat([_rand(5), _rand(10), _rand(5)])
    stream = _generator(99)
    expected_stream = torch.cat([_rand(10, stream), _rand(10, stream)])

    torch.manual_seed(1)
    tracker.add("stream", 99)  # adding does not move the default generator either
    first = _rand(5)
    with tracker.fork("stream"):
        forked_a = _rand(10)
    second = _rand(10)
    with tracker.fork("stream"):  # continues where the first fork stopped
        forked_b = _rand(10)
    third = _rand(5)
    torch.testing.assert_close(torch.cat([first, second, third]), expected_default, **_EXACT)
    torch.testing.assert_close(torch.cat([forked_a, forked_b]), expected_stream, **_EXACT)


def test_tracker_states_round_trip_and_errors():
    """get_states/set_states replay a stream; duplicate names and unknown forks are errors."""
    tracker = RNGStatesTracker()
    tracker.add("a", 5)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = _rand(8)
    tracker.set_states(saved)
    with tracker.fork("a"):
        again = _rand(8)
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 6)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert tracker.get_states() == {}


def test_model_parallel_seed_single_process():
    """Default stream = torch.manual_seed(seed); tracker stream = seed + 2718 (tp rank 0)."""
    parallel_state.destroy_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    default = _rand(6)
    with get_cuda_rng_tracker().fork():
        forked = _rand(6)
    assert list(get_cuda_rng_tracker().get_states()) == [MODEL_PARALLEL_RNG_TRACKER_NAME]
    torch.testing.assert_close(default, _rand(6, _generator(1234)), **_EXACT)
    torch.testing.assert_close(forked, _rand(6, _generator(1234 + 2718)), **_EXACT)


def _dropout_block(linear: nn.Module):
    """A block with dropout on the default stream and inside the tracker's fork."""

    def block(x: torch.Tensor) -> torch.Tensor:
        """linear -> dropout (default stream) -> tanh -> dropout (tracker stream)."""
        hidden = F.dropout(linear(x), p=0.5, training=True)
        with get_cuda_rng_tracker().fork():
            hidden = F.dropout(torch.tanh(hidden), p=0.3, training=True)
        return hidden * 2.0

    return block


def _run_block(block, params, x, probe, mode):
    """Output, input grad, param grads and RNG snapshots after forward and after backward.

    mode: "plain", or the `distribute_saved_activations` flag given to `checkpoint`.
    """
    for param in params:
        param.grad = None
    x = x.clone().requires_grad_()
    out = block(x) if mode == "plain" else checkpoint(block, mode, x)
    after_forward = _rng_snapshot()
    (out * probe).sum().backward()
    after_backward = _rng_snapshot()
    grads = [param.grad.clone() for param in params]
    return out.detach(), x.grad, grads, after_forward, after_backward


def _compare_checkpoint_with_plain(block, params, x, probe, distribute: bool) -> torch.Tensor:
    """Run plainly and checkpointed from one RNG state; assert equal results; return output."""
    start = _rng_snapshot()
    plain = _run_block(block, params, x, probe, "plain")
    _restore(start)
    ckpt = _run_block(block, params, x, probe, distribute)
    plain_out, plain_dx, plain_grads, plain_fwd, _ = plain
    out, dx, grads, after_forward, after_backward = ckpt
    # The recompute replays the block's kernels on the same values and masks: the same
    # arithmetic, so compared bitwise (output) and tightly (gradients), not to a reordering bound.
    torch.testing.assert_close(out, plain_out, atol=0.0, rtol=0.0)
    assert (out == 0).float().mean() > 0.3, "dropout did not drop anything"
    _assert_same_snapshot(after_forward, plain_fwd, "RNG consumed by forward")
    _assert_same_snapshot(after_backward, after_forward, "RNG after the recompute")
    for i, (grad, plain_grad) in enumerate(zip(grads, plain_grads)):
        torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=1e-6, msg=f"param {i}")
    assert dx is not None, "checkpoint gave no gradient for its input"
    torch.testing.assert_close(dx, plain_dx, atol=1e-6, rtol=1e-6)
    return out


def test_checkpoint_matches_plain_run_single_process():
    """Same output, input and parameter grads as the plain block; RNG untouched by recompute."""
    parallel_state.destroy_model_parallel()
    model_parallel_cuda_manual_seed(2024)
    linear = nn.Linear(HIDDEN, HIDDEN)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    probe = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    block = _dropout_block(linear)
    _compare_checkpoint_with_plain(block, list(linear.parameters()), x, probe, False)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_checkpoint_recomputes_in_the_forwards_autocast_precision(half):
    """Forward under autocast, backward outside it (as the trainer runs them): the recompute
    runs in the forward's half precision, so the gradients equal the plain block's exactly."""
    parallel_state.destroy_model_parallel()
    model_parallel_cuda_manual_seed(2024)
    first, second = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    params = [*first.parameters(), *second.parameters()]
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()  # as hidden states do: the checkpoint's output then needs a gradient

    def block(inputs: torch.Tensor) -> torch.Tensor:
        return second(F.gelu(first(inputs)))

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        for param in params:
            param.grad = None
        with torch.autocast(DEVICE.type, dtype=half):
            out = checkpoint(block, False, x) if checkpointed else block(x)
        assert out.dtype == half
        out.float().square().sum().backward()
        return [param.grad.clone() for param in params]

    for plain, recomputed in zip(grads(False), grads(True)):
        torch.testing.assert_close(recomputed, plain, **_EXACT)
    # And the recompute left autocast as it found it: off.
    assert not torch.is_autocast_enabled(DEVICE.type)


def test_successive_checkpointed_calls_draw_new_masks():
    """The masks come from the RNG: a second call (states moved on) gives another output."""
    parallel_state.destroy_model_parallel()
    model_parallel_cuda_manual_seed(2024)
    linear = nn.Linear(HIDDEN, HIDDEN)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    block = _dropout_block(linear)
    first = checkpoint(block, False, x)
    second = checkpoint(block, False, x)
    assert not torch.equal(first, second)


# --- two tensor-parallel ranks -------------------------------------------------------------


def _all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """This tensor from every rank of the (whole) world."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return gathered


def _check_streams_across_ranks() -> None:
    """Tracker stream differs across TP ranks; default-stream dropout masks agree."""
    model_parallel_cuda_manual_seed(1234)
    default_mask = F.dropout(torch.ones(512), p=0.5, training=True)
    with get_cuda_rng_tracker().fork():
        split_mask = F.dropout(torch.ones(512), p=0.5, training=True)
    later_default = torch.rand(64)
    defaults, splits = _all_gather(default_mask), _all_gather(split_mask)
    laters = _all_gather(later_default)
    assert all(torch.equal(defaults[0], other) for other in defaults[1:])
    assert all(torch.equal(laters[0], other) for other in laters[1:])
    assert not torch.equal(splits[0], splits[1]), "tracker streams agree across TP ranks"
    assert not torch.equal(default_mask, split_mask)


def _tensor_parallel_block():
    """Column -> gelu -> dropout (tracker) -> Row -> dropout (default), and its parameters."""
    init = nn.init.xavier_normal_
    torch.manual_seed(77)
    column = ColumnParallelLinear(HIDDEN, FFN, init, use_cpu_initialization=True)
    row = RowParallelLinear(FFN, HIDDEN, init, input_is_parallel=True, use_cpu_initialization=True)
    with torch.no_grad():
        column.bias.uniform_(-0.1, 0.1)
        row.bias.uniform_(-0.1, 0.1)

    def block(x: torch.Tensor) -> torch.Tensor:
        """The tensor-parallel MLP with both kinds of dropout."""
        hidden, _ = column(x)
        with get_cuda_rng_tracker().fork():  # split activations: a different mask per rank
            hidden = F.dropout(F.gelu(hidden), p=0.5, training=True)
        out, _ = row(hidden)
        return F.dropout(out, p=0.5, training=True)  # replicated: the same mask everywhere

    return block, [column.weight, column.bias, row.weight, row.bias]


def _check_tp_checkpoint(distribute: bool) -> None:
    """checkpoint == plain run at tp 2; the (replicated) output agrees across ranks."""
    model_parallel_cuda_manual_seed(99)
    block, params = _tensor_parallel_block()
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    probe = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    out = _compare_checkpoint_with_plain(block, params, x, probe, distribute)
    outs = _all_gather(out)
    assert torch.equal(outs[0], outs[1]), "replicated output differs across TP ranks"


def _check_distributed_input_is_a_shard() -> None:
    """distribute_saved_activations: what backward keeps of the input is 1/tp of its memory."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(8))
    x.requires_grad_()  # the same on both ranks: the input a checkpointed layer replicates
    hidden = x * 1.0  # a layer's input activation, as the previous layer produced it
    out = checkpoint(torch.tanh, True, hidden)
    saved = out.grad_fn.saved_tensors[0]
    kept_elements, kept_bytes = saved.numel(), saved.untyped_storage().nbytes()
    shares_input_memory = saved.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()
    del saved
    out.backward(torch.ones_like(out))  # every rank gathers the shards back (a collective)
    torch.testing.assert_close(x.grad, 1 - torch.tanh(hidden.detach()) ** 2)
    full_bytes = hidden.numel() * hidden.element_size()
    assert kept_elements == hidden.numel() // tp
    assert not shares_input_memory and kept_bytes == full_bytes // tp, (
        f"the saved 1/{tp} shard is a view keeping the whole input alive: "
        f"{kept_bytes} bytes held for {kept_elements} elements, the input has {full_bytes}"
    )


SPAWN_WORLD_SIZES = [2]


def spawn_body(checks, rank: int, world: int) -> None:
    """The 2-rank checks, at tp 2."""
    parallel_state.initialize_model_parallel(world, 1)
    checks.run("streams across ranks", _check_streams_across_ranks)
    checks.run("checkpoint tp2", _check_tp_checkpoint, False)
    checks.run("checkpoint tp2 distribute_saved_activations", _check_tp_checkpoint, True)
    checks.run("distributed input is a shard", _check_distributed_input_is_a_shard)
    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's check outcomes in the session's 2-rank world."""
    return spawned_suite[__name__][2]


def test_tracker_stream_differs_but_default_agrees_across_tp_ranks(spawned):
    """After model_parallel_cuda_manual_seed: per-rank tracker stream, shared default stream."""
    spawned.assert_ok("streams across ranks")


def test_checkpoint_matches_plain_run_tp2(spawned):
    """At tp 2: checkpointed tensor-parallel block == plain block, outputs and gradients."""
    spawned.assert_ok("checkpoint tp2")


def test_checkpoint_distribute_saved_activations_tp2(spawned):
    """distribute_saved_activations=True (input kept as 1/tp shards) gives the same grads."""
    spawned.assert_ok("checkpoint tp2 distribute_saved_activations")


def test_distribute_saved_activations_keeps_only_a_shard_tp2(spawned):
    """At tp 2 the input kept for backward holds half the input's memory, not all of it."""
    spawned.assert_ok("distributed input is a shard")


def test_spawned_body_ran_every_check(spawned):
    """Nothing escaped the checks, and every check has a test."""
    expected = {
        "streams across ranks",
        "checkpoint tp2",
        "checkpoint tp2 distribute_saved_activations",
        "distributed input is a shard",
    }
    assert spawned.names() == expected, spawned.per_rank[0].get(BODY)
