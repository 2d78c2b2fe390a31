"""How one peer of a swarm runs once its node is up: what `starling node start` does after
its hello, for a Python caller as for the command.

A peer that trains waits for the swarm to be big enough, then starts from the state it
should start from: its checkpoints when it resumes (agreed on with a quorum of peers), else
the swarm's state when it joined peers that are up, else its own start (with a warning when
that differs from the swarm's). It trains until `steps` or until `stop` is set, checkpoints
on the way, and tells the others its progress in its heartbeats. A peer that does not train
stays a member until `stop`.

    launch = NodeLaunch(protocol="allreduce", task="quadratic", steps=50).resolve()
    node = Node().start(listen, join, swarm_config=launch.swarm_config())
    stopped = PeerRun(launch).run(node, threading.Event(), on_record=print)

What it has to say goes to `on_record` as JSON-ready records (the command prints them as its
progress lines): `{"event": "training", ...}` once training starts; `{"step", "loss", "peers",
"lost", "bytes_sent", "wall_s"}` every `log_every` steps (with `unit`, `[epoch, index]` of the unit the
step trained, and `counted`, whether the update held it, for a task whose data is handed out
in units); `{"event": "stopped", "step", ...}`
with the evaluation once it stops.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starling.node import Node
from starling.node.transfer import TransferError
from starling.protocols import StepReport
from starling.runtime.launch import NodeLaunch
from starling.runtime.placement import Placement
from starling.runtime.replication import Replication, Single
from starling.runtime.trainer import CheckpointConfig, Trainer, TrainSpec, shard_for

if TYPE_CHECKING:
    from starling.runtime.metrics import MetricsServer, TensorBoardLog, TrainingProgress

log = logging.getLogger(__name__)

DEFAULT_WORLD = 16  # shards a peer's data is cut into when it is given none: it picks one from its id
RESUMED_CHECKPOINT_EVERY = 100  # steps between checkpoints of a resumed peer told no cadence (node start's default)
IDLE_CHECK_S = 0.5  # how often a peer that does not train looks for a fault of its node

Record = dict[str, Any]


@dataclass(frozen=True)
class PeerRun:
    """How one peer runs: its `launch` (resolved), and what the command's run options say.

    `shard`: this peer's data shard (rank, world); None picks one of 16 from its peer id.
    `log_every`: steps between progress records (0: none); `log_digest`: each carries the
    digest of the state the members hold alike (`synced`). `min_peers`: train only once this
    many peers (self included) are up, within `min_peers_timeout_s`. `checkpoint`: where and
    how often the training state goes to disk; a launch that resumes keeps checkpointing
    where it resumed from unless told otherwise. `resume_quorum`, `resume_timeout_s`: with a
    launch that resumes, how many peers must agree on the step to continue from, and how long
    to wait for them. `state_fetch_timeout_s`: a joiner's patience for the swarm's state.
    `placement`: device and precision.
    """

    launch: NodeLaunch
    shard: tuple[int, int] | None = None
    log_every: int = 10
    log_digest: bool = False
    min_peers: int = 1
    min_peers_timeout_s: float = 300.0
    checkpoint: CheckpointConfig | None = None
    resume_quorum: int = 1
    resume_timeout_s: float = 300.0
    state_fetch_timeout_s: float = 120.0
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if self.shard is not None:
            rank, world = self.shard
            if world < 1 or not 0 <= rank < world:
                raise ValueError(f"shard must be (rank, world) with 0 <= rank < world, got {self.shard}")
        if self.min_peers < 1:
            raise ValueError(f"min_peers must be >= 1, got {self.min_peers}")
        if self.resume_quorum < 1:
            raise ValueError(f"resume_quorum must be >= 1, got {self.resume_quorum}")

    @property
    def checkpoints(self) -> CheckpointConfig | None:
        """Where the training state goes: `checkpoint`, else, for a launch that resumes, the
        directory it resumes from."""
        if self.checkpoint is None and self.launch.resume_from is not None:
            return CheckpointConfig(str(self.launch.resume_from), RESUMED_CHECKPOINT_EVERY)
        return self.checkpoint

    def run(self, node: Node, stop: threading.Event, on_record: Callable[[Record], None] | None = None, *,
            metrics: MetricsServer | None = None, board: TensorBoardLog | None = None,
            replication: Replication | None = None) -> Record | None:
        """Run this peer on `node` (started with `launch.swarm_config()`) until its launch's
        steps or `stop`. Returns the "stopped" record, None for a peer that did not train or
        was stopped before it had the swarm's state.

        `metrics` exports the trainer and its progress, `board` gets the progress at each
        progress record. `replication`: how this peer's model is held by its processes
        (`runtime/replication.py`; `runtime/replica_launch.py` makes it): this process alone,
        rank 0 of a replica under DDP, or a rank of a replica under FSDP2 each of whose ranks
        syncs its own shard (a rank that does not `speak` says nothing to `on_record`). Raises TimeoutError when
        `min_peers` are not up in time, and what the `Trainer` raises (TrainSpecError,
        ProtocolError, TransferError, CheckpointError, ...).
        """
        if not self.launch.trains(node.swarm_config):
            while not stop.wait(IDLE_CHECK_S):
                node.check_fault()  # a node whose sockets failed ends with the reason, not silently
            return None
        self._wait_for_peers(node, stop)
        replication = replication or Single()
        if not replication.speaks:
            on_record = None
        return self._train(node, stop, on_record or _ignore, metrics, board, replication)

    def _wait_for_peers(self, node: Node, stop: threading.Event) -> None:
        deadline = time.monotonic() + self.min_peers_timeout_s
        while len(node.live_peers()) + 1 < self.min_peers and not stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"--min-peers {self.min_peers}: only {len(node.live_peers()) + 1} peers were up "
                                   f"after {self.min_peers_timeout_s:g} s")
            stop.wait(0.05)

    def _train(self, node: Node, stop: threading.Event, on_record: Callable[[Record], None],
               metrics: MetricsServer | None, board: TensorBoardLog | None,
               replication: Replication) -> Record | None:
        from starling.runtime.metrics import TrainingProgress

        # a swarm of each member's own data: this member's, and its tokenizer checked against the swarm's
        spec = TrainSpec.from_swarm_config(node.swarm_config).with_own_data(self.launch.own_data_options(),
                                                                            self.launch.tokenizer)
        # a member's own data is all its own: one shard of one, unless it is told to cut it
        default = (0, 1) if spec.local else (shard_for(node.peer_id, DEFAULT_WORLD), DEFAULT_WORLD)
        rank, world = self.shard or default
        trainer = Trainer(node, spec, rank, world, checkpoint=self.checkpoints, placement=self.placement,
                          replication=replication)
        try:
            trainer.create_protocol()
            progress = TrainingProgress()
            if metrics is not None:
                metrics.collector.attach(trainer, progress)
            if not self._start_from(trainer, node, stop):
                return None
            trainer.lead_replica()  # the state it starts from goes to the replica's other ranks
            assert trainer.proto is not None
            progress.step = trainer.proto.step_count  # a joiner's or resumed peer's
            reporter = _Reporter(node, trainer, progress, self.log_every, on_record, board, self.log_digest)
            on_record({"event": "training", "protocol": spec.protocol, "task": spec.task,
                       "shard": f"{trainer.rank}/{trainer.world}", "step": progress.step,
                       **trainer.placement.describe(), **replication.describe()})
            final = trainer.run(self.launch.steps, stop, reporter)
            trainer.finish_replica()  # the other ranks stop here, and say what they hold
            stopped = {"event": "stopped", "step": final, **{k: round(v, 5) for k, v in trainer.evaluate().items()},
                       **replication.stopped(trainer.proto)}
            info = trainer.proto.describe()
            if "privacy" in info:  # what a private protocol (sketch-dp) has spent
                stopped["privacy"] = info["privacy"]
            on_record(stopped)
            return stopped
        finally:
            trainer.close()

    def _start_from(self, trainer: Trainer, node: Node, stop: threading.Event) -> bool:
        """Load the state this peer starts from; False when `stop` came before it had it."""
        resumed = None
        if self.launch.resume_from is not None and trainer.replication.has_own_checkpoints():
            resumed = trainer.resume_replica()  # its own newest, whatever rank count wrote it
        elif self.launch.resume_from is not None:
            resumed = trainer.resume_swarm(self.resume_quorum, self.resume_timeout_s)
        try:
            if self.launch.joining and node.live_peers() and (resumed is None or _swarm_ahead_of(node, resumed)):
                # the swarm's state, not this peer's own start (see initial_state_differs); the first
                # node (not joining) is where the swarm's state starts, whoever joined it meanwhile.
                # A peer restarted into a swarm that trained on without it takes the swarm's state
                # too: its checkpoint is behind, and its ledger names it the most senior member.
                if resumed is not None:
                    log.info("resumed at step %d, but the swarm trained on: fetching its state", resumed)
                trainer.fetch_state(deadline_s=self.state_fetch_timeout_s, stop=stop)
            elif resumed is None and trainer.initial_state_differs:
                log.warning("this peer's initial state differs from the swarm's, and no peer is up to take the "
                            "swarm's from: it trains from its own start")
            if self.launch.joining:  # a replica's ranks each fetched their part: of one step
                trainer.align_replica(deadline_s=self.state_fetch_timeout_s, stop=stop)
        except TransferError:
            if not stop.is_set():
                raise
            log.info("stopped while fetching the swarm's state")
            return False
        return True


class _Reporter:
    """What each step's report becomes: progress (heartbeat meta, metrics), the replica's rank
    digests for `node status`, and a progress record every `log_every` steps."""

    def __init__(self, node: Node, trainer: Trainer, progress: TrainingProgress, log_every: int,
                 on_record: Callable[[Record], None], board: TensorBoardLog | None, digest: bool = False) -> None:
        self.node, self.trainer, self.progress = node, trainer, progress
        self.log_every, self.on_record, self.board, self.digest = log_every, on_record, board, digest
        self.start = time.monotonic()

    def __call__(self, report: StepReport) -> None:
        progress = self.progress
        progress.record(report)
        self.node.set_meta(**progress.meta())  # what `node watch` on any peer shows of this one
        replica = self.trainer.replication.status()
        if replica is not None:
            self.node.set_status_info(**replica)  # `node status`: do the replica's ranks agree?
        if self.log_every and (report.step + 1) % self.log_every == 0:
            # lost: members of the step's exchange whose contribution its update lacks (died, timed out)
            record: Record = {"step": report.step + 1, "loss": round(report.loss, 5), "peers": report.peers,
                              "lost": len(report.lost_peers), "bytes_sent": progress.bytes_sent,
                              "wall_s": round(time.monotonic() - self.start, 2)}
            unit = self.trainer.last_unit
            if self.trainer.ledger is not None:  # the unit this step trained, and whether the update held it
                record["unit"] = None if unit is None else [unit.epoch, unit.index]
                record["counted"] = self.trainer.last_unit_counted
            if self.digest:
                record["synced"] = getattr(self.trainer.proto, "synced_digest", lambda: None)()
                if self.trainer.ledger is not None:
                    record["ledger"] = self.trainer.ledger_digest
            self.on_record(record)
            if self.board is not None:
                self.board.log(progress)


def _swarm_ahead_of(node: Node, step: int) -> bool:
    """Whether a live peer says, in its beats, that it trains past `step`."""
    live = set(node.live_peers())
    for view in node.peers:
        theirs = view.meta.get("step") if view.id in live else None
        if isinstance(theirs, int) and theirs > step:
            return True
    return False


def _ignore(record: Record) -> None:
    pass
