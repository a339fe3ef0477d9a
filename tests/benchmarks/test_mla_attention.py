"""benchmarks/mla_attention.py runs (in this process, tiny sizes) and prints its table: every
setup's row, ratios to the mha row measured in the same run, and the bytes each recompute
choice keeps below those of MLA without recomputation (exact counts, not timings)."""

from __future__ import annotations

import contextlib
import io

from benchmarks import mla_attention


def test_quick_run_prints_every_setup_with_fewer_bytes_kept_when_recomputing() -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        mla_attention.main(["--quick", "--threads", "1"])
    rows = {
        cells[0]: cells
        for line in printed.getvalue().splitlines()
        if line.startswith("| ") and not line.startswith("| setup")
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }
    assert list(rows) == list(mla_attention.SETUPS), printed.getvalue()
    assert rows["mha"][4] == "1.00x" and rows["mha"][6] == "1.00x"
    kept = {name: float(row[5].removesuffix(" MiB")) for name, row in rows.items()}
    for name in list(mla_attention.SETUPS)[2:]:
        assert kept[name] < kept["mla"], (name, kept)
    assert kept["mla, all of them"] == min(kept.values()), kept
