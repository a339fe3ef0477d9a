"""The compiled dataset helpers (`megatron.data.helpers`, from helpers.cpp)."""

from __future__ import annotations

from types import ModuleType

from megatron.extensions import ExtensionNotBuiltError, load_extension

HelpersNotBuiltError = ExtensionNotBuiltError


def load_helpers() -> ModuleType:
    """Return the helpers module, or raise HelpersNotBuiltError naming the fix."""
    return load_extension("megatron.data.helpers")
