"""A child process that ends when the process that started it is gone.

A simulation's workers, a replica's follower ranks and the ranks a `node start` spawns hold
gigabytes and keep computing. When their parent is killed with SIGKILL (a CI timeout, the OOM
killer, a user's kill -9), nothing runs in it to stop them: multiprocessing's daemon flag and
`atexit` hooks act only when the parent exits normally, and the children are adopted by init
and train on, unseen. So each child calls `die_with_parent()` first thing: a daemon thread
watches its parent's pid, and when the child is reparented (the parent died), it ends the
child at once with `os._exit`, without waiting for threads or flushing anything the parent
can no longer read.

A child forked by a fork server (the simulator's, `runtime/forking.py`) has the server for its
parent, and the server outlives the process that asked for the child for as long as any such
child lives (each holds the server's "alive" pipe): it passes the pid of the process that
started it, and is watched for that one's exit (through a pidfd where Linux has them).

Polling, not Linux's parent-death signal: that signal fires when the *thread* that forked the
child exits, which would kill a worker started from a thread that then ends while its process
lives on. A poll every `POLL_S` costs nothing measurable and works on every POSIX system.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

POLL_S = 0.5
EXIT_CODE = 70  # what a child that outlived its parent exits with (EX_SOFTWARE)


def die_with_parent(parent_pid: int | None = None, poll_s: float = POLL_S,
                    started_by: int | None = None) -> threading.Thread | None:
    """End this process when `parent_pid` (default: the current parent) is no longer its
    parent, or, given `started_by` instead (the pid of the process that had a fork server
    start this one), when that process has exited. Returns the watching thread (None where
    there is no parent to watch: a process already adopted by init, or Windows)."""
    if os.name != "posix":
        return None
    if started_by is not None and started_by != os.getppid():
        watched, gone = started_by, _exited(started_by)
    else:
        watched = os.getppid() if parent_pid is None else parent_pid
        if watched <= 1:  # already orphaned or started by init: nothing to follow
            return None

        def gone() -> bool:
            return os.getppid() != watched

    if gone():  # it died before we got here
        _end(watched)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if gone():
                _end(watched)

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread


def _exited(pid: int) -> Callable[[], bool]:
    """Whether `pid` (not this process's parent) has exited: its pidfd is readable, or, where
    there are no pidfds, it no longer exists."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here (or it is gone already: kill says so)
        pidfd = None

    def exited() -> bool:
        if pidfd is not None:
            return bool(select.select([pidfd], [], [], 0)[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, under another user
            return False
        return False
    return exited


def _end(parent: int) -> None:
    try:
        log.warning("process %d: its parent %d is gone; exiting", os.getpid(), parent)
    finally:
        os._exit(EXIT_CODE)
