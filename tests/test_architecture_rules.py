"""The rules of docs/architecture.md that a grep can keep: each is a search of the source.

- The model receives its process groups (`megatron.core.process_groups.ModelGroups`, passed at
  construction): nothing under megatron/model/ names `parallel_state`.
- Every process group and every FSDP2 / torch.distributed.checkpoint mesh is a slice of the one
  device mesh (`parallel_state.get_device_mesh()[name]`): nothing builds a mesh back from a
  group with `DeviceMesh.from_group`.
"""

from __future__ import annotations

import os
import re

from tests.conftest import REPO_ROOT


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


def test_the_searches_find_what_they_look_for() -> None:
    """The searches above are not vacuous: they see a planted line, and the files exist."""
    planted = {"megatron/model/x.py": "a = 1\nsize = parallel_state.get_x()\n"}
    assert lines_matching(r"parallel_state", planted) == [
        "megatron/model/x.py:2: size = parallel_state.get_x()"
    ]
    model = _python_files("megatron/model")
    assert "megatron/model/gpt_model.py" in model and len(model) > 10
    assert lines_matching(r"get_device_mesh\(\)\[", _python_files("megatron"))
