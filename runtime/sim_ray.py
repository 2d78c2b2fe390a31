"""`starling simulate --ray ADDRESS`: the sharded simulator's workers as Ray actors, spread over
the machines of a Ray cluster.

The workers are the ones `--processes` runs (`sim_processes.worker_main`, placed round-robin
by rank, joiners to the least loaded), each inside a Ray actor instead of a spawned process,
and the same `Parent` drives them. An actor runs `worker_main` on a thread, with the queue and
events of its `WorkerLink` local to the actor: the parent keeps one `drain` call outstanding
per actor, which returns what the worker sent (waiting briefly for the first message), and
sends rank 0's address, joins, the start and the stop as calls of their own (and, for a
baseline on the same swarm, the word to take up the next run). Every peer
listens over tcp on a free port of its node's address as Ray knows it (not loopback), so peers
on different machines reach each other directly; Ray carries only this control traffic.

Actors ask for one CPU each and are scheduled with Ray's SPREAD strategy, so that P workers on
a cluster of N nodes land on min(P, N) of them. `processes=0` means one worker per node.
Nothing waits without bound: actors must be placed within `ready_timeout_s`, an actor that
dies (its process killed, its node lost) ends its polls with an error that fails the run naming
its ranks and node, and an address where no cluster answers fails before Ray would spend
minutes retrying it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import queue
import socket
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import ray
import ray.exceptions

from starling.runtime.capacity import raise_fd_limit
from starling.runtime.sim_processes import Parent, ProgressFn, WorkerLink, Workers, worker_main
from starling.runtime.simconfig import SimConfig, SimError
from starling.runtime.summary import PeerResult

log = logging.getLogger(__name__)

DRAIN_WAIT_S = 0.5  # how long an actor's drain waits for a first message before it answers empty
CONNECT_TIMEOUT_S = 5.0  # to find something listening at a HOST:PORT address before Ray dials it
NEXT_RUN_TIMEOUT_S = 30.0  # for every actor to take the word to take up the next run
_POLL_S = 0.05
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@contextlib.contextmanager
def connected(address: str) -> Iterator[None]:
    """This process connected to the Ray cluster at `address` for the block (`ray.init`), and
    disconnected after (`ray.shutdown`; a cluster that "local" started stops with it). A process
    already connected keeps its connection and `address` is not used. SimError, in one line, for
    an address where no cluster answers."""
    if ray.is_initialized():
        yield
        return
    _check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except Exception as exc:  # Ray raises ConnectionError, ValueError or RuntimeError, by what went wrong
        raise SimError(f"cannot connect to the Ray cluster at {address!r}: {_first_line(exc)}") from None
    try:
        yield
    finally:
        ray.shutdown()


def _check_reachable(address: str) -> None:
    """SimError at once when nothing listens at a HOST:PORT address (Ray itself retries such an
    address for minutes); "auto", "local" and forms Ray alone knows are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    host = host.strip("[]")
    # Ray dials a cluster on this machine at the node's own address, not at loopback.
    hosts = [host, ray.util.get_node_ip_address()] if host in _LOCAL_HOSTS else [host]
    error: OSError | None = None
    for candidate in dict.fromkeys(hosts):
        try:
            with socket.create_connection((candidate, int(port)), timeout=CONNECT_TIMEOUT_S):
                return
        except OSError as exc:
            error = exc
    raise SimError(f"no Ray cluster answers at {address} ({error}): start one with `ray start --head` and pass the "
                   "address it prints, or 'auto' on one of its machines, or 'local' for a new one on this machine")


def with_workers(config: SimConfig) -> SimConfig:
    """`config` with its worker count filled in: processes=0 means one worker per live node of
    the cluster this process is connected to (at most one per peer)."""
    if config.processes:
        return config
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return replace(config, processes=max(1, min(nodes, config.peers)))


def run_ray(config: SimConfig, progress: ProgressFn | None, then: SimConfig | None = None,
            then_progress: ProgressFn | None = None
            ) -> tuple[list[tuple[list[PeerResult], float]], list[dict[str, Any]]]:
    """Run the swarm in `config.processes` Ray actors of the cluster this process is connected
    to; with `then`, that run next on the same nodes (`Parent`). Each run's peers' results and
    start time, and each worker's ranks and node."""
    parent = Parent(config, RayWorkers(), progress, then, then_progress)
    runs = parent.run_all()
    return runs, parent.placed()


