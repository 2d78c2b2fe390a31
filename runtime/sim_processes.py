"""`starling simulate --processes P`: the swarm's peers spread over P worker processes.

Placement: initial ranks are dealt round-robin (rank r runs in worker r % P), so a worker holds
every P-th rank and a `kill:RANK` or `leave:RANK` event thins each worker about evenly. A joiner
goes to the worker with the fewest peers still training (the lowest index on a tie): a worker
already has torch imported and its network thread running, so a join costs no process start.

Inside a worker the peers run exactly as in the threaded simulator (`sim.py`): one training
thread per peer, `torch.set_num_threads(1)`, one network thread for all of them. Across workers
`inproc` cannot reach, so every peer binds the configured tcp or ipc endpoint and speaks to every
other peer, in its worker or not, over that socket.

Start-up, in stages that each fail once nothing has moved for `ready_timeout_s` (spawning and
importing torch count; a stage bounds stalls rather than its total, so a larger swarm may take
longer to form as long as its peers keep learning of each other):
1. The parent starts every worker at once (forks of the simulator's fork server,
   `runtime/forking.py`). The worker that holds rank 0 starts it and reports its address.
2. The parent hands that address to every worker; each starts its peers, which join through
   rank 0 (as in the threaded simulator), or, in a worker without rank 0, through one of its own
   that joined through rank 0 first (rank 0 after it); then waits until each sees all the others,
   builds their protocols and reports them ready.
3. The parent sets `start` (with the shared `t0`) and the workers start their training threads.

Workers talk to the parent through one queue (see `WorkerLink`); the parent talks to a worker
through the worker's inbox (rank 0's address, joins, and while the swarm forms the records of
the peers that joined elsewhere, which the workers' peers learn as a tracker's introductions).
The parent reaches its workers through a `Workers`: `ProcessWorkers` spawns them on this
machine; `sim_ray.py` runs the same `worker_main` in Ray actors on other machines. When a
peer's thread ends its worker reports it `done`; when every peer is done the parent sets
`stop`, and each worker then collects its peers' counters, sends their `PeerResult`s and closes
them (as the threaded simulator does once every thread has ended, so both count the same bytes).
A worker that exits while it still holds ranks whose results never came fails the run with a
`SimError` naming them; a worker whose parent is gone stops. No wait on either side is unbounded.

A second run on the same swarm (`then`, a baseline: `Simulation.run_compared`): at `stop` each
worker ends its peers' protocols and sends their results, keeping the nodes; once every result
came, the parent clears `start` and `stop` and sends each worker `next`; the worker builds the
second run's peers on its nodes and reports them ready, and the run goes on from stage 3.

At the last run's `stop` each worker's nodes first stop judging their peers
(`Node.stop_watching`), then the worker sends their results and keeps them up until the
parent, with every result in, sends `end` as it closes: no node is closed while another still
probes it, suspects it and declares it dead (which took a quarter of the workers' last seconds
at 1024 peers). A parent that goes no further (the first run failed) sends `end` too.
"""
from __future__ import annotations

import abc
import logging
import multiprocessing
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from starling.common.heap import building_heap
from starling.common.lifeline import die_with_parent
from starling.runtime.forking import fork_context, forked_args, run_forked
from starling.runtime.peer import (
    SimPeer,
    close_together,
    on_network_thread,
    raise_if_faulted,
    start_together,
    sync_with_seed,
)
from starling.runtime.simconfig import SimConfig, SimError, endpoint_for
from starling.runtime.summary import PeerResult
from starling.runtime.trainer import prepare_to_train
from starling.tasks import get_task

log = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]
_POLL_S = 0.05
_INTRODUCE_EVERY_S = 1.0  # while the swarm forms, the parent passes on new records this often


