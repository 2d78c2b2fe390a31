"""Timing two kinds of step against each other in one run: which goes first alternates every
step, so that drift in the machine's load falls on both (shared by the benchmarks that compare
Starling's step with a plain one)."""
from __future__ import annotations

import time
from collections.abc import Callable


def alternate(first: tuple[str, Callable[[], object]], second: tuple[str, Callable[[], object]], steps: int,
              warmup: int, sync: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Run both `(name, fn)` once per step for `warmup + steps` steps, `second` first on odd
    steps; the wall time of each call after the warm-up, by name. `sync` (a device's
    synchronize) runs before and after each timed call."""
    times: dict[str, list[float]] = {first[0]: [], second[0]: []}
    for i in range(warmup + steps):
        for name, fn in (first, second) if i % 2 == 0 else (second, first):
            if sync is not None:
                sync()
            began = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - began)
    return times
