"""The Node facade: a peer of a Starling swarm.

    node = Node().start(listen="tcp://127.0.0.1:0", join=["tcp://10.0.0.5:7000#KEY"])
    node.on("grads", handler)            # handler(msg) runs on the network thread
    node.send(peer_id, "grads", body, payload=[tensor])
    reply = node.request(peer_id, "state", {"name": "model"}, timeout_s=5)
    node.leave()

Joining is a hello to one known peer, which answers with its peer table (records
signed by their owners) and the swarm config; the joiner then says hello to every
peer it learned of. Liveness comes from heartbeats: every interval a node pings a few
random peers (all of them in a small swarm) with the beat counters it heard from
everyone, so the swarm's cost is n * fanout pings, not n^2; an id in a digest that a
node has no record of is asked for, which also finds peers that joined elsewhere at the
same time. A graceful leave is a signed broadcast.

Records are signed by their owners; beats and heartbeat metadata are authenticated hop
by hop only, so a member could claim another is alive for longer than it is (it cannot
forge records, requests or protocol messages on its behalf).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import logging
import math
import random
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from zmq.utils import z85

from starling.node import rpc
from starling.node.address import parse_address, parse_bind
from starling.node.identity import Identity, verify_signature
from starling.node.loop import NetworkThread
from starling.node.membership import (
    Liveness,
    PeerInfo,
    PeerRecord,
    PeerStatus,
    PeerTable,
    StatusChange,
    finite_meta,
    leave_statement,
    parse_digest,
)
from starling.node.security import (
    SecurityError,
    SecurityMode,
    ZapPolicy,
    check_plaintext_allowed,
    load_authorized_keys,
)
from starling.node.stats import NodeStats
from starling.node.transfer import BlobServer, TransferConfig, afetch_from_any
from starling.node.transport import Inbound, SendError, Transport, TransportConfig
from starling.node.wire import Limits, Message, RejectReason, WireError, decode, encode, frame_nbytes

log = logging.getLogger(__name__)

Handler = Callable[[Message], Any]
HELLO, ANNOUNCE, PING, LEAVE, STATUS = "$hello", "$announce", "$ping", "$leave", "$status"
WANT = "$want"  # asks a member for records it gossiped that we lack; answered with ANNOUNCE
MAX_WANT = 256
PUBLIC_INTERNAL = frozenset({HELLO, STATUS})


class JoinError(Exception):
    """Could not join the swarm through any of the given addresses."""


class SwarmConfigError(JoinError):
    """The swarm runs a config this node cannot run."""


class UnknownPeerError(ValueError):
    """A send or request named a peer this node does not know (or that left)."""


@dataclass(frozen=True)
class NodeConfig:
    liveness: Liveness = field(default_factory=Liveness)
    transport: TransportConfig = field(default_factory=TransportConfig)
    limits: Limits = field(default_factory=Limits)
    request_timeout_s: float = 10.0
    join_timeout_s: float = 10.0
    leave_timeout_s: float = 1.0
    forget_after_s: float = 60.0  # dead/left peers are dropped from the table after this


class LinkShaper(typing.Protocol):
    """Emulates a slow link on the way out (the simulator's bandwidth, latency, loss)."""

    async def admit(self, peer: str, nbytes: int) -> bool:
        """Wait until a message of `nbytes` to `peer` may leave; False drops it."""
        ...


@dataclass(frozen=True)
class PeerView:
    """A read-only snapshot of one peer-table entry."""

    id: str
    status: PeerStatus
    addresses: tuple[str, ...]
    last_seen_age_s: float
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status.value, "addresses": list(self.addresses),
                "last_seen_age_s": round(self.last_seen_age_s, 3), "meta": self.meta}


