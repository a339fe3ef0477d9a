"""Every refusal of the form "this engine (at this ZeRO stage, with this sharding) cannot run
this" is a row of `megatron.compatibility.FEATURES`, and nowhere else.

The search: no `raise ArgumentError` in megatron/ outside compatibility.py sits under a
condition that reads the engine (an enclosing `if`/`while` test, or the test of an earlier
`if ...: return` in an enclosing block; a name assigned from such a read counts as one). Then
each refusal that moved into the table still reads word for word as before, and still wins
over (or loses to) the same other refusals: validation checks the table in steps, where those
refusals stood.
"""

from __future__ import annotations

import ast
import json
import os
import re

import pytest

from megatron.arguments import ArgumentError, build_parser, typed_flags, validate_args
from megatron.deepspeed_facts import UnsupportedByDeepSpeed
from tests.conftest import REPO_ROOT

# What reads the engine: its enum, the layout's field, the functions that choose it, and
# the flag that picks DeepSpeed's engines.
ENGINE_READS = re.compile(
    r"\bEngine\.|\.engine\b|\bengine_of\(|\bchoose_engine\(|\buses_deepspeed\b|\bcuts_stages\b"
    r"|\bargs\.deepspeed\b"
)
# Refusals that read the engine and are not the table's, each with why.
NOT_THE_TABLES = {
    "megatron/arguments/precision.py:check_precision_on_this_machine": (
        "what this machine's DeepSpeed accelerator supports (fp16/bf16): a fact of the "
        "device found at start-up, not of the engine"
    ),
}
# Statements that end a branch early, so that what follows it runs only on the other one.
_EXITS = (ast.Return, ast.Continue, ast.Break)


def _reads_engine(node: ast.AST, tainted: set[str]) -> bool:
    names = {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}
    return bool(ENGINE_READS.search(ast.unparse(node))) or bool(names & tainted)


def _tainted_names(function: ast.AST) -> set[str]:
    """Local names assigned (directly or through each other) from a read of the engine."""
    tainted: set[str] = set()
    grown = True
    while grown:
        grown = False
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if not _reads_engine(value, tainted):
                continue
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id not in tainted:
                        tainted.add(name.id)
                        grown = True
    return tainted


def _is_argument_error(node: ast.Raise) -> bool:
    exception = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    if isinstance(exception, ast.Attribute):
        return exception.attr == "ArgumentError"
    return isinstance(exception, ast.Name) and exception.id == "ArgumentError"


def _scan(body: list[ast.stmt], guards: list[ast.expr], tainted: set[str], found: list) -> int:
    """Append each guarded `raise ArgumentError` line of `body` to `found`; return how many
    `raise ArgumentError` it holds."""
    guards, raises = list(guards), 0
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # scanned as a function of its own
        if isinstance(statement, ast.Raise) and statement.exc is not None:
            if _is_argument_error(statement):
                raises += 1
                if any(_reads_engine(guard, tainted) for guard in guards):
                    found.append(statement.lineno)
            continue
        test = statement.test if isinstance(statement, (ast.If, ast.While)) else None
        inner = guards + ([test] if test is not None else [])
        for _, value in ast.iter_fields(statement):
            if not isinstance(value, list):
                continue
            for handler in value:
                if isinstance(handler, ast.excepthandler):
                    raises += _scan(handler.body, inner, tainted, found)
            statements = [item for item in value if isinstance(item, ast.stmt)]
            raises += _scan(statements, inner, tainted, found)
        branches = (statement.body, statement.orelse) if isinstance(statement, ast.If) else ()
        if any(branch and isinstance(branch[-1], _EXITS) for branch in branches):
            guards.append(statement.test)  # what follows runs only on the other branch
    return raises


