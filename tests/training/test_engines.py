"""The settled layout, the engine choice, the compatibility table and where the engine is
branched on (docs/architecture.md, "The layout, the engines and the compatibility table")."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess

import pytest

from megatron.compatibility import FEATURES, RunFeatures, markdown_table, refusal, zero_stages_on
from megatron.deepspeed_facts import PIPELINE_ENGINE_ZERO_STAGES
from megatron.layout import Engine, ParallelLayout, choose_engine
from megatron.training.engines import ENGINES, TrainingEngine

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layout(engine: Engine, **sizes: int) -> ParallelLayout:
    values = dict(
        engine=engine,
        world_size=1,
        tensor_parallel=1,
        sequence_parallel=False,
        pipeline_parallel=1,
        virtual_pipeline=1,
        data_parallel=1,
        expert_parallel=1,
        ulysses=1,
        zero_stage=0,
        precision="fp32",
    )
    values.update(sizes)
    values["world_size"] = (
        values["tensor_parallel"]
        * values["pipeline_parallel"]
        * values["data_parallel"]
        * values["ulysses"]
        * values.get("context_parallel", 1)
    )
    return ParallelLayout(**values)


@pytest.mark.parametrize(
    "deepspeed, no_pipeline, pp, zero, engine",
    [
        (False, False, 1, 0, Engine.PLAIN),
        (False, False, 2, 0, Engine.MEGATRON_SCHEDULES),
        (True, False, 1, 0, Engine.DEEPSPEED_PIPE),  # Megatron-DeepSpeed's default, PP 1 too
        (True, False, 1, 1, Engine.DEEPSPEED_PIPE),
        (True, False, 1, 2, Engine.DEEPSPEED),  # ZeRO-2/3 leave the pipeline engine at PP 1
        (True, False, 2, 2, Engine.DEEPSPEED_PIPE),  # ... and are refused at PP 2 (below)
        (True, True, 1, 0, Engine.DEEPSPEED),
        (True, True, 2, 0, Engine.DEEPSPEED),
    ],
)
def test_choose_engine_is_megatron_deepspeeds_rule(deepspeed, no_pipeline, pp, zero, engine):  # noqa: ANN001
    assert choose_engine(deepspeed, no_pipeline, pp, zero) is engine


def test_the_layout_is_frozen_and_checks_its_sizes() -> None:
    layout = _layout(Engine.PLAIN, tensor_parallel=2, data_parallel=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.data_parallel = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="!= world 3"):
        ParallelLayout(Engine.PLAIN, 3, 2, False, 1, 1, 1, 1, 1, 0, "fp32")
    assert layout.describe() == "TP 2 x PP 1 x DP 2, fp32 on plain"


@pytest.mark.parametrize(
    "layout, moe, line",
    [
        (_layout(Engine.PLAIN, zero_stage=1), None, "--zero-stage 1 needs --deepspeed"),
        (
            _layout(Engine.DEEPSPEED_PIPE, zero_stage=2, pipeline_parallel=2),
            None,
            "--zero-stage 2 cannot be combined with --pipeline-model-parallel-size 2: "
            "DeepSpeed's pipeline engine supports ZeRO stages 0 and 1; for ZeRO-2/3-style "
            "sharding with pipelines drop --deepspeed and add --use-distributed-optimizer",
        ),
        (
            _layout(Engine.DEEPSPEED, pipeline_parallel=2),
            None,
            "--no-pipeline-parallel with --pipeline-model-parallel-size 2 under --deepspeed",
        ),
        (
            _layout(Engine.DEEPSPEED_PIPE, pipeline_parallel=2, virtual_pipeline=2),
            None,
            "--virtual-pipeline-model-parallel-size 2: the interleaved schedule is Megatron's",
        ),
        (_layout(Engine.PLAIN, ulysses=2), None, "--ds-sequence-parallel-size 2 needs --deepspeed"),
        (
            _layout(Engine.DEEPSPEED_PIPE, ulysses=2),
            None,
            "--ds-sequence-parallel-size 2 needs --no-pipeline-parallel",
        ),
        (_layout(Engine.DEEPSPEED_PIPE), "--num-experts 4", "--num-experts 4 needs --no-pipeline"),
        (
            _layout(Engine.PLAIN, data_parallel=2, expert_parallel=2),
            "--num-experts 4",
            "--moe-expert-parallel-size 2 needs --deepspeed --no-pipeline-parallel",
        ),
        (
            _layout(Engine.MEGATRON_SCHEDULES, tensor_parallel=2, pipeline_parallel=2),
            "--num-experts 4",
            "--num-experts 4 with --tensor-model-parallel-size 2 needs --deepspeed",
        ),
    ],
)
def test_each_refusal_comes_from_the_table(layout, moe, line) -> None:  # noqa: ANN001
    found = refusal(layout, RunFeatures(moe=moe))
    assert found is not None and found.startswith(line), found
    assert "\n" not in found


def test_what_every_engine_runs_is_not_refused() -> None:
    assert all(feature.engines for feature in FEATURES)
    experts = RunFeatures(moe="--num-experts 4")
    assert refusal(_layout(Engine.DEEPSPEED, zero_stage=3, ulysses=2), experts) is None
    interleaved = _layout(Engine.MEGATRON_SCHEDULES, pipeline_parallel=2, virtual_pipeline=2)
    assert refusal(interleaved) is None
    assert refusal(_layout(Engine.PLAIN), experts) is None  # MoE at EP 1, TP 1
    assert refusal(dataclasses.replace(interleaved, virtual_pipeline=1), experts) is None


def test_the_planner_reads_zero_stages_from_the_table() -> None:
    assert zero_stages_on(Engine.PLAIN) == (0,)
    assert zero_stages_on(Engine.DEEPSPEED) == (0, 1, 2, 3)
    assert zero_stages_on(Engine.DEEPSPEED_PIPE) == PIPELINE_ENGINE_ZERO_STAGES == (0, 1)


def test_every_engine_has_one_class_with_the_whole_interface() -> None:
    assert set(ENGINES) == set(Engine)
    for engine, cls in ENGINES.items():
        assert issubclass(cls, TrainingEngine) and cls.kind is engine
        assert not getattr(cls, "__abstractmethods__", None), (cls, cls.__abstractmethods__)


def test_the_docs_table_has_a_column_per_engine_and_a_row_per_feature() -> None:
    rows = markdown_table().splitlines()
    assert len(rows) == 2 + len(FEATURES)
    assert all(row.count("|") == len(Engine) + 3 for row in rows)
    with open(os.path.join(REPO_ROOT, "docs", "arguments.md"), encoding="utf-8") as doc:
        assert markdown_table() in doc.read()


def _architecture_grep() -> str:
    with open(os.path.join(REPO_ROOT, "docs", "architecture.md"), encoding="utf-8") as doc:
        for line in doc:
            if line.startswith("    grep -rnE "):
                return line.strip()
    raise AssertionError("docs/architecture.md lost its engine-branching grep")


def test_nothing_outside_the_engines_and_the_layout_branches_on_the_engine() -> None:
    """The search docs/architecture.md shows, run as written: it must find nothing."""
    command = _architecture_grep()
    found = subprocess.run(
        ["bash", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert found.returncode == 1 and found.stdout == "", found.stdout  # grep: no match
    # The search is not vacuous: it finds the engines' own branches.
    inside = re.sub(r"\| grep -vE .*$", "", command)
    matches = subprocess.run(
        ["bash", "-c", inside], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    ).stdout
    assert "megatron/training/engines/" in matches and "megatron/arguments/" in matches
