"""The Node facade: a peer of a Starling swarm.

    node = Node().start(listen="tcp://127.0.0.1:0", join=["tcp://10.0.0.5:7000#KEY"])
    node.on("grads", handler)            # handler(msg) runs on the network thread
    node.send(peer_id, "grads", body, payload=[tensor])
    reply = node.request(peer_id, "state", {"name": "model"}, timeout_s=5)
    node.leave()

A node is built from parts, each in its own module: the transport (sockets), the outbox
(the way out: framing, sends, answers, requests in flight, `node.outbox`), the dispatcher
(the way in, `node.dispatch`), requests and their typed errors (`node.rpc`), the membership
protocol (`node.swarm`) over the peer table (`node.membership`), joining from addresses
(`node.bootstrap`), relays between clients (`node.relay`), blob transfer (`node.transfer`),
and what the node reports of itself (`node.status`); `NodeConfig` (`node.config`) holds every
part's settings. This class builds the parts, hands each the shared pieces it needs (the
peer table, the outbox, what the node says about itself in `node.local`, a task spawner),
wires the few that call one another, and is the one surface training code uses. The parts
never reach back into it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from starling.node import rpc
from starling.node.address import PeerAddress, start_endpoints
from starling.node.bootstrap import Bootstrap, IncompatibleVersionError
from starling.node.config import NodeConfig
from starling.node.dispatch import Dispatcher, Handler
from starling.node.identity import Identity
from starling.node.local import LocalPeer
from starling.node.loop import NetworkThread, spawn_logged
from starling.node.membership import PeerRecord, PeerStatus, PeerTable, PeerView, StatusChange, finite_meta
from starling.node.outbox import LinkShaper, Outbox, UnknownPeerError
from starling.node.relay import Relay
from starling.node.security import SecurityMode, ZapPolicy, choose_security
from starling.node.stats import NodeStats
from starling.node.status import STATUS, NodeStatus
from starling.node.swarm import JoinError, Swarm, SwarmConfigError, config_conflicts
from starling.node.transfer import BlobServer, TransferConfig, afetch_patiently, fetch_candidates
from starling.node.transport import Transport
from starling.node.trust import ACCUSE, Trust
from starling.node.wire import Message

log = logging.getLogger(__name__)

# Importable from here as they always were: their homes are the modules they are imported from.
__all__ = ["STATUS", "IncompatibleVersionError", "JoinError", "LinkShaper", "Node", "NodeConfig", "NodeFault",
           "PeerView", "SwarmConfigError", "UnknownPeerError", "config_conflicts"]


class NodeFault(RuntimeError):
    """A node stopped on its own: one of its sockets failed (see `Node.fault`)."""


class Node:
    """A peer: its identity, sockets, peer table and handlers, behind one thread-safe API."""

    def __init__(self, identity: Identity | None = None, config: NodeConfig | None = None) -> None:
        self.config = config or NodeConfig()
        self.stats = NodeStats(max_peers=self.config.stats_peers)
        self.address = ""  # the join address others use: endpoint#KEY
        self._net = NetworkThread.get()
        # Kept by the node, not by its parts, so that rebuilding the parts keeps them.
        self._handlers: dict[str, tuple[Handler, bool]] = {}  # topic -> (handler, public), from `on`
        self._listeners: list[Callable[[StatusChange], None]] = []  # from `on_peer_change`
        self._info: dict[str, Any] = {}  # what `status` reports beside the table (`set_status_info`)
        self._zap_domain = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._blobs: BlobServer | None = None
        self._state = "new"
        self._fault: str | None = None
        self._closing: asyncio.Future[None] | None = None
        self._build(LocalPeer(identity or Identity.generate()))
        self._listeners.append(self._welcome)  # kept across rebuilds: reads the trust of the day

    def _build(self, local: LocalPeer) -> None:
        """Build the parts around `local` and wire them. Each part is given what it uses;
        the two loops among them (a relayed send goes out through the outbox, which routes
        a client's messages through the relay; the dispatcher tells the membership protocol
        of a status change it saw, and serves that protocol's topics) are closed here."""
        config, stats, spawn = self.config, self.stats, self._spawn
        self._local = local
        self._table = PeerTable(local.peer_id, config.liveness, config.table)
        self._agreed: dict[str, tuple[bytes, bytes]] = {}  # peer -> (its curve key, our X25519 secret)
        self._pending = rpc.PendingRequests()
        self._outbox = Outbox(local.peer_id, self._table, stats, self._pending,
                              request_timeout_s=config.request_timeout_s)
        self.trust = Trust(local, self._table, stats, self._outbox.send_quietly, spawn, witnesses=config.ban_witnesses)
        self._dispatch = Dispatcher(local, self._table, self._outbox, stats, spawn, limits=config.limits,
                                    admission=config.admission, load=self._net.load, closed=lambda: self.closed,
                                    handlers=self._handlers, banned=self.trust.is_banned)
        self._watching = True  # judging peers (probes, suspicions, dropped connections): `stop_watching`
        self._swarm = Swarm(local, self._table, self._outbox, stats, spawn, liveness=config.liveness,
                            admission=config.admission, forget_after_s=config.forget_after_s,
                            leave_timeout_s=config.leave_timeout_s, reject=self._dispatch.reject,
                            closed=lambda: self.closed or not self._watching, listeners=self._listeners)
        self._bootstrap = Bootstrap(local, self._table, self._outbox, self._swarm, stats, spawn,
                                    join_deadline_s=config.join_deadline_s, join_backoff_s=config.join_backoff_s,
                                    page_table=config.page_table_on_join,
                                    join_timeout_s=config.join_timeout_s, reach_timeout_s=config.reach_timeout_s,
                                    rejoin_interval_s=config.rejoin_interval_s)
        self._relay = Relay(local, self._table, self._outbox, spawn, config.relay, max_frames=config.limits.max_frames,
                            reject=self._dispatch.reject, deliver=self._dispatch.on_opened,
                            want_from=self._swarm.tables.want_from, home=self._swarm.relays.home)
        self._outbox.route_through_relays(self._relay.send)
        self._swarm.relays.kept = config.relay.max_relays + 1  # the ones `$via` names, and a spare
        self._swarm.loop_lag = self._net.lag.worst_since
        self._dispatch.notify = self._swarm.notify
        self._swarm.ticks[:] = [self._bootstrap.tick, self._relay.tick]
        self._status = NodeStatus(local, self._table, stats, self._outbox, self._swarm, self._relay, self.trust,
                                  config.admission, address=lambda: self.address, info=lambda: self._info)
        for part in (self._swarm, self._bootstrap, self._relay, self._status):
            part.register(self._dispatch)
        self._dispatch.on_internal_message(ACCUSE, self.trust.on_accusation)

    def _use_identity(self, identity: Identity) -> None:
        """`start(key=...)` replaces the identity the node was built with: every part that
        holds its keys or its id (the peer table's own id, the relay's sealing keys, the
        outbox's sender id) is built again around the new one, or relayed messages would be
        sealed and opened under the old keys. Nothing has run yet; what was set before
        `start` (handlers, listeners, the swarm config, meta, a link shaper) is kept."""
        shaper = self.shaper
        self._build(replace(self._local, identity=identity))
        self._outbox.shaper = shaper

    # What the node says about itself lives in `LocalPeer`, which its parts read.
    @property
    def identity(self) -> Identity:
        return self._local.identity

    @property
    def mode(self) -> SecurityMode:
        return self._local.mode

    @property
    def record(self) -> PeerRecord | None:
        return self._local.record

    @property
    def swarm_config(self) -> dict[str, Any] | None:
        return self._local.swarm_config

    @swarm_config.setter
    def swarm_config(self, config: dict[str, Any] | None) -> None:
        self._local.swarm_config = config

    @property
    def shaper(self) -> LinkShaper | None:
        """Emulates slow links on the way out (set by the simulator)."""
        return self._outbox.shaper

    @shaper.setter
    def shaper(self, shaper: LinkShaper | None) -> None:
        self._outbox.shaper = shaper

    # ---------------------------------------------------------------- lifecycle
    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    @property
    def fault(self) -> str | None:
        """Why this node stopped on its own (a socket failed), or None. A faulted node is
        closed: its peers see it go as a crash, and whoever trains on it must stop
        (`check_fault`)."""
        return self._fault

    def check_fault(self) -> None:
        """Raise NodeFault if a socket failure stopped this node."""
        if self._fault is not None:
            raise NodeFault(f"node {self.peer_id} stopped: {self._fault}")

    def _fail(self, reason: str) -> None:
        """A socket failed under this node (on the network thread): stop it, loudly, once."""
        if self._fault is not None:
            return
        self._fault = reason
        log.error("%s: %s; this node stops", self.peer_id, reason)
        if self._state != "closed":
            self._state = "closed"
            self._closing = asyncio.ensure_future(self._aclose())  # not in _tasks: it cancels those

    def start(
        self,
        listen: str | Sequence[str] | None = "tcp://127.0.0.1:0",
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

        `listen=None` (or no endpoint) makes a client: it binds nothing and is reached over
        the connections it opens. A node that listens on TCP off loopback and joins asks the
        peer it joins through to dial it back, and becomes a client if it cannot.
        """
        if self._state != "new":
            raise RuntimeError(f"node already {self._state}")
        if key is not None:
            self._use_identity(key if isinstance(key, Identity) else Identity.load(key))
        listens, adverts, joins = start_endpoints(listen, advertise, join)
        self._local.mode, allowed = choose_security(listens, adverts, joins, security, insecure, authorized_keys)
        if swarm_config is not None:
            self._local.swarm_config = dict(swarm_config)
        self._state = "starting"
        try:
            self._net.run(self._astart(listens, adverts, joins, allowed))
        except BaseException:
            self.close()
            raise
        self._state = "running"
        return self

    async def _astart(self, listens: list[str], adverts: list[str], joins: list[PeerAddress],
                      allowed: frozenset[bytes] | None) -> None:
        self._zap_domain = f"starling.{self.peer_id}.{id(self):x}"
        local = self._local
        transport = self._outbox.transport = Transport(
            self._net.context, mode=local.mode, curve_public_z85=local.identity.curve_public_z85,
            curve_secret_z85=local.identity.curve_secret_z85, zap_domain=self._zap_domain,
            config=self.config.transport, receiver=self._dispatch.on_inbound, busy=self._pending.waiting_on,
            dropped=self._swarm.connection_lost, refused=self._swarm.connection_refused, fatal=self._fail,
        )
        if local.mode is SecurityMode.CURVE:
            local.policy = ZapPolicy(allowed)
            self._net.zap.register(self._zap_domain, local.policy)
        endpoints: list[str] = []
        if listens:
            await transport.bind(listens, local.policy)
            endpoints = adverts or transport.advertised()
        if endpoints and joins:
            endpoints = await self._bootstrap.dialable(joins, endpoints)
        local.record = PeerRecord.create(local.identity, endpoints, time.time_ns(),
                                         relay=bool(endpoints) and self.config.offer_relay)
        key = self.identity.curve_public if self.mode is SecurityMode.CURVE else None
        self.address = str(PeerAddress(endpoints[0], key)) if endpoints else ""
        self._spawn(self._swarm.run())
        if joins:
            await self._bootstrap.join(joins)
            # a client is reachable through a relay only once the relay has had a message from
            # it on its own connection: one is on its way before the join returns
            await self._swarm.relays.greet()

    @property
    def reachable(self) -> bool:
        """Whether other peers can dial this node (False: a client, see `start`)."""
        return self.record is not None and self.record.reachable

    def is_reachable(self, peer_id: str) -> bool:
        """Whether `peer_id` (or this node) can be dialled, by its signed record; a peer not in
        the table counts as reachable (callable from any thread)."""
        if peer_id == self.peer_id:
            return self.reachable
        info = self._table.get(peer_id)
        return info is None or info.record.reachable

    def unreachable_peers(self) -> tuple[str, ...]:
        """The peers `is_reachable` says no to: those in the table whose signed record gives no
        address, and this node if it is a client. Kept by the table as records come and go, so
        asking costs nothing where every peer listens (callable from any thread: the copy is
        made without a switch of threads)."""
        unaddressed = tuple(self._table.unaddressed)
        return unaddressed if self.reachable else (*unaddressed, self.peer_id)

    def key_agreement(self, peer_id: str) -> bytes | None:
        """The X25519 secret this node shares with `peer_id`: its own curve key agreed with the
        curve key of the peer's signed record (32 bytes, the same at both ends). Derive a key
        per purpose from it (HKDF), never use it as it is. None for a peer not in the table
        (callable from any thread)."""
        info = self._table.get(peer_id)
        if info is None:
            return None
        key = info.record.curve_key
        cached = self._agreed.get(peer_id)
        if cached is None or cached[0] != key:
            cached = (key, self.identity.agree(key))
            if len(self._agreed) >= 4096:  # any thread may add: dropping the lot is safe, and rare
                self._agreed = {}
            self._agreed[peer_id] = cached
        return cached[1]

    def leave(self) -> None:
        """Announce a graceful leave to every live peer, then close."""
        if self._state == "running":
            try:
                self._net.run(self._swarm.leave(), timeout_s=self.config.leave_timeout_s + 5)
            except Exception as exc:
                log.warning("leave announcement incomplete: %r", exc)
        self.close()

    def stop_watching(self) -> None:
        """Stop judging peers: no more probes or suspicions, and a dropped connection is no
        longer a lead; the node still answers, sends and passes on what it hears. For the end of
        a simulation, before its nodes close one after another: nodes that still watch spend
        their last seconds probing each closed peer and declaring it dead. Not undone."""
        self._watching = False

    def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        try:
            self._net.run(self._aclose(), timeout_s=10)
        except concurrent.futures.TimeoutError:
            log.warning("%s: close did not finish within 10 s (a busy network thread)", self.peer_id)
        except Exception as exc:
            log.warning("%s: close: %r", self.peer_id, exc)

    async def _aclose(self) -> None:
        spawned = list(self._tasks)
        for task in spawned:
            task.cancel()
        if spawned:  # let them end while the loop runs, so that what they end with is read
            await asyncio.wait(spawned, timeout=1.0)
        self._pending.fail_all(rpc.RpcError("node closed"))
        if self._transport is not None:
            await self._transport.close()
        if self._local.policy is not None:
            self._net.zap.unregister(self._zap_domain)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # ---------------------------------------------------------------- public API
    def on(self, topic: str, handler: Handler, *, public: bool = False) -> None:
        """Register `handler(msg)` for a topic. It runs on the network thread, so it must be
        quick (hand work to another thread); it may be `async`. For a request its return
        value (a body, or `rpc.Reply(body, payload)`) is the answer; it refuses with
        `rpc.refusal(...)` as its answer, or by raising `rpc.RefusedError`. `public` lets
        peers outside the swarm (e.g. a status client) call it."""
        if not topic or topic.startswith("$"):
            raise ValueError(f"topic {topic!r} is reserved or empty")
        self._handlers[topic] = (handler, public)

    def on_peer_change(self, callback: Callable[[StatusChange], None]) -> None:
        """`callback(change)` runs on the network thread whenever a peer's status changes."""
        self._listeners.append(callback)

    def sync_peers(self, peer: str, collect: list[Any] | None = None) -> concurrent.futures.Future[int]:
        """Learn the peer table of `peer`, a member (anti-entropy: the peers that joined
        elsewhere, or through the same seed at the same time). The future gives how many
        records were news. `collect`: a list the records pulled are appended to, as they came
        on the wire, to hand to other nodes (`add_records`)."""
        return self._net.submit(self._swarm.tables.sync(peer, collect=collect))

    def add_records(self, records: list[Any], told_by: str | None = None) -> int:
        """Learn peer records in their wire form, handed to this node rather than sent to it
        (a simulator's worker shares one table pull among its peers this way). Each is checked
        as one relayed by `told_by` (allowlist, signature, table room); one that fails is
        counted as rejected and skipped. Returns how many were news."""
        return self._call(self._add_records(records, told_by))

    async def _add_records(self, records: list[Any], told_by: str | None) -> int:
        return self.add_records_here(records, told_by)

    def add_records_here(self, records: list[Any], told_by: str | None = None) -> int:
        """`add_records` for code already on the network thread (a simulator hands records to
        each of hundreds of nodes in one trip to the thread they share)."""
        return self._swarm.tables.add_records(records, told_by)

    def set_meta(self, **meta: Any) -> None:
        """Metadata (e.g. the protocol round) carried to every peer in this node's beats: signed
        into a new beat at most every `Liveness.meta_interval_s`, and spread with the membership
        updates (in a large swarm, best effort: see `node.swim`)."""
        # A new dict, swapped in whole: the network thread may be packing the old one into a ping.
        self._local.meta = finite_meta({**self._local.meta, **meta})

    def set_status_info(self, **info: Any) -> None:
        """Facts about this node that its `status` answer carries (and heartbeats do not):
        what whoever runs the node wants an operator to see, e.g. its replica's rank digests.
        Values must be plain data the wire can carry."""
        self._info = {**self._info, **info}  # swapped in whole: `status` may be reading the old one

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
        """The ids of peers alive or suspect, sorted (read on the network thread, without the
        full views `peers` builds: a simulator polls this for each of hundreds of nodes)."""
        return self._call(self._live_ids())

    async def _live_ids(self) -> list[str]:
        return self.live_peers_here()

    def live_peers_here(self) -> list[str]:
        """`live_peers` for code already on the network thread (a handler): a plain read.
        Banned peers are not in it: they own no shard and lead no round."""
        banned = self.trust.banned
        if not banned:
            return list(self._table.live_ids.in_order())
        return [i for i in self._table.live_ids.in_order() if i not in banned]

    def share_bans(self) -> None:
        """Any thread: send the accusations behind every ban to the live members again, at most
        once every `SHARE_EVERY_S` (`Trust.share_bans`): a round whose members began it apart may
        be one whose ban sets differ."""
        self.submit(self._share_bans())

    async def _share_bans(self) -> None:
        self.trust.share_bans(self.live_peers_here(), time.monotonic())

    def on_ban(self, callback: Callable[[str], None]) -> None:
        """`callback(peer_id)` on the network thread when this node bans a peer (`node.trust`)."""
        self.trust.on_ban(callback)

    async def _snapshot(self) -> list[PeerView]:
        return self._table.views(time.monotonic())

    def send(self, peer: str, topic: str, body: Any = None,
             payload: Sequence[Any] = ()) -> concurrent.futures.Future[None]:
        """Queue a one-way message; the future resolves when ZeroMQ has taken it.
        Payload tensors are sent without copying: do not modify them until then."""
        return self._net.submit(self.asend(peer, topic, body, payload))

    async def asend(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = ()) -> None:
        if topic.startswith("$"):
            raise ValueError(f"topic {topic!r} is reserved")
        await self._outbox.send(peer, topic, body, payload)

    def request(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = (),
                timeout_s: float | None = None) -> Message:
        """Call a peer's handler and wait for its answer. Raises RequestTimeout, or a
        RemoteError whose type and `.code` say why the peer failed it (see `node.rpc`)."""
        return self._call(self.arequest(peer, topic, body, payload, timeout_s))

    async def arequest(self, peer: str, topic: str, body: Any = None, payload: Sequence[Any] = (),
                       timeout_s: float | None = None) -> Message:
        return await self._outbox.request(peer, topic, body, payload, timeout_s)

    def serve_blob(self, name: str, provider: Callable[[], bytes]) -> None:
        """Let peers fetch `provider()` (a snapshot taken when a transfer opens) by name."""
        if self._blobs is None:
            self._blobs = BlobServer(self, self.config.transfer)
        self._blobs.publish(name, provider)

    def fetch_blob(self, name: str, peers: Sequence[str] | None = None,
                   config: TransferConfig | None = None, *, deadline_s: float = 0.0,
                   stop: threading.Event | None = None, max_bytes: int | None = None) -> tuple[str, bytes]:
        """Fetch a named blob in digest-checked chunks from the first peer that has it
        (default: every live peer, in random order so joiners spread over the swarm). Until
        `deadline_s` has passed, rounds over the peers (the live ones of that moment by
        default) repeat with backoff; setting `stop` ends that at once. Returns (peer,
        bytes); raises TransferError (also for a blob said to be over `max_bytes`)."""
        rng = random.Random()
        return self._call(afetch_patiently(self, fetch_candidates(self._table, peers, rng), name,
                                            config or self.config.transfer, deadline_s, rng, stop, max_bytes))

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Start a coroutine on the network thread and return at once (for overlap)."""
        return self._net.submit(coro)

    def run(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Run a coroutine on the network thread (for code that composes async calls)."""
        return self._call(coro, timeout_s)

    def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        return self._net.run(coro, timeout_s)

    def status(self, peers: bool = True) -> dict[str, Any]:
        """Peer table and counters as plain data (what `starling node status` prints); with
        `peers` False, all but the table (`node.status`)."""
        return self._status.status(peers)

    @property
    def zap_denied(self) -> int:
        """Connections the allowlist refused (in the ZAP handler, before any message)."""
        return self._status.zap_denied

    # ---------------------------------------------------------------- network thread
    @property
    def _transport(self) -> Transport | None:
        """The node's sockets, once started (the outbox holds them)."""
        return self._outbox.transport

    async def _asend_raw(self, peer: str, topic: str, body: Any, payload: Sequence[Any] = (), *,
                         wait: bool = True, stats_topic: str | None = None,
                         timeout_s: float | None = None, check_body: bool = True) -> None:
        """Send any message, "$" topics included (tests and benchmarks that play a hostile peer)."""
        await self._outbox.send(peer, topic, body, payload, wait=wait, stats_topic=stats_topic,
                                timeout_s=timeout_s, check_body=check_body)

    def _welcome(self, change: StatusChange) -> None:
        """A peer that joins (or comes back) hears of the swarm's bans (`Trust.welcome`)."""
        if change.new is PeerStatus.ALIVE and change.old in (None, PeerStatus.DEAD, PeerStatus.LEFT):
            self.trust.welcome(change.peer_id)

    def _notify(self, change: StatusChange) -> None:
        self._swarm.notify(change)

    def _spawn(self, coro: Any) -> asyncio.Future[Any]:
        return spawn_logged(coro, self._tasks, self.peer_id)
