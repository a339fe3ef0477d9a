"""The shape of a user error: exit 1 (2: a bad flag), one last `error:` line, files unchanged.

Shared by the tools' tests and the failing runs of pretrain_gpt.py (full disk, lost rank).
"""

from __future__ import annotations

import hashlib
import os


def assert_one_line_error(code: int, stderr: str, *named: str) -> str:
    """Exit code 1, no traceback, one `error:` line, the last, containing each of `named`.

    A bad flag (argparse's message, ending "(see --help)") exits 2, as argparse and
    pretrain_gpt.py do.
    """
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), stderr
    assert code == (2 if lines[-1].endswith("(see --help)") else 1), (code, stderr)
    assert sum(line.startswith("error:") for line in lines) == 1, stderr
    for fragment in named:
        assert fragment in lines[-1], (fragment, lines[-1])
    return lines[-1]


def file_under_a_file(tmp_path) -> str:
    """A path whose parent is a regular file: not writable, even for root."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    return str(blocker / "out")


def snapshot(folder) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder`, to show a failure changed nothing."""
    found = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as stream:
                found[os.path.relpath(path, folder)] = hashlib.sha256(stream.read()).hexdigest()
    return found


def damaged_checkpoint(folder) -> str:
    """A Megatron-layout checkpoint in `folder` whose one file is not a whole torch archive;
    that file's path."""
    shard = folder / "iter_0000003" / "mp_rank_00"
    shard.mkdir(parents=True)
    (shard / "model_optim_rng.pt").write_bytes(b"PK\x03\x04 truncated")
    (folder / "latest_checkpointed_iteration.txt").write_text("3\n")
    return str(shard / "model_optim_rng.pt")
