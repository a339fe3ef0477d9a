"""The rules of docs/architecture.md that a grep can keep: each is a search of the source.

- The model receives its process groups (`megatron.core.process_groups.ModelGroups`, passed at
  construction): nothing under megatron/model/ names `parallel_state`.
- Every process group and every FSDP2 / torch.distributed.checkpoint mesh is a slice of the one
  device mesh (`parallel_state.mesh_slice(name)`): nothing builds a mesh back from a
  group with `DeviceMesh.from_group`.
- `validate_args` returns the settled run, read-only: no code past megatron/arguments/ assigns
  an attribute of `args`, and the namespace itself refuses it.
- Run state belongs to the run: no module holds an instance of one of megatron's classes at
  module level (the MoE loss tracker is the model's, the background save the engine's), but
  for the two named here with the reason.
"""

from __future__ import annotations

import ast
import os
import pickle
import re

import pytest

from megatron.arguments import parse_args
from megatron.checkpointing.file_format import plain_args
from megatron.settled_args import SettledArgs, SettledArgsError, with_settled
from tests.conftest import REPO_ROOT

FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 100"
).split()


def _python_files(*folders: str) -> dict[str, str]:
    """Path (relative to the repository) -> text of every .py file under `folders`."""
    found = {}
    for folder in folders:
        for root, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8") as file:
                        found[os.path.relpath(path, REPO_ROOT)] = file.read()
    return found


def lines_matching(pattern: str, files: dict[str, str]) -> list[str]:
    """`path:line: text` of every line of `files` that `pattern` (a regex) matches."""
    regex = re.compile(pattern)
    return [
        f"{path}:{number}: {line.strip()}"
        for path, text in files.items()
        for number, line in enumerate(text.splitlines(), start=1)
        if regex.search(line)
    ]


def test_the_model_never_reaches_for_parallel_state() -> None:
    """Layers take their groups from the `ModelGroups` they are built with."""
    assert lines_matching(r"parallel_state", _python_files("megatron/model")) == []


def test_no_mesh_is_rebuilt_from_a_process_group() -> None:
    """FSDP2's and DCP's meshes are named slices of the run's device mesh."""
    files = _python_files("megatron", "tools", "benchmarks")
    assert lines_matching(r"\bfrom_group\(", files) == []


def test_no_code_past_validation_assigns_to_args() -> None:
    """Only megatron/arguments/ (which builds the namespace) assigns `args.name`; a copy made
    to be saved (`saved_args`) and the tools' own parsers are other namespaces."""
    files = _python_files("megatron", "tools", "benchmarks")
    files["pretrain_gpt.py"] = open(os.path.join(REPO_ROOT, "pretrain_gpt.py")).read()
    files["finetune_llama.py"] = open(os.path.join(REPO_ROOT, "finetune_llama.py")).read()
    outside = {
        path: text for path, text in files.items() if not path.startswith("megatron/arguments/")
    }
    found = lines_matching(
        r"(?<![\w.])(self\.)?args\.\w+ *(\+|-|\*)?= |setattr\((self\.)?args,", outside
    )
    # The tools' own argparse namespaces, before any validation.
    allowed = (
        "tools/preprocess_data.py:",
        "tools/files_to_jsonl.py:",
        "benchmarks/fp8_throughput.py:",
        "megatron/tokenizer/tokenizer.py:",
    )  # Megatron's build_tokenizer(args) API
    assert [line for line in found if not line.startswith(allowed)] == []


def test_the_settled_args_refuse_every_change() -> None:
    """parse_args returns a read-only namespace; with_settled makes a new one, the old one
    unchanged; pickling and the checkpoint's plain copy still work."""
    args = parse_args(FLAGS)
    assert isinstance(args, SettledArgs)
    with pytest.raises(SettledArgsError, match=r"args\.lr cannot be set after validate_args"):
        args.lr = 1.0
    with pytest.raises(SettledArgsError, match=r"args\.new_name cannot be set"):
        args.new_name = 1
    with pytest.raises(SettledArgsError, match=r"args\.lr cannot be deleted"):
        del args.lr
    assert args.lr == 1e-3
    later = with_settled(args, padded_vocab_size=128, lr=2e-3)
    assert isinstance(later, SettledArgs) and later.lr == 2e-3 and later.padded_vocab_size == 128
    assert args.lr == 1e-3 and not hasattr(args, "padded_vocab_size")
    assert vars(pickle.loads(pickle.dumps(later))) == vars(later)
    assert type(plain_args(later)).__name__ == "Namespace"  # what checkpoints save


PROCESS_WIDE = {
    # Timers(0) records nothing: the steps' default when no timers are given.
    ("megatron/training/step.py", "_NO_TIMERS"),
    # The model-parallel RNG streams fork the process's own generators (Megatron's tracker).
    ("megatron/core/tensor_parallel/random.py", "_TRACKER"),
}


def module_level_instances(files: dict[str, str]) -> set[tuple[str, str]]:
    """(path, name) of each module-level `NAME = SomeClass(...)` whose class is defined in
    `files`."""
    trees = {path: ast.parse(text) for path, text in files.items()}
    classes = {node.name for tree in trees.values() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)}  # fmt: skip
    found = set()
    for path, tree in trees.items():
        for node in tree.body:
            value = getattr(node, "value", None)
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(value, ast.Call):
                continue
            called = getattr(value.func, "id", getattr(value.func, "attr", None))
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if called in classes:
                found |= {(path, target.id) for target in targets if isinstance(target, ast.Name)}
    return found


def test_run_state_is_not_held_by_modules() -> None:
    """No process-wide singleton carries a run's state (see PROCESS_WIDE for the two kept)."""
    assert module_level_instances(_python_files("megatron")) == PROCESS_WIDE


def test_the_searches_find_what_they_look_for() -> None:
    """The searches above are not vacuous: they see a planted line, and the files exist."""
    planted = {"megatron/model/x.py": "a = 1\nsize = parallel_state.get_x()\n"}
    assert lines_matching(r"parallel_state", planted) == [
        "megatron/model/x.py:2: size = parallel_state.get_x()"
    ]
    model = _python_files("megatron/model")
    assert "megatron/model/gpt_model.py" in model and len(model) > 10
    assert lines_matching(r"mesh_slice\(\"dp_cp\"\)", _python_files("megatron"))
    tracker = "class Tracker:\n    pass\n\n\nTRACKER = Tracker()\nOTHER = dict()\n"
    assert module_level_instances({"megatron/x.py": tracker}) == {("megatron/x.py", "TRACKER")}
    planted = {"megatron/training/x.py": "    self.args.lr = 1\n    args.save += 'x'\n"}
    assert len(lines_matching(r"(?<![\w.])(self\.)?args\.\w+ *(\+|-|\*)?= ", planted)) == 2
