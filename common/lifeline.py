"""A child process that ends when the process that started it is gone.

A simulation's workers, a replica's follower ranks and the ranks a `node start` spawns hold
gigabytes and keep computing. When their parent is killed with SIGKILL (a CI timeout, the OOM
killer, a user's kill -9), nothing runs in it to stop them: multiprocessing's daemon flag and
`atexit` hooks act only when the parent exits normally, and the children are adopted by init
and train on, unseen. So each child calls `die_with_parent()` first thing: a daemon thread
watches its parent's pid, and when the child is reparented (the parent died), it ends the
child at once with `os._exit`, without waiting for threads or flushing anything the parent
can no longer read.

Polling, not Linux's parent-death signal: that signal fires when the *thread* that forked the
child exits, which would kill a worker started from a thread that then ends while its process
lives on. A poll every `POLL_S` costs nothing measurable and works on every POSIX system.
"""
from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

POLL_S = 0.5
EXIT_CODE = 70  # what a child that outlived its parent exits with (EX_SOFTWARE)


def die_with_parent(parent_pid: int | None = None, poll_s: float = POLL_S) -> threading.Thread | None:
    """End this process when `parent_pid` (default: the current parent) is no longer its
    parent. Returns the watching thread (None where there is no parent to watch: a process
    already adopted by init, or Windows)."""
    if os.name != "posix":
        return None
    parent = os.getppid() if parent_pid is None else parent_pid
    if parent <= 1:  # already orphaned or started by init: nothing to follow
        return None
    if os.getppid() != parent:  # the parent died before we got here
        _end(parent)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                _end(parent)

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread


def _end(parent: int) -> None:
    try:
        log.warning("process %d: its parent %d is gone; exiting", os.getpid(), parent)
    finally:
        os._exit(EXIT_CODE)
