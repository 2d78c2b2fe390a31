"""Request/response on top of one-way messages: correlation ids, a timeout on every call, and
failures that say what they are with a code.

A request travels as topic "$req" with body [topic, request_id, body]; the answer comes back
on the same connection as "$rep" with [request_id, ok, body]. A failed request's body is an
error, {"code": ErrorCode, "message": text, "reason": Refusal or None}, and the requester
raises the `RemoteError` subclass of its code. Code that must tell failures apart reads
`.code` (and a refusal's `.reason`), never the message, which is for people and logs.

A handler refuses work in one of two ways:
- it raises `RefusedError(reason, detail)`, and the request fails with that refusal;
- or, when the refusal is part of a protocol's answer and carries fields of its own (the
  reducer's `step`, SPSA's `upto`), it returns `refusal(reason, detail, **extra)`, a body
  {"ok": False, "code": reason, "reason": text, ...}, which `refusal_of` reads back.
Bad input from a peer is refused through a `Refuser`, which counts it in the node's stats too.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starling.node.stats import NodeStats
from starling.node.transport import NoSocket, SendError
from starling.node.wire import MAX_TOPIC_CHARS, Message, RejectReason, WireError

REQUEST_TOPIC = "$req"
REPLY_TOPIC = "$rep"
MAX_ERROR_TEXT = 2000
MAX_CODE_CHARS = 64
MAX_UNANSWERED = 4096  # requests remembered after they ended without a reply (`PendingRequests.late`)

log = logging.getLogger(__name__)


class ErrorCode(str, enum.Enum):
    """Why a request failed, as its error reply says."""

    NO_HANDLER = "no_handler"  # nothing serves the topic there (yet: a peer whose protocol is not up)
    CONFIG_CONFLICT = "config_conflict"  # a joiner's swarm config disagrees with the swarm's
    HANDLER_ERROR = "handler_error"  # the handler raised
    REFUSED = "refused"  # the handler refused, for a named `Refusal`
    BAD_REQUEST = "bad_request"  # the request failed the node's own checks (a malformed hello)
    BUSY = "busy"  # the node turned the request away unread: too many in flight (see node.admission)
    INCOMPATIBLE = "incompatible"  # the requester speaks no wire version this node speaks (node.version)


class Refusal(str, enum.Enum):
    """Named reasons a handler turns work down; every protocol refuses with these."""

    CLOSED = "closed"  # the protocol (or service) has shut down
    BUSY = "busy"  # try again later
    MALFORMED = "malformed"  # the body is not what the topic takes
    NOT_OWNER = "not_owner"  # sent to a peer that does not own that piece (a shard)
    BAD_CHUNK = "bad_chunk"  # a chunk index outside its shard
    BAD_PART = "bad_part"  # a payload that does not decode to what was expected
    NOT_FINITE = "not_finite"  # NaN or Inf values
    LATE = "late"  # the round it belongs to has closed
    DUPLICATE = "duplicate"  # a second, different contribution from the same sender
    UNKNOWN_STEP = "unknown_step"  # a step this peer cannot place in its log
    TOO_OLD = "too_old"  # older than anything kept here
    NOT_FOUND = "not_found"  # no such named thing here (a blob, a transfer)
    CANCELLED = "cancelled"  # the requester called it off
    CLOSE_FAILED = "close_failed"  # the refuser could not close the round (its own failure)
    UNKNOWN_VIEW = "unknown_view"  # a member list named by a digest this peer cannot resolve: send it whole
    BAD_SIGNATURE = "bad_signature"  # a contribution its sender's key did not sign (altered, or not its own)
    OVERWEIGHT = "overweight"  # a contribution claiming more weight than the swarm allows
    REPLAYED = "replayed"  # a contribution the same as one its author sent in an earlier round
    CONFLICT = "conflict"  # a request at odds with what this peer answered before (a secret's other half)


class RpcError(Exception):
    """Base class for failed requests."""


class NoSocketError(RpcError):
    """Every socket this node may open to others is busy with a request awaiting its reply:
    nothing was sent, and a socket may free in a moment."""


class RemoteError(RpcError):
    """The remote peer answered with an error; `.code` says which kind.

    Raised on a requester for an error reply (`peer` is set then). A handler may raise the
    subclasses that name a deliberate answer (`RefusedError`, `ConfigConflictError`) for its
    node to send; any other exception a handler raises is sent as a handler error.
    """

    code: ErrorCode = ErrorCode.HANDLER_ERROR

    def __init__(self, detail: str, *, peer: str | None = None, reason: Refusal | None = None,
                 data: dict[str, Any] | None = None) -> None:
        super().__init__(detail if peer is None else f"peer {peer}: {detail}")
        self.detail = detail
        self.peer = peer
        self.reason = reason  # set on refusals only
        self.data = data  # what the error says for code to act on, beside its text (a busy hello's other members)


class NoHandlerError(RemoteError):
    code = ErrorCode.NO_HANDLER


class ConfigConflictError(RemoteError):
    code = ErrorCode.CONFIG_CONFLICT


class HandlerError(RemoteError):
    code = ErrorCode.HANDLER_ERROR


class BadRequestError(RemoteError):
    code = ErrorCode.BAD_REQUEST


class Unanswered(Exception):
    """Raised by a handler: drop the request without an answer (counted `rate_limited`). For a
    requester that kept asking past the answers that told it to wait: even those cost bytes."""


class BusyError(RemoteError):
    """The node had too many requests in flight (from this connection, from peers outside the
    swarm, or in its process) and did not run the handler, or the handler turned the request
    away as too busy; the request may be sent again later. `data` may say where else to ask
    (a busy hello names other members, `node.bootstrap`)."""

    code = ErrorCode.BUSY


class IncompatibleError(RemoteError):
    """The requester speaks no wire version the node speaks (`node.version`); the detail is
    one line naming both sides' versions and which to upgrade."""

    code = ErrorCode.INCOMPATIBLE


