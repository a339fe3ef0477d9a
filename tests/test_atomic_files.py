"""megatron.atomic_files: outputs appear only when complete; failures leave old files intact."""

from __future__ import annotations

import os

import pytest

from megatron.atomic_files import atomic_outputs


def test_success_publishes_every_file(tmp_path):
    """On a normal exit each partial file replaces its final name; no partial remains."""
    finals = [str(tmp_path / "a.bin"), str(tmp_path / "a.idx")]
    (tmp_path / "a.bin").write_bytes(b"old")
    with atomic_outputs(*finals) as partials:
        assert all(".partial-" in p and not os.path.exists(p) for p in partials)
        for partial, data in zip(partials, (b"new bin", b"new idx")):
            with open(partial, "wb") as stream:
                stream.write(data)
        assert (tmp_path / "a.bin").read_bytes() == b"old"  # untouched until the end
    assert [open(f, "rb").read() for f in finals] == [b"new bin", b"new idx"]
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]


def test_failure_keeps_earlier_output_and_removes_partials(tmp_path):
    """An exception inside the block removes the partials and leaves the old file as it was."""
    final = tmp_path / "out.jsonl"
    final.write_bytes(b"earlier run")
    with pytest.raises(RuntimeError), atomic_outputs(str(final)) as (partial,):
        with open(partial, "wb") as stream:
            stream.write(b"half written")
        raise RuntimeError("killed mid-write")
    assert final.read_bytes() == b"earlier run"
    assert os.listdir(tmp_path) == ["out.jsonl"]
