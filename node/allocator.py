"""Keep freed message buffers in the process instead of handing them back to the kernel.

Every round of an all-reduce allocates buffers of a few MiB per chunk: ZeroMQ's I/O thread
allocates one per received frame, and parts, sums and averages are tensors of that size.
glibc serves blocks above its mmap threshold (128 KiB at start, adapting upward) with a
fresh `mmap` and returns them with `munmap` on free, and it trims the heap top past its
trim threshold; either way the next round's buffers are new pages, which the kernel
faults in and zeroes one 4 KiB page at a time. Measured on a 100 MB all-reduce of 2 peers
(`benchmarks/allreduce.py`): about 20,000 page faults per round per process, and a 50 MB
own-part copy taking 0.25 s instead of ~0.02 s; zeroing pages was the largest single
kernel cost. gloo never pays this because it reuses its buffers.

`keep_freed_memory()` sets glibc's mmap threshold to its maximum (32 MiB on 64-bit, above
the reducer's 4 MiB chunks) and a high trim threshold, so such buffers come from and go
back to the heap, and the next round reuses the same (already mapped) pages. The cost is
that a process keeps up to the trim threshold of freed memory mapped: its resident size
stays near its high-water mark, which is what a training process reaches every step anyway.

It is applied once per process when the network thread starts. It changes nothing when
the C library is not glibc, when the user has set glibc's own malloc environment variables
(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or `GLIBC_TUNABLES` with a malloc
tunable), or when `STARLING_KEEP_FREED_MEMORY=0`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

OPT_OUT_ENV = "STARLING_KEEP_FREED_MEMORY"
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's <malloc.h>
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@dataclass(frozen=True)
class AllocatorTuning:
    applied: bool
    reason: str  # why not, or what was set
    pid: int


_lock = threading.Lock()
_done: AllocatorTuning | None = None


def keep_freed_memory() -> AllocatorTuning:
    """Apply the tuning once per process (after a fork, once more in the child); returns
    what was done, and why not when nothing was."""
    global _done
    with _lock:
        if _done is None or _done.pid != os.getpid():
            _done = AllocatorTuning(*_tune(), pid=os.getpid())
            log.debug("allocator tuning: %s", _done)
        return _done


def _tune() -> tuple[bool, str]:
    if os.environ.get(OPT_OUT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{OPT_OUT_ENV} is off"
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return False, f"the user's own malloc settings win: {', '.join(user)}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False, "not glibc"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return False, f"mallopt unavailable: {exc}"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success and 0 for a value out of range.
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return False, "glibc refused the mmap threshold"
    if not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return False, "glibc refused the trim threshold"
    return True, f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
