"""megatron.core.parallel_state: Megatron's rank layout, the queries, and the `mpu` for DeepSpeed.

- `generate_rank_groups` equals the groups megatron-core 0.16.1's `RankGenerator` builds
  (run in a subprocess: the released package is also called `megatron`) for every
  (world, tp, pp) with up to 16 ranks;
- before initialization every query answers as one process would;
- in a 4-rank gloo world, for (tp, pp) = (2, 1), (2, 2), (1, 4), every query agrees with the
  generated groups and with Megatron's rank formulas, and every group really communicates;
- `mpu` has what DeepSpeed 0.19 calls, and none of the sequence-parallel queries that would
  make DeepSpeed set up Ulysses sequence parallelism.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import ParallelConfigError, generate_rank_groups
from tests.conftest import run_oracle
from tests.core.spawn_checks import BODY

ORACLE_SCRIPT = os.path.join(os.path.dirname(__file__), "megatron_core_rank_groups.py")
SPAWNED_CONFIGS = [(2, 1), (2, 2), (1, 4)]
KINDS = ["tensor", "data", "pipeline", "model", "embedding"]

# What deepspeed 0.19 calls on the mpu it is given (runtime/engine.py, zero/, pipe/, utils/
# groups.py, activation_checkpointing/, bwc.py).
DEEPSPEED_MPU_CALLS = [
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_group_ranks",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_src_rank",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pipe_parallel_group",
    "get_pipe_parallel_rank",
    "get_pipe_parallel_world_size",
    "get_slice_parallel_group",
    "get_slice_parallel_rank",
    "get_slice_parallel_world_size",
]
# Their presence makes DeepSpeed treat the run as sequence parallel (deepspeed/utils/groups.py).
DEEPSPEED_SEQUENCE_PARALLEL_PROBES = [
    "initialize_sequence_parallel",
    "get_sequence_parallel_world_size",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_group",
    "get_sequence_data_parallel_world_size",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_group",
]


def _all_cases(max_world: int = 16) -> list[tuple[int, int, int]]:
    """Every (world, tp, pp) with tp * pp dividing world, for worlds 1..max_world."""
    return [
        (world, tp, pp)
        for world in range(1, max_world + 1)
        for tp in range(1, world + 1)
        for pp in range(1, world + 1)
        if world % (tp * pp) == 0
    ]


def test_generate_rank_groups_equals_megatron_core(tmp_path):
    """Every group kind, in the same order, as megatron-core's RankGenerator for 1..16 ranks."""
    cases = _all_cases()
    assert len(cases) > 100
    cases_file, out_file = tmp_path / "cases.json", tmp_path / "groups.json"
    cases_file.write_text(json.dumps(cases))
    run_oracle(ORACLE_SCRIPT, str(cases_file), str(out_file))
    expected = json.loads(out_file.read_text())
    assert len(expected) == len(cases)
    mismatches = []
    for world, tp, pp in cases:
        ours = generate_rank_groups(world, tp, pp)
        theirs = expected[f"{world},{tp},{pp}"]
        kinds = KINDS + (["stage"] if pp > 1 else [])
        assert sorted(ours) == sorted(kinds)
        mismatches += [
            f"world {world} tp {tp} pp {pp} {kind}: ours {ours[kind]} megatron {theirs[kind]}"
            for kind in kinds
            if ours[kind] != theirs[kind]
        ]
    assert not mismatches, "\n".join(mismatches[:20])


def test_context_parallel_groups_equal_megatron_core(tmp_path):
    """With --context-parallel-size: megatron-core's cp and dp-cp groups are our sequence and
    sequence-data groups, and every other kind is still theirs (order tp-cp-ep-dp-pp)."""
    cases = [
        [world, tp, pp, cp]
        for world in (4, 8, 12, 16)
        for tp in (1, 2)
        for pp in (1, 2)
        for cp in (2, 4)
        if world % (tp * pp * cp) == 0
    ]
    cases_file, out_file = tmp_path / "cases.json", tmp_path / "groups.json"
    cases_file.write_text(json.dumps(cases))
    run_oracle(ORACLE_SCRIPT, str(cases_file), str(out_file))
    expected = json.loads(out_file.read_text())
    for world, tp, pp, cp in cases:
        ours = generate_rank_groups(world, tp, pp, context_parallel_size=cp)
        theirs = expected[f"{world},{tp},{pp},{cp}"]
        stage = ["stage"] if pp > 1 else []
        assert sorted(ours) == sorted(KINDS + ["sequence", "sequence_data"] + stage)
        for kind in theirs:
            assert ours[kind] == theirs[kind], (world, tp, pp, cp, kind)


