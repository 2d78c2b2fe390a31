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

from starling.common.lifeline import die_with_parent
from starling.common.memory import peak_rss, peak_rss_reset
from starling.runtime.forking import fork_context, forked_args, run_forked
from starling.runtime.peer import SimPeer
from starling.runtime.replica import ReplicaGroup, follow
from starling.runtime.shard_sync import held_bytes
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
    die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    group = ReplicaGroup(rank, config.nproc_per_replica, init_method, config.replica_timeout_s)
    parent = multiprocessing.parent_process()
    if rank == 0 or config.shard_sync:
        prepare_to_train()
    while not go.wait(_POLL_S * 4):
        if parent is not None and not parent.is_alive():
            return
    if rank and not config.shard_sync:
        try:
            out.put(("follower", replica, follow(group).to_json()))
        except Exception as exc:
            log.warning("replica %d rank %d stopped: %s: %s", replica, rank, type(exc).__name__, exc)
        return
    try:
        group.init()
        _lead(config, replica, group, inbox, out, start, t0, joining, peak_rss_reset())
    except Exception as exc:
        log.exception("replica %d's rank %d failed", replica, rank)
        out.put(("error", replica, rank, f"{type(exc).__name__}: {exc}"))
    finally:
        group.close()


def _lead(config: SimConfig, replica: int, group: ReplicaGroup, inbox: Any, out: Any, start: Any, t0: Any,
          joining: bool, rss_before: int | None = None) -> None:
    """A replica's peer: its leader, or with shard sync any of its ranks (each in the sub-swarm
    of its rank, reached through the same rank of the other replicas)."""
    # The parent SIGKILLs a rank for kill:R; the others train on until their group breaks.
    own = replace(config, churn=tuple(e for e in config.churn if e.kind != "kill"))
    rank = group.rank
    peer = SimPeer(own, get_task(config.task, **config.task_options), replica, "tcp://127.0.0.1:0",
                   (lambda r, step: out.put(("step", r, step))) if rank == 0 else None, group=group)
    try:
        if joining:
            addresses, expected = inbox.get(timeout=config.ready_timeout_s)
            if not peer.join_swarm(addresses, set(expected)):
                out.put(("result", replica, rank, peer.result, {}))
                return
            out.put(("address", replica, rank, peer.node.address, peer.node.peer_id))
            peer.train(t0.value)
        else:
            if replica == 0:
                peer.start([])
                out.put(("address", replica, rank, peer.node.address, peer.node.peer_id))
            else:
                peer.start([inbox.get(timeout=config.ready_timeout_s)])
                out.put(("address", replica, rank, peer.node.address, peer.node.peer_id))
            wait_for(lambda: len(peer.node.live_peers()) >= config.peers - 1, config.ready_timeout_s,
                     f"{config.peers} replicas to see each other")
            peer.create_protocol()
            out.put(("ready", replica, rank))
            if not start.wait(config.ready_timeout_s):
                raise SimError("the run did not start")
            peer.train(t0.value)
        peer.collect()
        digests = _digests(peer, rss_before) if peer.result.status == "finished" else {}
        if peer.trainer is not None:
            peer.trainer.finish_replica()
        if config.stop_at(replica) is not None and peer.result.status == "failed":
            peer.result.status = "killed" if config.stop_at(replica)[0] == "kill" else "left"  # type: ignore[index]
        out.put(("result", replica, rank, peer.result, digests))
    finally:
        peer.close()


def _digests(peer: SimPeer, rss_before: int | None) -> dict[str, Any]:
    """What the rank ends holding: digests of its model and the swarm's (with shard sync, of
    its chunks of them), the bytes it sent, the peers it still sees, and its memory: the
    training state it holds (`held_bytes`) against how far its resident memory rose from
    before its model was built to its peak."""
    trainer = peer.trainer
    if trainer is None or trainer.proto is None:
        return {}
    out = {"bytes_sent": peer.result.bytes_sent, "live_peers": len(peer.node.live_peers()),
           "held_bytes": held_bytes(trainer.proto)}
    peak = peak_rss()
    if rss_before is not None and peak is not None:
        out["peak_rss_growth_bytes"] = peak - rss_before
    return {**trainer.replication.digests(trainer.proto), **out}


