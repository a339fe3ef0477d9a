"""Real Megatron-DeepSpeed command lines (tests/compat/scripts/*.json), localized for tests.

Each file holds the `pretrain_gpt.py` argv a Megatron-DeepSpeed GPT script launched, the
DeepSpeed config it wrote, and its launcher (see tests/compat/scripts/README.md). `localized`
keeps every flag and value but points the paths at test fixtures: the dataset (each prefix of
a weighted --data-path list), the GPT-2 vocabulary, a scratch directory for outputs, and a
copy of the config; nccl becomes gloo.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from tests.conftest import MERGE_FILE, VOCAB_FILE

SCRIPTS_DIR = os.path.join(os.path.dirname(__file__), "scripts")
SCRIPT_FILES = sorted(glob.glob(os.path.join(SCRIPTS_DIR, "*.json")))
# Flags whose value is a directory or file the run writes.
_OUTPUTS = ("--save", "--load", "--tensorboard-dir", "--data-cache-path", "--wandb-save-dir")


@dataclass
class Script:
    """One captured command line."""

    name: str
    source: str
    launcher: str
    world_size: int
    argv: list[str]
    ds_config: dict | None


def load_script(path: str) -> Script:
    """The captured script at `path`."""
    with open(path) as file:
        data = json.load(file)
    name = os.path.splitext(os.path.basename(path))[0]
    return Script(
        name,
        data["source"],
        data["launcher"],
        data["world_size"],
        list(data["argv"]),
        data["ds_config"],
    )


def _split_equals(argv: list[str]) -> list[str]:
    tokens = []
    for token in argv:
        if token.startswith("--") and "=" in token:
            tokens.extend(token.split("=", 1))
        else:
            tokens.append(token)
    return tokens


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def localized(script: Script, dataset: str, scratch: str) -> list[str]:
    """`script.argv` with its paths replaced by fixtures under `scratch` (created as needed)."""
    tokens = _split_equals(script.argv)
    out: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        out.append(token)
        index += 1
        values = []
        while index < len(tokens) and not tokens[index].startswith("--"):
            values.append(tokens[index])
            index += 1
        if token == "--data-path":
            # Weighted lists keep their weights; every prefix becomes the fixture.
            values = [value if _is_number(value) else dataset for value in values]
        elif token == "--vocab-file":
            values = [VOCAB_FILE]
        elif token == "--merge-file":
            values = [MERGE_FILE]
        elif token in _OUTPUTS:
            values = [os.path.join(scratch, token.lstrip("-"))]
        elif token == "--deepspeed_config":
            config = os.path.join(scratch, "ds_config.json")
            os.makedirs(scratch, exist_ok=True)
            with open(config, "w") as file:
                json.dump(script.ds_config, file)
            values = [config]
        elif token == "--distributed-backend" and values == ["nccl"]:
            values = ["gloo"]
        out.extend(values)
    return out


def with_values(argv: list[str], values: dict[str, list[str] | None]) -> list[str]:
    """`argv` with each named flag's values replaced (None drops the flag); new flags appended."""
    tokens = _split_equals(argv)
    out: list[str] = []
    seen = set()
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        own = []
        while index < len(tokens) and not tokens[index].startswith("--"):
            own.append(tokens[index])
            index += 1
        if token in values:
            seen.add(token)
            if values[token] is not None:
                out += [token, *values[token]]
        else:
            out += [token, *own]
    for token, given in values.items():
        if token not in seen and given is not None:
            out += [token, *given]
    return out


def bf16_for_cpu(argv: list[str], config: dict | None) -> tuple[list[str], dict | None]:
    """fp16 swapped for bf16 (DeepSpeed's CPU accelerator has no fp16), in flags and config."""
    argv = ["--bf16" if token == "--fp16" else token for token in argv]
    if config is not None and config.get("fp16", {}).get("enabled"):
        config = dict(config, fp16={"enabled": False}, bf16={"enabled": True})
    return argv, config
