"""The many-peers-on-one-box simulator.

Every simulated peer is a real `Node` with real sockets and a real protocol. By default all
peers share one process (the process's one network thread, one training thread per peer);
with `processes=True` each peer is its own OS process, over tcp on loopback. Every node's
outgoing links go through a `LinkEmulator` (bandwidth, latency, loss).

    result = Simulation(SimConfig(peers=4, protocol="gossip", steps=100)).run()
    result.summary["eval_loss"], result.summary["bytes_sent_per_peer"]

Churn spec grammar (comma-separated events; a STEP is the swarm's step count)::

    kill:RANK@STEP      peer RANK crashes after STEP steps: its node closes without a leave,
                        so the others find out through heartbeats
    leave:RANK@STEP     peer RANK leaves gracefully after STEP steps
    join@STEP           a new peer joins once some peer has done STEP steps; it fetches the
    join:COUNT@STEP     protocol state from a live peer and continues at that peer's step

Initial peers have ranks 0..peers-1; joiners get the next ranks in the order they join, and
every peer's data shard is cut for a world of all the peers that will ever run.

The simulator sits in `node/` (see DESIGN.md) but needs a protocol and a task to run; it
imports them lazily and only by name, so `node` stays free of any specific protocol.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

from starling.node.identity import Identity
from starling.node.links import LinkEmulator, LinkModel
from starling.node.membership import Liveness
from starling.node.node import Node, NodeConfig
from starling.node.trainer import Trainer, TrainSpec, resolve_protocol, with_run_length
from starling.node.transport import TransportConfig

if TYPE_CHECKING:
    from starling.protocols.base import Protocol
    from starling.tasks.base import Task

log = logging.getLogger(__name__)

TRANSPORTS = ("inproc", "ipc", "tcp")
# Quick enough that a crashed peer is noticed within a short run, slow enough for a loaded box.
SIM_LIVENESS = Liveness(heartbeat_interval_s=0.25, suspect_timeout_s=1.5, dead_timeout_s=3.0)
_EVENT = re.compile(r"(kill|leave):(\d+)@(\d+)|join(?::(\d+))?@(\d+)")


class SimError(Exception):
    """The simulation could not run or a peer failed."""


class ChurnSpecError(ValueError):
    """A churn spec could not be read or does not fit the simulation."""


@dataclass(frozen=True)
class ChurnEvent:
    kind: Literal["kill", "leave", "join"]
    step: int
    rank: int | None = None  # kill and leave
    count: int = 1  # join

    def __str__(self) -> str:
        if self.kind == "join":
            return f"join{'' if self.count == 1 else f':{self.count}'}@{self.step}"
        return f"{self.kind}:{self.rank}@{self.step}"


def parse_churn(spec: str) -> tuple[ChurnEvent, ...]:
    """Read "kill:1@50,join@80" (see the module doc for the grammar)."""
    events: list[ChurnEvent] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        match = _EVENT.fullmatch(part)
        if not match:
            raise ChurnSpecError(f"cannot read churn event {part!r}: expected kill:RANK@STEP, "
                                 "leave:RANK@STEP, join@STEP or join:COUNT@STEP")
        if match.group(1):
            events.append(ChurnEvent(match.group(1), int(match.group(3)), rank=int(match.group(2))))  # type: ignore[arg-type]
        else:
            count = int(match.group(4) or 1)
            if count < 1:
                raise ChurnSpecError(f"churn event {part!r}: join count must be >= 1")
            events.append(ChurnEvent("join", int(match.group(5)), count=count))
    return tuple(events)


def check_churn(events: tuple[ChurnEvent, ...], peers: int, steps: int) -> None:
    """Raise ChurnSpecError if an event names a peer that never exists or a step past the end."""
    world = peers + sum(e.count for e in events if e.kind == "join")
    stopped: set[int] = set()
    for event in events:
        if event.step >= steps:
            raise ChurnSpecError(f"churn event {event} is at step {event.step}, but the run has {steps} steps")
        if event.rank is not None:
            if event.rank >= world:
                raise ChurnSpecError(f"churn event {event} names peer {event.rank}; ranks run 0..{world - 1}")
            if event.rank in stopped:
                raise ChurnSpecError(f"churn spec stops peer {event.rank} twice")
            stopped.add(event.rank)
    if len(stopped) >= world:
        raise ChurnSpecError("churn spec stops every peer; at least one must finish")


@dataclass(frozen=True)
class SimConfig:
    peers: int = 4
    protocol: str = "allreduce"  # a registered name, or "module:name" to import a plugin first
    task: str = "charlm"
    steps: int = 100
    compressor: str | None = None  # passed to the protocol as its `compressor` option
    transport: str = "inproc"
    processes: bool = False  # one OS process per peer (needs tcp or ipc)
    link: LinkModel = field(default_factory=LinkModel)
    churn: tuple[ChurnEvent, ...] = ()
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)  # protocol hyper-parameters
    task_options: Mapping[str, Any] = field(default_factory=dict)
    eval_every: int = 0  # peer 0 evaluates every this many steps (0: only at the end)
    liveness: Liveness = SIM_LIVENESS
    ready_timeout_s: float = 60.0  # for the swarm to form, and for a joiner to fetch state
    # A send to a crashed peer holds that peer's socket (and, behind it, this node's heartbeats)
    # until it times out; keep that below the suspect timeout so one crash does not look like two.
    send_timeout_s: float = 1.0
    join_timeout_s: float = 5.0  # a joiner greets every peer it learns of, even one that just crashed

    def __post_init__(self) -> None:
        if self.peers < 1:
            raise ValueError(f"peers must be >= 1, got {self.peers}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.processes and self.transport == "inproc":
            raise ValueError("processes need the tcp or ipc transport (inproc works within one process)")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        check_churn(self.churn, self.peers, self.steps)

    @property
    def world(self) -> int:
        """Every peer that will ever run (initial peers plus joiners)."""
        return self.peers + sum(e.count for e in self.churn if e.kind == "join")

    def protocol_options(self) -> dict[str, Any]:
        options = with_run_length(self.protocol, self.options, self.steps)
        if self.compressor is not None:
            options["compressor"] = self.compressor
        return options

    def stop_at(self, rank: int) -> tuple[str, int] | None:
        """("kill" | "leave", step) if the churn spec stops peer `rank`."""
        for event in self.churn:
            if event.rank == rank and event.kind in ("kill", "leave"):
                return event.kind, event.step
        return None

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "peers": self.peers, "steps": self.steps, "task": self.task,
                "compressor": self.compressor, "transport": self.transport, "processes": self.processes,
                "link": self.link.describe(), "churn": ",".join(map(str, self.churn)), "seed": self.seed,
                "options": {k: v for k, v in self.options.items()}, "task_options": dict(self.task_options)}


def check_config(config: SimConfig) -> None:
    """Resolve the protocol, its options and the task now, so bad input fails before any node starts."""
    from starling.protocols.base import config_from_options
    from starling.tasks import get_task

    cls = resolve_protocol(config.protocol)
    config_from_options(cls.config_class, config.protocol_options())
    task = get_task(config.task, **config.task_options)
    task.batches(config.world - 1, config.world, config.seed)  # checks the shard size for this world


@dataclass
class PeerResult:
    rank: int
    peer_id: str
    status: str = "running"  # finished | killed | left | failed
    records: list[dict[str, Any]] = field(default_factory=list)
    eval_loss: float | None = None
    bytes_sent: int = 0  # protocol topics (not starting with "$")
    bytes_sent_total: int = 0  # including membership traffic
    bytes_received: int = 0
    joined_at_step: int = 0
    train_end: float = 0.0  # time.time() when its last step finished
    links: dict[str, float] = field(default_factory=dict)
    protocol_info: dict[str, Any] = field(default_factory=dict)  # the protocol's describe() at the end, as JSON data
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sent_by_topic(node: Node) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_topic in node.stats.snapshot()["bytes_sent"].values():
        for topic, n in per_topic.items():
            out[topic] = out.get(topic, 0) + n
    return out


def json_data(value: Any) -> Any:
    """`value` as plain JSON data: a non-finite float becomes "inf", "-inf" or "nan" (as in
    privacy reports), and anything JSON has no type for becomes its str()."""
    if isinstance(value, Mapping):
        return {str(k): json_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_data(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def endpoint_for(transport: str, rank: int, ipc_dir: str, run_id: str) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:0"
    if transport == "ipc":
        return f"ipc://{ipc_dir}/{rank}.sock"
    return f"inproc://starling-sim-{run_id}-{rank}"


def seeded_identity(seed: int, rank: int) -> Identity:
    """Rank `rank`'s keys in a simulation seeded `seed`: the same in every run (never for a
    real swarm, see `Identity.from_seed`)."""
    return Identity.from_seed(f"starling.sim:{seed}:{rank}")


class SimPeer:
    """One simulated peer: a node, a protocol over a fresh model, and its training loop."""

    def __init__(self, config: SimConfig, task: Task, rank: int, listen: str,
                 on_step: Callable[[int, int], None] | None = None, crashed: set[str] | None = None,
                 identity: Identity | None = None) -> None:
        """`identity`: the node's keys; by default `seeded_identity(config.seed, rank)`, the
        same in every run, so that a run without churn or emulated links repeats bit for bit
        (peer ids decide shard ownership and the order in which owners sum)."""
        self.config, self.task, self.rank = config, task, rank
        self.listen = listen
        self.on_step = on_step or (lambda rank, step: None)
        node_config = NodeConfig(liveness=config.liveness, join_timeout_s=config.join_timeout_s,
                                 transport=TransportConfig(send_timeout_s=config.send_timeout_s))
        self.node = Node(identity or seeded_identity(config.seed, rank), config=node_config)
        self.emulator: LinkEmulator | None = None
        self.crashed = crashed if crashed is not None else set()
        if not config.link.is_ideal or any(e.kind == "kill" for e in config.churn):
            self.emulator = LinkEmulator(config.link, seed=config.link.seed * 1_000_003 + rank,
                                         unreachable=self.crashed)
            self.node.shaper = self.emulator
        self.trainer: Trainer | None = None
        self.proto: Protocol | None = None
        self.result = PeerResult(rank, self.node.peer_id)
        self.step = 0
        self._serve_state = any(e.kind == "join" for e in config.churn)

    # ---------------------------------------------------------------- setup
    def start(self, join: list[str]) -> str:
        self.node.start(self.listen, join, security="plaintext",
                        swarm_config={**self.spec().to_swarm_config(), "simulation": True})
        return self.node.address

    def spec(self) -> TrainSpec:
        return TrainSpec(self.config.protocol, self.config.task, self.config.protocol_options(),
                         dict(self.config.task_options), self.config.seed)

    def create_protocol(self) -> None:
        self.trainer = Trainer(self.node, self.spec(), self.rank, self.config.world, task=self.task,
                               serve_state=self._serve_state, snapshot_every_s=0.0)
        self.proto = self.trainer.create_protocol()

    def fetch_state(self) -> None:
        """A joiner's catch-up: the protocol state of some live peer, at that peer's step."""
        assert self.trainer is not None and self.proto is not None
        self.trainer.fetch_state()
        self.step = self.result.joined_at_step = self.proto.step_count

    # ---------------------------------------------------------------- training
    def train(self, t0: float) -> None:
        """Run steps up to the configured count (or until churn stops this peer), then evaluate."""
        import torch

        torch.set_num_threads(1)
        trainer, config = self.trainer, self.config
        assert trainer is not None
        stop = config.stop_at(self.rank)
        batches = trainer.batches()
        try:
            while self.step < config.steps:
                if stop is not None and self.step >= stop[1]:
                    self._stop(stop[0])
                    return
                report = trainer.step(next(batches))
                self.step += 1
                self._record(report, t0)
                self.on_step(self.rank, self.step)
            self.result.train_end = time.time()
            self.result.eval_loss = float(trainer.evaluate()["eval_loss"])
            self.result.protocol_info = json_data(self.proto.describe())  # type: ignore[union-attr]
            self.result.status = "finished"
        except Exception as exc:
            log.exception("peer %d failed at step %d", self.rank, self.step)
            self.result.status, self.result.error = "failed", f"{type(exc).__name__}: {exc}"
            self._stop("kill")  # the others see it go as a crash
            self.result.status = "failed"

    def _record(self, report: Any, t0: float) -> None:
        by_topic = sent_by_topic(self.node)
        record = {"peer": self.rank, "step": report.step, "loss": report.loss, "wall_s": time.time() - t0,
                  "bytes_sent": sum(n for t, n in by_topic.items() if not t.startswith("$")),
                  "bytes_sent_total": sum(by_topic.values()), "bytes_by_topic": by_topic,
                  "synced": report.synced, "peers": report.peers, "step_wall_s": report.wall_s,
                  "compute_s": report.compute_s}
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

    def collect(self) -> None:
        """Copy the node's byte counters and the link counters into the result."""
        by_topic = sent_by_topic(self.node)
        self.result.bytes_sent = sum(n for t, n in by_topic.items() if not t.startswith("$"))
        self.result.bytes_sent_total = sum(by_topic.values())
        self.result.bytes_received = self.node.stats.total_received()
        if self.emulator is not None:
            self.result.links = dataclasses.asdict(self.emulator.counters)

    def close(self) -> None:
        if self.result.status in ("running", "finished"):
            self.collect()
        if self.proto is not None and self.result.status in ("running", "finished"):
            self.proto.close()
        self.node.close()


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SimError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class SimResult:
    config: SimConfig
    peers: list[PeerResult]
    summary: dict[str, Any]

    def write(self, out_dir: str | Path) -> None:
        """Under `out_dir`: peer-RANK.jsonl (one JSON object per step), peers.json (each
        peer's final numbers) and summary.json."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("peer-*.jsonl"):
            stale.unlink()
        for peer in self.peers:
            with open(out / f"peer-{peer.rank}.jsonl", "w") as f:
                f.writelines(json.dumps(record) + "\n" for record in peer.records)
        finals = [{k: v for k, v in peer.to_json().items() if k != "records"} for peer in self.peers]
        (out / "peers.json").write_text(json.dumps(finals, indent=1) + "\n")
        (out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")


ProgressFn = Callable[[int], None]


class Simulation:
    """Runs one simulated swarm to the end. `progress(step)` gets the swarm's furthest step."""

    def __init__(self, config: SimConfig, progress: ProgressFn | None = None) -> None:
        self.config = config
        self.progress = progress

    def run(self) -> SimResult:
        check_config(self.config)
        if self.config.processes:
            from starling.node.sim_processes import run_processes  # it imports this module

            peers, t0 = run_processes(self.config, self.progress)
        else:
            peers, t0 = self._run_threads()
        return SimResult(self.config, peers, summarize(self.config, peers, t0))

    def _run_threads(self) -> tuple[list[PeerResult], float]:
        import torch

        from starling.tasks import get_task

        config = self.config
        task = get_task(config.task, **config.task_options)
        threads_before = torch.get_num_threads()
        torch.set_num_threads(1)
        run_id = uuid.uuid4().hex[:8]
        ipc_dir = tempfile.mkdtemp(prefix="starling-sim-") if config.transport == "ipc" else ""
        furthest = [0]
        crashed: set[str] = set()

        def on_step(rank: int, step: int) -> None:
            furthest[0] = max(furthest[0], step)

        def make_peer(rank: int) -> SimPeer:
            return SimPeer(config, task, rank, endpoint_for(config.transport, rank, ipc_dir, run_id), on_step,
                           crashed)

        peers = [make_peer(rank) for rank in range(config.peers)]
        threads: list[threading.Thread] = []
        try:
            address = peers[0].start([])
            for peer in peers[1:]:
                peer.start([address])
            wait_for(lambda: all(len(p.node.live_peers()) == config.peers - 1 for p in peers),
                     config.ready_timeout_s, f"{config.peers} peers to see each other")
            for peer in peers:
                peer.create_protocol()
            t0 = time.time()
            for peer in peers:
                threads.append(threading.Thread(target=peer.train, args=(t0,), name=f"sim-peer-{peer.rank}", daemon=True))
                threads[-1].start()
            joins = sorted((e for e in config.churn if e.kind == "join"), key=lambda e: e.step)
            while any(t.is_alive() for t in threads):
                while joins and furthest[0] >= joins[0].step:
                    for _ in range(joins.pop(0).count):
                        live = [p for p in peers if p.result.status in ("running", "finished") and p.proto]
                        joiner = make_peer(len(peers))
                        peers.append(joiner)
                        threads.append(threading.Thread(target=self._join, args=(joiner, live, t0),
                                                        name=f"sim-peer-{joiner.rank}", daemon=True))
                        threads[-1].start()
                if self.progress is not None:
                    self.progress(furthest[0])
                time.sleep(0.05)
            if self.progress is not None:
                self.progress(furthest[0])
            return [p.result for p in peers], t0
        finally:
            for peer in peers:
                peer.close()
            torch.set_num_threads(threads_before)

    def _join(self, joiner: SimPeer, live: list[SimPeer], t0: float) -> None:
        try:
            joiner.start([p.node.address for p in live])
            expected = {p.node.peer_id for p in live if p.result.status == "running"}
            try:
                wait_for(lambda: expected <= set(joiner.node.live_peers()), 5.0, "the joiner to see the swarm")
            except SimError:
                log.warning("joiner %d sees only part of the swarm; going on", joiner.rank)
            joiner.create_protocol()
            joiner.fetch_state()
        except Exception as exc:
            log.exception("peer %d could not join", joiner.rank)
            joiner.result.status, joiner.result.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        joiner.train(t0)