class _Replicas:
    """The parent: spawns every replica's ranks, relays addresses, applies churn, collects."""

    def __init__(self, config: SimConfig, progress: ProgressFn | None) -> None:
        self.config, self.progress = config, progress
        # A fork server that has imported torch and Starling once: each rank is then a fork of
        # it, not a fresh interpreter importing torch (seconds each, on a busy 2-core box). And
        # torch._dynamo, which torch imports at a process's first optimizer call: 1 s of CPU per
        # rank otherwise (two runs of two replicas of two ranks: 13.2 s of the ranks' CPU, 4.9 s).
        self.ctx = fork_context()
        self.out = self.ctx.Queue()
        self.start, self.t0 = self.ctx.Event(), self.ctx.Value("d", 0.0)
        self.dir = tempfile.mkdtemp(prefix="starling-replicas-")
        self.procs: dict[int, list[Any]] = {}
        self.inboxes: dict[int, list[Any]] = {}  # one per rank (with shard sync, each rank joins its sub-swarm)
        self.go: dict[int, Any] = {}
        self.addresses: dict[tuple[int, int], tuple[str, str]] = {}  # (replica, rank) -> (address, peer id)
        self.results: dict[int, PeerResult] = {}  # the replica's: its rank 0's (with the others' bytes added)
        self.rank_results: dict[int, dict[int, PeerResult]] = {}  # with shard sync: ranks > 0
        self.digests: dict[int, list[dict[str, Any]]] = {}
        self.ready: set[tuple[int, int]] = set()
        # the ranks of a replica that are peers of the swarm: all with shard sync, else its leader
        self.peer_ranks = config.nproc_per_replica if config.shard_sync else 1
        self.furthest = 0
        self.heard = time.monotonic()

    def launch(self, replica: int, joining: bool) -> None:
        """Spawn the replica's ranks; a joiner's wait for `go` (see `join`)."""
        inboxes = self.inboxes[replica] = [self.ctx.Queue() for _ in range(self.peer_ranks)]
        go = self.go[replica] = self.ctx.Event()
        if not joining:
            go.set()
        init = f"file://{self.dir}/replica-{replica}"
        level = logging.getLogger().getEffectiveLevel()
        self.procs[replica] = []
        for rank in range(self.config.nproc_per_replica):
            proc = self.ctx.Process(target=run_forked, name=f"replica-{replica}-rank-{rank}", daemon=True,
                                    args=forked_args(_rank_main, self.config, replica, rank, init,
                                                     inboxes[min(rank, self.peer_ranks - 1)], self.out, self.start,
                                                     self.t0, go, joining, level))
            proc.start()
            self.procs[replica].append(proc)

    def join(self, replica: int) -> None:
        """A spawned joiner's turn: each of its peer ranks greets the same rank of the live replicas."""
        for rank, inbox in enumerate(self.inboxes[replica]):
            live = [r for (r, k) in self.addresses if k == rank and r not in self.results]
            inbox.put(([self.addresses[r, rank][0] for r in live], [self.addresses[r, rank][1] for r in live]))
        self.go[replica].set()

    def handle(self, message: tuple[Any, ...]) -> None:
        self.heard = time.monotonic()
        kind, replica = message[0], message[1]
        if kind == "step":
            self.furthest = max(self.furthest, message[2])
            if self.progress is not None:
                self.progress(self.furthest)
        elif kind == "address":
            rank = message[2]
            self.addresses[replica, rank] = (message[3], message[4])
            if replica == 0 and not self.start.is_set():
                for other in range(1, self.config.peers):
                    self.inboxes[other][rank].put(message[3])
        elif kind == "ready":
            self.ready.add((replica, message[2]))
        elif kind == "follower":
            self.digests.setdefault(replica, []).append(message[2])
        elif kind == "result":
            rank, result, digests = message[2], message[3], message[4]
            if digests:
                self.digests.setdefault(replica, []).append({"rank": rank, **digests})
            if rank == 0:
                self.results[replica] = result
            else:
                self.rank_results.setdefault(replica, {})[rank] = result
        elif kind == "error":
            if message[2] == 0:
                self.results[replica] = PeerResult(replica, "", status="failed", error=message[3])
            else:
                log.warning("replica %d rank %d failed: %s", replica, message[2], message[3])

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
        self._until(lambda: len(self.ready) == config.peers * self.peer_ranks, "the replicas to form a swarm")
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
        for replica, ranks in self.rank_results.items():  # a replica's bytes leave through all its ranks
            result = self.results.get(replica)
            if result is not None:
                for other in ranks.values():
                    result.bytes_sent += other.bytes_sent
                    result.bytes_sent_total += other.bytes_sent_total
                    result.bytes_received += other.bytes_received
        for replica, result in self.results.items():
            result.protocol_info = {**result.protocol_info, "replica": {
                "ranks": config.nproc_per_replica, "shard_sync": config.shard_sync,
                "digests": sorted(self.digests.get(replica, []), key=lambda d: d["rank"])}}
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
        for inboxes in self.inboxes.values():
            for inbox in inboxes:
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
