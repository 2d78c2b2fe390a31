"""A process's resident memory, from /proc (Linux; None elsewhere)."""
from __future__ import annotations


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A memory field of /proc/PID/status (VmRSS, VmHWM, ...) in bytes; None where there is
    no such file or field."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def peak_rss_reset() -> int | None:
    """Reset this process's peak resident memory to what it holds now, and return that (bytes)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return status_bytes("VmRSS")


def peak_rss() -> int | None:
    """This process's peak resident memory since the last `peak_rss_reset` (bytes)."""
    return status_bytes("VmHWM")
