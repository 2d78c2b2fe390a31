"""`starling simulate --nproc-per-replica N`: every simulated peer is a replica of N gloo ranks.

Each rank is its own process (spawned), so the replica's ranks form a real torch.distributed
group (rendezvous through a file in a temporary directory). Rank 0 of each replica runs a
`SimPeer` over tcp on loopback, exactly as a peer of `--processes` does, and leads its
replica (`runtime/replica.py`); the other ranks follow it.

Start-up: every rank of the initial replicas is spawned at once; replica 0's leader reports
its address, the parent hands it to the other leaders, they join and wait until each sees all
the others, then report ready; the parent sets `start` with the shared t0.

Churn, by replica index: `kill:R@STEP` SIGKILLs the last rank of replica R (a follower: its
leader notices at its next collective and leaves the swarm cleanly; a killed leader would be
a crash, as `--processes` shows), `leave:R@STEP` makes R's leader leave and stop its ranks,
`join@STEP` spawns a new replica that joins, fetches the swarm's state and hands it to its
followers. Every wait is bounded: a replica whose leader exits without a result fails the run
naming it, and the run gives up once nothing has been heard for the replica timeout plus the
ready timeout.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from starling.runtime.peer import SimPeer
from starling.runtime.replica import ReplicaGroup, follow
from starling.runtime.sim_processes import ProgressFn
from starling.runtime.simconfig import SimConfig, SimError, wait_for
from starling.runtime.summary import PeerResult
from starling.runtime.trainer import prepare_to_train
from starling.tasks import get_task

log = logging.getLogger(__name__)

_POLL_S = 0.05


def _rank_main(config: SimConfig, replica: int, rank: int, init_method: str, inbox: Any, out: Any, start: Any,
               t0: Any, go: Any, joining: bool, log_level: int) -> None:
    """One rank's process: rank 0 leads the replica as a simulated peer, the others follow it.
    A joining replica's ranks are spawned with the others (importing torch takes seconds) and
    wait for `go`, set at their join step."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    group = ReplicaGroup(rank, config.nproc_per_replica, init_method, config.replica_timeout_s)
    parent = multiprocessing.parent_process()
    if rank == 0:
        prepare_to_train()
    while not go.wait(_POLL_S * 4):
        if parent is not None and not parent.is_alive():
            return
    if rank:
        try:
            out.put(("follower", replica, follow(group).to_json()))
        except Exception as exc:
            log.warning("replica %d rank %d stopped: %s: %s", replica, rank, type(exc).__name__, exc)
        return
    try:
        group.init()
        _lead(config, replica, group, inbox, out, start, t0, joining)
    except Exception as exc:
        log.exception("replica %d's leader failed", replica)
        out.put(("error", replica, f"{type(exc).__name__}: {exc}"))
    finally:
        group.close()


def _lead(config: SimConfig, replica: int, group: ReplicaGroup, inbox: Any, out: Any, start: Any, t0: Any,
          joining: bool) -> None:
    # The parent SIGKILLs a rank for kill:R; the leader itself trains on until its group breaks.
    own = replace(config, churn=tuple(e for e in config.churn if e.kind != "kill"))
    peer = SimPeer(own, get_task(config.task, **config.task_options), replica, "tcp://127.0.0.1:0",
                   lambda rank, step: out.put(("step", rank, step)), group=group)
    try:
        if joining:
            addresses, expected = inbox.get(timeout=config.ready_timeout_s)
            if not peer.join_swarm(addresses, set(expected)):
                out.put(("result", replica, peer.result, {}))
                return
            out.put(("address", replica, peer.node.address, peer.node.peer_id))
            peer.train(t0.value)
        else:
            if replica == 0:
                peer.start([])
                out.put(("address", replica, peer.node.address, peer.node.peer_id))
            else:
                peer.start([inbox.get(timeout=config.ready_timeout_s)])
                out.put(("address", replica, peer.node.address, peer.node.peer_id))
            wait_for(lambda: len(peer.node.live_peers()) >= config.peers - 1, config.ready_timeout_s,
                     f"{config.peers} replicas to see each other")
            peer.create_protocol()
            out.put(("ready", replica))
            if not start.wait(config.ready_timeout_s):
                raise SimError("the run did not start")
            peer.train(t0.value)
        digests = peer.trainer.replica.digests() if peer.trainer and peer.trainer.replica \
            and peer.result.status == "finished" else {}
        if peer.trainer is not None:
            peer.trainer.finish_replica()
        if config.stop_at(replica) is not None and peer.result.status == "failed":
            peer.result.status = "killed" if config.stop_at(replica)[0] == "kill" else "left"  # type: ignore[index]
        out.put(("result", replica, peer.result, digests))
    finally:
        peer.close()