def engine_conditioned_raises(source: str, path: str) -> tuple[list[str], int]:
    """(`path:function` at each engine-conditioned `raise ArgumentError`, how many raises of
    ArgumentError the source holds in functions)."""
    found, raises = [], 0
    for function in ast.walk(ast.parse(source, filename=path)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines: list[int] = []
            raises += _scan(function.body, [], _tainted_names(function), lines)
            found += [f"{path}:{function.name}"] * len(lines)
    return found, raises


def _megatron_sources() -> dict[str, str]:
    sources = {}
    for folder, _, files in os.walk(os.path.join(REPO_ROOT, "megatron")):
        for name in sorted(files):
            path = os.path.relpath(os.path.join(folder, name), REPO_ROOT).replace(os.sep, "/")
            if name.endswith(".py") and path != "megatron/compatibility.py":
                with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as file:
                    sources[path] = file.read()
    return sources


def test_no_flag_check_outside_the_table_refuses_by_engine() -> None:
    found, raises, written = [], 0, 0
    for path, source in _megatron_sources().items():
        hits, count = engine_conditioned_raises(source, path)
        found += hits
        raises += count
        written += len(re.findall(r"raise (?:errors\.)?ArgumentError\b", source))
    assert raises == written > 150  # the search reached every raise the flag checks write
    assert sorted(set(found)) == sorted(NOT_THE_TABLES), found


PLANTED = """
def direct(args):
    if args.decoupled_lr is not None and args.deepspeed:
        raise ArgumentError("refused")


def after_an_early_return(args):
    if args.optimizer != "muon" or not args.layout.engine.uses_deepspeed:
        return
    if args.ckpt_format == "torch_dist":
        raise ArgumentError("refused")


def through_a_name(args):
    layout = args.layout
    on_pipe = layout.engine is Engine.DEEPSPEED_PIPE
    for flag in ("a", "b"):
        if on_pipe:
            raise errors.ArgumentError(flag)


def in_the_else(args):
    if engine_of(args) is Engine.PLAIN:
        pass
    else:
        raise ArgumentError("refused")


def not_the_engine(args):
    if args.deepspeed:
        args.zero_stage = args.zero_stage or 0
    if args.lr < 0:
        raise ArgumentError("a value out of range")
    if args.layout.engine is Engine.PLAIN:
        raise ValueError("not a flag refusal")
"""


def test_the_search_finds_planted_engine_refusals() -> None:
    found, raises = engine_conditioned_raises(PLANTED, "planted.py")
    assert found == [
        "planted.py:direct",
        "planted.py:after_an_early_return",
        "planted.py:through_a_name",
        "planted.py:in_the_else",
    ]
    assert raises == 5


BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --train-iters 10 --lr 1e-3"
)
# DeepSpeed's Muon's update as Megatron-LM flags (megatron.arguments.muon_flags.DEEPSPEED_MUON).
DEEPSPEED_MUON = (
    "--muon-nesterov --muon-coefficient-type simple --muon-scale-mode shape_scaling "
    "--muon-no-split-qkv --clip-grad 0"
)
SHARDING_ON_DEEPSPEED = (
    "{flag} with --deepspeed: DeepSpeed shards with ZeRO (--zero-stage 1-3); drop {flag}, or "
    "drop --deepspeed for torch FSDP2"
)
SHARDED_EXPERTS = (
    "{flag} with --num-experts 4: FSDP2 over expert layers is not built here; use --deepspeed "
    "--no-pipeline-parallel with ZeRO"
)
DECOUPLED_LR = (
    "--decoupled-lr 0.0005 with --deepspeed: a learning rate of the input and output layers' "
    "own runs on the plain engine and Megatron's schedules here"
)
PER_TOKEN_LOSS = (
    "--calculate-per-token-loss with --deepspeed: the per-token normalisation divides the "
    "reduced gradients by the global batch's token count, which DeepSpeed's engine does not "
    "expose before its step; it runs on the plain engine and Megatron's schedules (drop "
    "--deepspeed)"
)
MUON_TORCH_DIST = (
    "--optimizer muon --ckpt-format torch_dist with --deepspeed: the DeepSpeed torch_dist "
    "writer saves Adam's moments only; use --ckpt-format torch"
)
MUON_FLAGS = (
    "--optimizer muon at fp32 ZeRO-{zero} (DeepSpeedZeroOptimizer) runs DeepSpeed's Muon, whose "
    "update is Megatron-LM's only with {needed}; add them, or use fp32 ZeRO-0 or drop "
    "--deepspeed (Megatron-LM's Muon with any --muon-* flags)"
)
TORCH_DIST_ON_PIPE = (
    "{flag} torch_dist with DeepSpeed's pipeline engine: not built; add --no-pipeline-parallel "
    "(PP = 1), or run the pipeline without --deepspeed (Megatron's schedules)"
)
TORCH_DIST_AT_ZERO0 = (
    "--ckpt-format torch_dist with --deepspeed {precision} at ZeRO stage 0: DeepSpeed's "
    "FP16_UnfusedOptimizer keeps its fp32 copies where its per-parameter accessors do not "
    "reach; use ZeRO stage 1-3 (or fp32)"
)


