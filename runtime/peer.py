"""One simulated peer: a real node, a protocol over a fresh model, and its training loop."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from starling.node import Node, NodeConfig, TransportConfig
from starling.node.identity import Identity
from starling.protocols import Protocol
from starling.runtime.links import LinkEmulator
from starling.runtime.replica import Replica
from starling.runtime.replication import ReplicaGroup, Replication, Single
from starling.runtime.shard_sync import ShardSync
from starling.runtime.simconfig import SIM_STATS_PEERS, SimConfig, SimError, seeded_identity, sim_liveness, wait_for
from starling.runtime.spec import LOCAL_DATA_OPTIONS, tokenizer_fingerprint
from starling.runtime.summary import PeerResult, json_data, sent_by_topic
from starling.runtime.trainer import CheckpointConfig, Trainer, TrainSpec
from starling.tasks import Task

T = TypeVar("T")

log = logging.getLogger(__name__)

SHARD_IDENTITY_STRIDE = 1_000_003  # rank k of replica r has the seeded identity of r + k * this


class SimPeer:
    """One simulated peer: a node, a protocol over a fresh model, and its training loop."""

    def __init__(self, config: SimConfig, task: Task, rank: int, listen: str,
                 on_step: Callable[[int, int], None] | None = None, crashed: set[str] | None = None,
                 identity: Identity | None = None, group: ReplicaGroup | None = None, node: Node | None = None
                 ) -> None:
        """`identity`: the node's keys; by default `seeded_identity(config.seed, rank)`, the
        same in every run, so that a run without churn or emulated links repeats bit for bit
        (peer ids decide shard ownership and the order in which owners sum). `node`: a node
        that is up already, in the swarm (see `then`)."""
        self.config, self.task, self.rank = config, task, rank
        self.listen = listen
        self.on_step = on_step or (lambda rank, step: None)
        # Socket monitors tell a node at once that a peer's process died; over inproc they
        # hear nothing (a simulated crash reaches the other peers through `crashed`) and would
        # cost two descriptors per DEALER.
        transport = TransportConfig(send_timeout_s=config.send_timeout_s,
                                    monitor_connections=config.transport != "inproc",
                                    max_open_dealers=config.max_dealers or TransportConfig.max_open_dealers)
        liveness = config.liveness or sim_liveness(config.peers_per_process(), config.world)
        # An initial peer takes the first page of its seed's table and no more: once its
        # process's peers have joined, one of them pulls the seed's table and every other is
        # handed it (`sync_with_seed`), so paging it per peer would cost the seed's process n^2
        # records. A joiner mid-run (its rank past the initial peers) pages it as a node does.
        node_config = NodeConfig(liveness=liveness, join_timeout_s=config.join_timeout_s,
                                 join_deadline_s=config.join_deadline_s, transport=transport,
                                 page_table_on_join=rank >= config.peers, stats_peers=SIM_STATS_PEERS)
        # With every rank syncing its own shard, each rank of a replica is a node of its own.
        self.replication: Replication = Single() if group is None else \
            ShardSync(group) if config.shard_sync else Replica(group)
        shard_rank = group.rank if isinstance(self.replication, ShardSync) else 0
        if identity is None:
            identity = seeded_identity(config.seed, rank + shard_rank * SHARD_IDENTITY_STRIDE)
        self.node = node if node is not None else Node(identity, config=node_config)
        self.emulator: LinkEmulator | None = None
        self.crashed = crashed if crashed is not None else set()
        if not config.link.is_ideal or any(e.kind == "kill" for e in config.churn):
            self.emulator = LinkEmulator(config.link, seed=config.link.seed * 1_000_003 + rank,
                                         unreachable=self.crashed)
        self.node.shaper = self.emulator  # a node taken over (`then`) gets this run's links
        self.trainer: Trainer | None = None
        self.proto: Protocol | None = None
        self.result = PeerResult(rank, self.node.peer_id)
        self.step = 0
        self._serve_state = any(e.kind == "join" for e in config.churn)
        self._sent_before: dict[str, int] = {}  # what the node had sent before this peer's run (`then`)
        self._received_before = 0
        self._sockets_before: dict[str, int] = {}

    def then(self, config: SimConfig) -> SimPeer:
        """A peer of the next run (`config`: the baseline of this one, on the same swarm) on this
        peer's node, once this peer's protocol has ended (`end_protocol`): the swarm that formed
        for this run trains the next one, with a fresh model, links and counters. The node's
        bytes so far are this run's: the next run counts from here."""
        nxt = SimPeer(config, self.task, self.rank, self.listen, self.on_step, self.crashed, node=self.node)
        nxt._sent_before, nxt._received_before = sent_by_topic(self.node), self.node.stats.total_received()
        nxt._sockets_before = dict(self.node.stats.sockets_opened_by_topic)
        # the swarm config the node shows is its peer's run's, whose model fixes the architecture anew
        self.node.swarm_config = {**nxt.spec().to_swarm_config(), "simulation": True,
                                  **nxt.replication.swarm_config()}
        return nxt

    # ---------------------------------------------------------------- setup
    def start(self, join: list[str]) -> str:
        self.node.start(self.listen, join, security="plaintext",
                        swarm_config={**self.spec().to_swarm_config(), "simulation": True,
                                      **self.replication.swarm_config()})
        return self.node.address

    def spec(self) -> TrainSpec:
        """What the simulated swarm trains. A partitioned corpus (`partition`) is a swarm of each
        member's own data, as `node start --data-scope local` runs one: every peer trains its own
        part in epochs of its own, weighed by what it trained, with no swarm ledger."""
        options = dict(self.config.task_options)
        if not options.get("partition"):
            return TrainSpec(self.config.protocol, self.config.task, self.config.protocol_options(), options,
                             self.config.seed)
        own = {k: v for k, v in options.items() if k in LOCAL_DATA_OPTIONS}
        return TrainSpec(self.config.protocol, self.config.task, self.config.protocol_options(),
                         {k: v for k, v in options.items() if k not in own}, self.config.seed, "local", own,
                         tokenizer_fingerprint(self.task))

    def create_protocol(self) -> None:
        checkpoint = None
        if self.config.checkpoint_dir:
            checkpoint = CheckpointConfig(str(Path(self.config.checkpoint_dir) / f"peer-{self.rank}"),
                                          self.config.checkpoint_every)
        self.trainer = Trainer(self.node, self.spec(), self.rank, self.config.world, task=self.task,
                               serve_state=self._serve_state, snapshot_every_s=0.0, checkpoint=checkpoint,
                               placement=self.config.placement(), replication=self.replication)
        self.proto = self.trainer.create_protocol()
        if self.config.resume and self.trainer.resume() is not None:
            self.step = self.proto.step_count

    def join_swarm(self, addresses: list[str], expected: set[str]) -> bool:
        """A joiner's way in: greet the live peers at `addresses`, wait (briefly) until it sees
        the peers `expected` (their ids), then fetch the training state. False, with the result
        marked failed, if it could not join."""
        try:
            self.start(addresses)
            try:
                wait_for(lambda: expected <= set(self.node.live_peers()), 5.0, "the joiner to see the swarm")
            except SimError:
                log.warning("joiner %d sees only part of the swarm; going on", self.rank)
            self.create_protocol()
            self.fetch_state()
        except Exception as exc:
            log.exception("peer %d could not join", self.rank)
            self.result.status, self.result.error = "failed", f"{type(exc).__name__}: {exc}"
            return False
        return True

    def fetch_state(self) -> None:
        """A joiner's catch-up: the protocol state of some live peer, at that peer's step."""
        assert self.trainer is not None and self.proto is not None
        self.trainer.fetch_state()
        self.step = self.result.joined_at_step = self.proto.step_count

    # ---------------------------------------------------------------- training
    def train(self, t0: float) -> None:
        """Run steps up to the configured count (or until churn stops this peer), then evaluate."""
        torch.set_num_threads(1)
        trainer, config = self.trainer, self.config
        assert trainer is not None
        trainer.lead_replica()  # its state, fetched or not, goes to the replica's other ranks
        stop = config.stop_at(self.rank)
        batches = trainer.batches()
        slowdown = config.slowdown(self.rank)
        try:
            while True:
                ending = None
                if self.step < config.steps:
                    if stop is not None and self.step >= stop[1]:
                        ending = "stop"
                    elif config.duration_s and time.time() - t0 >= config.duration_s:
                        ending = "time"
                # the ranks of a replica that each sync their own shard stop together, where the first does
                if not trainer.agree(self.step < config.steps and ending is None):
                    if ending == "stop":
                        self._stop(stop[0])  # type: ignore[index]
                        return
                    if ending == "time":
                        self._out_of_time()
                    break
                report = trainer.step(next(batches))
                # emulated slower hardware: the step's compute takes `slowdown` times as long
                slept = (slowdown - 1.0) * report.compute_s
                if slept > 0:
                    time.sleep(slept)
                self.step += 1
                self._record(report, t0, slept)
                self.on_step(self.rank, self.step)
            if not self.result.train_end:
                self.result.train_end = time.time()
            self.result.eval_loss = float(trainer.evaluate()["eval_loss"])
            self.result.protocol_info = json_data(self.proto.describe())  # type: ignore[union-attr]
            self.result.status = "finished"
        except Exception as exc:
            log.exception("peer %d failed at step %d", self.rank, self.step)
            self.result.status, self.result.error = "failed", f"{type(exc).__name__}: {exc}"
            self._stop("kill")  # the others see it go as a crash
            self.result.status = "failed"

    def _out_of_time(self) -> None:
        """The run's wall-clock budget is spent: leave (rounds stop waiting for me at once), then
        evaluate what this peer holds."""
        self.result.train_end = time.time()
        self.collect()
        self.proto.close()  # type: ignore[union-attr]
        self.node.leave()

    def _record(self, report: Any, t0: float, slept: float = 0.0) -> None:
        by_topic = self._sent()
        record = {"peer": self.rank, "step": report.step, "loss": report.loss, "wall_s": time.time() - t0,
                  "bytes_sent": sum(n for t, n in by_topic.items() if not t.startswith("$")),
                  "bytes_sent_total": sum(by_topic.values()), "bytes_by_topic": by_topic,
                  "synced": report.synced, "peers": report.peers, "step_wall_s": report.wall_s,
                  "compute_s": report.compute_s,
                  # sockets this peer opened so far, by topic: past the socket cap each opens a
                  # socket at both ends, a large share of a 1024-peer box's CPU (docs/benchmarks.md)
                  "sockets_opened_by_topic": {t: n - self._sockets_before.get(t, 0) for t, n in
                                              self.node.stats.sockets_opened_by_topic.items()
                                              if n > self._sockets_before.get(t, 0)}}
        if not report.sampled:  # client sampling: this step's round did not draw this peer
            record["sampled"] = False
        if self.config.peer_speed:  # emulated heterogeneity: the speed, and the compute it stood for
            record["speed"] = self.config.peer_speed[self.rank] if self.rank < len(self.config.peer_speed) else \
                max(self.config.peer_speed)
            record["slowdown_s"] = slept
        unit = self.trainer.last_unit if self.trainer is not None else None
        if unit is not None:  # the swarm's ledger handed this step's batch: which unit of which epoch
            record["unit"] = [unit.epoch, unit.index]
            record["unit_counted"] = self.trainer.last_unit_counted  # type: ignore[union-attr]
        if self.config.eval_every and self.rank == 0 and self.step % self.config.eval_every == 0:
            record["eval_loss"] = float(self.trainer.evaluate()["eval_loss"])  # type: ignore[union-attr]
        self.result.records.append(record)

    def _stop(self, how: str) -> None:
        self.result.train_end = time.time()
        self.collect()
        self.result.status = "killed" if how == "kill" else "left"
        if self.proto is not None:
            self.proto.close()
        if how == "leave":
            self.node.leave()
        else:
            # A crashed host swallows what is sent to it. In one process the other peers' links
            # learn of the crash at once (sends are dropped instead of piling up on a dead socket);
            # their failure detectors still find out only through missed heartbeats.
            self.crashed.add(self.node.peer_id)
            self.node.close()

    def _sent(self) -> dict[str, int]:
        """Bytes this peer's node sent in this peer's run, by topic."""
        return sent_by_topic(self.node, since=self._sent_before)

    def collect(self) -> None:
        """Copy the node's byte counters and the link counters into the result."""
        by_topic = self._sent()
        self.result.bytes_sent = sum(n for t, n in by_topic.items() if not t.startswith("$"))
        self.result.bytes_sent_total = sum(by_topic.values())
        self.result.bytes_received = self.node.stats.total_received() - self._received_before
        if self.emulator is not None:
            self.result.links = dataclasses.asdict(self.emulator.counters)

    def end_protocol(self) -> None:
        """The run is over: its checkpoints on disk, its counters in the result, its protocol
        closed. The node stays up."""
        if self.trainer is not None:
            self.trainer.finish_checkpoints()  # what a peer wrote is on disk when its run returns
        if self.result.status in ("running", "finished"):
            self.collect()
        if self.proto is not None and self.result.status in ("running", "finished"):
            self.proto.close()

    def close(self) -> None:
        self.end_protocol()
        self.node.close()


