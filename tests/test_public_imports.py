"""The import paths users' Megatron-DeepSpeed scripts use keep working, whichever comes first.

Each statement runs with no megatron module loaded yet (a fresh start for megatron; torch and
DeepSpeed stay loaded, so one interpreter does them all), because an import circle only shows
when a particular module is imported first.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO_ROOT

# statement -> {name it binds: the module that must define it}
PUBLIC_PATHS = {
    "from megatron.training import pretrain": {"pretrain": "megatron.training.training"},
    "from megatron.training import setup_model_and_optimizer": {
        "setup_model_and_optimizer": "megatron.training.training"
    },
    "from megatron.checkpointing import save_checkpoint, load_checkpoint": {
        "save_checkpoint": "megatron.checkpointing.save_load",
        "load_checkpoint": "megatron.checkpointing.save_load",
    },
    "from megatron.arguments import parse_args": {"parse_args": "megatron.arguments.parser"},
    "from megatron.initialize import initialize_megatron": {
        "initialize_megatron": "megatron.initialize"
    },
    "from megatron.core import parallel_state, tensor_parallel": {
        "parallel_state": "megatron.core.parallel_state",
        "tensor_parallel": "megatron.core.tensor_parallel",
    },
}

_PROBE = """
import json, sys, types
import torch, deepspeed  # the heavy third-party imports, loaded once
results = {}
for statement in json.loads(sys.argv[1]):
    for name in [name for name in sys.modules if name.split(".")[0] == "megatron"]:
        del sys.modules[name]
    scope = {}
    try:
        exec(statement, scope)
    except Exception as error:  # report every failing path, not only the first
        results[statement] = f"{type(error).__name__}: {error}"
        continue
    results[statement] = {
        name: value.__name__ if isinstance(value, types.ModuleType) else value.__module__
        for name, value in scope.items() if name != "__builtins__"
    }
print(json.dumps(results))
"""


def test_megatron_deepspeed_import_paths_work_first() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(PUBLIC_PATHS))],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == PUBLIC_PATHS