@dataclass
class WorkerLink:
    """What the parent shares with every worker: multiprocessing's queue, events and value
    for worker processes; their threading and `queue` counterparts inside a Ray actor."""

    # worker -> parent: ("address", rank, address, peer_id, record) | ("forming", worker, links_seen)
    #   | ("ready", worker, ranks) | ("step", worker, furthest) | ("done", rank, status)
    #   | ("result", rank, PeerResult) | ("error", worker, message)
    queue: Any
    start: Any  # set when training starts; t0 then holds its time.time()
    stop: Any  # set when every peer is done (or the run is given up): report and close
    t0: Any


def placement(peers: int, processes: int) -> list[list[int]]:
    """The initial ranks each of `processes` workers runs: round-robin, rank r in worker r % P."""
    return [list(range(worker, peers, processes)) for worker in range(processes)]


# ---------------------------------------------------------------------------- the worker side
def worker_main(config: SimConfig, index: int, ranks: list[int], inbox: Any, link: WorkerLink, ipc_dir: str,
                log_level: int, host: str = "127.0.0.1", then: SimConfig | None = None) -> None:
    """One worker, from start to its peers' results: run `ranks`, listening on `host` over tcp;
    with `then`, that run next on the same nodes (see `Parent`)."""
    die_with_parent()  # a parent killed outright must not leave its workers training (common/lifeline.py)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    prepare_to_train()
    worker = _Worker(config, index, inbox, link, ipc_dir, host, then)
    try:
        worker.run(ranks)
    except Exception as exc:
        log.exception("worker %d failed", index)
        link.queue.put(("error", index, f"{type(exc).__name__}: {exc}"))
    finally:
        worker.close()


