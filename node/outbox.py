"""A node's way out: every message a node sends leaves through its `Outbox`.

The outbox frames a message (`wire.encode`, one sequence per node), lets an emulated link
(`LinkShaper`) drop or delay protocol traffic, and hands the frames to the peer by the first
path that reaches it: our DEALER to it, the connection a client opened to us, or, for a
client neither side can dial, sealed through a relay (the route the node wires in from
`node.relay`). An answer goes back the way its request came. Requests wait for their reply
in the pending table (`node.rpc`), which the dispatcher resolves when the reply comes in.

Bytes are counted here, once per message: sent by peer and topic, or a failed send.

The node's parts (membership, bootstrap, relay, dispatcher) are handed the one outbox when
the node builds them; none of them frames or sends by itself.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import typing
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starling.node import rpc
from starling.node.membership import PeerStatus, PeerTable
from starling.node.stats import BOOTSTRAP, NodeStats
from starling.node.transport import SendError, Transport
from starling.node.wire import Message, encode, frame_nbytes

log = logging.getLogger(__name__)

Route = bytes | str  # a ROUTER connection's routing id, or the id of the member a message came from
Spawn = Callable[[Any], "asyncio.Future[Any]"]  # runs a coroutine as one of the node's tasks
RelaySend = Callable[..., Awaitable[None]]  # `Relay.send(dest, frames, *, wait, timeout_s)`


class UnknownPeerError(ValueError):
    """A send or request named a peer this node does not know (or that left)."""


class LinkShaper(typing.Protocol):
    """Emulates a slow link on the way out (the simulator's bandwidth, latency, loss)."""

    async def admit(self, peer: str, nbytes: int) -> bool:
        """Wait until a message of `nbytes` to `peer` may leave; False drops it."""
        ...


class Outbox:
    """Framing, sends, answers and requests in flight of one node. Lives on the network thread."""

    def __init__(self, peer_id: str, table: PeerTable, stats: NodeStats, pending: rpc.PendingRequests, *,
                 request_timeout_s: float) -> None:
        self.peer_id = peer_id
        self.table = table
        self.stats = stats
        self.pending = pending
        self.request_timeout_s = request_timeout_s
        self.transport: Transport | None = None  # the node's sockets, from its start on
        self.shaper: LinkShaper | None = None  # set by the simulator to emulate slow links
        self._relay: RelaySend | None = None
        self._seq = itertools.count()

    def route_through_relays(self, send: RelaySend) -> None:
        """How to reach a client neither side can dial (`Relay.send`, which sends back through
        this outbox: the node wires the two after building both)."""
        self._relay = send

    def frames(self, topic: str, body: Any, payload: Sequence[Any] = (), check_body: bool = True) -> list[Any]:
        return encode(topic, self.peer_id, next(self._seq), body, payload, check_body=check_body)

    async def admitted(self, peer: str, frames: list[Any]) -> bool:
        """Whether the emulated link lets these frames to `peer` leave (False: lost on it)."""
        return self.shaper is None or await self.shaper.admit(peer, frame_nbytes(frames))

    async def send(self, peer: str, topic: str, body: Any, payload: Sequence[Any] = (), *,
                   wait: bool = True, stats_topic: str | None = None,
                   timeout_s: float | None = None, check_body: bool = True) -> None:
        """Send any message, "$" topics included, to a known peer.
        `check_body=False` skips re-reading the body as the receiver will (see `wire.encode`)."""
        info = self.table.get(peer)
        if info is None or info.status is PeerStatus.LEFT or self.transport is None:
            raise UnknownPeerError(f"unknown peer {peer!r}")
        frames = self.frames(topic, body, payload, check_body)
        # Emulated links shape protocol traffic only; membership keeps its own timing.
        if not (stats_topic or topic).startswith("$") and not await self.admitted(peer, frames):
            return
        if self.transport.would_open(peer):
            self.stats.count_socket_opened(stats_topic or topic)
        try:
            await self.send_frames(peer, frames, wait=wait, timeout_s=timeout_s)
        except SendError:
            self.stats.count_send_failure()
            raise
        self.stats.count_sent(peer, stats_topic or topic, frame_nbytes(frames))

    async def send_quietly(self, peer: str, topic: str, body: Any) -> None:
        """A one-way message that may fail unseen (an accusation to a peer that just left)."""
        try:
            await self.send(peer, topic, body)
        except Exception as exc:
            log.debug("%s: %s to %s failed: %s", self.peer_id, topic, peer, exc)

    async def send_frames(self, peer: str, frames: list[Any], *, wait: bool = True,
                          timeout_s: float | None = None) -> None:
        """Frames to a peer: on our DEALER to it, down the connection a client opened to us,
        or, for a client neither can reach, sealed through a relay."""
        assert self.transport is not None
        if self.transport.can_send(peer) or self._relay is None or self.transport.closed:
            await self.transport.send(peer, frames, wait=wait, timeout_s=timeout_s)
        else:
            await self._relay(peer, frames, wait=wait, timeout_s=timeout_s)

    async def answer(self, route: Route, frames: list[Any], peer: str, topic: str, wait: bool = True) -> None:
        """Send an answer back the way its request came: the ROUTER connection, or (for a
        request a client read on its DEALER, or one relayed) the path to that peer. Counted
        under `peer` and `topic`; a failed send is counted, then raised."""
        assert self.transport is not None
        try:
            if isinstance(route, str):
                await self.send_frames(route, frames, wait=wait)
            else:
                await self.transport.reply(route, frames, wait=wait)
        except SendError:
            self.stats.count_send_failure()
            raise
        self.stats.count_sent(peer, topic, frame_nbytes(frames))

    async def request(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = (),
                      timeout_s: float | None = None) -> Message:
        """Call a peer's handler and wait for its answer (see `rpc.PendingRequests.call`)."""
        timeout = self.request_timeout_s if timeout_s is None else timeout_s

        def send(rid: int) -> Any:
            return self.send(peer, rpc.REQUEST_TOPIC, rpc.request_body(topic, rid, body), payload,
                             stats_topic=topic, timeout_s=timeout)

        return await self.pending.call(peer, topic, send, timeout)

    async def request_on(self, handle: str, topic: str, body: Any, timeout_s: float) -> Message:
        """A request on a connection of the transport's that is no peer of the table (a join's
        or a dial-back's, named `handle`); raises asyncio.TimeoutError without an answer."""
        assert self.transport is not None
        rid, fut = self.pending.open(handle)
        try:
            frames = self.frames(rpc.REQUEST_TOPIC, rpc.request_body(topic, rid, body))
            await self.transport.send(handle, frames, timeout_s=timeout_s)
            self.stats.count_sent(BOOTSTRAP, topic, frame_nbytes(frames))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self.pending.drop(rid)
