"""A process's resident memory, for the benchmarks and tests that bound it (a sibling script
module: benchmarks/ is not a package)."""
from __future__ import annotations


def rss_mb(pid: int | str = "self") -> float:
    """The resident memory of process `pid` (this one by default), in MB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")