def test_expert_parallel_groups_equal_megatron_core(tmp_path):
    """With --expert-model-parallel-size and --expert-tensor-parallel-size 1 (MoE parallel
    folding: experts spread over tensor x context x data-parallel ranks): our expert and
    expert-data groups are megatron-core's expert "ep" and "dp" groups, the dense ones still
    its dense groups."""
    cases = [
        [world, tp, pp, cp, ep]
        for world in (4, 8, 16)
        for tp in (1, 2, 4)
        for pp in (1, 2)
        for cp in (1, 2)
        for ep in (2, 4, 8)
        if world % (tp * pp * cp) == 0 and (world // pp) % ep == 0
    ]
    cases_file, out_file = tmp_path / "cases.json", tmp_path / "groups.json"
    cases_file.write_text(json.dumps(cases))
    run_oracle(ORACLE_SCRIPT, str(cases_file), str(out_file))
    expected = json.loads(out_file.read_text())
    for world, tp, pp, cp, ep in cases:
        ours = generate_rank_groups(
            world, tp, pp, context_parallel_size=cp, expert_parallel_size=ep
        )
        theirs = expected[f"{world},{tp},{pp},{cp},{ep}"]
        for kind in theirs:
            assert ours[kind] == theirs[kind], (world, tp, pp, cp, ep, kind)
        assert "expert" in theirs and "expert_data" in theirs


@pytest.mark.parametrize("world, tp, pp", [(8, 2, 2), (12, 3, 2), (16, 1, 4), (6, 6, 1)])
def test_generated_groups_partition_the_world(world, tp, pp):
    """Each kind except embedding covers every rank exactly once, with Megatron's group sizes."""
    groups = generate_rank_groups(world, tp, pp)
    dp = world // (tp * pp)
    sizes = {"tensor": tp, "data": dp, "pipeline": pp, "model": tp * pp}
    for kind, size in sizes.items():
        assert sorted(r for group in groups[kind] for r in group) == list(range(world)), kind
        assert all(len(group) == size for group in groups[kind]), kind
    assert groups["tensor"][0] == list(range(tp))  # tensor-parallel ranks are adjacent


@pytest.mark.parametrize(
    "world, tp, pp",
    [(6, 4, 1), (6, 1, 4), (8, 3, 1), (4, 2, 3), (6, 0, 1), (6, 1, 0)],
)
def test_config_error_names_both_flags(world, tp, pp):
    """A world the sizes do not divide (or a size below 1) names both command-line flags."""
    with pytest.raises(ParallelConfigError) as error:
        generate_rank_groups(world, tp, pp)
    message = str(error.value)
    assert "--tensor-model-parallel-size" in message
    assert "--pipeline-model-parallel-size" in message
    assert f"({tp})" in message and f"({pp})" in message
    assert isinstance(error.value, ValueError)


def test_world_six_with_tp_four_message():
    """The exact case a user hits with 6 GPUs and --tensor-model-parallel-size 4."""
    with pytest.raises(ParallelConfigError, match=r"world size \(6\)") as error:
        generate_rank_groups(6, 4, 1)
    assert "--tensor-model-parallel-size (4)" in str(error.value)
    assert "--pipeline-model-parallel-size (1)" in str(error.value)


def test_queries_before_initialization_answer_as_one_process():
    """Without initialize_model_parallel: rank 0 of size 1 everywhere, no groups."""
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_src_rank() == 0
    assert ps.get_tensor_model_parallel_group() is None
    assert ps.get_pipeline_model_parallel_rank() == 0
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_group() is None
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_embedding_group() is None
    assert ps.get_data_parallel_rank() == 0
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_data_parallel_group() is None
    assert ps.get_data_parallel_group_ranks() == [0]
    assert ps.get_model_parallel_group() is None
    assert ps.get_model_parallel_rank() == 0
    assert ps.get_model_parallel_world_size() == 1
    for name in DEEPSPEED_MPU_CALLS:
        answer = getattr(ps.mpu, name)()
        assert answer in (None, 0, 1, [0]), (name, answer)
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_parallel_state()


def test_initialize_needs_torch_distributed():
    """initialize_model_parallel refuses to run before torch.distributed is set up."""
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        ps.initialize_model_parallel(1, 1)
    assert not ps.model_parallel_is_initialized()


def test_mpu_has_what_deepspeed_calls():
    """Every mpu attribute DeepSpeed 0.19 calls exists, bound to the matching query."""
    for name in DEEPSPEED_MPU_CALLS:
        assert callable(getattr(ps.mpu, name, None)), name
    same = {
        "get_pipe_parallel_group": ps.get_pipeline_model_parallel_group,
        "get_pipe_parallel_rank": ps.get_pipeline_model_parallel_rank,
        "get_pipe_parallel_world_size": ps.get_pipeline_model_parallel_world_size,
        "get_slice_parallel_group": ps.get_tensor_model_parallel_group,
        "get_slice_parallel_rank": ps.get_tensor_model_parallel_rank,
        "get_slice_parallel_world_size": ps.get_tensor_model_parallel_world_size,
        "get_model_parallel_group": ps.get_model_parallel_group,
        "get_data_parallel_group": ps.get_data_parallel_group,
        "get_data_parallel_group_ranks": ps.get_data_parallel_group_ranks,
    }
    for name, function in same.items():
        assert getattr(ps.mpu, name) is function, name


def test_mpu_deliberately_lacks_sequence_parallel_queries():
    """DeepSpeed reads these as Ulysses sequence parallelism, which Megatron's SP is not."""
    for name in DEEPSPEED_SEQUENCE_PARALLEL_PROBES:
        assert not hasattr(ps.mpu, name), name


def _my_group(groups: dict, kind: str, rank: int) -> list[int] | None:
    """The one group of `kind` holding `rank` (None if none: embedding on middle stages)."""
    mine = [group for group in groups[kind] if rank in group]
    assert len(mine) <= 1, (kind, mine)
    return mine[0] if mine else None


def _sum_over(group: dist.ProcessGroup, rank: int) -> int:
    """All-reduce this rank's id over `group`: proves the group communicates as named."""
    value = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


def _check_queries(rank: int, world: int, tp: int, pp: int) -> None:
    """After initialize_model_parallel(tp, pp): every query, against groups and formulas."""
    state = ps.initialize_model_parallel(tp, pp)
    assert ps.model_parallel_is_initialized() and ps.get_parallel_state() is state
    groups = generate_rank_groups(world, tp, pp)
    dp = world // (tp * pp)
    tensor, data = _my_group(groups, "tensor", rank), _my_group(groups, "data", rank)
    pipeline, model = _my_group(groups, "pipeline", rank), _my_group(groups, "model", rank)
    embedding = _my_group(groups, "embedding", rank)
    ranks_of = dist.get_process_group_ranks

    # Megatron's layout: global = tp_rank + tp * (dp_rank + dp * pp_rank).
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    assert ps.get_tensor_model_parallel_world_size() == tp
    assert ps.get_tensor_model_parallel_rank() == tp_rank == tensor.index(rank)
    assert ps.get_tensor_model_parallel_src_rank() == tensor[0] == rank - tp_rank
    assert ranks_of(ps.get_tensor_model_parallel_group()) == tensor
    assert ps.get_pipeline_model_parallel_world_size() == pp
    assert ps.get_pipeline_model_parallel_rank() == pp_rank == pipeline.index(rank)
    assert ranks_of(ps.get_pipeline_model_parallel_group()) == pipeline
    assert ps.is_pipeline_first_stage() == (pp_rank == 0)
    assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1)
    assert ps.get_data_parallel_world_size() == dp
    assert ps.get_data_parallel_rank() == dp_rank == data.index(rank)
    assert ps.get_data_parallel_group_ranks() == data
    assert ranks_of(ps.get_data_parallel_group()) == data
    assert ranks_of(ps.get_model_parallel_group()) == model
    assert len(model) == tp * pp and rank in model
    assert ps.get_model_parallel_rank() == tp_rank
    assert ps.get_model_parallel_world_size() == tp
    if embedding is None:
        assert 0 < pp_rank < pp - 1
        assert ps.get_embedding_group() is None
    else:
        assert ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
        assert embedding == sorted({pipeline[0], pipeline[-1]})
        assert ranks_of(ps.get_embedding_group()) == embedding

    # The mpu DeepSpeed gets answers the same.
    assert ps.mpu.get_pipe_parallel_rank() == pp_rank
    assert ps.mpu.get_pipe_parallel_world_size() == pp
    assert ranks_of(ps.mpu.get_pipe_parallel_group()) == pipeline
    assert ps.mpu.get_slice_parallel_rank() == tp_rank
    assert ps.mpu.get_data_parallel_rank() == dp_rank
    assert ps.mpu.get_data_parallel_world_size() == dp

    # The groups really communicate among exactly those ranks (every rank reduces each).
    assert _sum_over(ps.get_tensor_model_parallel_group(), rank) == sum(tensor)
    assert _sum_over(ps.get_data_parallel_group(), rank) == sum(data)
    assert _sum_over(ps.get_pipeline_model_parallel_group(), rank) == sum(pipeline)
    assert _sum_over(ps.get_model_parallel_group(), rank) == sum(model)
    if embedding is not None:
        assert _sum_over(ps.get_embedding_group(), rank) == sum(embedding)
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1


