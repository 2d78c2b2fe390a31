"""Request/response on top of one-way messages: correlation ids and a timeout on every call.

A request travels as topic "$req" with body [topic, request_id, body]; the answer
comes back on the same connection as "$rep" with [request_id, ok, body_or_error].
A handler that raises produces an error reply, so the caller gets an exception
rather than a hang.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from starling.node.wire import Message, RejectReason, WireError

REQUEST_TOPIC = "$req"
REPLY_TOPIC = "$rep"
MAX_ERROR_TEXT = 2000


class RpcError(Exception):
    """Base class for failed requests."""


class RemoteError(RpcError):
    """The remote handler raised (or had no handler for the topic)."""


class RequestTimeout(RpcError, TimeoutError):
    """No reply within the call's timeout."""


@dataclass(frozen=True)
class Reply:
    """What a request handler returns when its answer carries tensors or raw frames."""

    body: Any = None
    payload: tuple[Any, ...] = ()


def request_body(topic: str, request_id: int, body: Any) -> list[Any]:
    return [topic, request_id, body]


def parse_request(msg: Message) -> tuple[str, int, Any]:
    b = msg.body
    if (not isinstance(b, list) or len(b) != 3 or not isinstance(b[0], str) or not b[0]
            or not isinstance(b[1], int) or isinstance(b[1], bool)):
        raise WireError(RejectReason.BAD_FIELD, "request body must be [topic, id, body]", field="body")
    return b[0], b[1], b[2]


def reply_body(request_id: int, ok: bool, body: Any) -> list[Any]:
    return [request_id, ok, body]


def parse_reply(msg: Message) -> tuple[int, bool, Any]:
    b = msg.body
    if (not isinstance(b, list) or len(b) != 3 or not isinstance(b[0], int)
            or isinstance(b[0], bool) or not isinstance(b[1], bool)):
        raise WireError(RejectReason.BAD_FIELD, "reply body must be [id, ok, body]", field="body")
    return b[0], b[1], b[2]


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]


def _mark_retrieved(fut: asyncio.Future[Any]) -> None:
    # A request whose caller gave up (timeout, close) must not log "never retrieved".
    if not fut.cancelled():
        fut.exception()


@dataclass
class PendingRequests:
    """Futures of requests in flight, by correlation id. Lives on the network thread."""

    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _pending: dict[int, tuple[asyncio.Future[Message], str]] = field(default_factory=dict)

    def open(self, peer: str) -> tuple[int, asyncio.Future[Message]]:
        rid = next(self._ids)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_mark_retrieved)
        self._pending[rid] = (fut, peer)
        return rid, fut

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
            fut.set_exception(RemoteError(f"peer {peer}: {body}"))

    def waiting_on(self, peer: str) -> bool:
        """True while a request to `peer` awaits its reply (which comes back on its DEALER)."""
        return any(p == peer for _, p in self._pending.values())

    def drop(self, rid: int) -> None:
        self._pending.pop(rid, None)

    def fail_peer(self, peer: str, exc: BaseException) -> None:
        """Fail at once every request waiting on a peer that is gone."""
        for rid, (fut, p) in list(self._pending.items()):
            if p == peer:
                del self._pending[rid]
                if not fut.done():
                    fut.set_exception(exc)

    def fail_all(self, exc: BaseException) -> None:
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()
