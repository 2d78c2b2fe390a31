"""Real `starling node start` processes for the benchmarks that kill peers (crash.py, chaos.py,
faults.py).

A `NodeProcess` drains the node's stdout on a thread and stamps each line on arrival, so a
benchmark reads when each step finished from its own clock (`time.monotonic()`), not from the
node's: the join address, the `training` event, every progress line, and the `stopped` line.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

# What starts a node's process, with subprocess.Popen's signature. The tests that run these
# benchmarks in their own process put theirs here (tests/cli_zygote.py's `cli_popen`, which
# forks the CLI from a process that imported torch once); a benchmark run as a script execs.
popen: Callable[..., subprocess.Popen] = subprocess.Popen


@dataclass(frozen=True)
class Progress:
    """One progress line: `peers` contributed to the step's update, `lost` members went missing."""

    at: float  # arrival, monotonic
    step: int
    loss: float
    peers: int
    lost: int


class NodeProcess:
    """One `starling node start` process; its lines are stamped on arrival. `threads` is its
    OMP_NUM_THREADS (1: several nodes share a box; None: torch's default, a thread per core)."""

    started: ClassVar[list[NodeProcess]] = []  # every one this process launched, for `kill_all`

    def __init__(self, args: list[str], log: str | None = None, threads: int | None = 1,
                 env_extra: dict[str, str] | None = None) -> None:
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        env.update(env_extra or {})
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.args = args
        self.log = open(log, "w") if log else None
        self.log_path = log
        self.launched_at = time.monotonic()
        self.proc = popen([sys.executable, "-m", "starling.cli.main", "node", "start", *args],
                          stdout=subprocess.PIPE, stderr=self.log or subprocess.DEVNULL, text=True, env=env)
        self.steps: list[Progress] = []
        self.records: list[dict[str, Any]] = []  # every progress line, as printed
        self.training_at: float | None = None  # when it printed {"event": "training"}
        self.training: dict[str, Any] | None = None
        self.stopped: dict[str, Any] | None = None
        self.address = ""
        self.address_at: float | None = None  # when it printed its join address: it is in the swarm
        self._drained = threading.Event()
        NodeProcess.started.append(self)
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                now = time.monotonic()
                if "join with:" in line:
                    self.address = line.rsplit("join with:", 1)[1].strip()
                    self.address_at = now
                elif line.startswith("{"):
                    self._record(now, json.loads(line))
                try:
                    if self.log is not None:
                        self.log.write(f"{now:.3f} stdout: {line}")
                except ValueError:  # closed by close() after a timeout
                    pass
        finally:
            self._drained.set()

    def _record(self, now: float, record: dict[str, Any]) -> None:
        if record.get("event") == "training":
            self.training, self.training_at = record, now
        elif record.get("event") == "stopped":
            self.stopped = record
        elif "step" in record and "loss" in record:
            self.records.append(record)
            self.steps.append(Progress(now, int(record["step"]), float(record["loss"]),
                                       int(record.get("peers", 1)), int(record.get("lost", 0))))

    def last_progress(self) -> float | None:
        """When its latest progress line (or its training event) arrived."""
        return self.steps[-1].at if self.steps else self.training_at

    def wait_for_address(self, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.address:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"a peer did not start (exit status {self.proc.poll()}, log {self.log_path})")
            time.sleep(0.05)
        return self.address

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, which the other peers see only from the dropped connection."""
        if self.alive():
            self.proc.kill()

    def terminate(self) -> None:
        """SIGTERM: the node stops training, prints its `stopped` line and leaves gracefully."""
        if self.alive():
            self.proc.terminate()

    def wait(self, timeout_s: float) -> int | None:
        """Its exit status once it has exited and its stdout is read; None if it did not exit in time."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self._drained.wait(5)
        return code

    def close(self) -> None:
        """Kill it if it still runs (whatever went wrong before), and close its log."""
        self.kill()
        self.wait(10)
        if self.log is not None:
            self.log.close()
            self.log = None

    def log_tail(self, lines: int = 5) -> list[str]:
        if not self.log_path:
            return []
        if self.log is not None:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return [line.rstrip() for line in f.readlines()[-lines:]]


def kill_all() -> None:
    """SIGKILL every node this process launched that still runs (a benchmark that was
    interrupted, or failed, leaves none behind)."""
    for node in NodeProcess.started:
        node.close()


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
