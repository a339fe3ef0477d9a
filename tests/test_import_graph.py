"""The import graph of megatron/: no circles, and every import points down the layers.

The graph is read from the source with `ast`: every `import` and `from ... import` statement,
at module level or inside a function (a deferred import is still a dependency), and every
`importlib.import_module("megatron...")` with a literal name. `from package import name` is
an edge to the submodule when `name` is one, else to the package's `__init__`.

The layers, top to bottom (docs/architecture.md says what each owns). A module may import its
own package, or any package of a lower layer; nothing else:

- entry: `pretrain()` (`megatron.training.training`, and the `megatron.training` namespace
  that exports it), `megatron.doctor`, `megatron.text_generation`: they run the program.
- initialize: `megatron.initialize`, which parses the flags and starts torch.distributed, and
  `megatron.dry_run`, which parses them and plans the job instead.
- arguments: `megatron.arguments.*`: parser, validation, ds_config (it checks the flags with
  the training schedules, so it sits above them).
- training: the rest of `megatron.training.*`: loop, steps, optimizer, schedules, monitor.
- checkpointing, planning: `megatron.checkpointing.*`, and `megatron.planning.*` (the
  `--dry-run` model, which reads the validated flags).
- model, data: `megatron.model.*`, `megatron.data.*`.
- tokenizer: `megatron.tokenizer.*` (the data tools encode with it).
- core: `megatron.core.*`.
- base: `megatron` itself, `config`, `layout`, `settled_args`, `utils`, `atomic_files`,
  `extensions`, `deepspeed_facts`: import nothing of megatron but the config parts.
- config parts: `deepseek_config`, `moe_config` and `yarn_config` (the typed DeepSeek, MoE
  and YaRN options `config` holds): nothing.

Parts that share a layer (model and data; the entry points; the base modules) do not import
each other.
"""

from __future__ import annotations

import ast
import os

from tests.conftest import REPO_ROOT

MEGATRON_DIR = os.path.join(REPO_ROOT, "megatron")

# (layer name, packages or modules in it); a module belongs to the first entry it matches.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "entry",
        (
            "megatron.training.training",
            "megatron.doctor",
            "megatron.text_generation",
        ),
    ),
    ("initialize", ("megatron.initialize", "megatron.dry_run")),
    ("arguments", ("megatron.arguments",)),
    ("training", ("megatron.training",)),
    ("checkpointing, planning", ("megatron.checkpointing", "megatron.planning")),
    ("model, data", ("megatron.model", "megatron.data")),
    ("tokenizer", ("megatron.tokenizer",)),
    ("core", ("megatron.core",)),
    ("compatibility", ("megatron.compatibility",)),
    (
        "base",
        (
            "megatron.config",
            "megatron.layout",
            "megatron.settled_args",
            "megatron.deepspeed_facts",
            "megatron.utils",
            "megatron.atomic_files",
            "megatron.extensions",
        ),
    ),
    ("config parts", ("megatron.deepseek_config", "megatron.moe_config", "megatron.yarn_config")),
)
# The package namespaces that only re-export: `megatron` holds the version, and
# `megatron.training` resolves `pretrain` and its siblings from megatron.training.training.
NAMESPACE_LAYER = {"megatron": "base", "megatron.training": "entry"}
# Code above megatron, which megatron must never import.
OUTSIDE = ("tools", "tests", "pretrain_gpt", "finetune_llama", "benchmarks")


def megatron_modules() -> dict[str, str]:
    """Dotted name -> file path for every module under megatron/."""
    modules = {}
    for folder, _, files in os.walk(MEGATRON_DIR):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, REPO_ROOT)[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    """The modules one import statement (or import_module call) depends on."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        found = [f"{base}.{alias.name}" for alias in node.names]
        return [name if name in modules else base for name in found]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def import_graph() -> dict[str, set[str]]:
    """Module -> the megatron modules (and outside top-level names) it imports."""
    modules = megatron_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), filename=path)
        is_package = path.endswith("__init__.py")
        edges: set[str] = set()
        for node in ast.walk(tree):
            for target in _targets(node, module, is_package, modules):
                top = target.split(".")[0]
                if top in OUTSIDE:
                    edges.add(target)
                elif top == "megatron":
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target != module:
                        edges.add(target)
        graph[module] = edges
    return graph


def layer_of(module: str) -> int | None:
    """Index into LAYERS (0 = top) of a megatron module, or None if no layer claims it."""
    names = [name for name, _ in LAYERS]
    if module in NAMESPACE_LAYER:
        return names.index(NAMESPACE_LAYER[module])
    for index, (_, members) in enumerate(LAYERS):
        if any(module == member or module.startswith(member + ".") for member in members):
            return index
    return None


def _package(module: str) -> str:
    """The part a module belongs to: its layer member (`megatron.model`, `megatron.config`...)."""
    for _, members in LAYERS:
        for member in members:
            if module == member or module.startswith(member + "."):
                return member
    return module


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each import circle once, as `a -> b -> a`."""
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycle = stack[stack.index(target) :] + [target]
                cycles.append(" -> ".join(cycle))
            elif target in graph and target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def direction_errors(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer, across a sibling package, or out to tools/tests."""
    errors = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        if here is None:
            errors.append(f"{module}: in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        for target in sorted(targets):
            if target.split(".")[0] in OUTSIDE:
                errors.append(f"{module} imports {target}: megatron never imports code above it")
                continue
            there = layer_of(target)
            if there is None:
                continue  # reported as a module of its own
            if there < here:
                errors.append(f"{module} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})")
            elif there == here and _package(module) != _package(target):
                if module not in NAMESPACE_LAYER:
                    errors.append(f"{module} imports its sibling part {target}")
    return errors


def test_megatron_has_no_import_circles() -> None:
    graph = import_graph()
    assert "megatron.training.loop" in graph and graph["megatron.training.loop"]  # read it all
    assert find_cycles(graph) == []


def test_every_import_points_down_the_layers() -> None:
    assert direction_errors(import_graph()) == []


def test_the_checks_catch_a_circle_and_an_upward_import() -> None:
    # The two circles this layout removed, and an import against the direction.
    circles = {
        "megatron.arguments.validation": {"megatron.arguments.ds_config"},
        "megatron.arguments.ds_config": {"megatron.arguments.validation"},
    }
    assert find_cycles(circles) == [
        "megatron.arguments.ds_config -> megatron.arguments.validation -> "
        "megatron.arguments.ds_config"
    ]
    upward = {
        "megatron.checkpointing.save_load": {"megatron.training.loop", "megatron.core"},
        "megatron.model.gpt_model": {"megatron.data.gpt_dataset"},
        "megatron.core.parallel_state": {"tools.checkpoint.reshard"},
        "megatron.new_module": set(),
    }
    assert direction_errors(upward) == [
        "megatron.checkpointing.save_load (checkpointing, planning) imports "
        "megatron.training.loop (training)",
        "megatron.core.parallel_state imports tools.checkpoint.reshard: megatron never imports "
        "code above it",
        "megatron.model.gpt_model imports its sibling part megatron.data.gpt_dataset",
        "megatron.new_module: in no layer (add it to LAYERS and docs/architecture.md)",
    ]


def test_deferred_and_importlib_imports_are_edges() -> None:
    graph = import_graph()
    # megatron/training/__init__.py resolves pretrain with importlib on first use.
    assert graph["megatron.training"] == {"megatron.training.training"}
    # save_load imports the DeepSpeed side inside functions (DeepSpeed loads only when used).
    assert "megatron.checkpointing.deepspeed_engine" in graph["megatron.checkpointing.save_load"]
