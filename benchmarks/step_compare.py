"""What the benchmarks that compare Starling's step with a plain one share: the plain step,
ranks spawned in their own processes, and a timer that alternates which step goes first (so
that drift in the machine's load falls on both)."""
from __future__ import annotations

import multiprocessing
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any


def plain_step(task: Any, model: Any, optimizer: Any, batches: Iterator[Any],
               set_to_none: bool = False) -> Callable[[], None]:
    """One step as a plain training loop takes it: zero the gradients, the task's loss through
    `model`, backward, the optimizer's step."""
    def step() -> None:
        optimizer.zero_grad(set_to_none=set_to_none)
        task.loss(model, next(batches)).backward()
        optimizer.step()

    return step


def run_ranks(target: Callable[..., None], ranks: int, *args: Any, timeout_s: float = 600.0) -> dict[int, Any]:
    """`target(rank, ranks, init, *args, out)` in `ranks` spawned processes that rendezvous
    through a fresh file; what each put on `out` (a dict with its "rank"), by rank."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tempfile.mkdtemp(prefix='starling-bench-')}/rendezvous"
    procs = [ctx.Process(target=target, args=(r, ranks, init, *args, out)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    by_rank = {got["rank"]: got for got in (out.get(timeout=timeout_s) for _ in procs)}
    for proc in procs:
        proc.join(timeout=30)
    return by_rank


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
