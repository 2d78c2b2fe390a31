"""A process's resident memory, for the benchmarks and tests that bound it (a sibling script
module: benchmarks/ is not a package)."""
from __future__ import annotations

from starling.common.memory import status_bytes


def rss_mb(pid: int | str = "self") -> float:
    """The resident memory of process `pid` (this one by default), in MB, from /proc."""
    found = status_bytes("VmRSS", pid)
    if found is None:
        raise RuntimeError(f"no VmRSS in /proc/{pid}/status")
    return found / 2**20