class RefusedError(RemoteError):
    """Work turned down for a named `reason` (`.reason`), with a human-readable detail."""

    code = ErrorCode.REFUSED

    def __init__(self, reason: Refusal, detail: str = "", *, peer: str | None = None) -> None:
        super().__init__(refusal_text(reason, detail), peer=peer, reason=reason)
        self.detail = detail  # without the reason: what goes on the wire next to it


class RequestTimeout(RpcError, TimeoutError):
    """No reply within the call's timeout."""


_ERRORS: dict[ErrorCode, type[RemoteError]] = {
    cls.code: cls for cls in (NoHandlerError, ConfigConflictError, HandlerError, BadRequestError, BusyError,
                              IncompatibleError, RefusedError)
}


@dataclass(frozen=True)
class Reply:
    """What a request handler returns when its answer carries tensors or raw frames."""

    body: Any = None
    payload: tuple[Any, ...] = ()


@dataclass(frozen=True)
class ErrorBody:
    """The body of a failed request's reply."""

    code: ErrorCode
    message: str
    reason: Refusal | None = None
    data: dict[str, Any] | None = None  # sent only when set: peers of 0.1.x read no such key

    def to_wire(self) -> dict[str, Any]:
        wire = {"code": self.code.value, "message": self.message[:MAX_ERROR_TEXT],
                "reason": None if self.reason is None else self.reason.value}
        if self.data is not None:
            wire["data"] = self.data
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> ErrorBody:
        """Parse and check an error reply; raises WireError (BAD_FIELD). A code or reason this
        version does not know (a later release's) reads as a handler error whose text starts
        with it: the requester fails with the peer's words instead of waiting out its timeout."""
        def bad(what: str) -> WireError:
            return WireError(RejectReason.BAD_FIELD, f"error reply: {what}", field="body")

        if not isinstance(obj, dict) or not isinstance(obj.get("message"), str):
            raise bad("expected {code, message, reason}")
        data = obj.get("data")
        if data is not None and not isinstance(data, dict):
            raise bad("data must be a map")
        message = obj["message"][:MAX_ERROR_TEXT]
        try:
            code = ErrorCode(obj.get("code"))
            reason = None if obj.get("reason") is None else Refusal(obj["reason"])
        except ValueError:
            named = obj.get("reason") if obj.get("code") == ErrorCode.REFUSED.value else obj.get("code")
            if not isinstance(named, str) or not 0 < len(named) <= MAX_CODE_CHARS:
                raise bad(f"malformed code {obj.get('code')!r} or reason {obj.get('reason')!r}") from None
            return cls(ErrorCode.HANDLER_ERROR, f"{named}: {message}"[:MAX_ERROR_TEXT], None, data)
        if (code is ErrorCode.REFUSED) != (reason is not None):
            raise bad("a reason goes with a refusal, and only with one")
        return cls(code, message, reason, data)

    @classmethod
    def of(cls, exc: BaseException) -> ErrorBody:
        """What a serving node answers for an exception its handler raised. Only a RemoteError
        raised here keeps its code: one that a handler's own request got from a third peer
        (`peer` set) is this handler's error, not a refusal by this node."""
        if isinstance(exc, RemoteError) and exc.peer is None:
            return cls(exc.code, exc.detail, exc.reason, exc.data)
        return cls(ErrorCode.HANDLER_ERROR, f"{type(exc).__name__}: {exc}")

    def exception(self, peer: str) -> RemoteError:
        """The typed exception a requester raises for this error from `peer`."""
        if self.reason is not None:
            return RefusedError(self.reason, self.message, peer=peer)
        return _ERRORS[self.code](self.message, peer=peer, data=self.data)