class _Worker:
    """One worker (a process, or a Ray actor): some of the swarm's peers, each training in its
    own thread."""

    def __init__(self, config: SimConfig, index: int, inbox: Any, link: WorkerLink, ipc_dir: str,
                 host: str, then: SimConfig | None = None) -> None:
        self.config, self.index, self.inbox, self.link, self.ipc_dir = config, index, inbox, link, ipc_dir
        self.host, self.then = host, then
        self.task = get_task(config.task, **config.task_options)
        self.crashed: set[str] = set()  # shared by this worker's peers, as in the threaded simulator
        self.peers: dict[int, SimPeer] = {}
        self.closed: set[int] = set()
        self.threads: dict[int, threading.Thread] = {}
        self.furthest = 0
        self.parent = multiprocessing.parent_process()

    def run(self, ranks: list[int]) -> None:
        with building_heap():  # the swarm's tables: long-lived, kept out of the collector's scans
            formed = self._form_swarm(ranks)
        if not formed:
            return
        runs = [self.config] + ([self.then] if self.then is not None else [])
        for i, config in enumerate(runs):
            if i and not self._take_up(ranks, config):
                return
            if not self._wait_for_start(ranks):
                return
            t0 = self.link.t0.value
            self.threads, self.furthest = {}, 0
            for rank in ranks:
                self._train_in_thread(rank, self.peers[rank].train, t0)
            self._serve(t0)
            if any(thread.is_alive() for thread in self.threads.values()):
                return  # the run was given up: the parent wants no results
            last = i == len(runs) - 1
            if last:  # every node of every worker stops judging its peers before any closes
                for peer in self.peers.values():
                    peer.node.stop_watching()
            self._report(close=False)
            if last:
                self._parents_word(self.config.ready_timeout_s)  # `end`, once every worker reported
                self.close()

    def _parents_word(self, timeout_s: float) -> str | None:
        """What the parent says once this worker has reported a run: `next` (take up the next
        run) or `end` (it has every result; it is closing); None if the parent is gone or
        said neither within `timeout_s`. (The parent's stop, set for the run before, is
        cleared only after every result came: it is no reason to stop here.)"""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                message = tuple(self.inbox.get(timeout=_POLL_S))
            except queue.Empty:
                message = ()
            if message[:1] in (("next",), ("end",)):
                return str(message[0])
            if self.parent is not None and not self.parent.is_alive():
                return None
        return None

    def _take_up(self, ranks: list[int], config: SimConfig) -> bool:
        """Once the parent says so, this worker's nodes take up the next run (`config`): each
        peer's protocol ended when it reported, and a peer of the next run, with a fresh model,
        takes over its node. False if the parent goes no further (the run failed) or is gone;
        SimError if it says nothing for ready_timeout_s."""
        word = self._parents_word(config.ready_timeout_s)
        if word is None and (self.parent is None or self.parent.is_alive()):
            raise SimError(f"worker {self.index} timed out after {config.ready_timeout_s:g} s waiting for "
                           "the next run")
        if word != "next":
            return False
        for rank in ranks:
            self.peers[rank] = self.peers[rank].then(config)
            self.peers[rank].create_protocol()
        self.config = config
        return True

    def _peer(self, rank: int) -> SimPeer:
        self.peers[rank] = SimPeer(self.config, self.task, rank,
                                   endpoint_for(self.config.transport, rank, self.ipc_dir, "", self.host),
                                   self._on_step, self.crashed)
        return self.peers[rank]

    def _on_step(self, rank: int, step: int) -> None:
        self.furthest = max(self.furthest, step)

    def _announce(self, peer: SimPeer) -> None:
        record = peer.node.record
        self.link.queue.put(("address", peer.rank, peer.node.address, peer.node.peer_id,
                             None if record is None else record.to_wire()))

    def _form_swarm(self, ranks: list[int]) -> bool:
        """Start this worker's peers through rank 0 and wait until they see the swarm; False
        if the run was given up first."""
        began = time.monotonic()
        peers = [self._peer(rank) for rank in ranks]
        if 0 in self.peers:
            self.peers[0].start([])
            self._announce(self.peers[0])
        early = []  # introductions that came first: a Ray actor's deliveries run on threads, in no order
        while True:
            message = self._next_message(self.config.ready_timeout_s, "rank 0's address")
            if message is None:
                return False
            if message[0] == "swarm":
                break
            early.append(message)
        first, seed_id = message[1], message[2]
        others = [peer for peer in peers if peer.rank != 0]
        if others and 0 not in self.peers:
            # One of ours joins through rank 0 and the rest through it (rank 0 after it): with
            # every joiner going through rank 0, its process, whose network thread runs its other
            # nodes too, would answer a thousand hellos while the last joiners everywhere wait.
            start_together(others[:1], [first], on_started=self._announce)
            others, joins = others[1:], [others[0].node.address, first]
        else:
            joins = [first]
        start_together(others, joins, on_started=self._announce)  # news for the parent as each joins
        started = time.monotonic()
        log.info("worker %d: its %d peers joined in %.1f s", self.index, len(peers), started - began)
        for message in early:
            self._introduce(peers, seed_id, message)
        if not self._wait_until_peers_see_each_other(peers, seed_id):
            return False
        log.info("worker %d: its peers saw the swarm %.1f s later", self.index, time.monotonic() - started)
        for peer in peers:
            peer.create_protocol()
        return True

    def _wait_for_start(self, ranks: list[int]) -> bool:
        """Report `ranks` ready and wait for the parent's start; False if the run was given up."""
        self.link.queue.put(("ready", self.index, ranks))
        while not self.link.start.wait(_POLL_S):
            if self._given_up():
                return False
        return True

    def _wait_until_peers_see_each_other(self, peers: list[SimPeer], seed_id: str) -> bool:
        """Wait until each of `peers` sees every other peer of the swarm, telling the parent
        while that count grows; SimError once it has not grown for ready_timeout_s. Peers
        still short pull rank 0's table now and then: the other workers join while this one
        waits, and the seed hears every hello."""
        needed = len(peers) * (self.config.peers - 1)
        best, moved, told = -1, time.monotonic(), 0.0
        pull_every_s = max(1.0, self.config.peers / 256)
        pulled = -pull_every_s
        while True:
            raise_if_faulted(peers)
            counts = on_network_thread(peers, lambda p: len(p.node.live_peers_here()))
            seen = sum(min(n, self.config.peers - 1) for n in counts)
            if seen >= needed:
                return True
            now = time.monotonic()
            if seen > best:
                best, moved = seen, now
                if now - told > 1.0:
                    told = now
                    self.link.queue.put(("forming", self.index, seen))
            elif now - moved > self.config.ready_timeout_s:
                raise SimError(f"worker {self.index}: its peers saw {seen} of the {needed} links to the rest "
                               f"of the swarm, and none more for {self.config.ready_timeout_s:g} s")
            if self._given_up():
                return False
            self._take_introductions(peers, seed_id)
            if now - pulled > pull_every_s:
                sync_with_seed(peers, seed_id, self.config.peers)
                pulled = time.monotonic()
            time.sleep(max(_POLL_S, len(peers) / 1000))  # each poll asks every peer of this worker

    def _take_introductions(self, peers: list[SimPeer], seed_id: str) -> None:
        """Records of peers that joined in other workers, which the parent passes on while the
        swarm forms (a tracker's introductions): each of ours learns them as relayed by the seed
        (`Node.add_records`: checked, each signature once per process). A thousand joins at once
        otherwise reach the peers of other workers only by gossip, a few records a message, or by
        table pulls from the seed, which a joiner turned away as busy never greeted."""
        while True:
            message = self._next_message(0.0)
            if message is None:
                return
            self._introduce(peers, seed_id, message)

    @staticmethod
    def _introduce(peers: list[SimPeer], seed_id: str, message: tuple[Any, ...]) -> None:
        if message[0] != "records":
            return  # nothing else comes while the swarm forms
        on_network_thread(peers, lambda p: p.node.add_records_here([r for r in message[1] if r[0] != p.node.peer_id],
                                                                   told_by=seed_id))

    def _serve(self, t0: float) -> None:
        """Until the parent says stop: launch joiners, pass on progress, report ended peers."""
        reported: set[int] = set()
        sent_step = 0
        while not self._given_up():
            message = self._next_message(_POLL_S)
            while message is not None:  # join:COUNT@STEP sends COUNT at once
                if message[0] != "join":  # introductions sent while the swarm formed: too late now
                    message = self._next_message(0.0)
                    continue
                _, rank, addresses, expected = message
                self._train_in_thread(rank, self._join, self._peer(rank), addresses, set(expected), t0)
                message = self._next_message(0.0)
            if self.furthest > sent_step:
                sent_step = self.furthest
                self.link.queue.put(("step", self.index, sent_step))
            for rank, thread in list(self.threads.items()):
                if rank not in reported and not thread.is_alive():
                    reported.add(rank)
                    self.link.queue.put(("done", rank, self.peers[rank].result.status))

    def _join(self, joiner: SimPeer, addresses: list[str], expected: set[str], t0: float) -> None:
        if joiner.join_swarm(addresses, expected):
            self._announce(joiner)
            joiner.train(t0)

    def _train_in_thread(self, rank: int, target: Callable[..., None], *args: Any) -> None:
        self.threads[rank] = threading.Thread(target=target, args=args, name=f"sim-peer-{rank}", daemon=True)
        self.threads[rank].start()

    def _report(self, close: bool = True) -> None:
        """Every peer is done: collect and close ours (with `close` False, end their protocols
        and keep their nodes, for the next run or until every worker has reported), then send
        their results."""
        if close:
            self.close()
        else:
            for peer in self.peers.values():
                peer.end_protocol()
        for rank in sorted(self.peers):
            self.link.queue.put(("result", rank, self.peers[rank].result))

    def _given_up(self) -> bool:
        if self.parent is not None and not self.parent.is_alive():
            self.link.queue.cancel_join_thread()  # nobody reads it: exit without flushing
            raise SimError("the parent process is gone")
        return bool(self.link.stop.is_set())

    def _next_message(self, timeout_s: float, what: str = "") -> tuple[Any, ...] | None:
        """The next message in the inbox; None on a quiet poll (`what` empty) or once the run is
        given up. With `what`, waits up to `timeout_s` and raises SimError past it."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if timeout_s <= 0:
                    return tuple(self.inbox.get_nowait())
                return tuple(self.inbox.get(timeout=min(_POLL_S, timeout_s)))
            except queue.Empty:
                pass
            if self._given_up() or not what:
                return None
            if time.monotonic() > deadline:
                raise SimError(f"worker {self.index} timed out after {timeout_s:g} s waiting for {what}")

    def close(self) -> None:
        closing = [self.peers[rank] for rank in sorted(self.peers) if rank not in self.closed]
        self.closed.update(peer.rank for peer in closing)
        close_together(closing)


# ---------------------------------------------------------------------------- the parent side
class Workers(abc.ABC):
    """How the parent reaches its workers: start them, send to one, read what they sent, and
    know which have ended. Every call returns within its timeout (or at once)."""

    @abc.abstractmethod
    def launch(self, config: SimConfig, holds: list[list[int]], log_level: int, then: SimConfig | None = None
               ) -> None:
        """Start worker i on the ranks `holds[i]`; with `then`, the run its nodes take up next
        (`next_run`)."""

    @abc.abstractmethod
    def send(self, index: int, message: tuple[Any, ...]) -> None:
        """Put `message` in worker `index`'s inbox."""

    @abc.abstractmethod
    def receive(self, timeout_s: float) -> tuple[list[tuple[Any, ...]], dict[int, str]]:
        """What the workers sent (waiting up to `timeout_s` for the first message), and the
        workers that have ended, each with how ("exited with code -9"). A worker is listed as
        ended only once everything it sent has been returned."""

    @abc.abstractmethod
    def begin(self, t0: float) -> None:
        """Every worker starts training, with `t0` the run's time.time() at the start."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Every worker reports and closes its peers (or, given up on, just stops)."""

    @abc.abstractmethod
    def close(self, finished: bool) -> None:
        """Wait briefly for the workers to end (longer for a `finished` run), then end them."""

    def next_run(self) -> None:
        """Every worker, its results of one run sent, takes up the next on the same nodes
        (`Parent`'s `then`): training not started, not stopped. Workers that cannot raise
        NotImplementedError, and the parent never asks them."""
        raise NotImplementedError

    @abc.abstractmethod
    def name(self, index: int) -> str:
        """Worker `index` for an error message: "worker process 1"."""

    def where(self, index: int) -> dict[str, Any]:
        """Where worker `index` ran, for the run's summary (empty: this machine)."""
        return {}


