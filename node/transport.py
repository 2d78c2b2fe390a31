"""ZeroMQ sockets of one node, in the Zyre pattern.

One ROUTER is bound for everything inbound; one DEALER per peer we talk to carries what
we send to it, opened and closed under a cap (`node.dealers`). Replies to requests go back
over the connection the request came on (ROUTER -> the requester's DEALER), so a peer behind
NAT can still ask questions.

A client peer (one with no address: it listens nowhere anyone can dial) is reached the same
way in the other direction: it opens DEALERs to the peers it talks to, and they send to it on
their ROUTER by the routing id of its connection (`attach`), learned from the last message
it sent them. No second connection is made, so nothing has to get through its NAT inbound.
All methods run on the network thread.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket as pysocket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from starling.node.dealers import (
    Busy,
    DealerCache,
    Dropped,
    EndpointRefused,
    Fatal,
    NoSocket,
    Refused,
    SendError,
    TransportConfig,
    dealer_ceiling,
)
from starling.node.loop import read_outcome
from starling.node.security import SecurityMode, ZapPolicy

log = logging.getLogger(__name__)

# Importable from here as they always were: their home is `node.dealers`.
__all__ = ["DRAIN_BATCH", "Busy", "Dropped", "EndpointRefused", "Fatal", "Inbound", "NoSocket", "Receiver",
           "Refused", "SendError", "Transport", "TransportConfig", "dealer_ceiling"]


@dataclass
class Inbound:
    """Raw frames as they arrived, plus where they came from."""

    frames: list[zmq.Frame]
    route: bytes | None  # ROUTER routing id to reply on; None for frames read on a DEALER
    via_peer: str | None  # the DEALER's peer id (or bootstrap key) when read on a DEALER
    user_id: str | None  # the CURVE client key (z85) authenticated by ZAP, if any
    # when the socket's reader took it (time.monotonic): what a handler reads to see how far
    # behind this node's loop is (a joiner's hello, turned away from a loop that fell behind)
    received_at: float = field(default_factory=time.monotonic)

    def origin(self) -> str:
        """Where these frames came from, as a peer table groups first-hand greeters: "ip:" and
        the address ZeroMQ read them from, or "local" (ipc, inproc: this machine)."""
        try:
            address = self.frames[0].get("Peer-Address")
        except (zmq.ZMQError, AttributeError, IndexError):  # no such property (ipc, inproc), or plain bytes
            return "local"
        return f"ip:{address}" if address else "local"


Receiver = Callable[[Inbound], Awaitable[None]]
DRAIN_BATCH = 64  # messages read per wake-up before yielding to other sockets


def _curve_user_id(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


def _outbound_host() -> str:
    """The address other machines most likely reach us on (no packet is sent)."""
    s = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    try:
        s.connect(("10.254.254.254", 1))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


class Transport(DealerCache):
    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        mode: SecurityMode,
        curve_public_z85: bytes,
        curve_secret_z85: bytes,
        zap_domain: str,
        config: TransportConfig,
        receiver: Receiver,
        busy: Busy = lambda key: False,
        dropped: Dropped = lambda key: None,
        fatal: Fatal = lambda reason: None,
        refused: Refused = lambda key: None,
    ) -> None:
        super().__init__(context, mode=mode, curve_public_z85=curve_public_z85, curve_secret_z85=curve_secret_z85,
                         config=config, busy=busy, dropped=dropped, fatal=fatal, refused=refused)
        self._zap_domain = zap_domain
        self._receiver = receiver
        self._router: zmq.asyncio.Socket | None = None
        self._attached: dict[str, bytes] = {}  # client peer -> ROUTER routing id of its connection to us
        self.bound: list[str] = []
        self.bound_schemes: frozenset[str] = frozenset()  # "tcp://", "ipc://", "inproc://" of those
        self._closed = False

    async def bind(self, endpoints: Sequence[str], policy: ZapPolicy | None) -> list[str]:
        """Bind the ROUTER; returns the concrete endpoints (ephemeral ports resolved)."""
        try:
            router = self.context.socket(zmq.ROUTER)
        except zmq.ZMQError as exc:  # out of descriptors or of the context's sockets: this start fails, cleanly
            raise OSError(f"cannot open a socket to listen on: {exc}") from None
        self._common(router)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # dual stack only where asked: with it, IPv4 binds report v4-mapped v6 endpoints
        router.setsockopt(zmq.IPV6, int(any(ep.startswith("tcp://[") for ep in endpoints)))
        if self.mode is SecurityMode.CURVE:
            router.curve_server = True
            router.curve_publickey = self._public
            router.curve_secretkey = self._secret
            router.zap_domain = self._zap_domain.encode()
        try:
            for ep in endpoints:
                if ep.startswith("tcp://") and ep.rsplit(":", 1)[1] in ("0", "*"):
                    ep = ep.rsplit(":", 1)[0] + ":*"
                router.bind(ep)
                self.bound.append(router.get(zmq.LAST_ENDPOINT).decode())
        except zmq.ZMQError as exc:
            router.close(0)
            raise OSError(f"cannot listen on {ep}: {exc}") from None
        self._router = router
        self.bound_schemes = frozenset(ep.split("//", 1)[0] + "//" for ep in self.bound)
        self._tasks[None] = asyncio.ensure_future(self._read(router, None))
        return list(self.bound)

    def advertised(self) -> list[str]:
        """Bound endpoints with wildcard hosts replaced by a reachable address."""
        out = []
        for ep in self.bound:
            if ep.startswith(("tcp://0.0.0.0:", "tcp://[::]:")):
                ep = f"tcp://{_outbound_host()}:{ep.rsplit(':', 1)[1]}"
            out.append(ep)
        return out

    def attach(self, key: str, route: bytes) -> None:
        """A client peer's message came in on our ROUTER with this routing id: send to it there."""
        if key in self._routes and not self._routes[key][0]:
            self._attached[key] = route

    def can_send(self, key: str) -> bool:
        """Whether `send` has a way to `key`: a peer we can dial, or a client attached to us."""
        route = self._routes.get(key)
        return route is not None and (bool(route[0]) or key in self._attached)

    @property
    def listening(self) -> bool:
        return self._router is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def would_open(self, key: str) -> bool:
        """Whether a send to `key` now opens a DEALER (none is open, and it is one we dial)."""
        route = self._routes.get(key)
        return key not in self._dealers and key not in self._attached and route is not None and bool(route[0])

    def disconnect(self, key: str, linger_ms: int = 0) -> None:
        self._routes.pop(key, None)
        self._attached.pop(key, None)
        self._close(key, linger_ms)

    async def send(self, key: str, frames: Sequence[object], *, wait: bool = True,
                   timeout_s: float | None = None) -> None:
        if self._closed:
            raise SendError(f"send to {key}: this node's sockets are closed")
        route = self._attached.get(key)
        if route is not None and self._router is not None:
            # A message for a client goes back down the connection it opened to us. If that
            # connection is gone, ZeroMQ drops it: its next message attaches a new one.
            await self._send(self._router, [route, *frames], wait, key, timeout_s)
            return
        dealer = self._dealer(key)
        self._sending[key] = self._sending.get(key, 0) + 1
        try:
            await self._send(dealer, frames, wait, key, timeout_s)
        finally:
            left = self._sending.pop(key) - 1
            if left:
                self._sending[key] = left

    async def reply(self, route: bytes, frames: Sequence[object], *, wait: bool = True) -> None:
        """Answer on the connection a request came in on; `wait=False` never waits (a busy
        refusal must not hold up the reader that refuses)."""
        if self._router is None:
            raise SendError("node is not listening")
        await self._send(self._router, [route, *frames], wait, "reply")

    async def _send(self, sock: zmq.asyncio.Socket, frames: Sequence[object], wait: bool, what: str,
                    timeout_s: float | None = None) -> None:
        timeout_s = self.config.send_timeout_s if timeout_s is None else min(timeout_s, self.config.send_timeout_s)
        try:
            if not wait:
                # The plain (non-asyncio) send: pyzmq's asyncio socket would queue even a
                # NOBLOCK send behind one already waiting on this peer, and a heartbeat
                # stuck behind a send to a crashed peer would freeze the failure detector.
                try:
                    sock._shadow_sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                finally:
                    # libzmq's FD is edge-triggered, and every zmq_send first processes the
                    # socket's pending commands, which reads the FD's edge: a message that
                    # arrived, or the connection of a fresh DEALER becoming writable. A send
                    # behind the asyncio wrapper's back, even one that fails with EAGAIN, can
                    # take that edge, and the wrapper's waiting recv or send would then sleep
                    # until the next edge. Re-check the socket's events either way.
                    if not sock.closed:
                        sock._schedule_remaining_events()
                return
            sent = sock.send_multipart(frames, copy=False)
            if sent.done():  # queued at once, as most are: no timer, and no loop turn to wait on
                sent.result()
                return
            # Its outcome is read also when the wait below gives up or is cancelled just as it
            # ends (a socket closed under it, at a node's close): else asyncio logs it unread.
            sent.add_done_callback(read_outcome)
            # Not `wait_for`: closing a socket (the cap, a newer record of its peer, a death)
            # cancels its waiting sends, and `wait_for` would raise that in the caller's task
            # as if the caller had been cancelled. A send its socket dropped is a failed send.
            try:
                await asyncio.wait((sent,), timeout=timeout_s)
            finally:
                sent.cancel()  # given up on (timed out, or the caller was cancelled); no-op once done
            if sent.cancelled():
                raise SendError(f"send to {what} timed out after {timeout_s} s" if not sock.closed
                                else f"send to {what} failed: its connection was closed") from None
            sent.result()
        except zmq.Again:
            raise SendError(f"peer {what} is not connected or its queue is full") from None
        except zmq.ZMQError as exc:
            raise SendError(f"send to {what} failed: {exc}") from None

    async def _read(self, sock: zmq.asyncio.Socket, key: str | None) -> None:
        plain = sock._shadow_sock  # the same socket without the asyncio wrapper
        while True:
            try:
                batch = [await sock.recv_multipart(copy=False)]
                # Drain what is already queued without a future per message: with dozens
                # of nodes in one process, per-message asyncio overhead is the bottleneck.
                while len(batch) < DRAIN_BATCH:
                    batch.append(plain.recv_multipart(flags=zmq.NOBLOCK, copy=False))
            except zmq.Again:
                pass
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or sock.closed:
                    return
                if exc.errno == errno.EINTR:
                    continue
                # A reader that retried would spin; one that returned would leave the node a
                # member that hears nothing on this socket. Either is a silent dead receiver.
                self._fatal(f"cannot read from {key or 'the listening socket'}: {exc}")
                return
            for frames in batch:
                await self._deliver(frames, key)
            # Yield once per batch. pyzmq completes a recv at once while messages are queued,
            # so without this a sender that never pauses keeps the loop in this reader: no
            # other task (replies, heartbeats, training sends) would run until it stops.
            await asyncio.sleep(0)

    async def _deliver(self, frames: list[zmq.Frame], key: str | None) -> None:
        if key is None:  # the ROUTER: first frame is the connection's routing id
            if len(frames) < 2:
                return
            inbound = Inbound(frames[1:], bytes(frames[0].bytes), None, _curve_user_id(frames[1]))
        else:
            inbound = Inbound(frames, None, key, None)
            if key in self._dealers:
                self._heard.add(key)
        try:
            await self._receiver(inbound)
        except Exception:  # a receiver bug must not kill the socket's reader
            log.exception("receiver failed")

    async def close(self, linger_ms: int | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        linger = self.config.linger_ms if linger_ms is None else linger_ms
        for task in self._tasks.values():
            task.cancel()
        for key, dealer in self._dealers.items():
            if key in self._monitors:
                dealer.disable_monitor()
            dealer.close(linger)
        for monitor in self._monitors.values():
            monitor.close(0)
        self._monitors.clear()
        if self._router is not None:  # replies still queued go out too, within the same linger
            self._router.close(linger)
        self._dealers.clear()
        self._routes.clear()
        self._attached.clear()
        self._heard.clear()
        self._tasks.clear()