def _check_bad_sizes_leave_no_state(rank: int, world: int) -> None:
    """A size that does not divide the world raises before any collective and sets nothing."""
    try:
        ps.initialize_model_parallel(3, 1)
    except ParallelConfigError as error:
        assert "--tensor-model-parallel-size (3)" in str(error)
    else:
        raise AssertionError("initialize_model_parallel(3, 1) on 4 ranks did not raise")
    assert not ps.model_parallel_is_initialized()


MESH_CONFIGS = [
    (1, 1, 2, 2),
    (2, 1, 1, 2),
    (1, 2, 2, 1),
    (2, 2, 1, 1),
    (1, 1, 1, 4),
    (2, 1, 1, 4),
    (2, 1, 2, 2),
]
"""(TP, PP, CP, EP) layouts of 4 ranks whose device mesh is checked against the groups."""

# The group kind each mesh name is, when that kind exists.
MESH_NAME_KINDS = {"tp": "tensor", "pp": "pipeline", "dp": "data", "model": "model",
                   "cp": "sequence", "dp_cp": "sequence_data", "stage": "stage",
                   "ep": "expert", "edp": "expert_data"}  # fmt: skip


def _check_mesh(rank: int, world: int, tp: int, pp: int, cp: int, ep: int) -> None:
    """Each named slice of the device mesh holds the ranks of its kind of group, and the
    accessors hand out those very groups."""
    ps.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_parallel_size=ep)
    mesh = ps.get_device_mesh()
    assert mesh.mesh_dim_names == ps.MESH_DIM_NAMES
    groups = generate_rank_groups(world, tp, pp, context_parallel_size=cp, expert_parallel_size=ep)
    for name, kind in MESH_NAME_KINDS.items():
        if name in ("ep", "edp") and ep == 1:
            continue  # no expert mesh
        ranks = ps.mesh_slice(name).mesh.tolist()
        if kind in groups:
            assert ranks == _my_group(groups, kind, rank), (name, kind)
        assert dist.get_process_group_ranks(ps.mesh_slice(name).get_group()) == ranks, name
    assert ps.get_tensor_model_parallel_group() is mesh["tp"].get_group()
    assert (
        ps.get_sequence_data_parallel_group()
        is ps.mesh_slice("dp_cp" if cp > 1 else "dp").get_group()
    )
    # The tensor x context ranks of a replica: TP x CP consecutive ranks (megatron-core's tp-cp).
    first = rank - rank % (tp * cp)
    assert ps.mesh_slice("tp_cp").mesh.tolist() == list(range(first, first + tp * cp))
    assert ps.get_tensor_and_sequence_parallel_world_size() == tp * cp
    if ep > 1:
        assert ps.get_expert_model_parallel_group() is ps.mesh_slice("ep").get_group()
        assert ps.get_expert_data_parallel_group() is ps.mesh_slice("edp").get_group()
        assert _sum_over(ps.get_expert_data_parallel_group(), rank) == sum(
            _my_group(groups, "expert_data", rank)
        )
    ps.destroy_model_parallel()