class ProcessWorkers(Workers):
    """Workers as processes of this machine, forked by the simulator's fork server
    (`runtime/forking.py`): torch is imported once, not once a worker."""

    def __init__(self, config: SimConfig) -> None:
        self.ctx = fork_context()
        self.link = WorkerLink(self.ctx.Queue(), self.ctx.Event(), self.ctx.Event(), self.ctx.Value("d", 0.0))
        self.ipc_dir = tempfile.mkdtemp(prefix="starling-sim-") if config.transport == "ipc" else ""
        self.inboxes: list[Any] = []
        self.processes: list[Any] = []

    def launch(self, config: SimConfig, holds: list[list[int]], log_level: int, then: SimConfig | None = None
               ) -> None:
        self.inboxes = [self.ctx.Queue() for _ in holds]
        for index, ranks in enumerate(holds):
            worker = self.ctx.Process(
                target=run_forked, name=f"sim-worker-{index}", daemon=True,
                args=forked_args(worker_main, config, index, list(ranks), self.inboxes[index], self.link,
                                 self.ipc_dir, log_level, "127.0.0.1", then))
            worker.start()
            self.processes.append(worker)  # only started ones: `close` joins them

    def send(self, index: int, message: tuple[Any, ...]) -> None:
        self.inboxes[index].put(message)

    def receive(self, timeout_s: float) -> tuple[list[tuple[Any, ...]], dict[int, str]]:
        # Exit codes first, then the queue: what an exited worker sent is in the queue by now.
        ended = {w: f"exited with code {p.exitcode}" for w, p in enumerate(self.processes) if p.exitcode is not None}
        messages: list[tuple[Any, ...]] = []
        try:
            messages.append(self.link.queue.get(timeout=timeout_s))
            while True:
                messages.append(self.link.queue.get_nowait())
        except queue.Empty:
            pass
        return messages, ended

    def begin(self, t0: float) -> None:
        self.link.t0.value = t0
        self.link.start.set()

    def stop(self) -> None:
        self.link.stop.set()

    def next_run(self) -> None:
        self.link.start.clear()
        self.link.stop.clear()
        for inbox in self.inboxes:
            inbox.put(("next",))

    def close(self, finished: bool) -> None:
        for inbox in self.inboxes:  # a worker waiting for a next run that will not come ends now
            inbox.put(("end",))
        # A worker given up on may hold training threads and unread messages: do not wait long.
        if not finished:
            for inbox in self.inboxes:
                inbox.cancel_join_thread()  # what a dead worker never read must not hold our exit
        deadline = time.monotonic() + (30.0 if finished else 3.0)  # finished: its workers close their nodes now
        for worker in self.processes:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)

    def name(self, index: int) -> str:
        return f"worker process {index}"