def refusal_text(reason: Refusal, detail: str = "") -> str:
    return f"{reason.value}: {detail}" if detail else reason.value


def refusal(reason: Refusal, detail: str = "", **extra: Any) -> dict[str, Any]:
    """The body of an answer that turns work down: {"ok": False, "code", "reason", **extra}.
    "reason" is text for people and logs ("late: the round already closed"); code that acts on
    a refusal reads "code" (see `refusal_of`) or an extra field it defined."""
    if {"ok", "code", "reason"} & extra.keys():
        raise ValueError(f"extra fields may not replace ok, code or reason: {sorted(extra)}")
    return {"ok": False, "code": reason.value, "reason": refusal_text(reason, detail), **extra}


class Refuser:
    """How a handler turns down bad input from a peer, for one topic: counted in the node's
    stats as `<topic>.<reason>`, logged, and answered with a `refusal` body.

    `counters`, if given, counts each one again as `rejected.<reason>`, for a protocol that
    reports counters of its own. Refusals that are not bad input (a closed protocol, a view
    this peer has not seen) are no one's fault: they go out as plain `refusal` bodies, uncounted.
    """

    def __init__(self, stats: NodeStats, topic: str, me: str, counters: Counter[str] | None = None) -> None:
        self.stats, self.topic, self.me, self.counters = stats, topic, me, counters

    def __call__(self, reason: Refusal, detail: str = "", **extra: Any) -> dict[str, Any]:
        """Count and log a refusal, and return its body (`extra` rides along, as in `refusal`)."""
        self.count(reason.value, detail)
        return refusal(reason, detail, **extra)

    def count(self, reason: str, detail: str) -> None:
        """Count and log bad input that gets no refusal of its own: a malformed answer to a
        request of this peer's, named by a `reason` of the topic's own."""
        self.stats.count_rejected(f"{self.topic}.{reason}")
        if self.counters is not None:
            self.counters[f"rejected.{reason}"] += 1
        log.info("%s: %s rejected (%s): %s", self.me, self.topic, reason, detail)


def refusal_of(body: Any) -> Refusal | None:
    """The named reason of a refusal body; None for any other body (an answer that is not a
    refusal, or one whose code this version does not know)."""
    if not isinstance(body, dict) or body.get("ok") is not False:
        return None
    try:
        return Refusal(body.get("code"))
    except ValueError:
        return None


def request_body(topic: str, request_id: int, body: Any) -> list[Any]:
    return [topic, request_id, body]


def parse_request(msg: Message) -> tuple[str, int, Any]:
    """[topic, id, body]. The topic is held to the bound a message's own topic has: a node keeps
    it as a key of its byte counters, which a status answer carries."""
    b = msg.body
    if (not isinstance(b, list) or len(b) != 3 or not isinstance(b[0], str) or not 0 < len(b[0]) <= MAX_TOPIC_CHARS
            or not isinstance(b[1], int) or isinstance(b[1], bool)):
        raise WireError(RejectReason.BAD_FIELD, f"request body must be [topic (1 to {MAX_TOPIC_CHARS} chars), id, "
                        "body]", field="body")
    return b[0], b[1], b[2]


def reply_body(request_id: int, ok: bool, body: Any) -> list[Any]:
    return [request_id, ok, body.to_wire() if isinstance(body, ErrorBody) else body]


def parse_reply(msg: Message) -> tuple[int, bool, Any]:
    """[id, ok, body]; a failed request's body comes back as a checked `ErrorBody`."""
    b = msg.body
    if (not isinstance(b, list) or len(b) != 3 or not isinstance(b[0], int)
            or isinstance(b[0], bool) or not isinstance(b[1], bool)):
        raise WireError(RejectReason.BAD_FIELD, "reply body must be [id, ok, body]", field="body")
    return b[0], b[1], b[2] if b[1] else ErrorBody.from_wire(b[2])


