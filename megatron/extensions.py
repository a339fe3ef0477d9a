"""What the base install lacks, and the fix to name: the compiled C++ extensions and the
optional packages of pyproject.toml's extras.

`pip install -e .` builds the extensions: `megatron.data.helpers` (dataset index builders) and
`megatron.tokenizer.bpe_engine` (the GPT-2 BPE encoder). A feature that needs an optional
package stops in one line that ends with `install_hint` (tests/test_base_install.py runs them
in an environment without the extras).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class ExtensionNotBuiltError(ImportError):
    """A C++ extension of this package is missing or cannot be loaded."""


def load_extension(module_name: str) -> ModuleType:
    """Import a compiled extension, or raise ExtensionNotBuiltError saying how to build it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        source = module_name.replace(".", "/") + ".cpp"
        raise ExtensionNotBuiltError(
            f"the C++ extension {module_name} (from {source}) could not be imported: {error}. "
            "Build it with `pip install -e .` from the repository root (needs a C++17 "
            "compiler and the Python headers, e.g. `apt-get install g++ python3-dev`), or "
            "run `bash scripts/setup_env.sh`."
        ) from error


def install_hint(packages: str, extra: str) -> str:
    """How to install an optional dependency: `pip install {packages} (or pip install -e
    '.[{extra}]')`, `extra` one of pyproject.toml's optional-dependencies."""
    return f"pip install {packages} (or pip install -e '.[{extra}]')"