class _Replicas:
    """The parent: spawns every replica's ranks, relays addresses, applies churn, collects."""

    def __init__(self, config: SimConfig, progress: ProgressFn | None) -> None:
        self.config, self.progress = config, progress
        # A fork server that has imported torch and Starling once: each rank is then a fork of
        # it, not a fresh interpreter importing torch (seconds each, on a busy 2-core box).
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload([__name__])
        self.out = self.ctx.Queue()
        self.start, self.t0 = self.ctx.Event(), self.ctx.Value("d", 0.0)
        self.dir = tempfile.mkdtemp(prefix="starling-replicas-")
        self.procs: dict[int, list[Any]] = {}
        self.inboxes: dict[int, Any] = {}
        self.go: dict[int, Any] = {}
        self.addresses: dict[int, tuple[str, str]] = {}
        self.results: dict[int, PeerResult] = {}
        self.digests: dict[int, list[dict[str, Any]]] = {}
        self.ready: set[int] = set()
        self.furthest = 0
        self.heard = time.monotonic()

    def launch(self, replica: int, joining: bool) -> None:
        """Spawn the replica's ranks; a joiner's wait for `go` (see `join`)."""
        inbox = self.inboxes[replica] = self.ctx.Queue()
        go = self.go[replica] = self.ctx.Event()
        if not joining:
            go.set()
        init = f"file://{self.dir}/replica-{replica}"
        level = logging.getLogger().getEffectiveLevel()
        self.procs[replica] = []
        for rank in range(self.config.nproc_per_replica):
            proc = self.ctx.Process(target=_rank_main, name=f"replica-{replica}-rank-{rank}", daemon=True,
                                    args=(self.config, replica, rank, init, inbox, self.out, self.start, self.t0,
                                          go, joining, level))
            proc.start()
            self.procs[replica].append(proc)

    def join(self, replica: int) -> None:
        """A spawned joiner's turn: it greets the live replicas' leaders."""
        live = [r for r in self.addresses if r not in self.results]
        self.inboxes[replica].put(([self.addresses[r][0] for r in live], [self.addresses[r][1] for r in live]))
        self.go[replica].set()

    def handle(self, message: tuple[Any, ...]) -> None:
        self.heard = time.monotonic()
        kind, replica = message[0], message[1]
        if kind == "step":
            self.furthest = max(self.furthest, message[2])
            if self.progress is not None:
                self.progress(self.furthest)
        elif kind == "address":
            self.addresses[replica] = (message[2], message[3])
            if replica == 0 and not self.start.is_set():
                for other in range(1, self.config.peers):
                    self.inboxes[other].put(message[2])
        elif kind == "ready":
            self.ready.add(replica)
        elif kind == "follower":
            self.digests.setdefault(replica, []).append(message[2])
        elif kind == "result":
            result, leader = message[2], message[3]
            if leader:
                self.digests.setdefault(replica, []).append({"rank": 0, **leader})
            self.results[replica] = result
        elif kind == "error":
            self.results[replica] = PeerResult(replica, "", status="failed", error=message[2])

    def poll(self, timeout_s: float) -> None:
        try:
            self.handle(self.out.get(timeout=timeout_s))
        except queue.Empty:
            pass
        for replica, procs in self.procs.items():  # a leader gone without a word: fail, naming it
            if replica not in self.results and not procs[0].is_alive():
                self.poll_rest()
                if replica not in self.results:
                    self.results[replica] = PeerResult(replica, "", status="failed",
                                                       error=f"replica {replica}'s leader exited "
                                                             f"(code {procs[0].exitcode}) without a result")

    def poll_rest(self) -> None:
        while True:
            try:
                self.handle(self.out.get(timeout=0.2))
            except queue.Empty:
                return

    def run(self) -> tuple[list[PeerResult], float]:
        config = self.config
        for replica in range(config.peers):
            self.launch(replica, joining=False)
        joiners = iter(range(config.peers, config.world))
        for replica in range(config.peers, config.world):
            self.launch(replica, joining=True)
        self._until(lambda: len(self.ready) == config.peers, "the replicas to form a swarm")
        self.t0.value = t0 = time.time()
        self.start.set()
        churn = sorted((e for e in config.churn if e.kind in ("kill", "join")), key=lambda e: e.step)
        while len(self.results) < len(self.procs):
            while churn and self.furthest >= churn[0].step:
                event = churn.pop(0)
                if event.kind == "kill":
                    victim = self.procs[event.rank][-1]
                    log.info("SIGKILL replica %d rank %d (pid %s)", event.rank, len(self.procs[event.rank]) - 1,
                             victim.pid)
                    os.kill(victim.pid, signal.SIGKILL)
                else:
                    for _ in range(event.count):
                        self.join(next(joiners))
            self.poll(_POLL_S)
            if time.monotonic() - self.heard > config.replica_timeout_s + config.ready_timeout_s:
                raise SimError(f"no replica reported anything for {time.monotonic() - self.heard:.0f} s")
        self._wait_for_followers()
        for replica, result in self.results.items():
            result.protocol_info = {**result.protocol_info, "replica": {
                "ranks": config.nproc_per_replica, "digests": sorted(self.digests.get(replica, []),
                                                                      key=lambda d: d["rank"])}}
        return [self.results[r] for r in sorted(self.results)], t0

    def _wait_for_followers(self) -> None:
        """Followers report after their leader's STOP: give them a moment to."""
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and any(p.is_alive() for procs in self.procs.values() for p in procs[1:]):
            self.poll(_POLL_S)
        self.poll_rest()

    def _until(self, done: Any, what: str) -> None:
        while not done():
            self.poll(_POLL_S)
            failed = [r for r in self.results.values() if r.status == "failed"]
            if failed:
                raise SimError(f"replica {failed[0].rank} failed: {failed[0].error}")
            if time.monotonic() - self.heard > self.config.ready_timeout_s:
                raise SimError(f"timed out after {self.config.ready_timeout_s:g} s waiting for {what}")

    def close(self, finished: bool) -> None:
        """Wait for the ranks to exit (a run given up on: kill them now)."""
        deadline = time.monotonic() + (10.0 if finished else 0.0)
        for procs in self.procs.values():
            for proc in procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5.0)
        for inbox in self.inboxes.values():
            inbox.cancel_join_thread()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_replicas(config: SimConfig, progress: ProgressFn | None = None) -> tuple[list[PeerResult], float]:
    """Run the swarm of replicas to the end: one PeerResult per replica, whose
    `protocol_info["replica"]` holds every rank's digests of its model and the swarm's."""
    replicas = _Replicas(config, progress)
    finished = False
    try:
        outcome = replicas.run()
        finished = True
        return outcome
    finally:
        replicas.close(finished)
