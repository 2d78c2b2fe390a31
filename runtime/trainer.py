"""The training runner: one node, one protocol over one task's model, and the step loop.

Both `starling node start --protocol ... --task ...` and every simulated peer run a
`Trainer`. The first node of a swarm fixes what the swarm trains (a `TrainSpec`, carried
in the node's swarm config); a joiner that names no protocol or task learns them from the
peer it joins, and one that names different ones is refused at join (see
`membership.config_conflicts`).

    spec = TrainSpec(protocol="gossip", task="charlm", options={"lr": 0.05})
    node = Node().start(listen, join, swarm_config=spec.to_swarm_config())
    trainer = Trainer(node, spec if not join else TrainSpec.from_swarm_config(node.swarm_config))
    trainer.create_protocol()
    if join:
        trainer.fetch_state()        # continue at the swarm's round, not from scratch
    trainer.run(steps=None, stop=threading.Event())

With `checkpoint=CheckpointConfig(directory, every)`, every `every` steps the protocol's
state (and the spec it trains) goes to disk on a writer thread, and `resume()` continues a
restarted peer from the newest checkpoint that verifies (see `runtime/checkpoint.py`).
"""
from __future__ import annotations

import concurrent.futures
import copy
import io
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from starling.common import peer_hash
from starling.common.faults import fault_point
from starling.data.assignment import Unit, UnitLedger
from starling.node import Node, TransferError
from starling.protocols import (
    PRIVATE_STATE,
    LossFn,
    Protocol,
    ProtocolError,
    StepReport,
)
from starling.runtime.checkpoint import (  # CheckpointConfig: imported from here too
    BackgroundCheckpointer,
    Checkpoint,
    CheckpointConfig,
    CheckpointError,
    CheckpointStore,
)
from starling.runtime.data_position import DATA_STATE, SwarmLedger
from starling.runtime.modelspec import ARCHITECTURE_KEY, INITIAL_STATE_KEY, architecture, first_difference, state_digest
from starling.runtime.placement import Placement
from starling.runtime.recipes import BatchRecipes
from starling.runtime.replication import Replication, Single, TrainingPlan
from starling.runtime.restart import agree_on_step, holders_of
from starling.runtime.spec import (
    RUN_LENGTH_OPTION,
    TrainSpec,
    TrainSpecError,
    plans_run_length,
    protocol_config,
    resolve_protocol,
    with_run_length,
)
from starling.tasks import Task, get_task

# TrainSpec and the reading of protocol options live in runtime/spec.py; their names are
# importable from here as well
__all__ = ["RUN_LENGTH_OPTION", "STATE_BLOB", "CheckpointConfig", "TrainSpec", "TrainSpecError", "Trainer",
           "plans_run_length", "prepare_to_train", "protocol_config", "resolve_protocol", "shard_for",
           "with_run_length"]

log = logging.getLogger(__name__)

STATE_BLOB = "starling.train.state"
BANS_STATE = "bans"  # a checkpoint's key of the node's bans (Trust.state_dict)
FETCH_STATE_DEADLINE_S = 120.0  # how long a joiner keeps trying to fetch the swarm's state


