"""The tools' errors are tested as a user sees them: without MEGATRON_DEBUG_TRACEBACKS."""

from __future__ import annotations

import pytest

from tools.cli_errors import DEBUG_TRACEBACKS


@pytest.fixture(autouse=True)
def _no_debug_tracebacks(monkeypatch):
    """A developer's MEGATRON_DEBUG_TRACEBACKS=1 would turn every one-line error into a raise."""
    monkeypatch.delenv(DEBUG_TRACEBACKS, raising=False)
