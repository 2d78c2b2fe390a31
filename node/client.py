"""A one-shot client for talking to a node from outside the swarm (`starling node status`, `watch`).

It connects a DEALER with a throwaway identity and calls a public request topic.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import zmq
from zmq.utils import z85

from starling.node import rpc
from starling.node.address import parse_address
from starling.node.identity import Identity
from starling.node.loop import NetworkThread
from starling.node.wire import Limits, WireError, decode, encode


class ClientError(Exception):
    """The node could not be reached or answered with an error."""


ANSWER_LIMITS = Limits(max_header_bytes=64 << 20)  # a status may be big: the asker chose to read it
STATUS_PAD = 1024  # a first status request pays for a 10 KiB answer: a small swarm's status in one round trip
MAX_PAD = 16 << 20  # the most a status request pads itself to (a node answers at most 10x what it is sent)
MAX_STATUS_PAGES = 1024  # a member's status comes in pages of the table (64 KiB each by default)
STATUS_BUSY_RETRIES = 30  # pages turned down as over the member's pull budget, waited out and asked again
STATUS_BUSY_WAIT_S = 0.25


class NodeBusy(ClientError):
    """The node turned the request down as busy (over the asker's budget): ask again later."""


async def _aquery(address: str, topic: str, body: Any, identity: Identity, timeout_s: float) -> Any:
    """One request; a `$status` answered with `{"pad_to": n}` (the node answers someone outside
    its swarm with at most ten times the bytes it was sent) is asked again, padded to n, and
    one answered in pages (asked by a member: `next` names where the table goes on) is read to
    its end, waiting out the pages turned down as over the member's pull budget (the first
    one too: the member's own table pulls may have spent it just before)."""
    status = topic == "$status" and body is None
    if status:
        result = await _status_page(address, {"pad": bytes(STATUS_PAD)}, identity, timeout_s)
    else:
        result = await _aquery_once(address, topic, body, identity, timeout_s)
    if status and isinstance(result, dict) and set(result) == {"pad_to"} \
            and isinstance(result["pad_to"], int) and STATUS_PAD < result["pad_to"] <= MAX_PAD:
        result = await _aquery_once(address, topic, {"pad": bytes(result["pad_to"])}, identity, timeout_s)
    if status and isinstance(result, dict) and isinstance(result.get("peers"), list) and "next" in result:
        await _read_pages(address, result, identity, timeout_s)
    return result


async def _read_pages(address: str, status: dict[str, Any], identity: Identity, timeout_s: float) -> None:
    """Append the later pages of a paged status to its `peers`, at most MAX_STATUS_PAGES."""
    following = status.pop("next")
    for _ in range(MAX_STATUS_PAGES):
        if not isinstance(following, str):
            return
        page = await _status_page(address, {"after": following}, identity, timeout_s)
        if not isinstance(page, dict) or not isinstance(page.get("peers"), list):
            raise ClientError(f"malformed status page from {address}")
        status["peers"].extend(page["peers"])
        nxt = page.get("next")
        if nxt is not None and (not isinstance(nxt, str) or nxt <= following):
            raise ClientError(f"status page from {address}: next must come after the page asked for")
        following = nxt
    raise ClientError(f"the status of {address} runs past {MAX_STATUS_PAGES} pages")


async def _status_page(address: str, body: Any, identity: Identity, timeout_s: float) -> Any:
    """One `$status` page, asked again while the node turns it down as over the member's pull
    budget (its own table pulls may have spent it), at most STATUS_BUSY_RETRIES times."""
    for _ in range(STATUS_BUSY_RETRIES):
        try:
            return await _aquery_once(address, "$status", body, identity, timeout_s)
        except NodeBusy:
            await asyncio.sleep(STATUS_BUSY_WAIT_S)
    return await _aquery_once(address, "$status", body, identity, timeout_s)


async def _aquery_once(address: str, topic: str, body: Any, identity: Identity, timeout_s: float) -> Any:
    target = parse_address(address)
    net = NetworkThread.get()
    sock = net.context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
    try:
        if target.curve_key is not None:
            sock.curve_serverkey = z85.encode(target.curve_key)
            sock.curve_publickey = identity.curve_public_z85
            sock.curve_secretkey = identity.curve_secret_z85
        sock.connect(target.endpoint)
        await sock.send_multipart(encode(rpc.REQUEST_TOPIC, identity.peer_id, 0, rpc.request_body(topic, 1, body)))
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(copy=False), timeout_s)
        except asyncio.TimeoutError:
            raise ClientError(f"no answer from {target.endpoint} within {timeout_s} s "
                              "(not running, wrong key, or not allowed)") from None
        try:
            msg = decode(frames, ANSWER_LIMITS)
            _, ok, result = rpc.parse_reply(msg)
        except WireError as exc:
            raise ClientError(f"malformed answer from {target.endpoint}: {exc}") from None
        if not ok:
            error = NodeBusy if result.code is rpc.ErrorCode.BUSY else ClientError
            raise error(f"{target.endpoint} refused ({result.code.value}): {result.message}")
        return result
    finally:
        sock.close(0)


def query(address: str, topic: str = "$status", body: Any = None, *, identity: Identity | None = None,
          timeout_s: float = 5.0) -> Any:
    """Call a public request topic on the node at `address` (a join address)."""
    return NetworkThread.get().run(_aquery(address, topic, body, identity or Identity.generate(), timeout_s))


def submit_query(address: str, topic: str = "$status", body: Any = None, *, identity: Identity | None = None,
                 timeout_s: float = 5.0) -> concurrent.futures.Future[Any]:
    """`query`, started on the network thread: returns at once with a future, so a caller
    that polls (`starling node watch`) can stop waiting, or cancel, at any moment."""
    return NetworkThread.get().submit(_aquery(address, topic, body, identity or Identity.generate(), timeout_s))
