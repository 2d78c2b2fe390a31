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
import dataclasses
import hashlib
import importlib
import io
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starling.common import option_name, peer_hash
from starling.common.faults import fault_point
from starling.data.assignment import Unit, UnitLedger
from starling.node import Node, TransferError
from starling.protocols import (
    PRIVATE_STATE,
    LossFn,
    Protocol,
    ProtocolError,
    StepReport,
    config_from_options,
    get_protocol,
)
from starling.runtime.checkpoint import (  # CheckpointConfig: imported from here too
    BackgroundCheckpointer,
    Checkpoint,
    CheckpointConfig,
    CheckpointError,
    CheckpointStore,
)
from starling.runtime.modelspec import ARCHITECTURE_KEY, INITIAL_STATE_KEY, architecture, first_difference, state_digest
from starling.runtime.placement import Placement
from starling.runtime.recipes import BatchRecipes
from starling.runtime.replication import Replication, Single, TrainingPlan
from starling.runtime.restart import agree_on_step, holders_of
from starling.tasks import Task, get_task

log = logging.getLogger(__name__)

STATE_BLOB = "starling.train.state"
# The data positions (UnitLedger states) of a unit task's last LEDGER_ROUNDS rounds, as JSON
# {round: state}: a peer whose view of the members changed, or that caught up, takes one from
# the round's most senior member, so that the swarm's ledgers agree again.
LEDGER_BLOB = "starling.train.ledger"
LEDGER_ROUNDS = 8
LEDGER_FETCH_S = 1.5  # how long a peer waits for the reference's ledger before advancing its own
LEDGER_MAX_BYTES = 64 << 20  # a ledger blob said to be larger is refused (8 rounds of a very large swarm fit)
DATA_STATE = "data"  # the state_dict key of the swarm's data position (a UnitLedger), next to the protocol's
BANS_STATE = "bans"  # a checkpoint's key of the node's bans (Trust.state_dict)
FETCH_STATE_DEADLINE_S = 120.0  # how long a joiner keeps trying to fetch the swarm's state
# A protocol option that plans for the run's length (sketch-dp's privacy budget is spread over
# it); filled from the run's step count when the user leaves it unset.
RUN_LENGTH_OPTION = "budget_steps"
_SPEC_KEYS = ("protocol", "task", "options", "task_options", "seed")


class TrainSpecError(ValueError):
    """A swarm config does not describe something this node can train."""


@dataclass(frozen=True)
class TrainSpec:
    """What a swarm trains: every peer must run the same protocol, options and task."""

    protocol: str
    task: str = "charlm"
    options: Mapping[str, Any] = field(default_factory=dict)  # protocol hyper-parameters
    task_options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def to_swarm_config(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "task": self.task, "options": dict(self.options),
                "task_options": dict(self.task_options), "seed": self.seed}

    @classmethod
    def from_swarm_config(cls, config: Mapping[str, Any] | None) -> TrainSpec:
        if not config or not config.get("protocol"):
            raise TrainSpecError("the swarm does not train (its first node was started without --protocol); "
                                 "name a protocol and task to start a training swarm")
        try:
            options, task_options = dict(config.get("options") or {}), dict(config.get("task_options") or {})
            return cls(str(config["protocol"]), str(config.get("task", "charlm")), options, task_options,
                       int(config.get("seed", 0)))
        except (TypeError, ValueError) as exc:
            raise TrainSpecError(f"malformed swarm config: {exc}") from None

    def resolved(self) -> dict[str, Any]:
        """The spec with every option parsed into its config (so "0.05" and 0.05 compare equal):
        what two specs must share to train the same swarm."""
        task = get_task(self.task, **self.task_options)
        task_config = getattr(task, "config", None)
        return {"protocol": self.protocol, "task": self.task, "seed": self.seed,
                "options": dataclasses.asdict(protocol_config(self.protocol, self.options)),
                "task_options": dataclasses.asdict(task_config) if dataclasses.is_dataclass(task_config)
                else dict(self.task_options)}

    def check(self) -> None:
        """Resolve the protocol, its options and the task now, so that bad input fails
        before training starts (raises ProtocolError or TaskSpecError naming the field)."""
        protocol_config(self.protocol, self.options)
        get_task(self.task, **self.task_options)


