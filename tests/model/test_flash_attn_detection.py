"""flash_attn 2 is used only when it is really there: not FlashAttention 4's namespace alone."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron.model import attention


@pytest.fixture
def packages(tmp_path, monkeypatch):  # noqa: ANN201
    """A folder on sys.path to install fake `flash_attn` packages into; forgets them after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [name for name in sys.modules if name.split(".")[0] == "flash_attn"]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [name for name in sys.modules if name.split(".")[0] == "flash_attn"]:
        del sys.modules[name]


def _on_a_hopper_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))


def test_flash_attention_4_namespace_is_not_flash_attn_2(packages, monkeypatch) -> None:
    (packages / "flash_attn" / "cute").mkdir(parents=True)  # no flash_attn/__init__.py
    (packages / "flash_attn" / "cute" / "__init__.py").write_text("")
    assert attention.flash_attn_2_version() is None
    _on_a_hopper_gpu(monkeypatch)
    assert attention.flash_attention_status() == (True, "torch SDPA flash backend")


def test_broken_flash_attn_falls_back_to_sdpa(packages, monkeypatch) -> None:
    (packages / "flash_attn").mkdir()
    (packages / "flash_attn" / "__init__.py").write_text("raise ImportError('undefined symbol')\n")
    assert attention.flash_attn_2_version() is None
    _on_a_hopper_gpu(monkeypatch)
    assert attention.flash_attention_status()[1] == "torch SDPA flash backend"


def test_flash_attn_2_is_found(packages, monkeypatch) -> None:
    (packages / "flash_attn").mkdir()
    (packages / "flash_attn" / "__init__.py").write_text(
        "__version__ = '2.8.3'\n\ndef flash_attn_func(*args, **kwargs):\n    pass\n"
    )
    assert attention.flash_attn_2_version() == "2.8.3"
    _on_a_hopper_gpu(monkeypatch)
    assert attention.flash_attention_status() == (True, "flash_attn package")