def validated(extra: str, world_size: int = 4):
    argv = (BASE + " " + extra).split()
    parser = build_parser()
    return validate_args(parser.parse_args(argv), world_size, typed_flags(parser, argv))


@pytest.fixture
def places(tmp_path) -> dict[str, str]:
    """A checkpoint to convert, where to write it, and DeepSpeed configs."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    accumulate_fp16 = tmp_path / "accumulate_fp16.json"
    accumulate_fp16.write_text(json.dumps({"data_types": {"grad_accum_dtype": "fp16"}}))
    return dict(run=str(run), out=str(tmp_path / "out"), fp16_accumulation=str(accumulate_fp16))


@pytest.mark.parametrize(
    "flags, message",
    [
        # sharded data parallelism (torch FSDP2), checked as settle_sharding settles it: before
        # --grad-reduce-in-bf16's and the checkpoint flags' checks, and the layout's rows.
        (
            "--deepspeed --use-distributed-optimizer",
            SHARDING_ON_DEEPSPEED.format(flag="--use-distributed-optimizer"),
        ),
        (
            "--deepspeed --no-pipeline-parallel --use-torch-fsdp2",
            SHARDING_ON_DEEPSPEED.format(flag="--use-torch-fsdp2"),
        ),
        (
            "--deepspeed --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",
            SHARDING_ON_DEEPSPEED.format(flag="--use-megatron-fsdp"),
        ),
        (
            "--deepspeed --use-distributed-optimizer --grad-reduce-in-bf16 --async-save",
            SHARDING_ON_DEEPSPEED.format(flag="--use-distributed-optimizer"),
        ),
        (
            "--deepspeed --pipeline-model-parallel-size 2 --zero-stage 2 "
            "--use-distributed-optimizer",
            SHARDING_ON_DEEPSPEED.format(flag="--use-distributed-optimizer"),
        ),
        # sharded data parallelism of DeepSpeed-MoE layers: after the layout's other rows,
        # before the MoE flags' own checks.
        (
            "--use-distributed-optimizer --num-experts 4",
            SHARDED_EXPERTS.format(flag="--use-distributed-optimizer"),
        ),
        (
            "--use-torch-fsdp2 --num-experts 4 --topk 3",
            SHARDED_EXPERTS.format(flag="--use-torch-fsdp2"),
        ),
        (
            "--use-distributed-optimizer --num-experts 4 --tensor-model-parallel-size 2",
            "--num-experts 4 with --tensor-model-parallel-size 2 needs --deepspeed "
            "--no-pipeline-parallel: each tensor-parallel rank's experts take 1/TP of the "
            "tokens, and only DeepSpeed's engine sums their gradients over those ranks",
        ),
        # --decoupled-lr and --calculate-per-token-loss: with the housekeeping flags, after the
        # profiling window's check and the MoE flags', before --manual-gc-interval's.
        ("--deepspeed --decoupled-lr 5e-4", DECOUPLED_LR),
        ("--deepspeed --decoupled-lr 5e-4 --manual-gc-interval -1", DECOUPLED_LR),
        (
            "--deepspeed --decoupled-lr 5e-4 --profile --profile-step-start 5 --profile-step-end 2",
            "--profile-step-end 2 is before --profile-step-start 5",
        ),
        (
            "--deepspeed --no-pipeline-parallel --decoupled-lr 5e-4 --num-experts 4 --topk 3",
            "--topk 3: DeepSpeed-MoE routes to 1 or 2 experts",
        ),
        ("--deepspeed --calculate-per-token-loss", PER_TOKEN_LOSS),
        ("--deepspeed --decoupled-lr 5e-4 --calculate-per-token-loss", DECOUPLED_LR),
        # The Muon and torch_dist rows: last, once DeepSpeed's optimizer wrapper is settled.
        ("--deepspeed --optimizer muon --ckpt-format torch_dist", MUON_TORCH_DIST),
        (
            "--deepspeed --no-pipeline-parallel --optimizer muon --load {run} "
            "--ckpt-convert-format torch_dist --ckpt-convert-save {out}",
            MUON_TORCH_DIST.replace("--ckpt-format", "--ckpt-convert-format"),
        ),
        (
            "--deepspeed --optimizer muon --ckpt-format torch_dist --calculate-per-token-loss",
            PER_TOKEN_LOSS,
        ),
        (
            "--deepspeed --no-pipeline-parallel --zero-stage 1 --decoupled-lr 5e-4 "
            "--optimizer muon",
            DECOUPLED_LR,
        ),
        (
            "--deepspeed --no-pipeline-parallel --zero-stage 1 --bf16 --optimizer muon "
            "--num-experts 4 --moe-router-topk 2",
            "--optimizer muon at bf16 ZeRO-1 (BF16_Optimizer) with Megatron-LM's MoE: "
            "DeepSpeed's Muon would orthogonalize the stacked experts transposed; use fp32 "
            "ZeRO-0 or drop --deepspeed",
        ),
        (
            f"--deepspeed --zero-stage 1 --bf16 --optimizer muon {DEEPSPEED_MUON}",
            "--optimizer muon at bf16 ZeRO-1 (BF16_Optimizer): DeepSpeed's BF16_Optimizer runs "
            "Muon only without a model-parallel unit, which both its engines pass; use ZeRO-2, "
            "or ZeRO-0 with --no-pipeline-parallel",
        ),
        (
            f"--deepspeed --no-pipeline-parallel --zero-stage 3 --optimizer muon {DEEPSPEED_MUON}",
            "--optimizer muon at fp32 ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): DeepSpeed's ZeRO-3 "
            'runs Muon only with "zero_optimization": {"reduce_scatter": false} in '
            "--deepspeed_config",
        ),
        (
            "--deepspeed --no-pipeline-parallel --zero-stage 1 --optimizer muon",
            MUON_FLAGS.format(
                zero=1,
                needed="--clip-grad 0 --muon-nesterov --muon-coefficient-type simple "
                "--muon-scale-mode shape_scaling --muon-no-split-qkv",
            ),
        ),
        (
            f"--deepspeed --no-pipeline-parallel --zero-stage 2 --optimizer muon {DEEPSPEED_MUON} "
            "--tensor-model-parallel-size 2",
            MUON_FLAGS.format(zero=2, needed="--muon-tp-mode blockwise"),
        ),
        ("--deepspeed --ckpt-format torch_dist", TORCH_DIST_ON_PIPE.format(flag="--ckpt-format")),
        (
            "--deepspeed --load {run} --ckpt-convert-format torch_dist --ckpt-convert-save {out}",
            TORCH_DIST_ON_PIPE.format(flag="--ckpt-convert-format"),
        ),
        (
            "--deepspeed --no-pipeline-parallel --bf16 --ckpt-format torch_dist",
            TORCH_DIST_AT_ZERO0.format(precision="bf16"),
        ),
        (
            "--deepspeed --no-pipeline-parallel --fp16 --ckpt-format torch_dist",
            TORCH_DIST_AT_ZERO0.format(precision="fp16"),
        ),
        (
            "--deepspeed --no-pipeline-parallel --bf16 --optimizer muon --ckpt-format torch_dist "
            "--deepspeed_config {fp16_accumulation}",
            MUON_TORCH_DIST,
        ),
    ],
)
def test_each_moved_refusal_reads_as_before(flags: str, message: str, places) -> None:
    with pytest.raises(ArgumentError) as refused:
        validated(flags.format(**places))
    assert str(refused.value) == message


def test_what_deepspeed_refuses_itself_is_left_to_it(places) -> None:
    """A precision mix DeepSpeed refuses: torch_dist's row leaves it to DeepSpeed's own words;
    Muon's rows, which need the wrapper, stop with them (as before the rows moved here)."""
    config = f"--deepspeed_config {places['fp16_accumulation']}"
    flags = f"--deepspeed --no-pipeline-parallel --bf16 {config}"
    assert validated(f"{flags} --ckpt-format torch_dist").ckpt_format == "torch_dist"
    with pytest.raises(UnsupportedByDeepSpeed) as refused:
        validated(f"{flags} --optimizer muon")
    assert str(refused.value) == (
        "DeepSpeed 0.19.8 at ZeRO stage 0 accumulates bf16 gradients in bf16 only "
        "(data_types.grad_accum_dtype fp16)"
    )


@pytest.mark.parametrize(
    "flags",
    [
        "--use-distributed-optimizer --decoupled-lr 5e-4 --calculate-per-token-loss",
        "--pipeline-model-parallel-size 2 --optimizer muon --ckpt-format torch_dist",
        "--deepspeed --no-pipeline-parallel --zero-stage 3 --ckpt-format torch_dist --bf16",
        "--deepspeed --no-pipeline-parallel --zero-stage 0 --optimizer muon --bf16",
        "--deepspeed --no-pipeline-parallel --num-experts 4 --zero-stage 1",
    ],
)
def test_what_the_engines_run_is_accepted(flags: str) -> None:
    assert validated(flags).layout is not None
