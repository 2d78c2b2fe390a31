"""Building a large, long-lived heap without paying the cyclic collector again and again.

A simulator's worker holds hundreds of nodes, and while its swarm forms each of them learns
every other peer: millions of objects (table entries, records, sockets' state) that will live
as long as the run. CPython's collector scans its oldest generation whenever that generation
has grown by a quarter, so a heap that grows from nothing to millions of objects is scanned
in full again and again while it grows (docs/benchmarks.md has what that cost a 1024-peer
simulation).

`building_heap()` turns the automatic collector off while such a heap is built and collects
only the young generations, every `young_every_s` from a thread of its own: what was made
since the last pass is scanned once, garbage cycles among it are freed, and what survives
moves to the oldest generation, which no pass scans. On leaving, one full collection frees the
cycles that were still alive at their young pass, `gc.freeze()` moves the built heap out of
every later collection's way, and the automatic collector resumes where it was. A heap
frozen this way is never scanned again: the objects the run makes later are collected as
usual.

The garbage this leaves for the final collection is what was still referenced at its young
pass and became garbage later, inside a cycle; the memory it holds until then is the price.
What is frozen stays until the process ends, even once it is garbage: freeze only in a
process whose built heap lives as long as the process does (a simulator's worker, not a
library caller's, which builds with `freeze=False`).
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_EVERY_S = 1.0


@contextmanager
def building_heap(young_every_s: float = YOUNG_EVERY_S, *, freeze: bool = True) -> Iterator[None]:
    """While the block runs, collect the young generations only, every `young_every_s`; then
    collect everything once and, with `freeze`, freeze the heap built (see the module's
    docstring). Without it the heap stays in the oldest generation, scanned again only once
    that has grown by a quarter more: for a process that must free what it built (a library
    caller's)."""
    was_enabled = gc.isenabled()
    gc.disable()
    done = threading.Event()

    def collect_young() -> None:
        while not done.wait(young_every_s):
            gc.collect(1)

    thread = threading.Thread(target=collect_young, name="heap-young-gc", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        gc.collect()
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