def _mark_retrieved(fut: asyncio.Future[Any]) -> None:
    # A request whose caller gave up (timeout, close) must not log "never retrieved".
    if not fut.cancelled():
        fut.exception()


@dataclass
class PendingRequests:
    """Futures of requests in flight, by correlation id. Lives on the network thread.

    A request that ended without its reply (timed out, cancelled, its peer gone) is remembered,
    the last MAX_UNANSWERED of them: a loaded peer's reply that comes after its request ended is
    late, not bad input, and is counted apart (`late`)."""

    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _pending: dict[int, tuple[asyncio.Future[Message], str]] = field(default_factory=dict)
    _unanswered: OrderedDict[int, str] = field(default_factory=OrderedDict)  # id -> peer, oldest first

    def open(self, peer: str) -> tuple[int, asyncio.Future[Message]]:
        rid = next(self._ids)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_mark_retrieved)
        self._pending[rid] = (fut, peer)
        return rid, fut

    async def call(self, peer: str, topic: str, send: Callable[[int], Awaitable[None]],
                   timeout_s: float) -> Message:
        """Open a request to `peer`, hand it to `send(request_id)`, and wait for the reply.

        Raises the peer's RemoteError, RequestTimeout, or RpcError (not sent; peer gone)."""
        rid, fut = self.open(peer)
        # One future ends the request: the reply, the peer declared gone (`fail_peer`), the
        # send's own failure, or the timer. A send can wait on a peer that crashed (no
        # connection to hand the message to); if the peer is declared dead meanwhile, `fut`
        # fails and the request ends now.
        timer = asyncio.get_running_loop().call_later(timeout_s, _time_out, fut)
        sending = asyncio.ensure_future(send(rid))
        sending.add_done_callback(lambda task: _send_ended(task, fut))
        try:
            return await fut
        except NoSocket as exc:
            raise NoSocketError(f"request {topic!r} to {peer}: {exc}") from None
        except SendError as exc:
            raise RpcError(f"request {topic!r} to {peer}: {exc}") from None
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply from {peer} to {topic!r} within {timeout_s} s") from None
        finally:
            timer.cancel()
            if not sending.done() and not (fut.done() and not fut.cancelled() and fut.exception() is None):
                sending.cancel()  # a send still waiting when its request failed goes no further
            self.drop(rid)

    def expects(self, rid: int, peer: str) -> bool:
        entry = self._pending.get(rid)
        return entry is not None and entry[1] == peer

    def resolve(self, rid: int, msg: Message, ok: bool, body: Any) -> None:
        fut, peer = self._pending.pop(rid)
        if fut.done():
            return
        if ok:
            fut.set_result(replace(msg, body=body))
        else:
            fut.set_exception(body.exception(peer))

    def waiting_on(self, peer: str) -> bool:
        """True while a request to `peer` awaits its reply (which comes back on its DEALER)."""
        return any(p == peer for _, p in self._pending.values())

    def drop(self, rid: int) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:  # ended with no reply
            self._ended_unanswered(rid, entry[1])

    def late(self, rid: int, peer: str) -> bool:
        """True, once, for the reply of a request to `peer` that ended without it."""
        if self._unanswered.get(rid) != peer:
            return False
        del self._unanswered[rid]
        return True

    def _ended_unanswered(self, rid: int, peer: str) -> None:
        self._unanswered[rid] = peer
        if len(self._unanswered) > MAX_UNANSWERED:
            self._unanswered.popitem(last=False)

    def fail_peer(self, peer: str, exc: BaseException) -> None:
        """Fail at once every request waiting on a peer that is gone."""
        for rid, (fut, p) in list(self._pending.items()):
            if p == peer:
                del self._pending[rid]
                self._ended_unanswered(rid, p)
                if not fut.done():
                    fut.set_exception(exc)

    def fail_all(self, exc: BaseException) -> None:
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()


def _time_out(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


def _send_ended(task: asyncio.Future[Any], fut: asyncio.Future[Any]) -> None:
    """A send that failed ends its request with its failure, unless the request had ended.
    A send still waiting when its request ended (answered, cancelled, timed out) may fail
    later, to nobody: its failure is read here, not logged as never retrieved."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not fut.done():
        fut.set_exception(exc)
