"""The network thread keeps freed message buffers mapped (glibc malloc tuning)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from starling.node import allocator

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt only")

# One all-reduce round's worth of chunk buffers: 16 blocks of 4 MiB alive at once, then all
# freed, 4 times, counting page faults; first under glibc's defaults, then after the network
# thread has started. A fresh interpreter, so that no earlier tuning applies.
# glibc's thresholds adapt upward after a large free, so what "the defaults" do depends on what
# the imports before the probe freed (a CI run that compiled torch's modules on import saw 0
# faults with them). The probe pins glibc's starting values (128 KiB each) first; setting
# them also turns the adaptation off, as the network thread's own setting does.
PROBE = r"""
import ctypes, ctypes.util, json, resource
import torch
from starling.node import allocator
from starling.node.loop import NetworkThread

# One torch thread, as Starling's simulator and benchmarks run: a thread pool started before
# the tuning would hold arenas of its own, and glibc hands those out to later threads in turn.
torch.set_num_threads(1)
mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
assert mallopt(allocator._M_MMAP_THRESHOLD, 128 << 10) == 1
assert mallopt(allocator._M_TRIM_THRESHOLD, 128 << 10) == 1

def faults_per_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        chunks = [torch.empty(1 << 20).fill_(1.0) for _ in range(16)]
        del chunks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_per_pass()  # warm: code paths, first heap growth
default = faults_per_pass()
NetworkThread.get()
faults_per_pass()
tuned = faults_per_pass()
in_thread = in_new_thread(thread_faults_per_pass)
print(json.dumps({"default": default, "tuned": tuned, "in_thread": in_thread, "tuning": repr(NetworkThread.tuning)}))
"""

# A thread's round of 24 blocks of 4 MiB (96 MiB alive at once, more than one 64 MiB heap of a
# thread's own glibc arena), all freed, 4 times; its own page faults in a second such pass.
# With the thresholds of the tuning but not its arena cap, glibc unmaps the arena's extra heap
# whenever it is all free, so every pass faults its pages in again.
THREAD_PASS = r"""
import ctypes, ctypes.util, resource, threading

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def thread_faults_per_pass():
    def one_pass():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(4):
            blocks = [libc.malloc(4 << 20) for _ in range(24)]
            for block in blocks:
                ctypes.memset(block, 1, 4 << 20)
            for block in blocks:
                libc.free(block)
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    one_pass()  # warm: first growth of the heap
    return one_pass()

def in_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]
"""
UNCAPPED = THREAD_PASS + r"""
mallopt = libc.mallopt
assert mallopt(-3, 32 << 20) == 1 and mallopt(-1, 256 << 20) == 1  # the tuning's thresholds only
print(in_new_thread(thread_faults_per_pass))
"""
PROBE = THREAD_PASS + PROBE


@pytest.mark.slow
@pytest.mark.timeout(600)  # a fresh interpreter that imports torch: over 100 s seen on a starved CI box
@glibc_only
def test_network_thread_keeps_freed_chunks_mapped() -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", allocator.OPT_OUT_ENV))}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=500,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "applied=True" in result["tuning"], result
    # 4 x 64 MiB is 65,536 pages: the defaults trim the heap after every pass and fault
    # them all in again; kept blocks fault in (almost) none.
    assert result["default"] > 32 * 1024, result
    assert result["tuned"] < 1024, result
    # A thread started after the tuning (ZeroMQ's I/O thread, say) shares the main heap,
    # which keeps what it frees too.
    assert result["in_thread"] < 1024, result


@pytest.mark.timeout(120)
@glibc_only
def test_a_threads_own_arena_unmaps_its_freed_heaps() -> None:
    """Why the tuning caps glibc at one arena: without the cap, the same thread's passes
    (thresholds as tuned) fault their extra heap in again every time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", UNCAPPED], env=env, capture_output=True, text=True, timeout=100,
                         check=True)
    assert int(out.stdout.strip().splitlines()[-1]) > 16 * 1024, out.stdout


@pytest.mark.parametrize("name,value,reason", [
    (allocator.OPT_OUT_ENV, "0", "is off"),
    ("MALLOC_TRIM_THRESHOLD_", "1048576", "MALLOC_TRIM_THRESHOLD_"),
    ("MALLOC_MMAP_THRESHOLD_", "65536", "MALLOC_MMAP_THRESHOLD_"),
    ("MALLOC_ARENA_MAX", "4", "MALLOC_ARENA_MAX"),
    ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536", "GLIBC_TUNABLES"),
])
def test_opt_out_and_the_users_own_settings_win(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                reason: str) -> None:
    """Checked before anything is set, so nothing in this process changes."""
    monkeypatch.setenv(name, value)
    applied, why = allocator._tune()
    assert not applied and reason in why


def test_applied_once_per_process() -> None:
    first = allocator.keep_freed_memory()
    assert allocator.keep_freed_memory() is first and first.pid == os.getpid()
