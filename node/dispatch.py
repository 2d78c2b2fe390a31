"""The inbound path of a node: decode, authenticate, and hand each message to its handler.

Replies resolve the requests the outbox holds in flight (`node.outbox`). Everything else comes
in on the node's ROUTER: the node's own "$" topics go to the part that serves them
(membership, bootstrap, relay), requests to their handler, whose answer (or typed error, see
`node.rpc`) goes back through the outbox on the same connection. A client (a node nobody can
dial) reads the same messages on the DEALERs it opened, and a message relayed between clients
arrives sealed, is opened by `node.relay` and comes back here (`on_opened`); both come from an
authenticated member, and their answers go back by the outbox's path to that peer. Their
origin ("route") is the peer id, a str, where a ROUTER connection's is its routing id, bytes.
A message that fails a check is dropped and counted by its `RejectReason`, and changes no
state.

Work that other processes cause is bounded by `node.admission`. Before a ROUTER message is
decoded, a stranger's connection that is over its rate is dropped. A request past a cap on
requests in flight is answered with a busy error and never reaches its handler. Waste (what
was only dropped or refused) pauses the reader now and then. Stats keep one entry per
authenticated member. Everything from senders outside the swarm is counted under
`stats.STRANGERS`, so no sender can make them grow.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from starling.node import rpc
from starling.node.admission import BUSY_DETAIL, Admission, AdmissionConfig
from starling.node.local import LocalPeer
from starling.node.membership import PeerInfo, PeerStatus, PeerTable, StatusChange
from starling.node.outbox import Outbox, Route, Spawn
from starling.node.security import SecurityMode
from starling.node.stats import STRANGERS, NodeStats
from starling.node.transport import Inbound, SendError
from starling.node.wire import ENVELOPE_BYTES, Limits, Message, RejectReason, WireError, decode, frame_nbytes

log = logging.getLogger(__name__)

Handler = Callable[[Message], Any]
BUSY_ERROR_BYTES = 64  # a busy error's reply around its message and data: [id, ok, {code, message, reason, data}]


class Dispatcher:
    """Routes a node's inbound messages. Lives on the network thread."""

    def __init__(self, local: LocalPeer, table: PeerTable, outbox: Outbox, stats: NodeStats, spawn: Spawn, *,
                 limits: Limits, admission: AdmissionConfig, load: Callable[[], float],
                 closed: Callable[[], bool], handlers: dict[str, tuple[Handler, bool]],
                 banned: Callable[[str], bool] = lambda peer: False) -> None:
        self.local = local
        self.table = table
        self.outbox = outbox
        self.stats = stats
        self.limits = limits
        self.admission = Admission(admission, load)
        self._spawn = spawn
        self._closed = closed
        self._banned = banned  # a banned member's messages are dropped and counted (node.trust)
        self.handlers = handlers  # topic -> (handler, public): the node's `on`
        # a peer's status changed on a message from it: the membership protocol's `notify`,
        # wired by the node (that protocol is built after, and serves its topics here)
        self.notify: Callable[[StatusChange], None] = lambda change: None
        # the node's own "$" topics: one-way messages, and requests answered with a body
        self.internal_messages: dict[str, Callable[[Message], None]] = {}
        self.internal_requests: dict[str, Callable[[Inbound, Any], Any]] = {}
        self.public_internal: set[str] = set()  # of those, the ones peers outside the swarm may call
        self.plain_answers: set[str] = set()  # of those, the ones whose answers need no check (see there)
        self.busy_data: dict[str, Callable[[int], dict[str, Any] | None]] = {}  # see `on_busy`

    def on_internal_message(self, topic: str, handler: Callable[[Message], None]) -> None:
        """Handle one of the node's own one-way "$" topics (membership gossip)."""
        self.internal_messages[topic] = handler

    def on_internal_request(self, topic: str, handler: Callable[[Inbound, str | None, Any], Any], *,
                            public: bool = False, plain_answers: bool = False) -> None:
        """Answer one of the node's own "$" request topics: `handler(inbound, member, body)`, where
        `member` is the asking member's id, or None for a sender outside the swarm (only a
        `public` topic is answered to one). `plain_answers`: the handler answers only with
        lists and maps it builds of strings, numbers and bytes (records, updates), at a depth
        the receiver accepts, so the answer is not unpacked again to check it before it is sent
        (on a seed, re-checking table pages took a quarter of its time)."""
        self.internal_requests[topic] = handler
        if public:
            self.public_internal.add(topic)
        if plain_answers:
            self.plain_answers.add(topic)

    def on_busy(self, topic: str, data: Callable[[int], dict[str, Any] | None]) -> None:
        """A busy answer to `topic` (over a cap here, or a `rpc.BusyError` its handler raised)
        carries `data(budget)` beside the error: where else to ask (a busy seed names other
        members to a joiner). `budget` is the bytes it may take, so that the answer stays within
        `stranger_reply_factor` times the request's."""
        self.busy_data[topic] = data

    def reject(self, reason: RejectReason, detail: str) -> None:
        self.stats.count_rejected(reason.value)
        log.debug("%s: rejected message (%s): %s", self.local.peer_id, reason.value, detail)

    async def on_inbound(self, inbound: Inbound) -> None:
        if self._closed():
            return
        route = inbound.route
        if route is not None and not self.admission.readable(route):
            self.stats.count_rejected(RejectReason.RATE_LIMITED.value)
            await self._wasted()
            return
        nbytes = frame_nbytes(inbound.frames)
        info: PeerInfo | None = None
        try:
            msg = decode(inbound.frames, self.limits)
            if route is None:
                via = inbound.via_peer or ""
                if msg.topic == rpc.REPLY_TOPIC:
                    self._on_reply(via, msg, nbytes)
                else:  # a client reads what its peers send it on the DEALER it opened to them
                    await self._on_router(inbound, via, msg, nbytes, self._member(via, msg))
                return
            info = self._authenticate(inbound, msg)
            if info is not None and not info.record.reachable:
                assert self.outbox.transport is not None
                self.outbox.transport.attach(msg.sender, route)
            if msg.topic == rpc.REPLY_TOPIC and info is not None:  # a client answers on its DEALER
                self._on_reply(msg.sender, msg, nbytes)
                return
            await self._on_router(inbound, route, msg, nbytes, info)
        except WireError as exc:
            self.reject(exc.reason, str(exc))
            if route is not None and info is None:  # a member's rejects spend nothing
                self.admission.charge(route)
                await self._wasted()

    async def _wasted(self) -> None:
        """Count a message that was only dropped or refused; every so often, pause the reader
        (see `node.admission`)."""
        if self.admission.wasted():
            await asyncio.sleep(self.admission.config.waste_pause_s)

    async def on_opened(self, src: str, frames: list[Any]) -> None:
        """A message `src` sealed for us and a relay delivered (opened by `node.relay`)."""
        if self._closed():
            return
        try:
            msg = decode(frames, self.limits)
            nbytes = frame_nbytes(frames)
            if msg.topic == rpc.REPLY_TOPIC:
                self._on_reply(src, msg, nbytes)
            else:
                await self._on_router(Inbound(frames, None, src, None), src, msg, nbytes, self._member(src, msg))
        except WireError as exc:
            self.reject(exc.reason, str(exc))

    def _member(self, via: str, msg: Message) -> PeerInfo:
        """The member a DEALER of ours (or a seal) proves a message came from."""
        info = self.table.get(via)
        if via.startswith("bootstrap-") or info is None or info.status is PeerStatus.LEFT:
            raise WireError(RejectReason.UNKNOWN_PEER, f"{msg.topic!r} from {via or 'nowhere'}, not a member",
                            field="sender")
        if msg.sender != via:
            raise WireError(RejectReason.SPOOFED_SENDER, f"message claims {msg.sender}, came from {via}",
                            field="sender")
        return info

    def _on_reply(self, via: str, msg: Message, nbytes: int) -> None:
        if msg.topic != rpc.REPLY_TOPIC:
            raise WireError(RejectReason.BAD_FIELD, f"expected a reply, got {msg.topic!r}", field="topic")
        if self._banned(via):
            raise WireError(RejectReason.BANNED, f"a reply from {via}, which is banned", field="sender")
        rid, ok, body = rpc.parse_reply(msg)
        pending = self.outbox.pending
        if not pending.expects(rid, via):
            if pending.late(rid, via):  # its request ended unanswered: the peer was slow, not wrong
                self.stats.count_late_reply()
                return
            raise WireError(RejectReason.BAD_FIELD, f"reply {rid} from {via} matches no request", field="body")
        if not via.startswith("bootstrap-") and msg.sender != via:
            raise WireError(RejectReason.SPOOFED_SENDER, f"reply claims {msg.sender}, came from {via}", field="sender")
        self.stats.count_received(via, rpc.REPLY_TOPIC, nbytes)
        change = self.table.seen(via, time.monotonic())
        if change is not None:
            self.notify(change)
        self.outbox.pending.resolve(rid, msg, ok, body)

    def _authenticate(self, inbound: Inbound, msg: Message) -> PeerInfo | None:
        """The sender's table entry if the message provably comes from it; None for a
        sender outside the swarm (allowed only for public requests)."""
        info = self.table.get(msg.sender)
        if info is None or info.status is PeerStatus.LEFT:
            return None
        if self.local.mode is SecurityMode.CURVE and inbound.user_id != info.record.curve_z85:
            raise WireError(RejectReason.SPOOFED_SENDER, f"{msg.sender} does not own this connection", field="sender")
        return info

    async def _on_router(self, inbound: Inbound, route: Route, msg: Message, nbytes: int,
                         info: PeerInfo | None) -> None:
        topic, rid, body = msg.topic, None, msg.body
        if topic == rpc.REQUEST_TOPIC:
            topic, rid, body = rpc.parse_request(msg)
        member = info is not None
        if member and self._banned(msg.sender):
            raise WireError(RejectReason.BANNED, f"{msg.sender} is banned (topic {topic!r})", field="sender")
        if not member:
            if rid is None or not self._is_public(topic):
                raise WireError(RejectReason.UNKNOWN_PEER, f"{msg.sender} is not a member (topic {topic!r})",
                                field="sender")
            if not self.admission.charge(route):
                await self._busy(route, topic, rid, "rate", nbytes=nbytes)
                return
        peer = msg.sender if member else STRANGERS
        self.stats.count_received(peer, topic, nbytes)
        if member:
            change = self.table.seen(msg.sender, time.monotonic())
            if change is not None:
                self.notify(change)
        internal = self.internal_messages.get(topic)
        if internal is not None and rid is None:
            internal(msg)
        elif rid is not None:  # a one-way topic asked as a request is answered no_handler, never run
            cap = self.admission.admit(route, member)
            if cap is not None:
                await self._busy(route, topic, rid, cap, peer, nbytes)
                return
            self._counted(route, member, self._serve(inbound, route, msg, topic, rid, body, member))
        else:
            self._on_message(route, msg, topic)

    def _on_message(self, route: Route, msg: Message, topic: str) -> None:
        """A member's one-way message to a handler; an async one counts as a request in flight."""
        handler = self.handlers.get(topic)
        if handler is None:
            raise WireError(RejectReason.UNKNOWN_TOPIC, f"no handler for {topic!r}", field="topic")
        if self.admission.admit(route, True) is not None:
            raise WireError(RejectReason.BUSY, f"{topic!r}: too many messages in flight on this connection")
        try:
            result = handler[0](msg)
        except rpc.RemoteError as exc:  # a typed refusal (a request topic sent one-way): the sender's error
            self.admission.release(route, True)
            self.reject(RejectReason.HANDLER_ERROR, f"handler for {topic!r} refused: {exc}")
            return
        except Exception:
            self.admission.release(route, True)
            self.reject(RejectReason.HANDLER_ERROR, f"handler for {topic!r} raised")
            log.exception("handler for %r raised", topic)
            return
        if inspect.isawaitable(result):
            self._counted(route, True, result)
        else:
            self.admission.release(route, True)

    def _counted(self, route: Route, member: bool, work: Any) -> None:
        """Run admitted work as a task, released when it ends (also if cancelled unstarted)."""
        self._spawn(work).add_done_callback(lambda _: self.admission.release(route, member))

    async def _busy(self, route: Route, topic: str, rid: int, cap: str, peer: str = STRANGERS,
                    nbytes: int = 0) -> None:
        """Answer a request with a busy error without running it, counted; never waits."""
        self.reject(RejectReason.BUSY, f"{topic}: {BUSY_DETAIL[cap]}")
        error = self._with_busy_data(rpc.ErrorBody(rpc.ErrorCode.BUSY, BUSY_DETAIL[cap]), topic, nbytes)
        frames = self.outbox.frames(rpc.REPLY_TOPIC, rpc.reply_body(rid, False, error))
        try:
            await self.outbox.answer(route, frames, peer, topic, wait=False)
        except SendError:
            pass  # counted by the outbox
        await self._wasted()

    def _with_busy_data(self, error: rpc.ErrorBody, topic: str, nbytes: int) -> rpc.ErrorBody:
        """A busy error with what `on_busy` registered for its topic, if that fits."""
        data = self.busy_data.get(topic)
        if data is None or error.data is not None:
            return error
        budget = (self.admission.config.stranger_reply_factor * nbytes - ENVELOPE_BYTES
                  - len(error.message.encode()) - BUSY_ERROR_BYTES)
        extra = data(budget) if budget > 0 else None
        return error if extra is None else replace(error, data=extra)

    def _is_public(self, topic: str) -> bool:
        if topic in self.public_internal:
            return True
        entry = self.handlers.get(topic)
        return entry is not None and entry[1]

    async def _serve(self, inbound: Inbound, route: Route, msg: Message, topic: str, rid: int, body: Any,
                     member: bool) -> None:
        """Run a request's handler and answer with its result, or with a typed error."""
        outbox = self.outbox
        payload: tuple[Any, ...] = ()
        try:
            result = await self._answer(inbound, msg, topic, body, member)
            if isinstance(result, rpc.Reply):
                result, payload = result.body, result.payload
            ok = True
        except WireError as exc:  # the request failed this node's own checks: counted as such
            self.reject(exc.reason, str(exc))
            ok, result = False, rpc.ErrorBody(rpc.ErrorCode.BAD_REQUEST, str(exc))
        except rpc.Unanswered as exc:
            self.reject(RejectReason.RATE_LIMITED, f"{topic}: {exc}")
            return
        except Exception as exc:
            ok, result = False, rpc.ErrorBody.of(exc)
            if result.code is rpc.ErrorCode.BUSY:
                result = self._with_busy_data(result, topic, frame_nbytes(inbound.frames))
            # a refusal, a config conflict or a missing handler is an answer, not a fault
            if result.code is rpc.ErrorCode.HANDLER_ERROR:
                self.reject(RejectReason.HANDLER_ERROR, f"{topic}: {exc}")
                log.warning("handler for %r failed: %s", topic, exc)
        try:
            frames = outbox.frames(rpc.REPLY_TOPIC, rpc.reply_body(rid, ok, result), payload,
                                   check_body=topic not in self.plain_answers)
        except (TypeError, ValueError) as exc:  # an answer the wire cannot carry (too deep, not msgpack)
            self.reject(RejectReason.HANDLER_ERROR, f"{topic}: answer cannot be sent: {exc}")
            error = rpc.ErrorBody(rpc.ErrorCode.HANDLER_ERROR, f"the answer cannot be sent: {exc}")
            frames = outbox.frames(rpc.REPLY_TOPIC, rpc.reply_body(rid, False, error))
        peer = msg.sender if member else STRANGERS
        if member and not topic.startswith("$") and not await outbox.admitted(msg.sender, frames):
            return  # lost on the emulated link
        try:
            await outbox.answer(route, frames, peer, topic)
        except SendError as exc:  # counted by the outbox
            log.debug("reply to %s failed: %s", msg.sender, exc)

    async def _answer(self, inbound: Inbound, msg: Message, topic: str, body: Any, member: bool) -> Any:
        internal = self.internal_requests.get(topic)
        if internal is not None:
            result = internal(inbound, msg.sender if member else None, body)
            return await result if inspect.isawaitable(result) else result
        entry = self.handlers.get(topic)
        if entry is None:
            raise rpc.NoHandlerError(f"no handler for {topic!r}")
        result = entry[0](replace(msg, topic=topic, body=body))
        if inspect.isawaitable(result):
            result = await result
        return result