def summarize(config: SimConfig, peers: list[PeerResult], t0: float) -> dict[str, Any]:
    """The run's headline numbers (see the CLI's --json)."""
    failed = [p for p in peers if p.status == "failed"]
    if failed:
        raise SimError(f"peer {failed[0].rank} failed: {failed[0].error}")
    finished = [p for p in peers if p.status == "finished"]
    if not finished:
        raise SimError("no peer finished the run")
    tails = []
    for p in finished:
        losses = [r["loss"] for r in p.records]
        tail = losses[-max(1, len(losses) // 10):]
        if tail:
            tails.append(sum(tail) / len(tail))
    evals = [p.eval_loss for p in finished if p.eval_loss is not None]
    links = {k: sum(p.links.get(k, 0) for p in peers) for k in ("dropped", "admitted", "delay_s")}
    return {
        **config.describe(),
        "train_loss": sum(tails) / len(tails) if tails else None,
        "eval_loss": sum(evals) / len(evals) if evals else None,
        "eval_loss_peer0": next((p.eval_loss for p in finished if p.rank == 0), None),
        "bytes_sent_per_peer": sum(p.bytes_sent for p in peers) / len(peers),
        "bytes_sent_per_peer_total": sum(p.bytes_sent_total for p in peers) / len(peers),
        "wall_s": max(p.train_end for p in peers) - t0,
        "final_peers": len(finished),
        "peer_status": {str(p.rank): p.status for p in peers},
        "messages_dropped": int(links["dropped"]),
        "link_delay_s_per_peer": links["delay_s"] / len(peers),
        # the protocol's own account of the run (sketch-dp: sketch size and privacy spent), from the
        # lowest-ranked peer that finished
        "protocol_info": min(finished, key=lambda p: p.rank).protocol_info,
    }