def config_conflicts(swarm: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """Keys this node set that the swarm has set differently."""
    return [f"{k}: swarm has {swarm[k]!r}, this node has {v!r}" for k, v in mine.items()
            if k in swarm and swarm[k] != v]


class Node:
    def __init__(self, identity: Identity | None = None, config: NodeConfig | None = None) -> None:
        self.identity = identity or Identity.generate()
        self.config = config or NodeConfig()
        self.stats = NodeStats()
        self.swarm_config: dict[str, Any] | None = None
        self.mode = SecurityMode.PLAINTEXT
        self.address = ""  # the join address others use: endpoint#KEY
        self.record: PeerRecord | None = None
        self._net = NetworkThread.get()
        self._table = PeerTable(self.identity.peer_id, self.config.liveness)
        self._handlers: dict[str, tuple[Handler, bool]] = {}
        self._listeners: list[Callable[[StatusChange], None]] = []
        self._pending = rpc.PendingRequests()
        self._seq = itertools.count()
        self._meta: dict[str, Any] = {}
        self._transport: Transport | None = None
        self._policy: ZapPolicy | None = None
        self._zap_domain = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._bootstraps = itertools.count()
        self._blobs: BlobServer | None = None
        self.shaper: LinkShaper | None = None  # set by the simulator to emulate slow links
        self._state = "new"
        self._beat = 0  # our heartbeat counter, relayed by others as proof we are alive
        self._rng = random.Random()
        self._wanted: dict[str, float] = {}  # peer id -> when we last asked for its record
        self._acked: dict[str, float] = {}  # peer id -> when we last answered its probe

    # ---------------------------------------------------------------- lifecycle
    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def start(
        self,
        listen: str | Sequence[str] = "tcp://127.0.0.1:0",
        join: Sequence[str] = (),
        *,
        key: Identity | str | Path | None = None,
        advertise: str | Sequence[str] | None = None,
        authorized_keys: str | Path | frozenset[bytes] | None = None,
        security: SecurityMode | str | None = None,
        insecure: bool = False,
        swarm_config: dict[str, Any] | None = None,
    ) -> Node:
        """Bind, then join through the first reachable address in `join` (if any).

        `security` defaults to CURVE unless every listen endpoint is inproc. Plaintext
        is refused on non-loopback endpoints unless `insecure`.
        """
        if self._state != "new":
            raise RuntimeError(f"node already {self._state}")
        if key is not None:
            self.identity = key if isinstance(key, Identity) else Identity.load(key)
            self._table = PeerTable(self.identity.peer_id, self.config.liveness)
        listens = [parse_bind(x) for x in ([listen] if isinstance(listen, str) else listen)]
        adverts = [] if advertise is None else [advertise] if isinstance(advertise, str) else list(advertise)
        adverts = [parse_address(a).endpoint for a in adverts]
        joins = [parse_address(a) for a in join]
        if security is None:
            all_inproc = all(e.startswith("inproc://") for e in listens)
            self.mode = SecurityMode.PLAINTEXT if all_inproc else SecurityMode.CURVE
        else:
            self.mode = SecurityMode(security)
        if self.mode is SecurityMode.PLAINTEXT:
            check_plaintext_allowed(listens + adverts + [j.endpoint for j in joins], insecure=insecure)
        else:
            if any(e.startswith("inproc://") for e in listens):
                raise SecurityError("CURVE does not apply to inproc endpoints; use security='plaintext'")
            missing = [str(j) for j in joins if j.curve_key is None]
            if missing:
                raise SecurityError(f"join address {missing[0]} has no '#KEY' part, which CURVE needs")
        allowed = None
        if authorized_keys is not None:
            if self.mode is not SecurityMode.CURVE:
                raise SecurityError("an allowlist (authorized keys) needs CURVE security")
            allowed = (authorized_keys if isinstance(authorized_keys, frozenset)
                       else load_authorized_keys(authorized_keys))
        if swarm_config is not None:
            self.swarm_config = dict(swarm_config)
        self._state = "starting"
        try:
            self._net.run(self._astart(listens, adverts, joins, allowed))
        except BaseException:
            self.close()
            raise
        self._state = "running"
        return self

    async def _astart(self, listens: list[str], adverts: list[str], joins: list[Any],
                      allowed: frozenset[bytes] | None) -> None:
        self._zap_domain = f"starling.{self.peer_id}.{id(self):x}"
        self._transport = Transport(
            self._net.context, mode=self.mode, curve_public_z85=self.identity.curve_public_z85,
            curve_secret_z85=self.identity.curve_secret_z85, zap_domain=self._zap_domain,
            config=self.config.transport, receiver=self._on_inbound, busy=self._pending.waiting_on,
        )
        if self.mode is SecurityMode.CURVE:
            self._policy = ZapPolicy(allowed)
            self._net.zap.register(self._zap_domain, self._policy)
        await self._transport.bind(listens, self._policy)
        endpoints = adverts or self._transport.advertised()
        self.record = PeerRecord.create(self.identity, endpoints, time.time_ns())
        key = self.identity.curve_public if self.mode is SecurityMode.CURVE else None
        from starling.node.address import PeerAddress  # local: only needed here

        self.address = str(PeerAddress(endpoints[0], key))
        self._spawn(self._heartbeat_loop())
        if joins:
            errors = []
            for address in joins:
                try:
                    await self._join_via(address.endpoint, address.curve_key)
                    break
                except SwarmConfigError:
                    raise
                except Exception as exc:  # try the next address
                    errors.append(f"{address}: {exc}")
            else:
                raise JoinError("could not join the swarm: " + "; ".join(errors))

    def leave(self) -> None:
        """Announce a graceful leave to every live peer, then close."""
        if self._state == "running":
            try:
                self._net.run(self._aleave(), timeout_s=self.config.leave_timeout_s + 5)
            except Exception as exc:
                log.warning("leave announcement incomplete: %r", exc)
        self.close()

    async def _aleave(self) -> None:
        assert self.record is not None
        stmt = leave_statement(self.peer_id, self.record.incarnation)
        body = [self.record.incarnation, self.identity.sign(stmt)]
        sends = [asyncio.ensure_future(self._asend_raw(p.peer_id, LEAVE, body, timeout_s=self.config.leave_timeout_s))
                 for p in self._table.live()]
        if sends:
            done, pending = await asyncio.wait(sends, timeout=self.config.leave_timeout_s)
            for t in pending:
                t.cancel()
            failed = len(pending) + sum(1 for t in done if t.exception() is not None)
            if failed:
                log.warning("%s: leave not delivered to %d of %d peers", self.peer_id, failed, len(sends))

    def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        try:
            self._net.run(self._aclose(), timeout_s=10)
        except Exception as exc:
            log.warning("close: %s", exc)

    async def _aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._pending.fail_all(rpc.RpcError("node closed"))
        if self._transport is not None:
            await self._transport.close()
        if self._policy is not None:
            self._net.zap.unregister(self._zap_domain)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # ---------------------------------------------------------------- public API
    def on(self, topic: str, handler: Handler, *, public: bool = False) -> None:
        """Register `handler(msg)` for a topic. It runs on the network thread, so it must be
        quick (hand work to another thread); it may be `async`. For a request its return
        value (a body, or `rpc.Reply(body, payload)`) is the answer. `public` lets peers
        outside the swarm (e.g. a status client) call it."""
        if not topic or topic.startswith("$"):
            raise ValueError(f"topic {topic!r} is reserved or empty")
        self._handlers[topic] = (handler, public)

    def on_peer_change(self, callback: Callable[[StatusChange], None]) -> None:
        """`callback(change)` runs on the network thread whenever a peer's status changes."""
        self._listeners.append(callback)

    def set_meta(self, **meta: Any) -> None:
        """Metadata (e.g. the protocol round) carried to every peer in heartbeats."""
        finite_meta({**self._meta, **meta})
        self._meta.update(meta)

    @property
    def peers(self) -> list[PeerView]:
        """Snapshot of the peer table (all statuses)."""
        return self._call(self._snapshot())

    def status_of(self, peer_id: str) -> PeerStatus | None:
        """One peer's status now, or None if the table has no entry (a plain read: callable
        from any thread, including a status-change callback on the network thread)."""
        info = self._table.get(peer_id)
        return None if info is None else info.status

    def live_peers(self) -> list[str]:
        return sorted(p.id for p in self.peers if p.status in (PeerStatus.ALIVE, PeerStatus.SUSPECT))

    async def _snapshot(self) -> list[PeerView]:
        now = time.monotonic()
        return [PeerView(p.peer_id, p.status, p.record.addresses, now - p.last_seen, dict(p.meta))
                for p in self._table.all()]

    def send(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = ()) -> concurrent.futures.Future[None]:
        """Queue a one-way message; the future resolves when ZeroMQ has taken it.
        Payload tensors are sent without copying: do not modify them until then."""
        return self._net.submit(self.asend(peer, topic, body, payload))

    async def asend(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = ()) -> None:
        if topic.startswith("$"):
            raise ValueError(f"topic {topic!r} is reserved")
        await self._asend_raw(peer, topic, body, payload)

    def request(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = (),
                timeout_s: float | None = None) -> Message:
        """Call a peer's handler and wait for its answer (raises RemoteError, RequestTimeout)."""
        return self._call(self.arequest(peer, topic, body, payload, timeout_s))

    async def arequest(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = (),
                       timeout_s: float | None = None) -> Message:
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        rid, fut = self._pending.open(peer)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        send = asyncio.ensure_future(self._asend_raw(peer, rpc.REQUEST_TOPIC, rpc.request_body(topic, rid, body),
                                                     payload, stats_topic=topic, timeout_s=timeout_s))
        try:
            # A send can wait on a peer that crashed (no connection to hand the message to);
            # if the peer is declared dead meanwhile, `fut` fails and the request ends now.
            await asyncio.wait({send, fut}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not send.done():
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    await send  # the reply beat the send's own bookkeeping
                    return fut.result()
                send.cancel()
                if fut.done():
                    return fut.result()  # raises the peer's failure
                raise asyncio.TimeoutError
            send.result()
            return await asyncio.wait_for(fut, max(deadline - loop.time(), 0.0))
        except SendError as exc:
            raise rpc.RpcError(f"request {topic!r} to {peer}: {exc}") from None
        except asyncio.TimeoutError:
            raise rpc.RequestTimeout(f"no reply from {peer} to {topic!r} within {timeout_s} s") from None
        finally:
            if not send.done():
                send.cancel()
            self._pending.drop(rid)

    def serve_blob(self, name: str, provider: Callable[[], bytes]) -> None:
        """Let peers fetch `provider()` (a snapshot taken when a transfer opens) by name."""
        if self._blobs is None:
            self._blobs = BlobServer(self)
        self._blobs.publish(name, provider)

    def fetch_blob(self, name: str, peers: Sequence[str] | None = None,
                   config: TransferConfig | None = None) -> tuple[str, bytes]:
        """Fetch a named blob in digest-checked chunks from the first peer that has it
        (default: every live peer in turn). Returns (peer, bytes); raises TransferError."""
        order = list(peers) if peers is not None else self.live_peers()
        return self._call(afetch_from_any(self, order, name, config))

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Start a coroutine on the network thread and return at once (for overlap)."""
        return self._net.submit(coro)

    def run(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Run a coroutine on the network thread (for code that composes async calls)."""
        return self._call(coro, timeout_s)

    def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        return self._net.run(coro, timeout_s)

    # ---------------------------------------------------------------- sending
    def _frames(self, topic: str, body: Any, payload: Sequence[Any]) -> list[Any]:
        return encode(topic, self.peer_id, next(self._seq), body, payload)

    async def _asend_raw(self, peer: str, topic: str, body: Any, payload: Sequence[Any] = (), *,
                         wait: bool = True, stats_topic: str | None = None,
                         timeout_s: float | None = None) -> None:
        info = self._table.get(peer)
        if info is None or info.status is PeerStatus.LEFT or self._transport is None:
            raise UnknownPeerError(f"unknown peer {peer!r}")
        frames = self._frames(topic, body, payload)
        # Emulated links shape protocol traffic only; membership keeps its own timing.
        if self.shaper is not None and not (stats_topic or topic).startswith("$"):
            if not await self.shaper.admit(peer, frame_nbytes(frames)):
                return  # lost on the emulated link
        try:
            await self._transport.send(peer, frames, wait=wait, timeout_s=timeout_s)
        except SendError:
            self.stats.count_send_failure()
            raise
        self.stats.count_sent(peer, stats_topic or topic, frame_nbytes(frames))

    # ---------------------------------------------------------------- membership
    def _connect(self, record: PeerRecord) -> None:
        assert self._transport is not None
        server_key = z85.encode(record.curve_key) if self.mode is SecurityMode.CURVE else None
        self._transport.connect(record.peer_id, record.addresses, server_key)

    def _hello_body(self, want_table: bool = True) -> list[Any]:
        assert self.record is not None
        return [self.record.to_wire(), self.swarm_config, want_table]

    async def _join_via(self, endpoint: str, curve_key: bytes | None) -> None:
        """Hello to one known address; learn its table and config. The peer we joined
        announces us to the others; any it missed find us in the beats pings carry."""
        assert self._transport is not None
        handle = f"bootstrap-{next(self._bootstraps)}"
        self._transport.connect(handle, [endpoint], z85.encode(curve_key) if curve_key else None)
        rid, fut = self._pending.open(handle)
        try:
            frames = self._frames(rpc.REQUEST_TOPIC, rpc.request_body(HELLO, rid, self._hello_body()), ())
            await self._transport.send(handle, frames)
            reply = await asyncio.wait_for(fut, self.config.join_timeout_s)
        except asyncio.TimeoutError:
            raise JoinError(f"no answer from {endpoint} within {self.config.join_timeout_s} s") from None
        except rpc.RemoteError as exc:
            if "SwarmConfigError" in str(exc):
                raise SwarmConfigError(str(exc)) from None
            raise JoinError(str(exc)) from None
        finally:
            self._pending.drop(rid)
            self._transport.disconnect(handle)
        responder = self._accept_hello_reply(reply.body)
        if curve_key is not None and responder.curve_key != curve_key:
            raise JoinError(f"{endpoint} answered with a record for a different key")

    def _accept_hello_reply(self, body: Any) -> PeerRecord:
        if not isinstance(body, dict) or not isinstance(body.get("peers"), list):
            raise JoinError("malformed hello reply")
        config = body.get("config")
        if config is not None:
            if not isinstance(config, dict):
                raise JoinError("malformed swarm config in hello reply")
            if self.swarm_config is not None:
                conflicts = config_conflicts(config, self.swarm_config)
                if conflicts:
                    raise SwarmConfigError("the swarm runs a config this node cannot run: " + "; ".join(conflicts))
            self.swarm_config = {**(self.swarm_config or {}), **config}
        responder = self._record(body.get("record"))
        self._learn(responder)
        for raw in body["peers"]:
            try:
                self._learn(self._record(raw))
            except WireError as exc:
                self.stats.count_rejected(exc.reason.value)
        return responder

    def _record(self, raw: Any) -> PeerRecord:
        """Parse a relayed record; check its signature unless we hold this exact record
        already (joins relay whole tables, so re-verifying would cost O(n^2) per join)."""
        record = PeerRecord.from_wire(raw, verify=False)
        known = self._table.get(record.peer_id)
        if known is None or known.record != record:
            record = record.verified()
        return record

    def _learn(self, record: PeerRecord) -> bool:
        """Add or refresh a verified record; connect to a new peer. True if it was news."""
        change = self._table.upsert(record, time.monotonic())
        known = self._table.get(record.peer_id)
        if known is None or known.record is not record:
            return False
        assert self._transport is not None
        if self._transport.has(record.peer_id):
            self._transport.disconnect(record.peer_id)  # addresses may have changed
        self._connect(record)
        if change is not None:
            self._notify(change)
        return True

    def _notify(self, change: StatusChange) -> None:
        log.info("%s: peer %s %s -> %s", self.peer_id, change.peer_id,
                 change.old.value if change.old else "new", change.new.value)
        if change.new in (PeerStatus.DEAD, PeerStatus.LEFT):
            self._pending.fail_peer(change.peer_id, rpc.RpcError(f"peer {change.peer_id} is {change.new.value}"))
        if change.new is PeerStatus.LEFT and self._transport is not None:
            self._transport.disconnect(change.peer_id)
        for cb in self._listeners:
            try:
                cb(change)
            except Exception:
                log.exception("peer-change listener failed")

    async def _heartbeat_loop(self) -> None:
        lv = self.config.liveness
        period = min(lv.heartbeat_interval_s, lv.suspect_timeout_s / 4)
        last_ping = last_dead_ping = 0.0
        wake_at: float | None = None
        while True:
            now = time.monotonic()
            # Woke a beat or more late: the loop (or the whole process) was stalled, and the
            # beats that came meanwhile may still be unread. Peers are not blamed for it.
            late = 0.0 if wake_at is None else now - wake_at
            if late > lv.heartbeat_interval_s:
                self.stats.count_stall(late)
                self._table.pardon(late, now)
                log.log(logging.INFO if late >= lv.suspect_timeout_s else logging.DEBUG,
                        "%s: liveness loop stalled %.2f s; not counted against peers", self.peer_id, late)
            if now - last_ping >= lv.heartbeat_interval_s:
                retry_dead = now - last_dead_ping >= lv.dead_timeout_s
                last_dead_ping = now if retry_dead else last_dead_ping
                last_ping = now
                self._beat += 1
                digest = self._digest()  # one per round, shared by its pings
                for peer_id, probe in self._ping_targets(now, retry_dead):
                    await self._ping(peer_id, probe, digest)
                horizon = now - lv.dead_timeout_s
                self._wanted = {k: t for k, t in self._wanted.items() if t > horizon}
                self._acked = {k: t for k, t in self._acked.items() if t > horizon}
            for change in self._table.sweep(now, self._relay_delay_s()):
                self._notify(change)
            for gone in self._table.forget(self.config.forget_after_s, now):
                if self._transport is not None:
                    self._transport.disconnect(gone)
            wake_at = time.monotonic() + period
            await asyncio.sleep(period)

    def _relay_delay_s(self) -> float:
        """How much later than a direct ping a relayed beat may arrive: one interval per
        gossip hop, about log(n) / log(fanout + 1) hops (0 while everyone is pinged).
        Failure detectors that gossip scale their timeouts with log(n) the same way."""
        lv = self.config.liveness
        live = len(self._table.live())
        if live <= lv.fanout:
            return 0.0
        return lv.heartbeat_interval_s * math.ceil(math.log(live + 1) / math.log(lv.fanout + 1))

    def _ping_targets(self, now: float, retry_dead: bool) -> list[tuple[str, bool]]:
        """Whom to ping this interval, and whether to ask for an answer (a probe).

        Up to `fanout` other peers, everyone is pinged. Beyond that, `fanout` random peers
        are, and each ping carries every beat we heard (see `_ping_body`), so a beat
        reaches the swarm in about log(n) / log(fanout) intervals at n * fanout pings per
        interval instead of n^2. Live peers we have not heard of for half the suspect
        timeout are probed (asked to ping us back at once), the longest silent first, a
        quarter of `fanout` per interval: an overloaded node whose view of everyone goes
        stale must not probe them all and add n answers to the load. Dead
        peers are retried once per dead timeout, in case they come back.
        """
        lv = self.config.liveness
        live, targets = [], []
        for p in self._table.all():
            if p.status is PeerStatus.DEAD:
                if retry_dead:
                    targets.append((p.peer_id, False))
            elif p.status is not PeerStatus.LEFT:
                live.append(p)
        if len(live) <= lv.fanout:
            return targets + [(p.peer_id, False) for p in live]
        chosen = self._rng.sample(live, lv.fanout)
        picked = {p.peer_id for p in chosen}
        stale = now - lv.suspect_timeout_s / 2
        probes = sorted((p for p in live if p.last_seen < stale and p.peer_id not in picked),
                        key=lambda p: p.last_seen)[: max(1, lv.fanout // 4)]
        return targets + [(p.peer_id, False) for p in chosen] + [(p.peer_id, True) for p in probes]

    def _digest(self) -> list[Any]:
        assert self.record is not None
        return [[self.peer_id, self.record.incarnation, self._beat, self._meta], *self._table.digest()]

    async def _ping(self, peer_id: str, probe: bool, digest: list[Any] | None = None) -> None:
        body = [digest or self._digest(), probe]
        assert self._transport is not None
        if not self._transport.is_open(peer_id):
            # A DEALER opened now takes a moment to connect: wait for it, bounded, off the
            # heartbeat loop's path.
            self._spawn(self._asend_raw(peer_id, PING, body, timeout_s=self.config.liveness.heartbeat_interval_s))
            return
        try:
            await self._asend_raw(peer_id, PING, body, wait=False)
        except (SendError, UnknownPeerError):
            pass  # the failure detector decides, not one dropped ping

    def _on_ping(self, sender: str, body: Any) -> None:
        """Apply the beats a ping carries; ask its sender for records we lack; answer a probe.

        Everything is checked before anything is applied; the new beats are usually few.
        """
        if not isinstance(body, list) or len(body) != 2 or not isinstance(body[1], bool):
            raise WireError(RejectReason.BAD_FIELD, "ping body must be [digest, probe]", field="body")
        now = time.monotonic()
        news, unknown = self._table.sort_digest(parse_digest(body[0]))
        news = [(peer_id, inc, beat, finite_meta(meta) if meta else meta) for peer_id, inc, beat, meta in news]
        for peer_id, incarnation, beat, meta in news:
            change = self._table.heartbeat(peer_id, incarnation, beat, meta, now)
            if change is not None:
                self._notify(change)
        interval = self.config.liveness.heartbeat_interval_s
        want = [peer_id for peer_id in dict.fromkeys(unknown)
                if now - self._wanted.get(peer_id, -math.inf) >= interval]
        if want:
            want = want[:MAX_WANT]
            self._wanted.update((peer_id, now) for peer_id in want)
            self._spawn(self._asend_raw(sender, WANT, want))
        if body[1] and now - self._acked.get(sender, -math.inf) >= self.config.liveness.heartbeat_interval_s / 2:
            self._acked[sender] = now
            self._spawn(self._ping(sender, False))

    def _on_want(self, sender: str, body: Any) -> None:
        if not isinstance(body, list) or len(body) > MAX_WANT or not all(isinstance(x, str) for x in body):
            raise WireError(RejectReason.BAD_FIELD, f"want body must be a list of at most {MAX_WANT} ids", field="body")
        records = []
        for peer_id in body:
            info = self._table.get(peer_id)
            if info is not None and info.status in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
                records.append(info.record.to_wire())
        if records:
            self._spawn(self._asend_raw(sender, ANNOUNCE, records))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s: background task failed: %s", self.peer_id, task.exception())

    # ---------------------------------------------------------------- receiving
    def _reject(self, reason: RejectReason, detail: str) -> None:
        self.stats.count_rejected(reason.value)
        log.debug("%s: rejected message (%s): %s", self.peer_id, reason.value, detail)

    async def _on_inbound(self, inbound: Inbound) -> None:
        if self._state == "closed":
            return
        nbytes = frame_nbytes(inbound.frames)
        try:
            msg = decode(inbound.frames, self.config.limits)
        except WireError as exc:
            self._reject(exc.reason, str(exc))
            return
        try:
            if inbound.route is None:
                self._on_reply(inbound, msg, nbytes)
            else:
                await self._on_router(inbound, msg, nbytes)
        except WireError as exc:
            self._reject(exc.reason, str(exc))

    def _on_reply(self, inbound: Inbound, msg: Message, nbytes: int) -> None:
        via = inbound.via_peer or ""
        if msg.topic != rpc.REPLY_TOPIC:
            raise WireError(RejectReason.BAD_FIELD, f"only replies are read on outbound sockets, got {msg.topic!r}", field="topic")
        rid, ok, body = rpc.parse_reply(msg)
        if not self._pending.expects(rid, via):
            raise WireError(RejectReason.BAD_FIELD, f"reply {rid} from {via} matches no request", field="body")
        if not via.startswith("bootstrap-") and msg.sender != via:
            raise WireError(RejectReason.SPOOFED_SENDER, f"reply claims {msg.sender}, came from {via}", field="sender")
        self.stats.count_received(via, rpc.REPLY_TOPIC, nbytes)
        self._table.seen(via, time.monotonic())
        self._pending.resolve(rid, msg, ok, body)

    def _authenticate(self, inbound: Inbound, msg: Message) -> PeerInfo | None:
        """The sender's table entry if the message provably comes from it; None for a
        sender outside the swarm (allowed only for public requests)."""
        info = self._table.get(msg.sender)
        if info is None or info.status is PeerStatus.LEFT:
            return None
        if self.mode is SecurityMode.CURVE and inbound.user_id != z85.encode(info.record.curve_key).decode():
            raise WireError(RejectReason.SPOOFED_SENDER, f"{msg.sender} does not own this connection", field="sender")
        return info

    async def _on_router(self, inbound: Inbound, msg: Message, nbytes: int) -> None:
        info = self._authenticate(inbound, msg)
        topic, rid, body = msg.topic, None, msg.body
        if topic == rpc.REQUEST_TOPIC:
            topic, rid, body = rpc.parse_request(msg)
        if info is None and not (rid is not None and self._is_public(topic)):
            raise WireError(RejectReason.UNKNOWN_PEER, f"{msg.sender} is not a member (topic {topic!r})", field="sender")
        self.stats.count_received(msg.sender, topic, nbytes)
        if info is not None:
            change = self._table.seen(msg.sender, time.monotonic())
            if change is not None:
                self._notify(change)
        if topic == PING:
            self._on_ping(msg.sender, body)
        elif topic == WANT:
            self._on_want(msg.sender, body)
        elif topic == LEAVE:
            self._on_leave(msg)
        elif topic == ANNOUNCE:
            self._on_announce(body)
        elif rid is not None:
            self._spawn(self._serve(inbound, msg, topic, rid, body))
        else:
            handler = self._handlers.get(topic)
            if handler is None:
                raise WireError(RejectReason.UNKNOWN_TOPIC, f"no handler for {topic!r}", field="topic")
            try:
                result = handler[0](msg)
                if inspect.isawaitable(result):
                    self._spawn(result)
            except Exception:
                self._reject(RejectReason.HANDLER_ERROR, f"handler for {topic!r} raised")
                log.exception("handler for %r raised", topic)

    def _is_public(self, topic: str) -> bool:
        if topic in PUBLIC_INTERNAL:
            return True
        entry = self._handlers.get(topic)
        return entry is not None and entry[1]

    async def _serve(self, inbound: Inbound, msg: Message, topic: str, rid: int, body: Any) -> None:
        ok, payload = True, ()
        try:
            if topic == HELLO:
                result: Any = self._on_hello(inbound, body)
            elif topic == STATUS:
                result = self.status()
            elif topic in self._handlers:
                result = self._handlers[topic][0](replace(msg, topic=topic, body=body))
                if inspect.isawaitable(result):
                    result = await result
            else:
                raise LookupError(f"no handler for {topic!r}")
            if isinstance(result, rpc.Reply):
                result, payload = result.body, result.payload
        except WireError as exc:
            self._reject(exc.reason, str(exc))
            ok, result = False, str(exc)
        except Exception as exc:
            if not isinstance(exc, (LookupError, SwarmConfigError)):
                self._reject(RejectReason.HANDLER_ERROR, f"{topic}: {exc}")
                log.warning("handler for %r failed: %s", topic, exc)
            ok, result = False, rpc.error_text(exc)
        assert self._transport is not None and inbound.route is not None
        frames = self._frames(rpc.REPLY_TOPIC, rpc.reply_body(rid, ok, result), payload)
        if self.shaper is not None and not topic.startswith("$"):
            if not await self.shaper.admit(msg.sender, frame_nbytes(frames)):
                return
        try:
            await self._transport.reply(inbound.route, frames)
            self.stats.count_sent(msg.sender, topic, frame_nbytes(frames))
        except SendError as exc:
            self.stats.count_send_failure()
            log.debug("reply to %s failed: %s", msg.sender, exc)

    def _on_hello(self, inbound: Inbound, body: Any) -> dict[str, Any]:
        if not isinstance(body, list) or len(body) != 3 or not isinstance(body[2], bool):
            raise WireError(RejectReason.BAD_FIELD, "hello body must be [record, config, want_table]", field="body")
        record = self._record(body[0])
        if self.mode is SecurityMode.CURVE and inbound.user_id != z85.encode(record.curve_key).decode():
            raise WireError(RejectReason.SPOOFED_SENDER, "hello record's key does not own this connection", field="record")
        theirs = body[1]
        if theirs is not None:
            if not isinstance(theirs, dict):
                raise WireError(RejectReason.BAD_FIELD, "swarm config must be a map", field="config")
            if self.swarm_config is None:
                self.swarm_config = dict(theirs)
            conflicts = config_conflicts(self.swarm_config, theirs)
            if conflicts:
                raise SwarmConfigError("the swarm runs a config this node cannot run: " + "; ".join(conflicts))
        # A joiner (it asks for the table) is announced to the others: one message each, no
        # answer, over the sockets this node holds open (every member's, in a swarm within
        # `max_open_dealers`). One we hold no socket to, one that joined elsewhere at the same
        # time, or an announce lost to a crash, is caught by the beats in ping digests: an
        # unknown id there is asked for (WANT). Announcing to every member would open and close
        # a socket per member on every join at a seed capped below the swarm's size (a
        # 256-node swarm capped at 32 sockets took 602 s to start, 177 s capped at 64).
        assert self._transport is not None
        if self._learn(record) and body[2]:
            for p in self._table.live():
                if p.peer_id != record.peer_id and self._transport.is_open(p.peer_id):
                    self._spawn(self._asend_raw(p.peer_id, ANNOUNCE, [record.to_wire()]))
        assert self.record is not None
        # A joiner's hello gets the whole table; one that asks for none (a re-announce) does not.
        peers = [p.record.to_wire() for p in self._table.live() if p.peer_id != record.peer_id] if body[2] else []
        return {"record": self.record.to_wire(), "config": self.swarm_config, "peers": peers}

    def _on_announce(self, body: Any) -> None:
        if not isinstance(body, list) or len(body) > 256:
            raise WireError(RejectReason.BAD_FIELD, "announce body must be a list of records", field="body")
        for raw in body:
            try:
                self._learn(self._record(raw))
            except WireError as exc:
                self._reject(exc.reason, str(exc))

    def _on_leave(self, msg: Message) -> None:
        body = msg.body
        if (not isinstance(body, list) or len(body) != 2 or not isinstance(body[0], int)
                or not isinstance(body[1], bytes)):
            raise WireError(RejectReason.BAD_FIELD, "leave body must be [incarnation, signature]", field="body")
        info = self._table.get(msg.sender)
        if info is None or not verify_signature(info.record.verify_key, leave_statement(msg.sender, body[0]), body[1]):
            raise WireError(RejectReason.BAD_SIGNATURE, f"leave for {msg.sender} is not signed by it", field="body")
        change = self._table.left(msg.sender, body[0])
        if change is not None:
            self._notify(change)

    def status(self) -> dict[str, Any]:
        """Peer table and counters as plain data (what `starling node status` prints)."""
        now = time.monotonic()
        return {
            "id": self.peer_id, "address": self.address, "security": self.mode.value,
            "config": self.swarm_config, "meta": dict(self._meta),
            "peers": [{**p.summary(), "last_seen_s": round(now - p.last_seen, 3)} for p in self._table.all()],
            "stats": self.stats.snapshot(),
            "zap_denied": self._policy.denied_count if self._policy else 0,
        }
