"""Write tests/durations.json (seconds per test file) from pytest JUnit reports, or print the
slowest tests of a run.

    python -m pytest --junitxml=report.xml ...   # a full run
    python scripts/test_durations.py report.xml  # then commit tests/durations.json
    python scripts/test_durations.py --slowest 30 report.xml  # what scripts/run_tests.sh prints

tests/conftest.py reads it under pytest-xdist to start the longest files first; a stale or
missing entry only changes the order in which files run, never which tests run.
"""

from __future__ import annotations

import argparse
import json
import os
import xml.etree.ElementTree as ElementTree

OUTPUT = os.path.join(os.path.dirname(__file__), os.path.pardir, "tests", "durations.json")


def file_of(classname: str) -> str:
    """`tests.core.test_x.TestY` -> `tests/core/test_x.py` (the module part of a classname)."""
    parts = []
    for part in classname.split("."):
        parts.append(part)
        if part.startswith("test_"):
            break
    return "/".join(parts) + ".py"


def main() -> None:
    """Sum each file's test times (set-up and tear-down included) and write them, longest first."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="+", help="JUnit XML files of pytest runs")
    parser.add_argument("--slowest", type=int, metavar="N", help="print the N slowest tests")
    args = parser.parse_args()
    seconds: dict[str, float] = {}
    tests: list[tuple[float, str]] = []
    for report in args.report:
        if not os.path.isfile(report):
            continue
        for case in ElementTree.parse(report).iter("testcase"):
            path = file_of(case.get("classname", ""))
            took = float(case.get("time", 0.0))
            seconds[path] = seconds.get(path, 0.0) + took
            tests.append((took, f"{path}::{case.get('name')}"))
    if args.slowest:
        tests.sort(reverse=True)
        for took, name in tests[: args.slowest]:
            print(f"{took:8.1f} s  {name}")
        print(f"{len(tests)} tests, {sum(seconds.values()):.0f} s of test time in all")
        return
    ordered = {path: round(s, 1) for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    with open(OUTPUT, "w", encoding="utf-8") as file:
        json.dump(ordered, file, indent=0)
        file.write("\n")
    print(f"wrote {len(ordered)} files, {sum(ordered.values()):.0f} s in all, to {OUTPUT}")


if __name__ == "__main__":
    main()
