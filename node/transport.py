"""ZeroMQ sockets of one node, in the Zyre pattern.

One ROUTER is bound for everything inbound; one DEALER per peer we talk to carries what
we send to it. A known peer's DEALER opens when it is learned while fewer than
`max_open_dealers` are open, else on the first send to it, closing the least recently
used one that has nothing in flight (so a swarm of hundreds of nodes in one process does not
hold n^2 sockets). Replies to requests go back over the connection the request came on
(ROUTER -> the requester's DEALER), so a peer behind NAT can still ask questions.

A client peer (one with no address: it listens nowhere anyone can dial) is reached the same
way in the other direction: it opens DEALERs to the peers it talks to, and they send to it on
their ROUTER by the routing id of its connection (`attach`), learned from the last message
it sent them. No second connection is made, so nothing has to get through its NAT inbound.
All methods run on the network thread.
"""
from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import random
import socket as pysocket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from starling.node.loop import read_outcome
from starling.node.security import SecurityMode, ZapPolicy

log = logging.getLogger(__name__)


# What running out of this process's own resources looks like (descriptors, the context's
# sockets, memory); any other error opening a DEALER is about the address it was given.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, zmq.EMTHREAD})


class SendError(ConnectionError):
    """A message could not be handed to ZeroMQ (peer unreachable, queue full, timeout)."""


class EndpointRefused(SendError):
    """ZeroMQ refused to dial a peer's endpoint: that peer cannot be reached, the node goes on."""


class NoSocket(SendError):
    """This node has no socket to spare for the send (its DEALERs are busy, or it is out of
    descriptors): nothing is known of the peer, and a failure detector must not blame it."""


@dataclass(frozen=True)
class TransportConfig:
    max_message_bytes: int = 1 << 30  # ZMQ_MAXMSGSIZE: bigger frames are dropped unread
    send_hwm: int = 1000  # messages queued per peer before sends wait
    recv_hwm: int = 1000
    linger_ms: int = 200  # how long close() may flush pending messages
    send_timeout_s: float = 10.0  # a send that cannot be queued by then fails
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 2000
    # DEALERs open at once. None is closed while a send or request is in flight, so the cap
    # can be passed, by at most a quarter (`dealer_ceiling`): past that a send to a peer with
    # no open DEALER fails (SendError) until one goes idle. Peers that are slow to read or to
    # answer must not make a node open sockets without bound.
    max_open_dealers: int = 64
    # Watch each DEALER's connection (a ZeroMQ socket monitor, one more socket pair per DEALER):
    # when a peer's process dies its kernel closes the connection at once, and the node hears
    # of it in milliseconds instead of after the heartbeats' dead timeout.
    monitor_connections: bool = True
    # Out of descriptors with no idle DEALER to close, a node gives up (stops, with the reason)
    # once that has lasted this long: libzmq frees a closed socket's descriptor a moment late.
    exhausted_grace_s: float = 5.0


_MONITOR_IDS = itertools.count()

# Running out of descriptors again this soon after lowering the cap lowers it no further: the
# sockets closed then free their descriptors a moment later (libzmq's reaper thread).
_CAP_SETTLE_S = 1.0