def _group_timeout(group: dist.ProcessGroup) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _check_groups_take_the_run_timeout(rank: int, world: int) -> None:
    """Every group the layout builds, the MoE's expert groups among them, waits the run's
    --distributed-timeout-minutes (as `initialize_distributed` sets it), not torch's default."""
    from torch.distributed import distributed_c10d

    from megatron.initialize import timeout_new_groups_after

    before = distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout
    timeout_new_groups_after(timedelta(minutes=7))
    try:
        # A layout no other check builds (the meshes are kept per layout).
        ps.initialize_model_parallel(2, 2, expert_parallel_size=2)
        names = ["tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "model", "stage", "ep", "edp"]
        for name in names:
            assert _group_timeout(ps.mesh_slice(name).get_group()) == timedelta(minutes=7), name
        assert _group_timeout(ps.get_embedding_group()) == timedelta(minutes=7)
        ps.destroy_model_parallel()
    finally:
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = before


SPAWN_WORLD_SIZES = [4]


def spawn_body(checks, rank: int, world: int) -> None:
    """The 4-rank world: every configuration's queries, then a bad configuration."""
    for tp, pp in SPAWNED_CONFIGS:
        checks.run(f"queries tp={tp} pp={pp}", _check_queries, rank, world, tp, pp)
    for sizes in MESH_CONFIGS:
        checks.run(f"mesh {sizes}", _check_mesh, rank, world, *sizes)
    checks.run("bad sizes", _check_bad_sizes_leave_no_state, rank, world)
    checks.run("timeouts", _check_groups_take_the_run_timeout, rank, world)


@pytest.fixture(scope="module")
def spawned(spawned_suite):
    """This module's check outcomes in the session's 4-rank world."""
    return spawned_suite[__name__][4]


@pytest.mark.parametrize("tp, pp", SPAWNED_CONFIGS)
def test_queries_match_generated_groups_on_four_ranks(spawned, tp, pp):
    """Every query (and mpu) on every rank agrees with the groups; each group communicates."""
    spawned.assert_ok(f"queries tp={tp} pp={pp}")


@pytest.mark.parametrize("sizes", MESH_CONFIGS)
def test_device_mesh_slices_are_the_groups_on_four_ranks(spawned, sizes):
    """The device meshes: every named slice is its kind of group, the accessors' groups."""
    spawned.assert_ok(f"mesh {sizes}")


def test_bad_sizes_on_four_ranks_leave_no_state(spawned):
    """initialize_model_parallel(3, 1) on 4 ranks raises the config error on every rank."""
    spawned.assert_ok("bad sizes")


def test_every_group_takes_the_run_timeout_on_four_ranks(spawned):
    """The dense and expert groups wait --distributed-timeout-minutes (issue 58)."""
    spawned.assert_ok("timeouts")


def test_spawned_body_ran_every_check(spawned):
    """Nothing escaped the checks, and no check ran that no test looks at."""
    expected = {f"queries tp={tp} pp={pp}" for tp, pp in SPAWNED_CONFIGS} | {"bad sizes"}
    expected |= {"timeouts"}
    expected |= {f"mesh {sizes}" for sizes in MESH_CONFIGS}
    assert spawned.names() == expected, spawned.per_rank[0].get(BODY)