class Parent:
    """Starts the workers, relays rank 0's address, launches joiners, collects results.

    With `then` (a run on the same swarm, the baseline: see `Simulation.run_compared`), once
    every result of the first run came, each worker's nodes take up `then`, with fresh models,
    and train it from a start of its own: the swarm forms once for both runs."""

    def __init__(self, config: SimConfig, workers: Workers, progress: ProgressFn | None,
                 then: SimConfig | None = None, then_progress: ProgressFn | None = None) -> None:
        self.config, self.workers, self.progress = config, workers, progress
        self.then, self.then_progress = then, then_progress
        self.holds = placement(config.peers, config.processes)  # worker -> the ranks it ever ran
        self.addresses: dict[int, tuple[str, str]] = {}  # rank -> (address, peer id)
        self.ready = 0
        self.furthest = 0
        self.done: dict[int, str] = {}  # rank -> final status
        self.results: dict[int, PeerResult] = {}
        self.forming = False  # while the swarm forms, records are passed on to every worker
        self._introduce: list[Any] = []  # records not yet passed on
        self._introduced_at = 0.0

    def run(self) -> tuple[list[PeerResult], float]:
        """The run's peers' results, and its start (time.time())."""
        return self.run_all()[0]

    def run_all(self) -> list[tuple[list[PeerResult], float]]:
        """Each run's peers' results and start: the run's, then `then`'s if there is one."""
        config, workers = self.config, self.workers
        finished = False
        try:
            if self.then is None:
                workers.launch(config, self.holds, logging.getLogger().getEffectiveLevel())
            else:
                workers.launch(config, self.holds, logging.getLogger().getEffectiveLevel(), self.then)
            began = time.monotonic()
            self._until(lambda: 0 in self.addresses, "the workers to start rank 0")
            log.info("rank 0 listens after %.1f s; %d workers now start their peers", time.monotonic() - began,
                     len(self.holds))
            for index in range(len(self.holds)):
                workers.send(index, ("swarm", *self.addresses[0]))
            self.forming = True
            self._until(lambda: self.ready == config.peers, "the workers' peers to form a swarm")
            self.forming = False
            log.info("%d peers in %d workers formed a swarm in %.1f s", config.peers, len(self.holds),
                     time.monotonic() - began)
            runs = []
            for progress in [self.progress] + ([self.then_progress] if self.then is not None else []):
                if runs:  # the next run, on the nodes that trained the last
                    self.ready, self.furthest, self.done, self.results = 0, 0, {}, {}
                    workers.next_run()
                    began = time.monotonic()
                    self._until(lambda: self.ready == config.peers, "the workers' peers to take up the next run")
                    log.info("the nodes took up the next run in %.1f s", time.monotonic() - began)
                self.progress = progress
                t0 = time.time()
                workers.begin(t0)
                self._train()
                trained = time.monotonic()
                workers.stop()
                self._until(lambda: len(self.results) == len(self.done), "the workers to report their peers")
                log.info("the workers reported their peers %.1f s after the last step", time.monotonic() - trained)
                runs.append(([self.results[rank] for rank in sorted(self.results)], t0))
                if any(result.status == "failed" for result in runs[-1][0]):
                    break  # the failure is the outcome (`summarize` names it): no next run
            finished = True
            return runs
        finally:
            workers.stop()
            workers.close(finished)

    def placed(self) -> list[dict[str, Any]]:
        """Each worker's ranks and where it ran."""
        return [{"worker": index, "ranks": list(ranks), **self.workers.where(index)}
                for index, ranks in enumerate(self.holds)]

    def _train(self) -> None:
        joins = sorted((e for e in self.config.churn if e.kind == "join"), key=lambda e: e.step)
        launched = self.config.peers
        while len(self.done) < launched:
            while joins and self.furthest >= joins[0].step:
                for _ in range(joins.pop(0).count):
                    self._launch_joiner(launched)
                    launched += 1
            self._pump()
            if self.progress is not None:
                self.progress(self.furthest)

    def _launch_joiner(self, rank: int) -> None:
        live = {r: a for r, a in self.addresses.items() if r not in self.done or self.done[r] == "finished"}
        worker = min(range(len(self.holds)),
                     key=lambda w: (sum(r not in self.done for r in self.holds[w]), w))
        self.holds[worker].append(rank)
        running = [peer_id for r, (_, peer_id) in live.items() if r not in self.done]
        self.workers.send(worker, ("join", rank, [address for address, _ in live.values()], running))

    def _until(self, cond: Callable[[], bool], what: str) -> None:
        """Pump until `cond`; SimError once no worker has said anything for ready_timeout_s."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise SimError(f"timed out after {self.config.ready_timeout_s:g} s without news waiting for {what}")
            if self._pump():
                deadline = time.monotonic() + self.config.ready_timeout_s

    def _pump(self) -> bool:
        """Read what the workers sent (up to _POLL_S for the first message), and say whether
        anything came; raise SimError if a worker failed or ended while it still held ranks
        whose results never came."""
        messages, ended = self.workers.receive(_POLL_S)
        for message in messages:
            self._handle(message)
        now = time.monotonic()
        if self.forming and self._introduce and now - self._introduced_at >= _INTRODUCE_EVERY_S:
            for index in range(len(self.holds)):
                self.workers.send(index, ("records", self._introduce))
            self._introduce, self._introduced_at = [], now
        for index, how in ended.items():
            missing = [rank for rank in self.holds[index] if rank not in self.results]
            if missing:
                raise SimError(f"{self.workers.name(index)} {how} while it held "
                               f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
        return bool(messages)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "address":
            self.addresses[message[1]] = (message[2], message[3])
            if self.forming and len(message) > 4 and message[4] is not None:
                self._introduce.append(message[4])
        elif kind == "ready":
            self.ready += len(message[2])
        elif kind == "step":
            self.furthest = max(self.furthest, message[2])
        elif kind == "done":
            self.done[message[1]] = message[2]
        elif kind == "forming":
            pass  # news that the swarm is still forming: `_until` waits on
        elif kind == "result":
            self.results[message[1]] = message[2]
        elif kind == "error":
            index = message[1]
            raise SimError(f"{self.workers.name(index)} (ranks {', '.join(map(str, self.holds[index]))}) "
                           f"failed: {message[2]}")


def run_processes(config: SimConfig, progress: ProgressFn | None, then: SimConfig | None = None,
                  then_progress: ProgressFn | None = None) -> list[tuple[list[PeerResult], float]]:
    """Run `config.peers` peers in `config.processes` worker processes and collect their
    results and start; with `then`, that run next on the same nodes, and its results too."""
    return Parent(config, ProcessWorkers(config), progress, then, then_progress).run_all()
