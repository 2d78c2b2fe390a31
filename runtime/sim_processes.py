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
1. The parent spawns every worker at once. The worker that holds rank 0 starts it and reports
   its address.
2. The parent hands that address to every worker; each starts its peers, which join through
   rank 0 (as in the threaded simulator), waits until each sees all the others, builds their
   protocols and reports them ready.
3. The parent sets `start` (with the shared `t0`) and the workers start their training threads.

Workers talk to the parent through one queue (see `_Link`); the parent talks to a worker through
the worker's inbox (rank 0's address, joins). When a peer's thread ends its worker reports it
`done`; when every peer is done the parent sets `stop`, and each worker then collects its peers'
counters, sends their `PeerResult`s and closes them (as the threaded simulator does once every
thread has ended, so both count the same bytes). A worker that exits while it still holds ranks
whose results never came fails the run with a `SimError` naming them; a worker whose parent is
gone stops. No wait on either side is unbounded.
"""
from __future__ import annotations

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

from starling.runtime.peer import SimPeer, raise_if_faulted, start_together, sync_with_seed
from starling.runtime.simconfig import SimConfig, SimError, endpoint_for
from starling.runtime.summary import PeerResult
from starling.runtime.trainer import prepare_to_train
from starling.tasks import get_task

log = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]
_POLL_S = 0.05


@dataclass
class _Link:
    """What the parent shares with every worker."""

    # worker -> parent: ("address", rank, address, peer_id) | ("forming", worker, links_seen)
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
def _worker_main(config: SimConfig, index: int, ranks: list[int], inbox: Any, link: _Link, ipc_dir: str,
                 log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    prepare_to_train()
    worker = _Worker(config, index, inbox, link, ipc_dir)
    try:
        worker.run(ranks)
    except Exception as exc:
        log.exception("worker %d failed", index)
        link.queue.put(("error", index, f"{type(exc).__name__}: {exc}"))
    finally:
        worker.close()


class _Worker:
    """One worker process: some of the swarm's peers, each training in its own thread."""

    def __init__(self, config: SimConfig, index: int, inbox: Any, link: _Link, ipc_dir: str) -> None:
        self.config, self.index, self.inbox, self.link, self.ipc_dir = config, index, inbox, link, ipc_dir
        self.task = get_task(config.task, **config.task_options)
        self.crashed: set[str] = set()  # shared by this worker's peers, as in the threaded simulator
        self.peers: dict[int, SimPeer] = {}
        self.closed: set[int] = set()
        self.threads: dict[int, threading.Thread] = {}
        self.furthest = 0
        self.parent = multiprocessing.parent_process()

    def run(self, ranks: list[int]) -> None:
        if not self._form_swarm(ranks):
            return
        t0 = self.link.t0.value
        for rank in ranks:
            self._train_in_thread(rank, self.peers[rank].train, t0)
        self._serve(t0)
        if all(not thread.is_alive() for thread in self.threads.values()):
            self._report()  # else the run was given up: the parent wants no results

    def _peer(self, rank: int) -> SimPeer:
        self.peers[rank] = SimPeer(self.config, self.task, rank,
                                   endpoint_for(self.config.transport, rank, self.ipc_dir, ""),
                                   self._on_step, self.crashed)
        return self.peers[rank]

    def _on_step(self, rank: int, step: int) -> None:
        self.furthest = max(self.furthest, step)

    def _announce(self, peer: SimPeer) -> None:
        self.link.queue.put(("address", peer.rank, peer.node.address, peer.node.peer_id))

    def _form_swarm(self, ranks: list[int]) -> bool:
        """Start this worker's peers through rank 0 and report them ready; False if the run
        was given up first."""
        peers = [self._peer(rank) for rank in ranks]
        if 0 in self.peers:
            self.peers[0].start([])
            self._announce(self.peers[0])
        message = self._next_message(self.config.ready_timeout_s, "rank 0's address")
        if message is None:
            return False
        first, seed_id = message[1], message[2]
        others = [peer for peer in peers if peer.rank != 0]
        start_together(others, [first])
        for peer in others:
            self._announce(peer)
        if not self._wait_until_peers_see_each_other(peers, seed_id):
            return False
        for peer in peers:
            peer.create_protocol()
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
            seen = sum(min(len(p.node.live_peers()), self.config.peers - 1) for p in peers)
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
            if now - pulled > pull_every_s:
                sync_with_seed(peers, seed_id, self.config.peers)
                pulled = time.monotonic()
            time.sleep(max(_POLL_S, len(peers) / 1000))  # each poll asks every peer of this worker

    def _serve(self, t0: float) -> None:
        """Until the parent says stop: launch joiners, pass on progress, report ended peers."""
        reported: set[int] = set()
        sent_step = 0
        while not self._given_up():
            message = self._next_message(_POLL_S)
            while message is not None:  # join:COUNT@STEP sends COUNT at once
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

    def _report(self) -> None:
        """Every peer is done: collect and close ours, then send their results."""
        for rank in sorted(self.peers):
            self._close(rank)
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

    def _close(self, rank: int) -> None:
        if rank not in self.closed:
            self.closed.add(rank)
            self.peers[rank].close()

    def close(self) -> None:
        for rank in sorted(self.peers):
            self._close(rank)


