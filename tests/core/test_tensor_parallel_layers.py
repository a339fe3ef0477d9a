"""Tensor-parallel layers against their dense twins, forward and backward, at tp 1, 2 and 4.

Each check builds the parallel layer with `use_cpu_initialization=True` after seeding torch
identically on every rank, builds the dense layer from the same seed, and compares: the
shard is the dense weight's slice; the output (gathered, or this rank's slice) equals the
dense output; after backward the input gradient and the weight and bias gradient shards equal
the dense gradients' slices. Activations are Megatron's `[s, b, h]`. Worlds of 1, 2 and 4
ranks run with tp = world size; the 4-rank world also runs tp 2 with two data-parallel
replicas, where a collective over the wrong group would show.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear_with_vocab_parallel_weight,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel import mappings as tp_regions
from megatron.core.tensor_parallel.mappings import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)
from tests.core.spawn_checks import BODY, run_checks_per_layout
from tests.tolerances import assert_close_reordered

# (world size, tp): tp = world, and tp 2 inside 4 ranks (two data-parallel replicas), where
# a collective on the wrong group would be caught.
LAYOUTS = [(1, 1), (2, 2), (4, 4), (4, 2)]
LAYOUT_IDS = [f"world{world}-tp{tp}" for world, tp in LAYOUTS]
SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 8, 12, 16
SEED = 1234
TOKENS = SEQ * BATCH
# The parallel layers sum the same products as the dense ones in another order (partial sums
# per rank, then the all-reduce), so fp32 results agree to a reordering bound (see
# tests/tolerances.py) counted from the longest sums into them:
# a linear layer's output sums HIDDEN (column) or FFN (row) products plus the bias, its input
# gradient the other of the two, its weight and bias gradients the TOKENS tokens;
LINEAR_TERMS = HIDDEN + FFN + 1 + TOKENS
# the logits against the vocab-split table sum HIDDEN products, their input gradient VOCAB
# (split over the ranks), the table's gradient TOKENS;
LOGITS_TERMS = HIDDEN + VOCAB + TOKENS
# the MLP: both linears forward (HIDDEN + FFN), both backward (FFN + HIDDEN), weight and bias
# gradients over the tokens.
MLP_TERMS = 2 * (HIDDEN + FFN + 1) + TOKENS
# Moving values (scatter, gather, split) does no arithmetic: compared bitwise.
EXACT = {"atol": 0, "rtol": 0}


def init_method(weight: torch.Tensor) -> torch.Tensor:
    """A draw with a scale that makes every product non-trivial."""
    return nn.init.normal_(weight, mean=0.0, std=0.5)


def _shard(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This tensor-parallel rank's contiguous slice of `tensor` along `dim`."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return tensor.chunk(world, dim=dim)[rank]


def _dense_weight(rows: int, cols: int) -> torch.Tensor:
    """The full weight the parallel layer draws when built right after `torch.manual_seed`."""
    torch.manual_seed(SEED)
    return init_method(torch.empty(rows, cols))


def _inputs(*shape: int, seed: int = 7) -> torch.Tensor:
    """A random tensor, the same on the ranks of a tensor-parallel group.

    Data-parallel replicas get different ones, so that mixing data from another replica
    (a collective over the wrong group) cannot go unnoticed.
    """
    seed += 1000 * parallel_state.get_data_parallel_rank()
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, probe: torch.Tensor):
    """Dense output and (input, weight, bias) gradients of sum(probe * (x W^T + b))."""
    weight = weight.clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    x = x.clone().requires_grad_()
    out = F.linear(x, weight, bias)
    (out * probe).sum().backward()
    return out.detach(), x.grad, weight.grad, bias.grad


def _check_column(gather_output: bool, skip_bias_add: bool) -> None:
    """ColumnParallelLinear: shard, output, input grad, weight and bias grad shards."""
    full_weight = _dense_weight(FFN, HIDDEN)
    full_bias = _inputs(FFN, seed=3)
    x, probe = _inputs(SEQ, BATCH, HIDDEN), _inputs(SEQ, BATCH, FFN, seed=11)
    dense_out, dense_dx, dense_dw, dense_db = _dense_linear(full_weight, full_bias, x, probe)

    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(
        HIDDEN,
        FFN,
        init_method,
        gather_output=gather_output,
        skip_bias_add=skip_bias_add,
        use_cpu_initialization=True,
    )
    torch.testing.assert_close(layer.weight.detach(), _shard(full_weight, 0), atol=0, rtol=0)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    with torch.no_grad():
        layer.bias.copy_(_shard(full_bias, 0))
    x_local = x.clone().requires_grad_()
    out, bias = layer(x_local)
    local_probe = _shard(probe, -1)
    expected = dense_out if gather_output else _shard(dense_out, -1)
    if skip_bias_add:
        # The caller adds the bias (this rank's shard, even when the output is gathered).
        assert bias is layer.bias
        expected = expected - (full_bias if gather_output else _shard(full_bias, 0))
    else:
        assert bias is None
    assert_close_reordered(out, expected, terms=LINEAR_TERMS)
    loss = (out * (probe if gather_output else local_probe)).sum()
    if skip_bias_add:
        loss = loss + (bias * local_probe.sum(dim=(0, 1))).sum()
    loss.backward()
    assert_close_reordered(x_local.grad, dense_dx, terms=LINEAR_TERMS)
    assert_close_reordered(layer.weight.grad, _shard(dense_dw, 0), terms=LINEAR_TERMS)
    assert_close_reordered(layer.bias.grad, _shard(dense_db, 0), terms=LINEAR_TERMS)


def _check_row(input_is_parallel: bool, skip_bias_add: bool) -> None:
    """RowParallelLinear: shard, output (bias once, after the reduce), all gradients."""
    full_weight = _dense_weight(HIDDEN, FFN)
    full_bias = _inputs(HIDDEN, seed=5)
    x, probe = _inputs(SEQ, BATCH, FFN), _inputs(SEQ, BATCH, HIDDEN, seed=13)
    dense_out, dense_dx, dense_dw, dense_db = _dense_linear(full_weight, full_bias, x, probe)

    torch.manual_seed(SEED)
    layer = RowParallelLinear(
        FFN,
        HIDDEN,
        init_method,
        input_is_parallel=input_is_parallel,
        skip_bias_add=skip_bias_add,
        use_cpu_initialization=True,
    )
    torch.testing.assert_close(layer.weight.detach(), _shard(full_weight, 1), atol=0, rtol=0)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
    assert layer.bias.shape == (HIDDEN,)
    with torch.no_grad():
        layer.bias.copy_(full_bias)
    x_local = (_shard(x, -1) if input_is_parallel else x).clone().requires_grad_()
    out, bias = layer(x_local)
    if skip_bias_add:
        assert bias is layer.bias
        assert_close_reordered(out, dense_out - full_bias, terms=LINEAR_TERMS)
        out = out + bias
    else:
        assert bias is None
    assert_close_reordered(out, dense_out, terms=LINEAR_TERMS)
    (out * probe).sum().backward()
    expected_dx = _shard(dense_dx, -1) if input_is_parallel else dense_dx
    assert_close_reordered(x_local.grad, expected_dx, terms=LINEAR_TERMS)
    assert_close_reordered(layer.weight.grad, _shard(dense_dw, 1), terms=LINEAR_TERMS)
    assert_close_reordered(layer.bias.grad, dense_db, terms=LINEAR_TERMS)


def _check_embedding() -> None:
    """VocabParallelEmbedding against nn.Embedding: ids in every shard, repeated ids."""
    full_weight = _dense_weight(VOCAB, HIDDEN)
    dense = nn.Embedding.from_pretrained(full_weight.clone(), freeze=False)
    ids = torch.cat([torch.arange(VOCAB), torch.tensor([0, VOCAB - 1, 5, 5, 9, VOCAB // 2])])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(3))]
    ids = ids.view(BATCH, -1)
    probe = _inputs(*ids.shape, HIDDEN, seed=17)
    dense_out = dense(ids)
    (dense_out * probe).sum().backward()

    torch.manual_seed(SEED)
    layer = VocabParallelEmbedding(VOCAB, HIDDEN, init_method, use_cpu_initialization=True)
    torch.testing.assert_close(layer.weight.detach(), _shard(full_weight, 0), atol=0, rtol=0)
    per_rank = VOCAB // parallel_state.get_tensor_model_parallel_world_size()
    assert layer.vocab_start_index == parallel_state.get_tensor_model_parallel_rank() * per_rank
    assert layer.vocab_end_index == layer.vocab_start_index + per_rank
    out = layer(ids)
    # A lookup: the all-reduce adds the owner's row to the others' zeros; a row's gradient
    # sums its id's occurrences (at most every id in the batch), in another order.
    assert_close_reordered(out, dense_out.detach(), terms=ids.numel())
    (out * probe).sum().backward()
    assert_close_reordered(layer.weight.grad, _shard(dense.weight.grad, 0), terms=ids.numel())


def _check_vocab_parallel_logits(gather_output: bool, sequence_parallel: bool) -> None:
    """linear_with_vocab_parallel_weight against F.linear with the whole embedding table."""
    full_weight = _dense_weight(VOCAB, HIDDEN)
    x, probe = _inputs(SEQ, BATCH, HIDDEN), _inputs(SEQ, BATCH, VOCAB, seed=19)
    dense_w = full_weight.clone().requires_grad_()
    dense_x = x.clone().requires_grad_()
    dense_out = F.linear(dense_x, dense_w)
    (dense_out * probe).sum().backward()

    weight = _shard(full_weight, 0).clone().requires_grad_()
    x_local = (_shard(x, 0) if sequence_parallel else x).clone().requires_grad_()
    logits = linear_with_vocab_parallel_weight(x_local, weight, sequence_parallel, gather_output)
    if gather_output:
        assert_close_reordered(logits, dense_out.detach(), terms=LOGITS_TERMS)
        (logits * probe).sum().backward()
    else:
        assert_close_reordered(logits, _shard(dense_out.detach(), -1), terms=LOGITS_TERMS)
        (logits * _shard(probe, -1)).sum().backward()
    expected_dx = _shard(dense_x.grad, 0) if sequence_parallel else dense_x.grad
    assert_close_reordered(x_local.grad, expected_dx, terms=LOGITS_TERMS)
    assert_close_reordered(weight.grad, _shard(dense_w.grad, 0), terms=LOGITS_TERMS)


def _check_sequence_parallel_mlp() -> None:
    """Column(SP) -> gelu -> Row(SP) on this rank's sequence slice against the dense MLP."""
    w1, w2 = _dense_weight(FFN, HIDDEN), None
    torch.manual_seed(SEED + 1)
    w2 = init_method(torch.empty(HIDDEN, FFN))
    b1, b2 = _inputs(FFN, seed=23), _inputs(HIDDEN, seed=29)
    x, probe = _inputs(SEQ, BATCH, HIDDEN), _inputs(SEQ, BATCH, HIDDEN, seed=31)
    dense = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    dense_x, dense_w1, dense_b1, dense_w2, dense_b2 = dense
    dense_out = F.linear(F.gelu(F.linear(dense_x, dense_w1, dense_b1)), dense_w2, dense_b2)
    (dense_out * probe).sum().backward()

    torch.manual_seed(SEED)
    column = ColumnParallelLinear(
        HIDDEN, FFN, init_method, sequence_parallel=True, use_cpu_initialization=True
    )
    torch.manual_seed(SEED + 1)
    row = RowParallelLinear(
        FFN,
        HIDDEN,
        init_method,
        input_is_parallel=True,
        sequence_parallel=True,
        use_cpu_initialization=True,
    )
    torch.testing.assert_close(column.weight.detach(), _shard(w1, 0), atol=0, rtol=0)
    torch.testing.assert_close(row.weight.detach(), _shard(w2, 1), atol=0, rtol=0)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        assert column.sequence_parallel and row.sequence_parallel
        assert row.bias.sequence_parallel
    with torch.no_grad():
        column.bias.copy_(_shard(b1, 0))
        row.bias.copy_(b2)
    x_local = _shard(x, 0).clone().requires_grad_()
    hidden, _ = column(x_local)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    assert hidden.shape == (SEQ, BATCH, FFN // tp)  # the whole sequence, this rank's features
    out, _ = row(F.gelu(hidden))
    assert_close_reordered(out, _shard(dense_out.detach(), 0), terms=MLP_TERMS)
    (out * _shard(probe, 0)).sum().backward()
    assert_close_reordered(x_local.grad, _shard(dense_x.grad, 0), terms=MLP_TERMS)
    assert_close_reordered(column.weight.grad, _shard(dense_w1.grad, 0), terms=MLP_TERMS)
    assert_close_reordered(column.bias.grad, _shard(dense_b1.grad, 0), terms=MLP_TERMS)
    assert_close_reordered(row.weight.grad, _shard(dense_w2.grad, 1), terms=MLP_TERMS)
    # Partial on each rank (its sequence slice only) until the sequence-parallel hook sums it.
    assert_close_reordered(row.bias.grad, dense_b2.grad, terms=MLP_TERMS)


def _check_mappings() -> None:
    """Each region's forward collective and its transpose in backward, on [s, b, h] tensors."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    full = _inputs(SEQ, BATCH, HIDDEN, seed=41)
    grad = _inputs(SEQ, BATCH, HIDDEN, seed=43)
    # Rank r holds (r + 1) * t of a rank-dependent t: the TP sum is (1 + .. + tp) * t, equal
    # to total * t up to summing tp terms in another order; what only moves is bitwise equal.
    scale, total = rank + 1.0, tp * (tp + 1) / 2

    def run(region, x, upstream, *args):
        """Forward output and input gradient of region(x) under the upstream gradient."""
        x = x.clone().requires_grad_()
        out = region(x, *args)
        out.backward(upstream)
        return out.detach(), x.grad

    out, dx = run(tp_regions.copy_to_tensor_model_parallel_region, full, scale * grad)
    torch.testing.assert_close(out, full, **EXACT)
    assert_close_reordered(dx, total * grad, terms=tp)
    out, dx = run(tp_regions.reduce_from_tensor_model_parallel_region, scale * full, grad)
    assert_close_reordered(out, total * full, terms=tp)
    torch.testing.assert_close(dx, grad, **EXACT)
    out, dx = run(tp_regions.scatter_to_tensor_model_parallel_region, full, _shard(grad, -1))
    torch.testing.assert_close(out, _shard(full, -1), **EXACT)
    torch.testing.assert_close(dx, grad, **EXACT)
    out, dx = run(tp_regions.gather_from_tensor_model_parallel_region, _shard(full, -1), grad)
    torch.testing.assert_close(out, full, **EXACT)
    torch.testing.assert_close(dx, _shard(grad, -1), **EXACT)
    out, dx = run(tp_regions.scatter_to_sequence_parallel_region, full, _shard(grad, 0))
    torch.testing.assert_close(out, _shard(full, 0), **EXACT)
    torch.testing.assert_close(dx, grad, **EXACT)
    region = tp_regions.gather_from_sequence_parallel_region
    out, dx = run(region, _shard(full, 0), scale * grad, True)
    torch.testing.assert_close(out, full, **EXACT)
    assert_close_reordered(dx, _shard(total * grad, 0), terms=tp)
    out, dx = run(region, _shard(full, 0), grad, False)
    torch.testing.assert_close(out, full, **EXACT)
    torch.testing.assert_close(dx, _shard(grad, 0), **EXACT)
    region = tp_regions.reduce_scatter_to_sequence_parallel_region
    out, dx = run(region, scale * full, _shard(grad, 0))
    assert_close_reordered(out, _shard(total * full, 0), terms=tp)
    torch.testing.assert_close(dx, grad, **EXACT)
    # Partitioned activations: 1/tp of the flat tensor each, put back together exactly.
    chunk = split_tensor_into_1d_equal_chunks(full)
    assert chunk.numel() == full.numel() // tp
    torch.testing.assert_close(chunk, _shard(full.reshape(-1), 0), **EXACT)
    torch.testing.assert_close(gather_split_1d_tensor(chunk), full.reshape(-1), **EXACT)


def _check_size_errors() -> None:
    """Sizes tp does not divide, and SP combinations that cannot work, raise ValueError."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    odd = 6  # divisible by tp 1 and 2, not by 4
    splits = {
        "column output": lambda: ColumnParallelLinear(
            HIDDEN, odd, init_method, use_cpu_initialization=True
        ),
        "row input": lambda: RowParallelLinear(
            odd, HIDDEN, init_method, use_cpu_initialization=True
        ),
        "vocabulary": lambda: VocabParallelEmbedding(
            odd, HIDDEN, init_method, use_cpu_initialization=True
        ),
    }
    for what, build in splits.items():
        if odd % tp == 0:
            build()
            continue
        try:
            build()
        except ValueError as error:
            assert "--tensor-model-parallel-size" in str(error), (what, str(error))
        else:
            raise AssertionError(f"{what} {odd} split over tp {tp}")
    impossible_sp = {
        "gathered SP column": lambda: ColumnParallelLinear(
            HIDDEN, FFN, init_method, gather_output=True, sequence_parallel=True
        ),
        "SP row without parallel input": lambda: RowParallelLinear(
            FFN, HIDDEN, init_method, input_is_parallel=False, sequence_parallel=True
        ),
    }
    for what, build in impossible_sp.items():
        if tp == 1:
            build()  # sequence parallelism is off with one rank: nothing to refuse
            continue
        try:
            build()
        except ValueError:
            pass
        else:
            raise AssertionError(f"{what} accepted at tp {tp}")
    # Sequence parallelism needs the sequence to split evenly.
    if tp > 1:
        try:
            scatter_to_sequence_parallel_region(torch.zeros(SEQ + 1, BATCH, HIDDEN))
        except ValueError as error:
            assert "--tensor-model-parallel-size" in str(error)
        else:
            raise AssertionError("an indivisible sequence was split")


CHECKS = {
    **{
        f"column gather_output={g} skip_bias_add={s}": (_check_column, g, s)
        for g in (True, False)
        for s in (False, True)
    },
    **{
        f"row input_is_parallel={p} skip_bias_add={s}": (_check_row, p, s)
        for p in (True, False)
        for s in (False, True)
    },
    "vocab parallel embedding": (_check_embedding,),
    **{
        f"vocab parallel logits gather_output={g} sequence_parallel={sp}": (
            _check_vocab_parallel_logits,
            g,
            sp,
        )
        for g in (True, False)
        for sp in (False, True)
        if not (g and sp)
    },
    "sequence parallel mlp": (_check_sequence_parallel_mlp,),
    "mapping regions": (_check_mappings,),
    "size errors": (_check_size_errors,),
}


SPAWN_WORLD_SIZES = sorted({world for world, _ in LAYOUTS})


def spawn_body(checks, rank: int, world: int) -> None:
    """Every layer check for each layout of this world size."""
    run_checks_per_layout(checks, world, LAYOUTS, CHECKS)


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's check outcomes by world size (from the session's spawned worlds)."""
    return spawned_suite[__name__]


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("gather_output", [True, False])
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_column_parallel_linear_matches_dense(spawned, world, tp, gather_output, skip_bias_add):
    """ColumnParallelLinear == nn.Linear (its output slice, or the gathered output)."""
    name = f"column gather_output={gather_output} skip_bias_add={skip_bias_add}"
    spawned[world].assert_ok(f"tp={tp} {name}")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_row_parallel_linear_matches_dense(spawned, world, tp, input_is_parallel, skip_bias_add):
    """RowParallelLinear == nn.Linear, the bias added once after the reduction."""
    name = f"row input_is_parallel={input_is_parallel} skip_bias_add={skip_bias_add}"
    spawned[world].assert_ok(f"tp={tp} {name}")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
def test_vocab_parallel_embedding_matches_embedding(spawned, world, tp):
    """VocabParallelEmbedding == nn.Embedding for ids spanning every shard, grads included."""
    spawned[world].assert_ok(f"tp={tp} vocab parallel embedding")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(
    "gather_output, sequence_parallel", [(True, False), (False, False), (False, True)]
)
def test_linear_with_vocab_parallel_weight_matches_dense(
    spawned, world, tp, gather_output, sequence_parallel
):
    """Logits against the vocab-split table == F.linear against the whole table."""
    name = (
        f"vocab parallel logits gather_output={gather_output} sequence_parallel={sequence_parallel}"
    )
    spawned[world].assert_ok(f"tp={tp} {name}")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
def test_sequence_parallel_mlp_matches_dense(spawned, world, tp):
    """Column(SP) + Row(SP) on sequence slices == the dense MLP; row bias grad is summed."""
    spawned[world].assert_ok(f"tp={tp} sequence parallel mlp")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
def test_mapping_regions_and_their_transposes(spawned, world, tp):
    """Each collective region, forward and backward, against the full-tensor arithmetic."""
    spawned[world].assert_ok(f"tp={tp} mapping regions")


@pytest.mark.parametrize("world, tp", LAYOUTS, ids=LAYOUT_IDS)
def test_sizes_that_cannot_split_raise(spawned, world, tp):
    """Indivisible sizes name --tensor-model-parallel-size; impossible SP setups refuse."""
    spawned[world].assert_ok(f"tp={tp} size errors")


@pytest.mark.parametrize("world", SPAWN_WORLD_SIZES)
def test_spawned_body_ran_every_check(spawned, world):
    """Nothing escaped the checks, and every check has a test."""
    expected = {f"tp={tp} {name}" for w, tp in LAYOUTS if w == world for name in CHECKS}
    assert spawned[world].names() == expected, spawned[world].per_rank[0].get(BODY)
