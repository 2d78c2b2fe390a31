"""Metrics of a live node: Prometheus exposition, and scalars for TensorBoard.

    progress = TrainingProgress()
    server = MetricsServer(node, host="127.0.0.1", port=9400)   # GET /metrics
    server.collector.attach(trainer, progress)
    ...  on every StepReport: progress.record(report)

The training thread does nothing for metrics but `TrainingProgress.record` (it keeps the last
report and a few running sums). Everything else is read when Prometheus scrapes: the node's
counters (`node/stats.py`), its peer table, the progress, the trainer's newest checkpoint.

Each server has its own `CollectorRegistry`, never prometheus_client's global one, so that
several nodes in one process (tests, a simulation) each export their own.

Labels stay bounded whatever the swarm does. `peer` is a member of the peer table, at most
`MAX_PEER_LABELS` of them, or (in the trust metrics) one of at most `MAX_PEER_LABELS` banned
peers. Everything else is counted under `<strangers>` (senders outside the swarm, as the node's
stats count them) or `<others>`. `topic`, `reason` and `kind` keep at most `MAX_TOPIC_LABELS`,
`MAX_REASON_LABELS` and `MAX_KIND_LABELS` values, the rest under `<others>`.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from starling.node import Node
from starling.node.membership import PeerStatus
from starling.node.stats import OTHERS, STRANGERS
from starling.protocols import StepReport

MAX_PEER_LABELS = 64
MAX_TOPIC_LABELS = 64
MAX_REASON_LABELS = 64
MAX_KIND_LABELS = 64


class MetricsError(Exception):
    """Metrics cannot be served or written where they were asked for."""


@dataclass
class TrainingProgress:
    """What training has done so far, as the steps' reports said. The training thread is the
    one writer (`record`); a scrape reads the fields as they are, so one scrape may mix
    two consecutive steps."""

    steps: int = 0  # steps this process trained (a joiner's count starts at its join)
    step: int = 0  # the swarm step after the last one trained
    loss: float = math.nan  # the last step's training loss
    rounds: int = 0  # steps in which an exchange with peers completed
    rounds_incomplete: int = 0  # steps whose round went on without someone (died, timed out)
    bytes_sent: int = 0  # the protocol's own bytes, as the steps' reports counted them
    bytes_received: int = 0
    peers: int = 1  # peers in the last step's update, self included
    wall_s: float = 0.0  # time spent in steps
    compute_s: float = 0.0  # the part of it spent in local compute (the rest: waiting on the network)
    last_sync_unix_s: float | None = None  # wall-clock time of the last completed exchange

    def record(self, report: StepReport) -> None:
        self.steps += 1
        self.step = report.step + 1
        self.loss = float(report.loss)
        self.rounds += bool(report.synced)
        self.rounds_incomplete += bool(report.lost_peers)
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.peers = report.peers
        self.wall_s += report.wall_s
        self.compute_s += report.compute_s
        if report.synced:
            self.last_sync_unix_s = time.time()

    def meta(self) -> dict[str, Any]:
        """What a training peer tells the others in its beats (flat, finite scalars), so
        that a watcher of any one node sees every peer's step, loss and last sync."""
        loss = self.loss if math.isfinite(self.loss) else None  # beat meta refuses NaN
        synced = None if self.last_sync_unix_s is None else round(self.last_sync_unix_s, 3)
        return {"step": self.step, "loss": loss, "synced": synced}


def _bounded(names: Iterator[str] | list[str], limit: int) -> set[str]:
    """The first `limit` names in sorted order: the ones that keep a label of their own."""
    return set(sorted(set(names))[:limit])


async def _read_trust(node: Node) -> dict[str, Any]:
    return node.trust.status()


