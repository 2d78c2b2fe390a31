"""The protocol seam: what every training algorithm gives the runtime.

A protocol owns one peer's view of training: it wraps a model, talks to other peers
through a `Node` (registering its own topics), and decides what to exchange and when.
Its `step(loss_fn)` works like `torch.optim.Optimizer.step(closure)`: a backprop
protocol calls `loss_fn()` and `backward()`; a zeroth-order one calls it under
perturbations.

    proto = get_protocol("gossip").create(node, model, {"lr": 0.05, "topology": "ring"})
    for batch in task.batches(rank, world, seed):
        report = proto.step(lambda: task.loss(model, batch))
"""
from __future__ import annotations

import dataclasses
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from starling.common import config_from_options as common_config_from_options

if typing.TYPE_CHECKING:
    from starling.node.node import Node

LossFn = Callable[[], torch.Tensor]


class ProtocolError(Exception):
    """A protocol could not complete an operation (bad config, bad state, unknown name)."""


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
    wall_s: float = 0.0
    compute_s: float = 0.0  # time spent in local compute (the rest was waiting on the network)


@dataclass(frozen=True)
class ProtocolConfig:
    """Hyper-parameters every protocol has; subclasses add their own fields."""

    lr: float = 0.01
    compressor: str = "none"  # a spec for starling.compressors.from_spec
    round_timeout_s: float = 30.0  # a round closes without peers that have not delivered by then


class Protocol(ABC):
    """One peer's side of a training algorithm."""

    name: ClassVar[str]
    config_class: ClassVar[type[ProtocolConfig]] = ProtocolConfig

    def __init__(self, node: Node, model: nn.Module, config: ProtocolConfig) -> None:
        self.node = node
        self.model = model
        self.config = config
        self.step_count = 0

    @classmethod
    def create(cls, node: Node, model: nn.Module, options: Mapping[str, Any] | None = None) -> Protocol:
        return cls(node, model, config_from_options(cls.config_class, options or {}))

    @abstractmethod
    def step(self, loss_fn: LossFn) -> StepReport:
        """One training step (local compute plus whatever exchange the schedule calls for)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a joiner needs to continue in lock-step with the swarm."""
        return {"step": self.step_count, "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.step_count = int(state["step"])

    def eval_model(self) -> nn.Module:
        """The model to evaluate (DiLoCo evaluates its outer parameters)."""
        return self.model

    def on_peer_joined(self, peer_id: str) -> None:  # noqa: B027 (an optional hook)
        """Called on the network thread when a peer becomes alive."""

    def on_peer_left(self, peer_id: str) -> None:  # noqa: B027 (an optional hook)
        """Called on the network thread when a peer leaves or is declared dead."""

    def close(self) -> None:  # noqa: B027 (an optional hook)
        """Release anything the protocol holds (threads, pending exchanges)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "config": dataclasses.asdict(self.config)}


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
