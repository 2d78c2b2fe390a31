"""The protocol seam: what every training algorithm gives the runtime.

A protocol owns one peer's view of training: it wraps a model, talks to other peers
through a `Node` (registering its own topics), and decides what to exchange and when.
Its `step(loss_fn)` works like `torch.optim.Optimizer.step(closure)`: a backprop
protocol calls `loss_fn()` and `backward()`; a zeroth-order one calls it under
perturbations.

    proto = get_protocol("gossip").create(node, model, {"lr": 0.05, "topology": "ring"})
    for batch in task.batches(rank, world, seed):
        report = proto.step(lambda: task.loss(model, batch))

What every built-in protocol's plumbing shares lives here too, so that a protocol file holds
its algorithm: `meter` counts the bytes of its `topic_prefix`, `_serve` registers its topics
and the peer hooks once it is built, and a step is `_begin_step()` (a `StepClock`), the
algorithm, and `_report(...)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from starling.collectives import ByteMeter, ShardedReducer, watch_peers
from starling.common import config_from_options as common_config_from_options

if typing.TYPE_CHECKING:
    from starling.node.node import Node
    from starling.node.wire import Message
    from starling.protocols.audit import AuditData

LossFn = Callable[[], torch.Tensor]
PRIVATE_STATE = "private"  # the state_dict key of what only the peer's own restart loads
Handler = Callable[["Message"], Any]  # a topic's handler, as Node.on takes it (plain or async)


class ProtocolError(Exception):
    """A protocol could not complete an operation (bad config, bad state, unknown name)."""


class DivergedError(ProtocolError):
    """Training produced non-finite values (too high a learning rate, no clipping)."""


@dataclass(frozen=True)
class StepReport:
    """What one `step` did. Byte counts are this step's, as the node counted them."""

    step: int
    loss: float
    bytes_sent: int = 0
    bytes_received: int = 0
    synced: bool = False  # whether an exchange with peers completed during this step
    peers: int = 1  # peers whose contribution this step's update used (self included)
    lost_peers: tuple[str, ...] = ()  # peers dropped from a round because they died or timed out
    # of those, the ones whose contribution is in no part of the update (nothing of theirs counted)
    absent_peers: tuple[str, ...] = ()
    wall_s: float = 0.0
    compute_s: float = 0.0  # time spent in local compute (the rest was waiting on the network)
    sampled: bool = True  # False: with client sampling, this peer was not drawn for the step's round
    # an owner of the step's round saw its members begin it apart (parameters or `round_context`):
    # the runtime takes the data ledger from its reference at the next round
    diverged: bool = False