def resolve_protocol(name: str) -> type[Protocol]:
    """A protocol class by registered name; "module:name" imports `module` first, and a bare
    name not yet registered is looked for in `starling.protocols.<name>`."""
    module, sep, registered = name.rpartition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ProtocolError(f"protocol {name!r}: cannot import {module!r}: {exc}") from None
        return get_protocol(registered)
    try:
        return get_protocol(name)
    except ProtocolError:
        if not name.replace("-", "_").isidentifier():
            raise
        try:
            importlib.import_module(f"starling.protocols.{name.replace('-', '_')}")
        except ModuleNotFoundError:
            raise ProtocolError(f"unknown protocol {name!r}") from None
        return get_protocol(name)


def protocol_config(protocol: str, options: Mapping[str, Any]) -> Any:
    """The config dataclass `protocol` builds from `options`, as every peer's protocol will.

    This is the one reading of protocol options between a command line and the protocol:
    names with dashes or underscores, values typed or as text (``"20"``, ``"yes"``). Everything
    that needs to know what a run's options amount to (its optimizer, its lr, whether they are
    valid) asks this, never the raw mapping. Raises ProtocolError naming the bad field.
    """
    return config_from_options(resolve_protocol(protocol).config_class, options)


def with_run_length(protocol: str, options: Mapping[str, Any], steps: int | None) -> dict[str, Any]:
    """`options`, plus `budget_steps=steps` when the protocol's config has that field and the
    user did not set it, so that whatever the protocol plans over the run fits its length."""
    out = dict(options)
    if steps is None or any(option_name(name) == RUN_LENGTH_OPTION for name in out):
        return out
    if plans_run_length(protocol):
        out[RUN_LENGTH_OPTION] = steps
    return out