def prepare_to_train() -> None:
    """Pay torch's one-time lazy work now. The first optimizer a process builds imports
    torch._dynamo: 1.8 to 3.5 s on a busy 2-core box, nearly all of a joiner's time from its
    hello to its first step (fetching the state took 10 ms). A node that will train calls this
    before it says hello: from its hello on, the others count it in their rounds, and every
    second it then spends importing is a second their rounds wait for its parts (found by the
    chaos soak, benchmarks/chaos.py)."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def shard_for(peer_id: str, world: int) -> int:
    """A data shard for a peer that has no rank (a real swarm): stable, spread by its id."""
    return peer_hash(peer_id) % world


class Trainer:
    """Runs one peer's training: builds the model and protocol, serves its state to
    joiners, fetches the swarm's state when joining, and loops over its data shard."""

    def __init__(self, node: Node, spec: TrainSpec, rank: int, world: int, task: Task | None = None,
                 serve_state: bool = True, snapshot_every_s: float = 1.0,
                 checkpoint: CheckpointConfig | None = None, placement: Placement | None = None,
                 replication: Replication | None = None) -> None:
        """`placement`: this peer's device, parameter dtype, autocast and where the protocol
        keeps its outer state (default: the model as the task builds it). `replication`: how
        this peer's model is held by its processes (`runtime/replication.py`): one process
        (`Single`, the default), a replica of many ranks under DDP (`Replica`, this process its
        rank 0; the group initialized), or one rank of a replica whose ranks each sync their own
        shard under FSDP2 (`ShardSync`). `rank`, `world`: the peer's data shard; a rank of a
        replica reads its part of it."""
        self.node, self.spec = node, spec
        self.replication = replication or Single()
        self.replication.bind(node)
        self.rank, self.world = self.replication.shard(rank, world)
        self.placement = placement or Placement()
        # Whether this peer's initial state differs from the swarm's first peer's (known at
        # create_protocol): it must then take the swarm's state rather than train from its own.
        self.initial_state_differs = False
        self.task = task if task is not None else get_task(spec.task, **spec.task_kwargs())
        self.proto: Protocol | None = None
        self.serve_state = serve_state
        self.snapshot_every_s = snapshot_every_s  # 0: after every step
        self._snapshot = b""
        self._snapshot_at = float("-inf")
        self._snapshot_agreed: bool | None = None  # whether the next step refreshes it, as the replica agreed
        self.checkpoint = checkpoint
        self._store = CheckpointStore(checkpoint.directory, checkpoint.keep) if checkpoint else None
        self._writer = BackgroundCheckpointer(self._store) if self._store else None
        self._resumed_at = 0  # batches of the shard a resumed checkpoint had already trained on
        self._batch_index = 0  # the index in the shard of the batch `batches()` gave last
        # Which units of the task's data each member trains, for a task that has units
        # (`starling.data.assignment`); its position goes in checkpoints and the state joiners fetch.
        # A swarm of each member's own data (`spec.local`) has no ledger: every member trains its
        # own units in epochs of its own, and says where it is in its status.
        units = self.task.data_units()
        self.data = SwarmLedger(node, units, spec.seed) if units and not spec.local else None  # `data_position.py`
        self._own_batches = self.task.shard_batches(self.rank, self.world, spec.seed) if spec.local else None
        self.last_unit: Unit | None = None  # the unit of the batch `batches()` gave last
        self.last_unit_counted = True  # whether the last step's update held this peer's work on its unit
        self._step_weight: float | None = None  # the weight of the next step (0: it takes part without counting)
        # The newest checkpoint this peer wrote (durable) or resumed from: its age is a metric.
        self.last_checkpoint: Checkpoint | None = None

    def create_protocol(self) -> Protocol:
        config = self.node.swarm_config or {}
        # The first peer (whose model fixes the swarm's architecture) fixes its replicas' shape
        # too; a peer whose replica differs is refused before it builds anything (ReplicaError).
        self.node.swarm_config = self.replication.check_swarm_config(dict(config), ARCHITECTURE_KEY not in config)
        ranks = self.replication.ranks
        if self.ledger is not None and ranks > 1:
            raise TrainSpecError(f"task {self.task.name!r} hands out units to a swarm's members; a replica of "
                                 f"{ranks} ranks would need them split among its ranks, which it "
                                 "does not yet do: run one rank per peer")
        cls = resolve_protocol(self.spec.protocol)
        if (why := self.replication.check_protocol(self.spec.protocol, cls.local_inner_steps)) is not None:
            raise TrainSpecError(why)
        model = self.task.make_model()
        self._check_architecture(model)  # as the task builds it: peers may differ in device and dtype
        # Cast to a lower precision, the model loses bits the protocol's float32 state keeps.
        full = copy.deepcopy(model) if self.placement.lowers_precision(model) else None
        model, full = self.replication.place(self.placement.place(model), full, self.checkpoint)
        where = {str(t.device) for t in model.parameters()}
        if where != {"cpu"} and not cls.runs_on_accelerators:
            raise TrainSpecError(f"protocol {self.spec.protocol!r} runs on the CPU only (its tensors do not yet "
                                 f"follow the model's device), and this peer's model is on {', '.join(sorted(where))}; "
                                 "use --device cpu")
        self.proto = cls.create(self.node, model, self.spec.options)
        self.replication.attach(self.proto)
        # the round's ledger and the ban set are part of what the members must hold alike at its start
        self.proto.round_context = self._round_context
        if full is not None:
            self.proto.start_from(full.to(device=self.placement.device) if self.placement.device else full)
            del full
        if self.placement.state_device is not None:
            self.proto.place_state(self.placement.state_device)
        # An optional hook: a protocol that needs the peer's own data set, not only the batches
        # its step() closure sees (sketch-dp's sample-level DP draws Poisson batches from it).
        attach_task = getattr(self.proto, "attach_task", None)
        if callable(attach_task):
            attach_task(self.task, self.rank, self.world, self.spec.seed)
        self._attach_recipes(self.proto)
        if self.serve_state:
            self.take_snapshot()
            self.node.serve_blob(STATE_BLOB, lambda: self._snapshot)
        if self.data is not None:  # a joiner waits a round where it can take part without counting
            self.data.start(cls.weightless_steps)
        return self.proto

    def _attach_recipes(self, proto: Protocol) -> None:
        """Give the protocol this peer's batch recipes (`runtime/recipes.py`), for audits and
        checks of pseudo-gradients. A replica of many ranks computes its gradient over their
        batches together, which no recipe names."""
        checked = next((name for name in ("audit_rate", "verify_rate") if getattr(proto.config, name, 0.0) > 0.0), None)
        if self.ledger is not None:
            if checked is not None:
                raise TrainSpecError(f"{checked} needs a task whose peers read their own shard; {self.task.name!r} "
                                     "hands out units, which a checker does not yet recompute")
            return
        if self.replication.ranks > 1:
            if checked is not None:
                raise TrainSpecError(f"{checked} needs peers of one rank each: a replica's gradient is over "
                                     "its ranks' batches together, which a checker cannot recompute")
            return
        proto.audit_data = BatchRecipes(self.task, self.spec.seed, self.rank, self.world,
                                        lambda: self._batch_index, self._loss_of)

    def lead_replica(self) -> None:
        """The state this peer starts from is loaded (fetched, resumed or its own): a replica's
        other ranks take it and train alongside from here on."""
        assert self.proto is not None, "create_protocol() first"
        self.replication.lead(self.proto, TrainingPlan(self.spec.task, dict(self.spec.task_options), self.spec.seed,
                                                       self.rank, self.world, self._resumed_at, self.placement))

    @property
    def forward_model(self) -> Any:
        """The module the loss runs through: the replica's (DDP's, FSDP2's), else the protocol's model."""
        return self.replication.forward_model

    @property
    def resumed_at(self) -> int:
        """Batches of the shard a resumed checkpoint had already trained on."""
        return self._resumed_at

    def _check_architecture(self, model: Any) -> None:
        """The first peer whose model is built fixes the swarm's architecture (in its swarm
        config, which joiners learn at join); a later peer whose model differs is refused here,
        before it fetches any state, with the first tensor that differs named."""
        mine, digest = architecture(model), state_digest(model)
        config = self.node.swarm_config
        swarm = config.get(ARCHITECTURE_KEY) if config else None
        if swarm is None:
            self.node.swarm_config = {**(config or {}), ARCHITECTURE_KEY: mine, INITIAL_STATE_KEY: digest}
            return
        if not isinstance(swarm, list):
            raise TrainSpecError(f"the swarm config's {ARCHITECTURE_KEY!r} is not a list of tensors")
        if (difference := first_difference(swarm, mine)) is not None:
            raise TrainSpecError(f"this peer's model differs from the swarm's: {difference}")
        initial = config.get(INITIAL_STATE_KEY) if config else None
        self.initial_state_differs = isinstance(initial, str) and initial != digest
        if self.initial_state_differs:
            log.info("%s: this peer's initial state (digest %s) differs from the swarm's (%s); it takes the "
                     "swarm's state instead of training from its own start", self.node.peer_id, digest, initial)

    def fetch_state(self, peers: list[str] | None = None, deadline_s: float = FETCH_STATE_DEADLINE_S,
                    stop: threading.Event | None = None) -> str:
        """A joiner's catch-up: the protocol state of some live peer, at that peer's step.
        A busy or failing source sends it to the others, then round after round with backoff
        until `deadline_s` has passed (or `stop` is set); then TransferError says what was
        tried."""
        import torch

        assert self.proto is not None, "create_protocol() first"
        source, blob = self.node.fetch_blob(STATE_BLOB, peers, deadline_s=deadline_s, stop=stop)
        fault_point("join.fetched")
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)  # then to my device
        state.pop(PRIVATE_STATE, None)  # the donor's own residuals are not the joiner's
        data = state.pop(DATA_STATE, None)
        ledger = self.data.parse(data) if self.data is not None else None  # checked before anything changes
        self.proto.load_state_dict(state)
        if ledger is not None:
            self.data.take(ledger)  # type: ignore[union-attr]  (the swarm's data position, as the donor saw it)
        log.info("%s: joined from %s at step %d", self.node.peer_id, source, self.proto.step_count)
        return source

    def take_snapshot(self) -> None:
        import torch

        assert self.proto is not None
        buffer = io.BytesIO()
        state = self.proto.state_dict()
        state.pop(PRIVATE_STATE, None)  # a joiner does not load it: why send it
        if self.data is not None:
            state[DATA_STATE] = self.data.state_dict()
        torch.save(state, buffer)
        self._snapshot = buffer.getvalue()  # one reference swap: the network thread reads it
        self._snapshot_at = time.monotonic()

    def batches(self) -> Iterator[Any]:
        """This peer's data: the units the swarm's ledger hands it, round after round, for a
        task with units; else its shard, after `resume()` from the batch the checkpoint had reached."""
        if self.ledger is not None:
            return self._units()
        shard = itertools.islice(self.task.batches(self.rank, self.world, self.spec.seed), self._resumed_at, None)
        return self._counted(shard, self._resumed_at)

    def _counted(self, shard: Iterator[Any], start: int) -> Iterator[Any]:
        for index, batch in enumerate(shard, start=start):
            self._batch_index = index  # what the step on this batch states in its recipe
            yield batch

    def _units(self) -> Iterator[Any]:
        """The units the swarm's ledger hands this peer, round after round (`SwarmLedger.rounds`)."""
        assert self.data is not None and self.proto is not None
        proto = self.proto
        for unit, counts in self.data.rounds(lambda: proto.step_count):
            self._batch_index = unit.index
            # a unit that does not count: no unit this round, so the next in line, weighing nothing
            self.last_unit, self._step_weight = (unit, None) if counts else (None, 0.0)
            yield self.task.unit_batch(unit.index)

    @property
    def ledger(self) -> UnitLedger | None:
        """The swarm's data position this peer holds (None for a task without units)."""
        return self.data.ledger if self.data is not None else None

    @property
    def ledger_adopted(self) -> int:
        """Times this peer took the round's reference's ledger."""
        return self.data.adopted if self.data is not None else 0

    @property
    def ledger_digest(self) -> str | None:
        """The digest of the ledger of the round this peer is in, as hex (None without a ledger):
        what every member of the round should hold alike."""
        if self.data is None:
            return None
        return self.data.digest().hex()[:16] or None

    def _round_context(self) -> bytes:
        """What the members of a round must hold alike besides the protocol's state: the ban set
        and, with units of data, the round's ledger."""
        ledger = self.data.digest() if self.data is not None else b""
        return self.node.trust.ban_digest + ledger

    def step(self, batch: Any) -> StepReport:
        """One protocol step on `batch`; refreshes the snapshot joiners fetch."""
        proto = self.proto
        assert proto is not None
        loss_fn = self._loss_of(batch)
        self.node.check_fault()
        fault_point("train.step", proto.step_count)
        weight, self._step_weight = self._step_weight, None
        if self.spec.local:  # weighed by what it trained (a protocol that weighs contributions takes it)
            proto.weigh_next_step(self.task.batch_work(batch))
            self._say_position()
        if weight is not None:  # a round this peer takes part in without counting (`_units`; one rank only)
            report = proto.step(loss_fn, weight=weight)  # type: ignore[call-arg]
        else:
            report = self.replication.step(lambda: proto.step(loss_fn))
        self.node.check_fault()  # a step whose sockets failed under it may have "finished" alone
        if report.diverged:  # the members began the round apart: whatever bans differ, they share again
            self.node.share_bans()
        if self.data is not None:
            self.last_unit_counted = self.data.stepped(report)
        if self._snapshot_now():
            self.take_snapshot()
        # the ranks of a sharded replica write together, at the steps they took together
        count = self.replication.steps_taken(proto)
        if self.checkpoint is not None and count % self.checkpoint.every == 0:
            self.save_checkpoint()
        return report

    def _say_position(self) -> None:
        """A member of a local swarm: where it is in its own data, in its status."""
        done = self._batch_index + 1
        position: dict[str, Any] = {"scope": "local", "batches": done}
        if self._own_batches:
            position.update(epoch=self._batch_index // self._own_batches, epoch_batches=self._own_batches)
        self.node.set_status_info(data=position)

    def _loss_of(self, batch: Any) -> LossFn:
        """The loss on `batch` at the protocol's model, as every step of this peer computes it."""
        proto, task, placement = self.proto, self.task, self.placement
        assert proto is not None
        model = proto.model
        batch = placement.batch(batch, model)
        forward = self.forward_model if self.forward_model is not None else model

        def loss_fn() -> Any:
            with placement.autocast(model):
                return task.loss(forward, batch)
        return loss_fn

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        """Hand a copy of the protocol's state to the writer thread; the training thread
        pays only for the copy (`state_dict()` clones)."""
        assert self.proto is not None
        if self.replication.has_own_checkpoints():  # every rank its part, at once (a collective)
            self.replication.save_checkpoint(self.proto, self.spec.to_swarm_config())
            return
        assert self._writer is not None
        state = {"protocol": self.proto.state_dict(), "swarm": self.spec.to_swarm_config(),
                 "rank": self.rank, "world": self.world}
        if self.data is not None:
            state[DATA_STATE] = self.data.state_dict()
        state[BANS_STATE] = self.node.run(_trust_state(self.node))
        future = self._writer.save(self.proto.step_count, state,
                                   meta={"peer_id": self.node.peer_id, "swarm": self.spec.to_swarm_config()})
        future.add_done_callback(self._checkpoint_written)

    def _checkpoint_written(self, future: concurrent.futures.Future[Checkpoint]) -> None:
        # On the writer thread; one reference swap, read by whoever reports the checkpoint's age.
        if not future.cancelled() and future.exception() is None:
            self.last_checkpoint = future.result()

    def resume(self, at_most: int | None = None) -> Checkpoint | None:
        """Load the newest checkpoint (of a step <= `at_most`) that verifies into the
        protocol; None if the directory holds none. Raises CheckpointError for a checkpoint
        of another swarm (a different protocol, task, options or seed)."""
        assert self.proto is not None and self._store is not None, "create_protocol() with a checkpoint config"
        found = self._store.load_latest(at_most=at_most)
        if found is None:
            return None
        checkpoint, state = found
        self._check_checkpoint_swarm(checkpoint.state_path, state.get("swarm"))
        try:
            ledger = self.data.parse(state.get(DATA_STATE)) if self.data is not None else None
        except ValueError as exc:
            raise CheckpointError(f"{checkpoint.state_path} holds a data position this task cannot take: "
                                  f"{exc}") from None
        self.proto.load_state_dict(state["protocol"])
        try:
            restored = self.node.run(_restore_bans(self.node, state.get(BANS_STATE)))
        except ValueError as exc:
            raise CheckpointError(f"{checkpoint.state_path}: {exc}") from None
        if restored:
            log.info("%s: %d bans restored from the checkpoint", self.node.peer_id, restored)
        if ledger is not None:  # where this peer was: the swarm may have gone on without it
            self.data.take(ledger)  # type: ignore[union-attr]
        self._resumed_at = self.proto.step_count
        self.last_checkpoint = checkpoint
        if self.serve_state:
            self.take_snapshot()  # a peer that lacks this checkpoint may fetch it from here
        log.info("%s: resumed from %s at step %d", self.node.peer_id, checkpoint.state_path, self.proto.step_count)
        return checkpoint

    def _check_checkpoint_swarm(self, path: Any, swarm: Any) -> None:
        """CheckpointError unless the checkpoint at `path` was written by a swarm training what
        this one trains (`swarm`: its swarm config)."""
        try:
            same = TrainSpec.from_swarm_config(swarm).resolved() == self.spec.resolved()
        except (TrainSpecError, ProtocolError, ValueError) as exc:
            raise CheckpointError(f"{path} names a swarm this peer cannot run: {exc}") from None
        if not same:
            raise CheckpointError(f"{path} was written by a swarm training {swarm}, not {self.spec.to_swarm_config()}")

    def resume_replica(self) -> int | None:
        """A replica that writes its own checkpoints (each rank its part; `ShardSync`): load its
        newest, whatever rank count wrote it (torch's distributed checkpoint reshards; a
        collective). Returns the step, or None when there is none. CheckpointError for one of
        another swarm."""
        assert self.proto is not None and self.replication.has_own_checkpoints(), "create_protocol() with checkpoints"
        found = self.replication.latest_checkpoint()
        if found is None:
            return None
        path, manifest = found
        self._check_checkpoint_swarm(path, manifest.get("swarm"))
        try:
            step = self.replication.load_checkpoint(path, manifest, self.proto)
        except (ValueError, RuntimeError, ProtocolError) as exc:
            raise CheckpointError(f"{path} cannot be loaded into this replica: {str(exc)[:500]}") from None
        if self.serve_state:
            self.take_snapshot()
        log.info("%s: resumed a %s rank from %s (written by %s ranks) at step %d", self.node.peer_id,
                 self.replication.name, path, manifest.get("ranks"), step)
        return step

    def resume_swarm(self, quorum: int, timeout_s: float) -> int | None:
        """A whole-swarm restart: agree with `quorum` peers on the newest step they hold a
        checkpoint of (`runtime/restart.py`), then load it. A peer that lacks that step
        continues from a peer that has it, as a joiner does. Returns the step training goes
        on from, or None when no quorum holds a checkpoint (a fresh start)."""
        assert self.proto is not None and self._store is not None, "create_protocol() with a checkpoint config"
        agreed = agree_on_step(self.node, self._store, quorum, timeout_s)
        if agreed is None:
            return None
        checkpoint = self.resume(at_most=agreed)
        if checkpoint is None or checkpoint.step != agreed:
            log.warning("%s: holds no checkpoint of the agreed step %d; fetching the swarm's state",
                        self.node.peer_id, agreed)
            self.fetch_state(holders_of(self.node, agreed) or None)
        return self.proto.step_count

    def agree(self, go: bool) -> bool:
        """Whether to take the next step: `go`, and in a sharded replica, every rank's `go` (a
        collective each rank calls before each step; a failed one leaves the sub-swarm). The
        same collective settles whether the step refreshes the joiners' snapshot."""
        go, self._snapshot_agreed = self.replication.agree(go, self._snapshot_due())
        return go

    def _snapshot_due(self) -> bool:
        return self.serve_state and time.monotonic() - self._snapshot_at >= self.snapshot_every_s

    def _snapshot_now(self) -> bool:
        """Whether this step refreshes the snapshot: as agreed before it (`agree`), else when
        it is due (a step taken without agreeing first)."""
        agreed, self._snapshot_agreed = self._snapshot_agreed, None
        return self.serve_state and (agreed if agreed is not None else self._snapshot_due())

    def align_replica(self, deadline_s: float = FETCH_STATE_DEADLINE_S, stop: threading.Event | None = None) -> None:
        """A joining replica whose ranks each fetched their part of the swarm's state: until
        every rank holds the same step, the ranks behind fetch again (a collective each rank
        calls). A donor replica's ranks refresh their snapshots at the same steps, but a rank
        may fetch just before such a step and another just after it."""
        assert self.proto is not None, "create_protocol() first"
        deadline = time.monotonic() + deadline_s
        while True:
            low, high = self.replication.step_range(self.proto.step_count)
            if low == high:
                return
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise TransferError(f"the ranks of this replica fetched the swarm's state at steps {low} to {high} "
                                    f"and did not meet at one step within {deadline_s:g} s")
            if self.proto.step_count < high:
                log.info("%s: fetched step %d, another rank of this replica step %d: fetching again",
                         self.node.peer_id, self.proto.step_count, high)
                self.fetch_state(deadline_s=max(0.0, deadline - time.monotonic()), stop=stop)

    def evaluate(self) -> dict[str, float]:
        assert self.proto is not None
        return self.replication.evaluate(self.task, self.proto.eval_model())

    def run(self, steps: int | None, stop: threading.Event,
            on_report: Callable[[StepReport], None] | None = None) -> int:
        """Train until the protocol's step count reaches `steps` (None: until `stop`); in a
        sharded replica, until any rank of it stops."""
        assert self.proto is not None
        batches = self.batches()
        while self.agree(not stop.is_set() and (steps is None or self.proto.step_count < steps)):
            report = self.step(next(batches))
            if on_report is not None:
                on_report(report)
        return self.proto.step_count

    def finish_replica(self) -> None:
        """Tell the replica's other ranks to stop here (they end holding this rank's state)."""
        self.replication.finish()

    def finish_checkpoints(self) -> None:
        """Wait for the checkpoint being written (and one waiting) to become durable."""
        if self._writer is not None:
            self._writer.close()

    def close(self) -> None:
        self.finish_replica()
        self.finish_checkpoints()
        if self.proto is not None:
            self.proto.close()


async def _trust_state(node: Node) -> dict[str, Any]:
    return node.trust.state_dict()  # on the network thread, which bans


async def _restore_bans(node: Node, state: Any) -> int:
    return node.trust.load_state_dict(state)
