"""Machine facts the benchmarks print in their headers (for RESULTS.md).

Imported by the benchmark scripts as a sibling module: `python benchmarks/X.py` puts this
folder first on `sys.path`.
"""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
