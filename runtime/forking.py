"""The simulator's fork server: its worker processes and replica ranks are forks of one process
that imported torch, `torch._dynamo` (which torch imports at a process's first optimizer call)
and the simulator's modules once, where each spawned child imported them again: 3 to 4 s of CPU
a child on a busy 2-core box.

multiprocessing keeps one fork server per process, started at its first use with the preload
list set then; every user here sets the same list, so whichever starts it, it serves all.
Two things differ from a spawned child, and `run_forked` puts both right first thing:
- a fork server's child starts with the environment the server started with, a spawned one
  with its parent's as it is at the spawn: the child is given its parent's. What torch read
  from the environment at import (its thread pools' sizes, say) is the server's; the simulator
  sets what it needs (one thread a peer) itself;
- the server is the child's parent, and it outlives a parent killed outright while any child
  of it lives (each holds the server's "alive" pipe): the child watches the process that
  started it, not its parent (`common/lifeline.py`).
"""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Mapping
from typing import Any

from starling.common.lifeline import die_with_parent

PRELOAD = ["torch._dynamo", "starling.runtime.sim_processes", "starling.runtime.replica_sim"]


def fork_context() -> Any:
    """The multiprocessing context of the simulator's processes: its fork server."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def forked_args(target: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """The arguments of a fork server's `Process` that runs `target(*args)` as `run_forked` does."""
    return (os.getpid(), dict(os.environ), target, *args)


def run_forked(started_by: int, environment: Mapping[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """`target(*args)` in a fork server's child: with the `environment` its parent held when it
    started the child, and ended when that parent (`started_by`) is gone. The server is the
    child's parent in the OS, and outlives a parent killed outright while any child of it
    lives, so the child must watch the process that started it (`common/lifeline.py`)."""
    die_with_parent(started_by=started_by)
    os.environ.clear()
    os.environ.update(environment)
    return target(*args)
