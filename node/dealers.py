"""The DEALERs of one node's transport (`node.transport`): one per peer it sends to, capped.

A known peer's DEALER opens when it is learned while fewer than `max_open_dealers` are open,
else on the first send to it, closing the least recently used one that has nothing in flight
(so a swarm of hundreds of nodes in one process does not hold n^2 sockets). A DEALER with a
send or a request in flight is never closed, so the cap can be passed, by at most a quarter
(`dealer_ceiling`). A process that runs out of descriptors lowers the cap to half of what fit
and sheds idle DEALERs past it; one that has had nothing to shed for `exhausted_grace_s` stops.
Each DEALER's connection is watched by a socket monitor, so a peer whose process dies is heard
of at once, not after the heartbeats' dead timeout (without the monitors a SIGKILL in a
256-peer swarm was known dead in a median 21 s instead of 1.8 s, for 9% less CPU,
`benchmarks/membership.py`). Past the cap the failure detector probes its fingers
(`node.ring`), whose DEALERs it pins open: a probe opens no socket, and their connections are
watched all along.

The settings of the node's sockets (`TransportConfig`) and the errors of a send live here, under
the transport that builds on them, and are importable from `node.transport` as well.
"""
from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from starling.node.security import SecurityMode

log = logging.getLogger(__name__)

# What running out of this process's own resources looks like (descriptors, the context's
# sockets, memory); any other error opening a DEALER is about the address it was given.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, zmq.EMTHREAD})

# Routes (endpoints, server key) held once per process: every node of a simulated swarm routes to
# every other, n^2 routes of n distinct ones. Emptied when full (a node keeps what it holds).
_SHARED_ROUTES: dict[tuple[tuple[str, ...], bytes | None], tuple[tuple[str, ...], bytes | None]] = {}
MAX_SHARED_ROUTES = 65536


def _shared_route(endpoints: Sequence[str], server_key_z85: bytes | None) -> tuple[tuple[str, ...], bytes | None]:
    route = (tuple(endpoints), server_key_z85)
    held = _SHARED_ROUTES.get(route)
    if held is None:
        if len(_SHARED_ROUTES) >= MAX_SHARED_ROUTES:
            _SHARED_ROUTES.clear()
        held = _SHARED_ROUTES.setdefault(route, route)
    return held


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
    # Watch DEALERs' connections (a ZeroMQ socket monitor, one more socket pair per DEALER):
    # when a peer's process dies its kernel closes the connection at once, and the node hears
    # of it in milliseconds instead of after the heartbeats' dead timeout. Every DEALER is
    # watched while the peers a node knows fit under its cap; past the cap, only those it
    # keeps open (`DealerCache.watches`).
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


Dropped = Callable[[str], None]  # a DEALER's connection to this peer (or bootstrap handle) dropped
Refused = Callable[[str], None]  # an attempt to (re)connect a DEALER to this peer failed: nothing accepted it
Busy = Callable[[str], bool]  # True while requests to this peer await replies on its DEALER
Fatal = Callable[[str], None]  # a socket failed (no descriptor left, a broken reader): the node cannot go on