def dealer_ceiling(max_open_dealers: int) -> int:
    """The most DEALERs a node holds at once: its cap, plus a quarter for busy ones."""
    return max_open_dealers + max(1, max_open_dealers // 4)


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
Dropped = Callable[[str], None]  # a DEALER's connection to this peer (or bootstrap handle) dropped
Busy = Callable[[str], bool]  # True while requests to this peer await replies on its DEALER
Fatal = Callable[[str], None]  # a socket failed (no descriptor left, a broken reader): the node cannot go on
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


class Transport:
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
    ) -> None:
        self.context = context
        self.mode = mode
        self.config = config
        self._public = curve_public_z85
        self._secret = curve_secret_z85
        self._zap_domain = zap_domain
        self._receiver = receiver
        self._router: zmq.asyncio.Socket | None = None
        self._busy = busy
        self._dropped = dropped
        self._fatal = fatal
        self._monitors: dict[str, zmq.asyncio.Socket] = {}
        self._routes: dict[str, tuple[tuple[str, ...], bytes | None]] = {}  # every known peer
        self._dealers: dict[str, zmq.asyncio.Socket] = {}  # the open ones, least recently used first
        self._sending: dict[str, int] = {}  # sends in flight per DEALER
        self._attached: dict[str, bytes] = {}  # client peer -> ROUTER routing id of its connection to us
        self._heard: set[str] = set()  # peers that sent us something down the DEALER we hold to them
        self._tasks: dict[str | None, asyncio.Task[None]] = {}
        self.bound: list[str] = []
        self.bound_schemes: frozenset[str] = frozenset()  # "tcp://", "ipc://", "inproc://" of those
        self.dealers_opened = 0  # over the node's life: how much the socket cap churns
        self.dealers_refused = 0  # sends failed because every DEALER up to the ceiling was busy
        self.connect_failures = 0  # DEALERs not opened: ZeroMQ refused the peer's endpoint
        self.dealers_shed = 0  # idle DEALERs closed because the process ran out of descriptors
        self.exhausted = 0  # DEALERs not opened because the process had no descriptor or socket left
        # open DEALERs allowed: the configured cap, lowered to half of what fit when descriptors ran out
        self.dealer_cap = config.max_open_dealers
        self._exhausted_since: float | None = None  # out of descriptors with nothing idle to close, since
        self._cap_lowered_at: float | None = None  # when running out of descriptors last lowered the cap
        self._closed = False

    def _common(self, sock: zmq.asyncio.Socket) -> None:
        c = self.config
        sock.setsockopt(zmq.LINGER, c.linger_ms)
        sock.setsockopt(zmq.SNDHWM, c.send_hwm)
        sock.setsockopt(zmq.RCVHWM, c.recv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, c.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, c.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, c.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)

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

    def connect(self, key: str, endpoints: Sequence[str], server_key_z85: bytes | None) -> None:
        """Know how to reach `key` (a peer id or a bootstrap handle); open its DEALER now
        while fewer than `max_open_dealers` are open, so that it is connected before the
        first message. (Opening on the first send instead lost messages: a DEALER opened
        under a pending asyncio send and raw heartbeat sends sometimes never delivered.)"""
        if key in self._routes:
            return
        if self.mode is SecurityMode.CURVE and server_key_z85 is None:
            raise ValueError(f"peer {key} has no CURVE key but this node uses CURVE")
        self._routes[key] = (tuple(endpoints), server_key_z85)
        if endpoints and len(self._dealers) < self.dealer_cap:
            try:
                self._open(key, eager=True)
            except EndpointRefused:  # counted in `_open`; sends to it will say why
                pass

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

    def _open(self, key: str, eager: bool = False) -> zmq.asyncio.Socket:
        """Open `key`'s DEALER. `eager`: opened ahead of any send (`connect`), which running out
        of descriptors only stops: the socket opens when a send needs it."""
        try:
            dealer = self._open_dealer(key)
        except zmq.ZMQError as exc:
            if exc.errno not in _EXHAUSTED:
                # The peer's address cannot be dialled (an endpoint ZeroMQ refuses): that peer's
                # problem, never this node's. Its sends fail; nothing else changes.
                self.connect_failures += 1
                raise EndpointRefused(f"cannot connect to {key}: {exc}") from None
            reason = f"cannot open a socket to {key} ({len(self._dealers)} open already): {exc}"
            self.exhausted += 1
            # Out of descriptors (EMFILE) or of the context's sockets. From now on hold half the
            # DEALERs that fit, and close the idle ones past that (least recently used first):
            # a DEALER needs more descriptors once it connects (its TCP connection, which libzmq
            # opens later and retries in silence), and peers' connections to our ROUTER need
            # theirs. Holding all that fit left nothing for either: a node that answered no one.
            shed = self._lower_cap()
            if eager:
                raise EndpointRefused(reason) from None
            # A send needs one: fail this send and say so; the next open finds the closed ones'
            # descriptors free (libzmq frees a closed socket's a moment later). Only when the
            # node has had nothing to shed for `exhausted_grace_s` can it no longer reach its
            # peers, and going on would leave it a member that silently drops work.
            if shed:
                raise NoSocket(f"{reason}; closed {shed} idle connections to make room") from None
            now = time.monotonic()
            if self._exhausted_since is None:
                self._exhausted_since = now
            if now - self._exhausted_since < self.config.exhausted_grace_s:
                raise NoSocket(f"{reason}; nothing idle to close") from None
            self._fatal(reason)
            raise NoSocket(reason) from None
        self._exhausted_since = None
        return dealer

    def _lower_cap(self) -> int:
        """Halve the cap to half the DEALERs open (once per `_CAP_SETTLE_S`: the descriptors of
        sockets closed a moment ago are still held), then close idle DEALERs past it, least
        recently used first (none with a send or a request in flight), or at least one where
        the cap was lowered a moment ago. Their peers stay known and are dialled again when
        next needed. Returns how many were closed."""
        now = time.monotonic()
        if self._cap_lowered_at is None or now - self._cap_lowered_at >= _CAP_SETTLE_S:
            cap = max(1, min(self.dealer_cap, len(self._dealers) // 2))
            if cap < self.dealer_cap:
                log.warning("out of descriptors with %d connections open: holds at most %d from now on",
                            len(self._dealers), cap)
            self.dealer_cap = cap
            self._cap_lowered_at = now
        idle = [k for k in self._dealers if not self._sending.get(k) and not self._busy(k)]
        victims = idle[: max(1 if idle else 0, len(self._dealers) - self.dealer_cap)]
        for victim in victims:
            self._close(victim, 0)
        self.dealers_shed += len(victims)
        return len(victims)

    def _open_dealer(self, key: str) -> zmq.asyncio.Socket:
        endpoints, server_key_z85 = self._routes[key]
        dealer = self.context.socket(zmq.DEALER)
        self._common(dealer)
        # Queue nothing for a peer we are not connected to: sends wait (bounded) instead
        # of piling up for a peer that may never come back.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.IPV6, 1)  # IPv6 literals, and names that resolve to v6 only; v4 still works
        if self.mode is SecurityMode.CURVE:
            dealer.curve_serverkey = server_key_z85
            dealer.curve_publickey = self._public
            dealer.curve_secretkey = self._secret
        monitor = None
        try:
            for ep in endpoints:
                dealer.connect(ep)
            if self.config.monitor_connections:
                monitor = self._monitor(dealer)
        except zmq.ZMQError:
            dealer.close(0)
            raise
        self._dealers[key] = dealer
        self.dealers_opened += 1
        self._tasks[key] = asyncio.ensure_future(self._read(dealer, key))
        if monitor is not None:
            self._monitors[key] = monitor
            self._tasks[f"monitor:{key}"] = asyncio.ensure_future(self._watch(monitor, key))
        return dealer

    def _monitor(self, dealer: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        """A PAIR socket that receives `dealer`'s disconnections. libzmq's IO thread writes each
        event to the monitor with a blocking send, so the reading end must never be missing or
        full: with no reader (its socket could not be opened, out of descriptors) or a full
        queue, the IO thread blocks for good and the whole process stops reading and accepting
        connections. The reading end therefore has no queue limit (an event is a few dozen
        bytes, at most one per reconnect interval), and when it cannot be opened the monitor is
        stopped before the error goes on."""
        addr = f"inproc://starling-monitor-{next(_MONITOR_IDS)}"  # never reused, unlike a descriptor number
        dealer.monitor(addr, zmq.EVENT_DISCONNECTED)
        pair = None
        try:
            pair = self.context.socket(zmq.PAIR)
            pair.setsockopt(zmq.LINGER, 0)
            pair.setsockopt(zmq.RCVHWM, 0)
            pair.connect(addr)
        except zmq.ZMQError:
            if pair is not None:
                pair.close(0)
            dealer.disable_monitor()
            raise
        return pair

    async def _watch(self, monitor: zmq.asyncio.Socket, key: str) -> None:
        """Tell the node when the DEALER's connection to `key` drops (the peer's process died,
        or its host closed the connection): a lead for the failure detector, not a verdict."""
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except asyncio.CancelledError:
                raise
            except (zmq.ZMQError, ValueError):
                return  # the monitor was closed with its DEALER
            if event["event"] == zmq.EVENT_DISCONNECTED:
                try:
                    self._dropped(key)
                except Exception:  # the node's bug must not stop the watch
                    log.exception("connection-drop handler failed for %s", key)
            elif event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return

    def _dealer(self, key: str) -> zmq.asyncio.Socket:
        """The open DEALER for `key`, opened (closing idle ones over the cap) if need be."""
        dealer = self._dealers.pop(key, None)
        if dealer is not None:
            self._dealers[key] = dealer  # most recently used last
            return dealer
        if key not in self._routes:
            raise SendError(f"no connection to peer {key}")
        if not self._routes[key][0]:
            raise SendError(f"peer {key} is a client with no connection to us")
        excess = len(self._dealers) + 1 - self.dealer_cap
        if excess > 0:
            idle = [k for k in self._dealers if not self._sending.get(k) and not self._busy(k)]
            for victim in idle[:excess]:
                self._close(victim, self.config.linger_ms)  # queued messages still go out
            if len(self._dealers) >= dealer_ceiling(self.dealer_cap):
                self.dealers_refused += 1
                raise NoSocket(f"no socket for {key}: all {len(self._dealers)} open DEALERs are busy "
                                f"(cap {self.dealer_cap})")
        return self._open(key)

    @property
    def open_dealers(self) -> int:
        return len(self._dealers)

    def sample_open(self, rng: random.Random, k: int) -> list[str]:
        """Up to `k` random peers this node holds an open DEALER to (sending to them opens no
        socket and closes none)."""
        keys = [key for key in self._dealers if not key.startswith("bootstrap-")]
        return rng.sample(keys, min(k, len(keys)))

    @property
    def starved(self) -> bool:
        """Whether this process ran out of descriptors or sockets: its cap is then what fit, and
        a send that opens a socket closes another (whose descriptor frees a moment later), so
        what can go to an open socket should."""
        return self.exhausted > 0

    def would_open(self, key: str) -> bool:
        """Whether a send to `key` now opens a DEALER (none is open, and it is one we dial)."""
        route = self._routes.get(key)
        return key not in self._dealers and key not in self._attached and route is not None and bool(route[0])

    def is_open(self, key: str) -> bool:
        return key in self._dealers

    def heard(self, key: str) -> bool:
        """Whether `key` has sent us anything down our open DEALER to it: proof that it knows
        the connection (a client's relay can reach it there, `attach`)."""
        return key in self._heard

    def has(self, key: str) -> bool:
        return key in self._routes

    def disconnect(self, key: str, linger_ms: int = 0) -> None:
        self._routes.pop(key, None)
        self._attached.pop(key, None)
        self._close(key, linger_ms)

    def _close(self, key: str, linger_ms: int) -> None:
        dealer = self._dealers.pop(key, None)
        self._heard.discard(key)
        for name in (key, f"monitor:{key}"):
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
        monitor = self._monitors.pop(key, None)
        if dealer is not None:
            if monitor is not None:
                dealer.disable_monitor()
            dealer.close(linger_ms)
        if monitor is not None:
            monitor.close(0)

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
            # Its outcome is read also when the wait below gives up or is cancelled just as it
            # ends (a socket closed under it, at a node's close): else asyncio logs it unread.
            sent.add_done_callback(read_outcome)
            await asyncio.wait_for(sent, timeout_s)
        except zmq.Again:
            raise SendError(f"peer {what} is not connected or its queue is full") from None
        except asyncio.TimeoutError:
            raise SendError(f"send to {what} timed out after {timeout_s} s") from None
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
        if self._router is not None:
            self._router.close(0)
        self._dealers.clear()
        self._routes.clear()
        self._attached.clear()
        self._heard.clear()
        self._tasks.clear()