class StepClock:
    """Times one `step`: its wall time so far, and the part of it spent in local compute (the
    `computing()` blocks); the rest was waiting on the network."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.compute_s = 0.0

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.compute_s += time.monotonic() - began

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self.start


@dataclass(frozen=True)
class ProtocolConfig:
    """Hyper-parameters every protocol has; subclasses add their own fields."""

    lr: float = 0.01
    compressor: str = "none"  # a spec for starling.compressors.from_spec
    round_timeout_s: float = 30.0  # a round closes without peers that have not delivered by then


# The most shards (owners) a round of a sharded all-reduce has, by default: a member's part holds
# a socket to its owner until the owner's group closes, and a node keeps 64 open
# (TransportConfig.max_open_dealers); the rest is room for membership traffic and transfers.
MAX_OWNERS = 48
# The fewest values a shard holds, by default. Every part and every average is a message of its
# own, signed, checked and answered, so a small vector cut into many shards costs messages, not
# bytes: 32 simulated peers all-reducing 1,000 values took 3.2 s a step in 32 shards and 0.3 s
# in shards of 512 values (two owners: a round keeps two wherever two members can own, see
# `Placement.layout`). A vector of more than MAX_OWNERS * MIN_SHARD_NUMEL values is cut as
# before. The cost: fewer owners carry a small vector's round, so an owner that dies takes a
# larger share of it along.
MIN_SHARD_NUMEL = 512


class Protocol(ABC):
    """One peer's side of a training algorithm.

    A subclass says what it is on its class line (or sets the same class attributes):

        class Gossip(BackpropProtocol, name="gossip", config_class=GossipConfig, topic_prefix="gossip."):
    """

    name: ClassVar[str]
    config_class: ClassVar[type[ProtocolConfig]] = ProtocolConfig
    topic_prefix: ClassVar[str | None] = None  # the topics whose bytes `meter` counts, e.g. "gossip."
    # Whether the protocol runs with its model on an accelerator (cuda, mps): its tensors follow
    # the model's device, and what it sends is encoded there. One that does not say so runs on
    # the CPU only, and the runtime refuses a --device for it, naming this reason.
    runs_on_accelerators: ClassVar[bool] = False
    # Whether the local step is backprop and the inner optimizer's step (`self.optimizer`) on this
    # peer's gradients alone, everything from other peers written into the parameters after it
    # (DiLoCo). Only such a protocol runs in a replica of many ranks: rank 0 runs it, the
    # others repeat its inner steps and take what it wrote besides (runtime/replica.py).
    local_inner_steps: ClassVar[bool] = False
    # Whether `step(loss_fn, weight=0.0)` takes part in the round without counting: the peer's
    # gradient is left out of the average (its weight is 0) and it applies the swarm's update
    # like every member. A peer that the data ledger gave no unit in a round steps so.
    weightless_steps: ClassVar[bool] = False

    def __init_subclass__(cls, *, name: str | None = None, config_class: type[ProtocolConfig] | None = None,
                          topic_prefix: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name = name
        if config_class is not None:
            cls.config_class = config_class
        if topic_prefix is not None:
            cls.topic_prefix = topic_prefix

    def __init__(self, node: Node, model: nn.Module, config: ProtocolConfig) -> None:
        self.node = node
        self.model = model
        self.config = config
        self.step_count = 0
        self.reducers: list[ShardedReducer] = []  # the all-reduces this protocol averages with, if any
        # small lossless rounds beside them (buffers, agreement checks): peer events, no residuals
        self.side_reducers: list[ShardedReducer] = []
        self._open = True  # until close(): step() raises, handlers refuse, peer events are ignored
        # Set by the runtime: this peer's batch recipe and any member's batch, for protocols that
        # audit others' contributions by recomputing them (protocols/audit.py).
        self.audit_data: AuditData | None = None
        # Set by the runtime: bytes of what else the members must hold alike at a round's start
        # (the data ledger), added to the state digest a round's parts name: members whose
        # ledgers differ are flagged apart like members whose parameters differ.
        self.round_context: Callable[[], bytes] | None = None
        self.next_step_work = 1.0  # `weigh_next_step`: the share of a full batch the next step trains
        if self.topic_prefix is not None:  # counting from before any topic is served
            self.meter = ByteMeter(node, self.topic_prefix)

    @classmethod
    def create(cls, node: Node, model: nn.Module, options: Mapping[str, Any] | None = None) -> Protocol:
        return cls(node, model, config_from_options(cls.config_class, options or {}))

    @abstractmethod
    def step(self, loss_fn: LossFn) -> StepReport:
        """One training step (local compute plus whatever exchange the schedule calls for)."""

    def weigh_next_step(self, work: float) -> None:
        """How much training the next step is, as a share of a full batch (a member of a swarm
        of its own data whose batch was partly padding). A protocol whose contributions are
        weighed by the training behind them (DiLoCo: the inner steps) counts it; others ignore it."""
        self.next_step_work = work

    def state_dict(self) -> dict[str, Any]:
        """Everything a joiner needs to continue in lock-step with the swarm, plus, under
        PRIVATE_STATE, what only this peer's own restart may load (its error-feedback
        residuals: a joiner that took a donor's would send the donor's error a second time)."""
        state = {"step": self.step_count, "model": _clone_once(self.model.state_dict())}
        private = self.private_state()
        if private:
            state[PRIVATE_STATE] = private
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.step_count = int(state["step"])
        if PRIVATE_STATE in state:
            self.load_private_state(state[PRIVATE_STATE])

    def private_state(self) -> dict[str, Any]:
        """This peer's own part of the state (see `state_dict`): by default its reducers'
        error-feedback residuals."""
        return {"reducers": [reducer.state_dict() for reducer in self.reducers]} if self.reducers else {}

    def load_private_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `private_state` returned, from this peer's own checkpoint."""
        for reducer, saved in zip(self.reducers, state.get("reducers", ())):
            reducer.load_state_dict(saved)

    def place_state(self, device: torch.device | str) -> None:
        """Keep the protocol's own persistent state (DiLoCo's outer parameters and momentum) on
        `device`: the CPU spares an accelerator's memory. A protocol whose state is the model
        and its optimizer has nothing to place, and ignores it."""
        return None  # a hook: the default places nothing

    def start_from(self, model: nn.Module) -> None:
        """`model` is this peer's model before it was cast to a lower precision (same tensors,
        float32): a protocol that keeps float32 state of its own (DiLoCo's outer parameters)
        starts it from these values, so that peers of different dtypes start from one point.
        Called before the first step; a protocol whose state is the model ignores it."""
        return None  # a hook: the default keeps nothing apart from the model

    def eval_model(self) -> nn.Module:
        """The model to evaluate (DiLoCo evaluates its outer parameters)."""
        return self.model

    def on_peer_joined(self, peer_id: str) -> None:
        """Called on the network thread when a peer becomes alive."""
        for reducer in (*self.reducers, *self.side_reducers):
            reducer.peer_joined(peer_id)

    def on_peer_left(self, peer_id: str) -> None:
        """Called on the network thread when a peer leaves or is declared dead: no round of
        this protocol's reducers waits for it any longer."""
        for reducer in (*self.reducers, *self.side_reducers):
            reducer.peer_left(peer_id)

    def close(self) -> None:
        """Release anything the protocol holds (threads, pending exchanges); an override calls
        this too, which marks the protocol closed."""
        self._open = False

    def is_open(self) -> bool:
        return self._open

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "config": dataclasses.asdict(self.config)}

    # ------------------------------------------------------------------ for implementations
    def _serve(self, handlers: Mapping[str, Handler] | None = None) -> None:
        """Register this protocol's topics and route peer events to its hooks while it is
        open. The last thing a constructor does: a request or an event may arrive at once,
        on the network thread, and must find every attribute in place."""
        for topic, handler in (handlers or {}).items():
            self.node.on(topic, handler)
        watch_peers(self.node, self.on_peer_joined, self.on_peer_left, self.is_open)

    def _begin_step(self) -> StepClock:
        if not self._open:
            raise ProtocolError(f"{self.name}: step() after close()")
        return StepClock()

    def _report(self, step: int, loss: float, clock: StepClock, *, synced: bool = False, peers: int = 1,
                lost: tuple[str, ...] = (), absent: tuple[str, ...] = (), sampled: bool = True,
                diverged: bool = False) -> StepReport:
        """This step's report, with the bytes `meter` counted since the last one."""
        sent, received = self.meter.take()
        return StepReport(step=step, loss=loss, bytes_sent=sent, bytes_received=received, synced=synced,
                          peers=peers, lost_peers=lost, absent_peers=absent, wall_s=clock.wall_s,
                          compute_s=clock.compute_s, sampled=sampled, diverged=diverged)


def _clone_once(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a state dict in which tensors that were one (tied weights: an output layer
    that is the input embedding) stay one: cloned once, stored once by torch.save, and tied
    again when loaded."""
    clones: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}
    out = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in clones:
            clones[key] = t.detach().clone()
        out[name] = clones[key]
    return out


_REGISTRY: dict[str, type[Protocol]] = {}


def register(cls: type[Protocol]) -> type[Protocol]:
    """Class decorator: make a protocol available by its `name`."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ProtocolError(f"protocol name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def get_protocol(name: str) -> type[Protocol]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ProtocolError(f"unknown protocol {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def registered_protocols() -> list[str]:
    return sorted(_REGISTRY)


def config_from_options(config_class: type[Any], options: Mapping[str, Any]) -> Any:
    """Build a frozen config dataclass from defaults plus `options` (typed or CLI strings);
    an unknown name or an unparsable value raises ProtocolError naming it."""
    return common_config_from_options(config_class, options, error=ProtocolError)