CLOSING_AT_ONCE = 32  # simulated peers closing at once (each close waits for its node's tasks to end)


def close_together(peers: list[SimPeer]) -> None:
    """Close `peers` a few dozen at a time (CLOSING_AT_ONCE). A close waits up to a second for
    its node's tasks to end on the network thread the peers share: one at a time, a worker's 32
    peers take 12-19 s to report after the last step; at once, the waits overlap."""
    if not peers:
        return
    for peer in peers:  # none of them probes or suspects the others as they go (`Node.stop_watching`)
        peer.node.stop_watching()
    with concurrent.futures.ThreadPoolExecutor(min(CLOSING_AT_ONCE, len(peers)), "sim-close") as pool:
        for future in [pool.submit(peer.close) for peer in peers]:
            future.result()


JOINS_IN_FLIGHT = 8  # simulated peers joining at once: each hello's round trip waits on the busy network thread


def start_together(peers: list[SimPeer], join: list[str],
                   on_started: Callable[[SimPeer], None] | None = None) -> None:
    """Start `peers`, each joining through `join`, a few at a time (JOINS_IN_FLIGHT): one at
    a time, a swarm of hundreds spent its start-up waiting on one hello's round trip after
    another. Peers that join at once learn of each other as peers joining elsewhere do
    (announces, gossip, table pulls). `on_started(peer)` is called as each one has joined (a
    worker tells its parent, which hears that the swarm is forming). Raises the first peer's
    failure."""
    if not peers:
        return
    with concurrent.futures.ThreadPoolExecutor(min(JOINS_IN_FLIGHT, len(peers)), "sim-join") as pool:
        futures = {pool.submit(peer.start, join): peer for peer in peers}
        for future in concurrent.futures.as_completed(futures):
            future.result()
            if on_started is not None:
                on_started(futures[future])