class NodeCollector:
    """A prometheus_client collector that reads one node (and, once attached, its trainer)
    whenever it is scraped."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.trainer: Any = None
        self.progress: TrainingProgress | None = None

    def attach(self, trainer: Any, progress: TrainingProgress) -> None:
        """From now on, export what `trainer` (a `runtime.Trainer`) and `progress` hold."""
        self.trainer, self.progress = trainer, progress

    def collect(self) -> Iterator[Metric]:
        node = self.node
        peers = node.peers if not node.closed else []
        stats = node.stats.snapshot()
        config = node.swarm_config or {}
        info = InfoMetricFamily("starling_node", "This node: its peer id and what its swarm trains.")
        info.add_metric([], {"peer_id": node.peer_id, "protocol": str(config.get("protocol") or ""),
                             "task": str(config.get("task") or "") if config.get("protocol") else ""})
        yield info

        by_status = GaugeMetricFamily("starling_peers", "Peers in this node's table, by status.", labels=["status"])
        counts = {status.value: 0 for status in PeerStatus}
        for peer in peers:
            counts[peer.status.value] += 1
        for status, count in counts.items():
            by_status.add_metric([status], count)
        yield by_status

        members = _bounded([p.id for p in peers], MAX_PEER_LABELS)
        for direction in ("sent", "received"):
            yield self._bytes(direction, stats[f"bytes_{direction}"], members)
        yield CounterMetricFamily("starling_messages_sent", "Messages this node sent.", stats["messages_sent"])
        yield CounterMetricFamily("starling_messages_received", "Messages this node read.",
                                  stats["messages_received"])
        yield CounterMetricFamily("starling_send_failures", "Sends that failed.", stats["send_failures"])
        yield CounterMetricFamily("starling_late_replies", "Replies that came after their request had ended "
                                  "(timed out, or its peer declared gone).", stats["late_replies"])

        rejected = CounterMetricFamily("starling_rejected_frames", "Inbound messages refused, by reason.",
                                       labels=["reason"])
        kept = _bounded(stats["rejected"], MAX_REASON_LABELS)
        by_reason: dict[str, int] = defaultdict(int)
        for reason, count in stats["rejected"].items():
            by_reason[reason if reason in kept else OTHERS] += count
        for reason, count in sorted(by_reason.items()):
            rejected.add_metric([reason], count)
        yield rejected
        yield CounterMetricFamily("starling_zap_denied", "Connections the allowlist refused.", node.zap_denied)
        yield CounterMetricFamily("starling_stalls", "Times this node's liveness loop woke a beat or more late.",
                                  stats["stalls"])
        yield CounterMetricFamily("starling_stall_seconds", "Total lateness of those wake-ups (not held against "
                                  "peers' silence).", stats["stalled_s"])
        yield from self._trust(members)
        yield from self._training()

    def _bytes(self, direction: str, table: Mapping[str, Mapping[str, int]], members: set[str]) -> Metric:
        family = CounterMetricFamily(f"starling_bytes_{direction}", f"Bytes {direction} (whole messages), by peer "
                                     "and topic.", labels=["peer", "topic"])
        topics = _bounded([t for per in table.values() for t in per], MAX_TOPIC_LABELS)
        sums: dict[tuple[str, str], int] = defaultdict(int)
        for peer, per in table.items():
            peer_label = peer if peer in members or peer == STRANGERS else OTHERS
            for topic, nbytes in per.items():
                sums[peer_label, topic if topic in topics else OTHERS] += nbytes
        for (peer, topic), nbytes in sorted(sums.items()):
            family.add_metric([peer, topic], nbytes)
        return family

    def _trust(self, members: set[str]) -> Iterator[Metric]:
        """What this node holds against other peers (`node.trust`), read on the network thread
        that writes it."""
        node = self.node
        trust = node.trust.status() if node.closed else node.run(_read_trust(node))
        banned = trust["banned"]
        named_bans = _bounded(banned, MAX_PEER_LABELS)
        labelled = members | named_bans
        counts = trust["counts"]
        kinds = _bounded([k for per in counts.values() for k in per], MAX_KIND_LABELS)
        sums: dict[tuple[str, str], int] = defaultdict(int)
        for peer, per in counts.items():
            for kind, n in per.items():
                sums[peer if peer in labelled else OTHERS, kind if kind in kinds else OTHERS] += n
        family = CounterMetricFamily("starling_peer_contributions", "What this node counted against each peer's "
                                     "contributions (refused, screened, clipped, disputed, ...), by peer and kind.",
                                     labels=["peer", "kind"])
        for (peer, kind), n in sorted(sums.items()):
            family.add_metric([peer, kind], n)
        yield family
        yield GaugeMetricFamily("starling_banned_peers", "Peers this node has banned.", len(banned))
        per_peer = GaugeMetricFamily("starling_peer_banned", "1 for each peer this node has banned (<others>: "
                                     "how many more).", labels=["peer"])
        for peer in sorted(named_bans):
            per_peer.add_metric([peer], 1)
        if len(banned) > len(named_bans):
            per_peer.add_metric([OTHERS], len(banned) - len(named_bans))
        yield per_peer

    def _training(self) -> Iterator[Metric]:
        progress, trainer = self.progress, self.trainer
        if progress is None:
            return
        yield CounterMetricFamily("starling_steps", "Training steps this process ran.", progress.steps)
        yield GaugeMetricFamily("starling_step", "The swarm step this node has reached.", progress.step)
        yield GaugeMetricFamily("starling_loss", "The last step's training loss.", progress.loss)
        yield GaugeMetricFamily("starling_step_peers", "Peers in the last step's update, self included.",
                                progress.peers)
        yield CounterMetricFamily("starling_rounds", "Steps in which an exchange with peers completed.",
                                  progress.rounds)
        yield CounterMetricFamily("starling_rounds_incomplete", "Steps whose round went on without a peer that "
                                  "died or timed out.", progress.rounds_incomplete)
        yield CounterMetricFamily("starling_step_seconds", "Wall time spent in training steps.", progress.wall_s)
        yield CounterMetricFamily("starling_compute_seconds", "The part of it spent in local compute.",
                                  progress.compute_s)
        if progress.last_sync_unix_s is not None:
            yield GaugeMetricFamily("starling_last_sync_timestamp_seconds", "When the last exchange completed "
                                    "(Unix time).", progress.last_sync_unix_s)
        checkpoint = getattr(trainer, "last_checkpoint", None)
        if checkpoint is not None:
            age = max(0.0, time.time() - checkpoint.created)
            yield GaugeMetricFamily("starling_checkpoint_age_seconds", "Seconds since the newest checkpoint this "
                                    "node wrote or resumed from was created.", age)
            yield GaugeMetricFamily("starling_checkpoint_step", "The step of that checkpoint.", checkpoint.step)


class MetricsServer:
    """Serves one node's metrics over HTTP in the Prometheus text format (a daemon thread of
    prometheus_client's own)."""

    def __init__(self, node: Node, host: str = "127.0.0.1", port: int = 0) -> None:
        self.collector = NodeCollector(node)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class TensorBoardLog:
    """The JSON progress lines' numbers as TensorBoard scalars (`node start --tensorboard DIR`).
    Needs the `tensorboard` package (`pip install 'starling[tensorboard]'`); torch's
    SummaryWriter writes its event file on a thread of its own."""

    def __init__(self, directory: str | Path, writer: Callable[..., Any] | None = None) -> None:
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise MetricsError("--tensorboard needs the tensorboard package: "
                                   "pip install 'starling[tensorboard]'") from None
            writer = SummaryWriter
        try:
            self._writer = writer(log_dir=str(directory))
        except OSError as exc:
            raise MetricsError(f"cannot write TensorBoard logs to {directory}: {exc.strerror or exc}") from None

    def log(self, progress: TrainingProgress) -> None:
        step, add = progress.step, self._writer.add_scalar
        if math.isfinite(progress.loss):
            add("train/loss", progress.loss, step)
        add("swarm/peers", progress.peers, step)
        add("swarm/rounds", progress.rounds, step)
        add("swarm/rounds_incomplete", progress.rounds_incomplete, step)
        add("bytes/sent", progress.bytes_sent, step)
        add("bytes/received", progress.bytes_received, step)

    def close(self) -> None:
        self._writer.close()