def plans_run_length(protocol: str) -> bool:
    """Whether the protocol plans over the run's length (its config has `budget_steps`)."""
    return any(f.name == RUN_LENGTH_OPTION for f in dataclasses.fields(resolve_protocol(protocol).config_class))


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
        self.task = task if task is not None else get_task(spec.task, **spec.task_options)
        self.proto: Protocol | None = None
        self.serve_state = serve_state
        self.snapshot_every_s = snapshot_every_s  # 0: after every step
        self._snapshot = b""
        self._snapshot_at = float("-inf")
        self.checkpoint = checkpoint
        self._store = CheckpointStore(checkpoint.directory, checkpoint.keep) if checkpoint else None
        self._writer = BackgroundCheckpointer(self._store) if self._store else None
        self._resumed_at = 0  # batches of the shard a resumed checkpoint had already trained on
        self._batch_index = 0  # the index in the shard of the batch `batches()` gave last
        # Which units of the task's data each member trains, for a task that has units
        # (`starling.data.assignment`); its position goes in checkpoints and the state joiners fetch.
        units = self.task.data_units()
        self.ledger = UnitLedger(units, spec.seed) if units else None
        self.last_unit: Unit | None = None  # the unit of the batch `batches()` gave last
        self._ledger_rounds: dict[int, str] = {}  # round -> the ledger's state after advancing to it, as JSON
        self._ledger_blob = b"{}"  # those, as served (one reference swap: the network thread reads it)
        self._ledger_members: tuple[str, ...] | None = None  # the members the ledger last advanced with
        # round -> members absent from its whole update, for each round that lost someone
        self._went_without: dict[int, tuple[str, ...]] = {}
        self.ledger_adopted = 0  # times this peer took the reference's ledger
        self.last_unit_counted = True  # whether the last step's update held this peer's work on its unit
        self._weightless_round: int | None = None  # a round the reference's ledger gave this peer no unit in
        self._step_weight: float | None = None  # the weight of the next step (0: it takes part without counting)
        self._readopt = False  # this peer's ledger may differ from the reference's: take it again next round
        self._recheck = False  # the ledger came with a fetched state: take this round's from the reference
        # the ledger came from a checkpoint or a donor: until a reference's has been taken, this
        # peer is never its own reference, even where that ledger names it the most senior member
        self._ledger_fresh = False
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
        if self.ledger is not None:  # a joiner waits a round where it can take part without counting
            self.ledger.newcomers_wait = cls.weightless_steps
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
        if self.ledger is not None:
            self.node.serve_blob(LEDGER_BLOB, lambda: self._ledger_blob)
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
        ledger = self._ledger_from(state.pop(DATA_STATE, None))  # checked before anything changes
        self.proto.load_state_dict(state)
        if ledger is not None:
            self.ledger = ledger  # the swarm's data position, as the donor saw it
            self._recheck = self._ledger_fresh = True
        log.info("%s: joined from %s at step %d", self.node.peer_id, source, self.proto.step_count)
        return source

    def _ledger_from(self, data: Any) -> UnitLedger | None:
        """A ledger holding a saved or fetched data position (None if this task has no units or
        none came); ValueError for one of another data set or a malformed one."""
        if self.ledger is None or data is None:
            return None
        ledger = UnitLedger(self.ledger.units, self.ledger.seed, self.ledger.units_per_member,
                            self.ledger.newcomers_wait)
        ledger.load_state_dict(data)
        return ledger

    def take_snapshot(self) -> None:
        import torch

        assert self.proto is not None
        buffer = io.BytesIO()
        state = self.proto.state_dict()
        state.pop(PRIVATE_STATE, None)  # a joiner does not load it: why send it
        if self.ledger is not None:
            state[DATA_STATE] = self.ledger.state_dict()
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
        """Each round (this peer's step count), advance the ledger with the members this peer
        sees and train the units it hands this peer."""
        assert self.ledger is not None and self.proto is not None
        me = self.node.peer_id
        while True:
            round_ = self.proto.step_count
            if round_ > self.ledger.round or self._recheck:
                self._advance_ledger(round_, tuple(sorted({me, *self.node.live_peers()})))
                self.node.set_status_info(data=self.ledger.position())
            for unit in self.ledger.units_of(me):
                self._batch_index, self.last_unit = unit.index, unit
                yield self.task.unit_batch(unit.index)
            if self._weightless_round == round_ and not self.ledger.units_of(me):
                # no unit this round: step on the next one in line, weighing nothing, to keep in step
                self.last_unit, self._step_weight = None, 0.0
                yield self.task.unit_batch(self.ledger.peek().index)
            if self.proto.step_count == round_:  # not stepped (a caller that only reads batches)
                return

    def _advance_ledger(self, round_: int, members: tuple[str, ...]) -> None:
        """The ledger at `round_`: advanced here with `members`, settling the last round (a member
        absent from its whole update did not finish its units); or, when this peer skipped
        rounds (it caught up), the members changed or the last round lost someone (views may
        differ for a round), taken from the round's most senior member, which every peer that
        sees the same members asks."""
        assert self.ledger is not None
        recheck, self._recheck = round_ == self.ledger.round, False  # a joiner's first round
        jumped = recheck or round_ > self.ledger.round + 1
        changed = self._ledger_members is not None and members != self._ledger_members
        changed = changed or self.ledger.round in self._went_without or self._readopt  # or lost someone
        self._readopt = False
        self._ledger_members = members
        # the reference: the round's most senior member (the first in the ledger's order that is
        # still here), never a joiner, whose ledger has not caught up yet
        me = self.node.peer_id
        present = set(members) - ({me} if self._ledger_fresh and len(members) > 1 else set())
        reference = next((p for p in self.ledger.order if p in present), min(present))
        adopted = None
        if (jumped or changed) and reference != me:
            adopted = self._reference_ledger(reference, round_)
        if adopted is not None or len(members) == 1:
            self._ledger_fresh = False
        if adopted is not None:
            self.ledger = adopted
            self.ledger_adopted += 1
            # a peer that caught up or just joined may have been late in this round, which the
            # others then settle without it: it takes the next round's ledger too
            self._readopt = jumped
        elif not recheck:
            without = [p for p in self._went_without.get(self.ledger.round, ()) if p in members]
            if len(without) > max(2, len(members) // 4):
                # Most of the round looks absent: its members disagreed on who was in it (a shard
                # layout of another view sends parts to other owners), and their work did count
                # where it went. Only a few absences are taken for work that counted nowhere.
                without = []
            self.ledger.advance(round_, members, unfinished=without)
        if not self.ledger.in_flight.get(self.node.peer_id):  # it did not see this peer yet, or it is new
            log.info("%s: the ledger of round %d (%s) gives this peer no unit", self.node.peer_id, round_,
                     "from " + reference if adopted is not None else "its own")
            self._readopt = True
            if self.proto is not None and self.proto.weightless_steps:
                self._weightless_round = round_
            else:  # a protocol that cannot step without counting: train the next unit in line
                self.ledger.admit(self.node.peer_id)
        self._went_without = {r: v for r, v in self._went_without.items() if r >= round_ - 1}
        self._ledger_rounds[round_] = json.dumps(self.ledger.state_dict())  # each round's serialized once
        for old in [r for r in self._ledger_rounds if r <= round_ - LEDGER_ROUNDS]:
            del self._ledger_rounds[old]
        rounds = ", ".join(f'"{r}": {state}' for r, state in self._ledger_rounds.items())
        self._ledger_blob = ("{" + rounds + "}").encode()

    @property
    def ledger_digest(self) -> str | None:
        """The digest of the ledger of the round this peer is in, as hex (None without a ledger):
        what every member of the round should hold alike."""
        if self.ledger is None:
            return None
        return self._ledger_digest().hex()[:16] or None

    def _round_context(self) -> bytes:
        """What the members of a round must hold alike besides the protocol's state: the ban set
        and, with units of data, the round's ledger."""
        ledger = self._ledger_digest() if self.ledger is not None else b""
        return self.node.trust.ban_digest + ledger

    def _ledger_digest(self) -> bytes:
        """The digest of the ledger of the round this peer is in (its serialized form, kept
        anyway for the others to fetch); empty before the first round."""
        assert self.ledger is not None
        state = self._ledger_rounds.get(self.ledger.round)
        return hashlib.sha256(state.encode()).digest() if state is not None else b""

    def _reference_ledger(self, reference: str, round_: int) -> UnitLedger | None:
        """`reference`'s ledger at `round_` (None if it has none for that round within
        LEDGER_FETCH_S, or sends one that does not load: this peer then advances its own)."""
        deadline = time.monotonic() + LEDGER_FETCH_S
        while True:
            try:
                left = max(0.0, deadline - time.monotonic())
                _, blob = self.node.fetch_blob(LEDGER_BLOB, [reference], deadline_s=left, max_bytes=LEDGER_MAX_BYTES)
                state = json.loads(blob).get(str(round_)) if blob.startswith(b"{") else None
                if state is not None:
                    ledger = self._ledger_from(state)
                    if ledger is not None and ledger.round == round_:
                        return ledger
            except (TransferError, ValueError, AttributeError, RecursionError) as exc:
                log.info("%s: no ledger of round %d from %s: %s", self.node.peer_id, round_, reference, exc)
                return None
            if time.monotonic() >= deadline:  # the reference has not reached the round
                log.info("%s: %s had no ledger of round %d within %.1f s", self.node.peer_id, reference, round_,
                         LEDGER_FETCH_S)
                return None
            time.sleep(0.02)

    def step(self, batch: Any) -> StepReport:
        """One protocol step on `batch`; refreshes the snapshot joiners fetch."""
        proto = self.proto
        assert proto is not None
        loss_fn = self._loss_of(batch)
        self.node.check_fault()
        fault_point("train.step", proto.step_count)
        weight, self._step_weight = self._step_weight, None
        if weight is not None:  # a round this peer takes part in without counting (`_units`; one rank only)
            report = proto.step(loss_fn, weight=weight)  # type: ignore[call-arg]
        else:
            report = self.replication.step(lambda: proto.step(loss_fn))
        self.node.check_fault()  # a step whose sockets failed under it may have "finished" alone
        if report.diverged:  # the members began the round apart: whatever bans differ, they share again
            self.node.share_bans()
        if self.ledger is not None:
            if report.absent_peers or report.lost_peers:
                self._went_without[report.step] = tuple(report.absent_peers)
            if report.diverged:  # the members began the round apart (ledgers, or parameters): re-take it
                self._readopt = True
            self.last_unit_counted = self.node.peer_id not in report.absent_peers
        if self.serve_state and time.monotonic() - self._snapshot_at >= self.snapshot_every_s:
            self.take_snapshot()
        # the ranks of a sharded replica write together, at the steps they took together
        count = self.replication.steps_taken(proto)
        if self.checkpoint is not None and count % self.checkpoint.every == 0:
            self.save_checkpoint()
        return report

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
        if self.ledger is not None:
            state[DATA_STATE] = self.ledger.state_dict()
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
            ledger = self._ledger_from(state.get(DATA_STATE))
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
            self.ledger = ledger
            self._recheck = self._ledger_fresh = True
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
        collective each rank calls before each step; a failed one leaves the sub-swarm)."""
        return self.replication.agree(go)

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