class DealerCache:
    """The open DEALERs of a transport, and the peers it knows how to reach. The transport reads
    each DEALER it opens (`_read`)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        mode: SecurityMode,
        curve_public_z85: bytes,
        curve_secret_z85: bytes,
        config: TransportConfig,
        busy: Busy,
        dropped: Dropped,
        fatal: Fatal,
        refused: Refused = lambda key: None,
    ) -> None:
        self.context = context
        self.mode = mode
        self.config = config
        self._public = curve_public_z85
        self._secret = curve_secret_z85
        self._busy = busy
        self._dropped = dropped
        self._refused = refused
        self._fatal = fatal
        self._monitors: dict[str, zmq.asyncio.Socket] = {}
        self._routes: dict[str, tuple[tuple[str, ...], bytes | None]] = {}  # every known peer
        self._dealers: dict[str, zmq.asyncio.Socket] = {}  # the open ones, least recently used first
        self._sending: dict[str, int] = {}  # sends in flight per DEALER
        self._heard: set[str] = set()  # peers that sent us something down the DEALER we hold to them
        self._pinned: frozenset[str] = frozenset()  # kept open past the cap: the failure detector's fingers
        self._tasks: dict[str | None, asyncio.Task[None]] = {}
        self.dealers_opened = 0  # over the node's life: how much the socket cap churns
        self.dealers_refused = 0  # sends failed because every DEALER up to the ceiling was busy
        self.connect_failures = 0  # DEALERs not opened: ZeroMQ refused the peer's endpoint
        self.dealers_shed = 0  # idle DEALERs closed because the process ran out of descriptors
        self.exhausted = 0  # DEALERs not opened because the process had no descriptor or socket left
        # open DEALERs allowed: the configured cap, lowered to half of what fit when descriptors ran out
        self.dealer_cap = config.max_open_dealers
        self._exhausted_since: float | None = None  # out of descriptors with nothing idle to close, since
        self._cap_lowered_at: float | None = None  # when running out of descriptors last lowered the cap

    async def _read(self, sock: zmq.asyncio.Socket, key: str | None) -> None:
        """Read what `sock` receives (the transport's reader)."""
        raise NotImplementedError

    def _common(self, sock: zmq.asyncio.Socket) -> None:
        c = self.config
        sock.setsockopt(zmq.LINGER, c.linger_ms)
        sock.setsockopt(zmq.SNDHWM, c.send_hwm)
        sock.setsockopt(zmq.RCVHWM, c.recv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, c.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, c.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, c.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)

    def connect(self, key: str, endpoints: Sequence[str], server_key_z85: bytes | None) -> None:
        """Know how to reach `key` (a peer id or a bootstrap handle); open its DEALER now
        while fewer than `max_open_dealers` are open, so that it is connected before the
        first message. (Opening on the first send instead lost messages: a DEALER opened
        under a pending asyncio send and raw heartbeat sends sometimes never delivered.)"""
        if key in self._routes:
            return
        if self.mode is SecurityMode.CURVE and server_key_z85 is None:
            raise ValueError(f"peer {key} has no CURVE key but this node uses CURVE")
        self._routes[key] = _shared_route(endpoints, server_key_z85)
        if endpoints and len(self._dealers) < self.dealer_cap:
            try:
                self._open(key, eager=True)
            except EndpointRefused:  # counted in `_open`; sends to it will say why
                pass

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
            if self.config.monitor_connections and self.watches(key):
                monitor = self._monitor(dealer)
        except zmq.ZMQError:
            dealer.close(0)
            raise
        self._dealers[key] = dealer
        self.dealers_opened += 1
        self._tasks[key] = asyncio.ensure_future(self._read(dealer, key))
        if monitor is not None:
            self._start_watch(key, monitor)
        return dealer

    def watches(self, key: str) -> bool:
        """Whether `key`'s DEALER gets a socket monitor when it opens: every one while the peers
        this node knows fit under its cap (each DEALER then stays open), and past the cap only
        those it keeps open: the failure detector's fingers (`pin`), whose deaths it must hear
        of first, and bootstrap handles. Past the cap the other DEALERs open for a send or two
        and close again, and a monitor doubled the sockets each of those opened and closed;
        a peer's death comes from its fingers' monitors and probes, and spreads as a claim."""
        return (len(self._routes) <= self.dealer_cap or key in self._pinned
                or key.startswith("bootstrap-"))

    def _start_watch(self, key: str, monitor: zmq.asyncio.Socket) -> None:
        self._monitors[key] = monitor
        self._tasks[f"monitor:{key}"] = asyncio.ensure_future(self._watch(monitor, key))

    def _monitor(self, dealer: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        """A PAIR socket that receives `dealer`'s disconnections. libzmq's IO thread writes each
        event to the monitor with a blocking send, so the reading end must never be missing or
        full: with no reader (its socket could not be opened, out of descriptors) or a full
        queue, the IO thread blocks for good and the whole process stops reading and accepting
        connections. The reading end therefore has no queue limit (an event is a few dozen
        bytes, at most one per reconnect interval). So the reading end is opened and connected
        first (inproc connects before the bind), and the monitor started only once it is there:
        stopping a monitor that has no reader can block for good (libzmq sends it a last
        event), so a failure leaves no monitor to stop."""
        addr = f"inproc://starling-monitor-{next(_MONITOR_IDS)}"  # never reused, unlike a descriptor number
        pair = self.context.socket(zmq.PAIR)  # out of descriptors: raises here, nothing to undo
        try:
            pair.setsockopt(zmq.LINGER, 0)
            pair.setsockopt(zmq.RCVHWM, 0)
            pair.connect(addr)
            dealer.monitor(addr, zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        except zmq.ZMQError:
            pair.close(0)
            raise
        return pair

    async def _watch(self, monitor: zmq.asyncio.Socket, key: str) -> None:
        """Tell the node when the DEALER's connection to `key` drops (the peer's process died,
        or its host closed the connection), and when an attempt to connect again fails (libzmq
        closes the descriptor of a connect that nothing accepted: refused at once where the
        address has no listener, as on a dead process's port or ipc path; only after the
        kernel's timeouts where packets are lost). Leads for the failure detector, not
        verdicts."""
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except asyncio.CancelledError:
                raise
            except (zmq.ZMQError, ValueError):
                return  # the monitor was closed with its DEALER
            if event["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                handler = self._dropped if event["event"] == zmq.EVENT_DISCONNECTED else self._refused
                try:
                    handler(key)
                except Exception:  # the node's bug must not stop the watch
                    log.exception("connection handler failed for %s", key)
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
            idle = [k for k in self._dealers
                    if k not in self._pinned and not self._sending.get(k) and not self._busy(k)]
            for victim in idle[:excess]:
                self._close(victim, self.config.linger_ms)  # queued messages still go out
            if len(self._dealers) >= dealer_ceiling(self.dealer_cap):
                self.dealers_refused += 1
                raise NoSocket(f"no socket for {key}: all {len(self._dealers)} open DEALERs are busy "
                                f"(cap {self.dealer_cap})")
        return self._open(key)

    def pin(self, keys: frozenset[str]) -> None:
        """Keep the DEALERs of `keys` open: a send to another peer past the cap closes an idle
        DEALER that is not one of them (the failure detector's fingers, `node.ring`, which it
        probes every few periods and whose connections it watches). The caller keeps them to
        half the cap. Running out of descriptors may still close them. A newly pinned DEALER
        that is open unwatched is watched from now on (`watches`)."""
        added = keys - self._pinned
        self._pinned = keys
        if not self.config.monitor_connections:
            return
        for key in added:
            dealer = self._dealers.get(key)
            if dealer is None or key in self._monitors:
                continue
            try:
                monitor = self._monitor(dealer)
            except zmq.ZMQError as exc:  # out of descriptors: its probes still judge it
                log.debug("no monitor for the DEALER to finger %s: %s", key, exc)
                continue
            self._start_watch(key, monitor)

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

    def is_open(self, key: str) -> bool:
        return key in self._dealers

    def heard(self, key: str) -> bool:
        """Whether `key` has sent us anything down our open DEALER to it: proof that it knows
        the connection (a client's relay can reach it there, `attach`)."""
        return key in self._heard

    def has(self, key: str) -> bool:
        return key in self._routes

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
