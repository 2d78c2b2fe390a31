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
print(json.dumps({"default": default, "tuned": tuned, "tuning": repr(NetworkThread.tuning)}))
"""


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


@pytest.mark.parametrize("name,value,reason", [
    (allocator.OPT_OUT_ENV, "0", "is off"),
    ("MALLOC_TRIM_THRESHOLD_", "1048576", "MALLOC_TRIM_THRESHOLD_"),
    ("MALLOC_MMAP_THRESHOLD_", "65536", "MALLOC_MMAP_THRESHOLD_"),
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
