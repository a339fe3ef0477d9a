"""Tests for `python -m megatron.doctor`: the report on this machine, and its FAIL paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron import doctor
from tests.conftest import REPO_ROOT

CHECK_NAMES = [
    "python",
    "torch",
    "cuda",
    "nccl",
    "deepspeed",
    "helpers",
    "bpe_engine",
    "flash_attn",
    "tiktoken",
    "gpt2 vocab",
    "hf export",
    "wandb",
    "tensorboard",
]


@pytest.fixture(scope="module")
def reports() -> dict[str, tuple[int, str, str]]:
    """`python -m megatron.doctor` and `... --json` from the repository root, run side by side.

    Maps "text" and "json" to (exit status, stdout, stderr).
    """
    processes = {
        kind: subprocess.Popen(
            [sys.executable, "-m", "megatron.doctor", *args],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kind, args in (("text", []), ("json", ["--json"]))
    }
    outputs = {kind: process.communicate(timeout=120) for kind, process in processes.items()}
    return {kind: (processes[kind].returncode, *outputs[kind]) for kind in processes}


@pytest.fixture(scope="module")
def json_results(reports) -> list[dict]:
    """The doctor's --json report on this machine (stdout must be pure JSON)."""
    returncode, stdout, stderr = reports["json"]
    assert returncode == 0, stdout + stderr
    return json.loads(stdout)


def test_report_lists_every_check_and_exits_0(reports):
    returncode, stdout, stderr = reports["text"]
    assert returncode == 0, stdout + stderr
    lines = stdout.splitlines()
    assert len(lines) == len(CHECK_NAMES) + 2, stdout
    assert lines[0].startswith("megatron doctor")
    for name, line in zip(CHECK_NAMES, lines[1:]):
        status = line.split()[0]
        assert status in ("OK", "WARN"), line
        assert line[2:].startswith(f"{status:<5} {name:<14} "), line
    assert lines[-1].startswith("all required checks passed"), stdout


def test_json_report(json_results):
    assert [result["name"] for result in json_results] == CHECK_NAMES
    assert set(json_results[0]) == {"name", "status", "detail", "fix"}
    status = {result["name"]: result["status"] for result in json_results}
    for name in ("python", "torch", "deepspeed", "helpers", "bpe_engine", "gpt2 vocab"):
        assert status[name] == "OK", json_results
    assert "FAIL" not in status.values()
    if not torch.cuda.is_available():
        cuda = json_results[CHECK_NAMES.index("cuda")]
        assert cuda["status"] == "WARN"
        assert cuda["detail"].startswith("no CUDA GPU: training runs on CPU over gloo")
        assert status["flash_attn"] == "WARN"


def test_import_is_cheap():
    code = "import sys, megatron.doctor; print(sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "[]"


def test_missing_optional_package_is_a_warning_with_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise
    result = doctor.check_tiktoken()
    assert (result.name, result.status) == ("tiktoken", "WARN")
    assert "pip install tiktoken" in result.fix


def test_missing_extension_fails_with_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.data.helpers", None)
    result = doctor.check_helpers()
    assert (result.name, result.status) == ("helpers", "FAIL")
    assert "megatron.data.helpers" in result.detail
    assert "pip install -e ." in result.fix


def test_missing_deepspeed_fails_with_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    result = doctor.check_deepspeed()
    assert (result.status, result.fix) == ("FAIL", "pip install deepspeed")


def test_missing_vocab_fails_with_fix(monkeypatch, tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.setattr(doctor, "REPO_ROOT", str(tmp_path))
    result = doctor.check_vocab()
    assert result.status == "FAIL"
    assert result.fix == "bash dataset/download_vocab.sh"


def test_a_raising_check_becomes_a_fail():
    @doctor._check("broken")
    def check_broken() -> doctor.CheckResult:
        raise ValueError("something went wrong\nsecond line")

    doctor.CHECKS.remove(check_broken)  # registered by the decorator; keep CHECKS as shipped
    result = check_broken()
    assert (result.name, result.status) == ("broken", "FAIL")
    assert result.detail == "ValueError: something went wrong"


def test_main_returns_1_when_a_required_check_fails(monkeypatch, capsys):
    def passing() -> doctor.CheckResult:
        return doctor.CheckResult("fine", "OK", "all good")

    def failing() -> doctor.CheckResult:
        return doctor.CheckResult("deepspeed", "FAIL", "No module named 'deepspeed'", "pip x")

    monkeypatch.setattr(doctor, "CHECKS", [passing, failing])
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "  FAIL  deepspeed      No module named 'deepspeed'  -> fix: pip x" in out
    assert out.splitlines()[-1].startswith("1 required check failed")
    assert doctor.main(["--json"]) == 1
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == ["OK", "FAIL"]
    monkeypatch.setattr(doctor, "CHECKS", [passing])
    assert doctor.main([]) == 0
