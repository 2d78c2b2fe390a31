"""Helpers the exchange protocols share: a flat view of a model, packets on the wire,
per-step byte counts, optimizers, and peer-change hooks.

Nothing here knows a specific algorithm; `allreduce` and `gossip` read top-down and call these.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from starling.compressors import Compressor, ErrorFeedback, Packet, from_spec
from starling.node.loop import AwakeDeadline
from starling.node.membership import PeerStatus, StatusChange
from starling.node.rpc import RemoteError, RequestTimeout
from starling.protocols.base import ProtocolError

if TYPE_CHECKING:
    from starling.node.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

REPLY_TOPIC_STATS = "$rep"  # the node counts received replies under this topic
GONE = (PeerStatus.DEAD, PeerStatus.LEFT)


class FlatModel:
    """The model's trainable parameters seen as one float32 vector (and their gradients).

    The flat buffers are allocated once; copying in and out is the only per-step cost.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ProtocolError("the model has no trainable parameters")
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.grad = torch.zeros(self.numel, dtype=torch.float32)

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, self.sizes))

    def gather_grads(self) -> torch.Tensor:
        """Copy every gradient into the persistent flat buffer (zeros for unused params)."""
        for p, chunk in zip(self.params, self._chunks(self.grad)):
            if p.grad is None:
                chunk.zero_()
            else:
                chunk.copy_(p.grad.reshape(-1))
        return self.grad

    def scatter_grads(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, self._chunks(flat)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(chunk.view_as(p.grad))

    @torch.no_grad()
    def read_params(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=torch.float32) if out is None else out
        for p, chunk in zip(self.params, self._chunks(out)):
            chunk.copy_(p.reshape(-1))
        return out

    @torch.no_grad()
    def add_to_params(self, delta: torch.Tensor) -> None:
        for p, chunk in zip(self.params, self._chunks(delta)):
            p.add_(chunk.view_as(p).to(p.dtype))

    @torch.no_grad()
    def write_params(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, self._chunks(flat)):
            p.copy_(chunk.view_as(p))


def make_codec(spec: str) -> tuple[Compressor, ErrorFeedback | None]:
    """The compressor for `spec`, and error feedback unless it is lossless (`none`)."""
    codec = from_spec(spec)
    return codec, (None if codec.spec == "none" else ErrorFeedback(codec))


def check_compressor_spec(spec: str) -> None:
    """For config `__post_init__`: raises ValueError naming a bad spec."""
    from_spec(spec)


def check_reduce_config(config: Any) -> None:
    """For `__post_init__` of configs that train with an optimizer over a ShardedReducer
    (allreduce, sketch-dp): raises ValueError naming the bad field."""
    if config.optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {config.optimizer!r}")
    if not config.lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {config.lr}")
    if not 0.0 <= config.momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {config.momentum}")
    if config.weight_decay < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {config.weight_decay}")
    for name in ("round_timeout_s", "reply_grace_s", "retry_interval_s"):
        if not getattr(config, name) > 0.0:
            raise ValueError(f"{name} must be > 0, got {getattr(config, name)}")
    check_compressor_spec(config.compressor)


def encode(codec: Compressor, feedback: ErrorFeedback | None, tensor: torch.Tensor, name: str) -> Packet:
    """Encode with error feedback when there is any; a residual whose shape no longer
    matches (membership changed the shard sizes) is dropped first."""
    if feedback is None:
        return codec.encode(tensor, name=name)
    residual = feedback.residual(name)
    if residual is not None and residual.shape != tensor.shape:
        feedback.reset(name)
    return feedback.encode(tensor, name=name)


def packet_from_wire(header: Any, payload: Sequence[Any]) -> Packet:
    """Rebuild a packet from a message: buffers travel as uint8 tensor frames."""
    if not isinstance(header, dict):
        raise ValueError("packet header must be a map")
    buffers = []
    for item in payload:
        if isinstance(item, torch.Tensor):
            buffers.append(item.reshape(-1).view(torch.uint8))
        else:
            buffers.append(torch.frombuffer(bytearray(item), dtype=torch.uint8))
    return Packet(header, tuple(buffers))


class ByteMeter:
    """Per-step byte counts from the node's counters, for this protocol's topics.

    Replies arrive under the node's generic reply topic, so received bytes include every
    reply this node got (in practice only the protocol's own; joins are rare).
    """

    def __init__(self, node: Node, topic_prefix: str) -> None:
        self.node = node
        self.prefix = topic_prefix
        self._last = self._now()

    def _now(self) -> tuple[int, int]:
        s = self.node.stats
        return s.total_sent(self.prefix), s.total_received(self.prefix) + s.total_received(REPLY_TOPIC_STATS)

    def take(self) -> tuple[int, int]:
        """Bytes (sent, received) since the last call."""
        now = self._now()
        delta = (now[0] - self._last[0], now[1] - self._last[1])
        self._last = now
        return delta


def make_optimizer(params: Sequence[nn.Parameter], name: str, lr: float, momentum: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ProtocolError(f"unknown optimizer {name!r}; known: sgd, adamw")


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def watch_peers(node: Node, joined: Callable[[str], None], left: Callable[[str], None],
                is_open: Callable[[], bool]) -> None:
    """Route the node's status changes to a protocol's join/leave hooks (network thread)."""

    def on_change(change: StatusChange) -> None:
        if not is_open():
            return
        if change.new in GONE:
            left(change.peer_id)
        elif change.new is PeerStatus.ALIVE and (change.old is None or change.old in GONE):
            joined(change.peer_id)

    node.on_peer_change(on_change)


def membership(node: Node) -> tuple[str, ...]:
    """Sorted live peers plus this node: the view a round is built on."""
    return tuple(sorted({*node.live_peers(), node.peer_id}))


async def request_patiently(node: Node, peer: str, topic: str, body: Any, payload: Sequence[Any],
                            deadline: AwakeDeadline, retry_s: float) -> Message:
    """A request within `deadline` (the loop's awake time: a reply read late because this loop
    was stalled still counts), retried every `retry_s` while the peer has no handler for the
    topic yet (its protocol is not up). Raises RequestTimeout, or what the request raised."""
    while True:
        try:
            if deadline.expired():
                raise asyncio.TimeoutError
            return await deadline.wait(node.arequest(peer, topic, body, payload,
                                                     timeout_s=max(deadline.wall_left(), 0.01)))
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply from {peer} to {topic!r} within the round's time") from None
        except RemoteError as exc:
            if "no handler" not in str(exc) or deadline.left <= retry_s:
                raise
            await deadline.sleep(retry_s)