class WorkerActor:
    """One worker inside a Ray actor: `worker_main` on a thread of the actor's process, its link
    and inbox local to the actor and reached through the methods below, which Ray runs on
    threads of their own (the actor's max_concurrency) beside it."""

    def __init__(self) -> None:
        raise_fd_limit()  # a spawned worker inherits the parent's raised limit; an actor raises its own
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.link = WorkerLink(queue.Queue(), threading.Event(), threading.Event(), types.SimpleNamespace(value=0.0))
        self.thread: threading.Thread | None = None

    def where(self) -> dict[str, str]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "host": ray.util.get_node_ip_address()}

    def run(self, config: SimConfig, index: int, ranks: list[int], log_level: int,
            then: SimConfig | None = None) -> None:
        self.thread = threading.Thread(
            target=worker_main, name=f"sim-worker-{index}", daemon=True,
            args=(config, index, ranks, self.inbox, self.link, "", log_level, ray.util.get_node_ip_address(), then))
        self.thread.start()

    def drain(self, wait_s: float) -> tuple[list[tuple[Any, ...]], bool]:
        """What the worker sent since the last drain (waiting up to `wait_s` for the first
        message), and whether it was still running before it was read: once it says False,
        everything the worker ever sent has been returned."""
        running = self.thread is not None and self.thread.is_alive()
        messages: list[tuple[Any, ...]] = []
        try:
            messages.append(self.link.queue.get(timeout=wait_s) if running else self.link.queue.get_nowait())
            while True:
                messages.append(self.link.queue.get_nowait())
        except queue.Empty:
            pass
        return messages, running

    def deliver(self, message: tuple[Any, ...]) -> None:
        self.inbox.put(message)

    def begin(self, t0: float) -> None:
        self.link.t0.value = t0
        self.link.start.set()

    def stop(self) -> None:
        self.link.stop.set()

    def next_run(self) -> None:
        """The worker, its results sent, takes up the next run: not started, not stopped. One
        call, so that the worker never sees `next` with the last run's stop still set."""
        self.link.start.clear()
        self.link.stop.clear()
        self.inbox.put(("next",))


@functools.cache
def _actor_class() -> Any:
    # drain waits while deliver, begin and stop come in: one thread each, and one spare
    return ray.remote(max_concurrency=4)(WorkerActor)


class RayWorkers(Workers):
    """Workers as Ray actors of the cluster this process is connected to."""

    def __init__(self) -> None:
        self.actors: list[Any] = []
        self.placed: list[dict[str, str]] = []
        self.polls: dict[Any, int] = {}  # each live actor's outstanding drain -> its index
        self.ended: dict[int, str] = {}
        self.stopped = False

    def launch(self, config: SimConfig, holds: list[list[int]], log_level: int, then: SimConfig | None = None
               ) -> None:
        actor = _actor_class().options(num_cpus=1, scheduling_strategy="SPREAD")
        self.actors = [actor.remote() for _ in holds]
        try:
            self.placed = ray.get([a.where.remote() for a in self.actors], timeout=config.ready_timeout_s)
            # started before the first drain, which would otherwise find no worker running
            started = [actor.run.remote(config, index, list(ranks), log_level, then)
                       for index, (actor, ranks) in enumerate(zip(self.actors, holds))]
            ray.get(started, timeout=config.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise SimError(f"Ray did not start the {len(holds)} workers within {config.ready_timeout_s:g} s: each "
                           "needs a free CPU on some node of the cluster (`ray status` shows them)") from None
        except ray.exceptions.RayError as exc:
            raise SimError(f"a Ray worker could not start: {_first_line(exc)}") from None
        log.info("workers on Ray nodes: %s", ", ".join(f"{i}: {p['host']}" for i, p in enumerate(self.placed)))
        for index, actor in enumerate(self.actors):
            self.polls[actor.drain.remote(DRAIN_WAIT_S)] = index

    def send(self, index: int, message: tuple[Any, ...]) -> None:
        self.actors[index].deliver.remote(message)

    def receive(self, timeout_s: float) -> tuple[list[tuple[Any, ...]], dict[int, str]]:
        messages: list[tuple[Any, ...]] = []
        if not self.polls:
            time.sleep(timeout_s)
            return messages, dict(self.ended)
        ready, _ = ray.wait(list(self.polls), num_returns=1, timeout=timeout_s)
        if ready:  # and any other answer already in
            ready, _ = ray.wait(list(self.polls), num_returns=len(self.polls), timeout=0)
        for ref in ready:
            index = self.polls.pop(ref)
            try:
                sent, running = ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:  # not expected of a ready answer: ask again
                self.polls[ref] = index
                continue
            except ray.exceptions.RayError as exc:  # the actor died, or its node
                self.ended[index] = f"died ({_first_line(exc)})"
                continue
            messages.extend(sent)
            if running:
                self.polls[self.actors[index].drain.remote(DRAIN_WAIT_S)] = index
            else:
                self.ended[index] = "ended"
        return messages, dict(self.ended)

    def begin(self, t0: float) -> None:
        for actor in self.actors:
            actor.begin.remote(t0)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            for actor in self.actors:
                actor.stop.remote()

    def next_run(self) -> None:
        # Waited for: an actor runs its calls on several threads, in no set order, and the
        # parent's begin must find the last run's start and stop cleared.
        try:
            ray.get([actor.next_run.remote() for actor in self.actors], timeout=NEXT_RUN_TIMEOUT_S)
        except ray.exceptions.RayError as exc:  # a dead actor: its polls end the run naming it
            log.warning("a Ray worker did not take up the next run: %s", _first_line(exc))
        self.stopped = False

    def close(self, finished: bool) -> None:
        """Let the workers close their peers (their nodes leave), then end the actors."""
        for actor in self.actors:  # a worker that reported its last run closes its nodes on `end`
            with contextlib.suppress(Exception):
                actor.deliver.remote(("end",))
        deadline = time.monotonic() + (30.0 if finished else 3.0)
        while self.polls and time.monotonic() < deadline:
            self.receive(_POLL_S)
        for actor in self.actors:
            with contextlib.suppress(Exception):  # one already dead
                ray.kill(actor)

    def name(self, index: int) -> str:
        where = self.where(index)
        return f"Ray worker {index}" + (f" on node {where['node_id'][:12]} ({where['host']})" if where else "")

    def where(self, index: int) -> dict[str, Any]:
        return dict(self.placed[index]) if index < len(self.placed) else {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