# ---------------------------------------------------------------------------- the parent side
class _Parent:
    """Spawns the workers, relays rank 0's address, launches joiners, collects results."""

    def __init__(self, config: SimConfig, progress: ProgressFn | None) -> None:
        self.config, self.progress = config, progress
        self.ctx = multiprocessing.get_context("spawn")
        self.link = _Link(self.ctx.Queue(), self.ctx.Event(), self.ctx.Event(), self.ctx.Value("d", 0.0))
        self.ipc_dir = tempfile.mkdtemp(prefix="starling-sim-") if config.transport == "ipc" else ""
        self.holds = placement(config.peers, config.processes)  # worker -> the ranks it ever ran
        self.inboxes = [self.ctx.Queue() for _ in self.holds]
        self.workers: list[Any] = []
        self.addresses: dict[int, tuple[str, str]] = {}  # rank -> (address, peer id)
        self.ready = 0
        self.furthest = 0
        self.done: dict[int, str] = {}  # rank -> final status
        self.results: dict[int, PeerResult] = {}

    def run(self) -> tuple[list[PeerResult], float]:
        config, log_level = self.config, logging.getLogger().getEffectiveLevel()
        finished = False
        try:
            for index, ranks in enumerate(self.holds):
                worker = self.ctx.Process(
                    target=_worker_main, name=f"sim-worker-{index}", daemon=True,
                    args=(config, index, list(ranks), self.inboxes[index], self.link, self.ipc_dir, log_level))
                worker.start()
                self.workers.append(worker)  # only started ones: the cleanup joins them
            began = time.monotonic()
            self._until(lambda: 0 in self.addresses, "the worker processes to start rank 0")
            log.info("rank 0 listens after %.1f s; %d workers now start their peers", time.monotonic() - began,
                     len(self.workers))
            for inbox in self.inboxes:
                inbox.put(("swarm", *self.addresses[0]))
            self._until(lambda: self.ready == config.peers, "the peer processes to form a swarm")
            log.info("%d peers in %d processes formed a swarm in %.1f s", config.peers, len(self.workers),
                     time.monotonic() - began)
            self.link.t0.value = t0 = time.time()
            self.link.start.set()
            self._train()
            self.link.stop.set()
            self._until(lambda: len(self.results) == len(self.done), "the workers to report their peers")
            finished = True
            return [self.results[rank] for rank in sorted(self.results)], t0
        finally:
            self.link.stop.set()
            # A worker given up on may hold training threads and unread messages: do not wait long.
            if not finished:
                for inbox in self.inboxes:
                    inbox.cancel_join_thread()  # what a dead worker never read must not hold our exit
            deadline = time.monotonic() + (15.0 if finished else 3.0)
            for worker in self.workers:
                worker.join(timeout=max(0.0, deadline - time.monotonic()))
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=5)

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
        self.inboxes[worker].put(("join", rank, [address for address, _ in live.values()], running))

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
        anything came; raise SimError if a worker failed or exited while it still held ranks
        whose results never came."""
        exited = [(w, p.exitcode) for w, p in enumerate(self.workers) if p.exitcode is not None]
        news = False
        try:  # drain after looking at exit codes: what an exited worker sent is in the queue by now
            message = self.link.queue.get(timeout=_POLL_S)
            while True:
                news = True
                self._handle(message)
                message = self.link.queue.get_nowait()
        except queue.Empty:
            pass
        for index, code in exited:
            missing = [rank for rank in self.holds[index] if rank not in self.results]
            if missing:
                raise SimError(f"worker process {index} exited with code {code} while it held "
                               f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
        return news

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "address":
            self.addresses[message[1]] = (message[2], message[3])
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
            raise SimError(f"worker process {index} (ranks {', '.join(map(str, self.holds[index]))}) "
                           f"failed: {message[2]}")


def run_processes(config: SimConfig, progress: ProgressFn | None) -> tuple[list[PeerResult], float]:
    """Run `config.peers` peers in `config.processes` worker processes and collect their results."""
    return _Parent(config, progress).run()