TRIP_PEERS = 16  # peers one trip to the network thread serves: hold the loop a short while, not 128 times


def on_network_thread(peers: list[SimPeer], fn: Callable[[SimPeer], T]) -> list[T]:
    """`fn(peer)` for each of `peers` (nodes of this process, which share its one network
    thread), run on that thread, TRIP_PEERS peers a trip. A blocking call per node (`live_peers`,
    `add_records`) waits for a turn of a loop that hundreds of nodes keep busy: 128 of them in a
    row stalled a simulator's worker for seconds while its swarm formed."""
    async def trip(group: list[SimPeer]) -> list[T]:
        return [fn(peer) for peer in group]

    out: list[T] = []
    for start in range(0, len(peers), TRIP_PEERS):
        group = peers[start:start + TRIP_PEERS]
        out.extend(group[0].node.run(trip(group)))
    return out


def sync_with_seed(peers: list[SimPeer], seed_id: str, world: int) -> int:
    """One anti-entropy pass for peers that share a process: the first of `peers` that does
    not yet see all `world` peers pulls the seed's table (the seed heard every joiner's hello),
    and the others that do not are handed the records it got (`Node.add_records`: checked as
    if relayed by the seed, each signature once per process). Peers that joined at the same
    time learn each other here; one pull per process instead of one per peer keeps the seed
    answering probes (a thousand peers pulling its whole table every few seconds starved it,
    and the swarm took it for dead). A pull that fails is left to the gossip and the next
    pass. Returns how many peers were behind."""
    counts = on_network_thread(peers, lambda p: len(p.node.live_peers_here()))
    behind = [p for p, seen in zip(peers, counts) if p.node.peer_id != seed_id and seen < world - 1]
    if not behind:
        return 0
    records: list[Any] = []
    try:
        behind[0].node.sync_peers(seed_id, collect=records).result(timeout=120)
    except Exception as exc:
        log.debug("table pull from the seed failed: %r", exc)
    if records:
        on_network_thread(behind[1:], lambda p: p.node.add_records_here(records, told_by=seed_id))
    return len(behind)


def raise_if_faulted(peers: list[SimPeer]) -> bool:
    """True, or SimError naming the first peer whose node stopped on a socket failure."""
    for peer in peers:
        if peer.node.fault is not None:
            raise SimError(f"peer {peer.rank}'s node stopped: {peer.node.fault}")
    return True
