"""The membership protocol: how a node joins a swarm, stays known in it, and leaves it.

Joining is a hello to one known peer (sent by `node.bootstrap`, which also tries addresses in
turn, checks that the joiner can be dialled, and rejoins a split swarm); the peer answers with
its table (records signed by their owners) and the swarm config, and the joiner connects to
every peer it learned of.
A node's swarm config comes from its own start or from that answer, never from a hello it
receives (a hello's config is only checked against its own).
Liveness is SWIM with Lifeguard's refinements (`node.swim` holds the arithmetic): each period
a node probes one member (`$probe`, a request), asks a few others to try (`$probe-via`) when it
gets no answer, and then claims the member suspect; changes (joins, beats, claims, leaves) ride
on probes and their answers, and claims and news (joins, a member's own new meta) on a small
gossip fan-out (`$gossip`), so a node's work per period is constant however large the swarm. A
joiner's record is news at its seed and at every member that learns it, from gossip or from the
seed's announce, so a join reaches the swarm in O(log n) periods. A beat naming a peer a node
has no record of is asked about (WANT); `$sync` pages are anti-entropy (`node.table_sync`). A graceful leave is a signed
broadcast. The connection monitor stays the fast path: a member whose connection to a peer
drops probes it at once and, unanswered, claims it dead.

Records, beats and leaves are signed by their owners and relayed verbatim, so a member can pass
on what another peer said about itself (its liveness, its relays in `$via`) but cannot make it
up; a suspicion or a death is signed by the member that claims it. A forged update is refused
and counted.

The table itself (records, statuses, the failure detector's arithmetic) is
`node.membership`; this module is the messages that keep it current.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

import msgpack
from zmq.utils import z85

from starling.node import rpc
from starling.node.admission import AdmissionConfig
from starling.node.dispatch import Dispatcher
from starling.node.hello import MAX_TURNED_AWAY, Hello, PeerVersions, mismatch_text
from starling.node.identity import verify_signature
from starling.node.local import LocalPeer
from starling.node.loop import AwakeDeadline
from starling.node.membership import (
    LIVE_SHIFT,
    PeerInfo,
    PeerRecord,
    PeerStatus,
    PeerTable,
    RefusedAgain,
    StatusChange,
    TableFull,
    leave_statement,
    parse_beat,
    sign_beat,
)
from starling.node.outbox import Outbox, Spawn, UnknownPeerError
from starling.node.relay_keeping import RelayKeeper
from starling.node.security import SecurityMode
from starling.node.stats import NodeStats
from starling.node.swim import (
    NEWS,
    ROUTINE,
    URGENT,
    Awareness,
    Broadcasts,
    ClaimLedger,
    Liveness,
    ProbeOrder,
    Suspicion,
)
from starling.node.table_sync import ANNOUNCE, MAX_WANTED, SYNC, WANT, TableSync
from starling.node.transport import Inbound, NoSocket, SendError
from starling.node.updates import DEAD, MAX_LIVE, SUSPECT, Beat, Claim, Leave, Record, Update, parse_updates
from starling.node.wire import ENVELOPE_BYTES, Message, RejectReason, WireError, frame_nbytes

log = logging.getLogger(__name__)

HELLO, LEAVE = "$hello", "$leave"
PROBE, PROBE_VIA, GOSSIP = "$probe", "$probe-via", "$gossip"
MAX_PROBES_VIA = 16  # indirect probes this node runs for others at once
MAX_UNVERIFIED = 64  # claimants whose claims wait for their record
NO_SOCKET: Any = object()  # `_ask`'s answer when this node had no socket to send on
MAX_ANNOUNCE = 256
MAX_REFUSED = 1024  # refused records remembered, so that beats naming them are not asked about


class JoinError(Exception):
    """Could not join the swarm through any of the given addresses."""


class SwarmConfigError(JoinError):
    """The swarm runs a config this node cannot run."""


def config_conflicts(swarm: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """Keys this node set that the swarm has set differently."""
    return [f"{k}: swarm has {swarm[k]!r}, this node has {v!r}" for k, v in mine.items()
            if k in swarm and swarm[k] != v]


def config_conflict_text(conflicts: list[str]) -> str:
    return "the swarm runs a config this node cannot run: " + "; ".join(conflicts)


class Swarm:
    """One node's side of the membership protocol, over its peer table: it sends through the
    node's outbox and connects and disconnects the outbox's transport. Lives on the network
    thread."""

    def __init__(self, local: LocalPeer, table: PeerTable, outbox: Outbox, stats: NodeStats, spawn: Spawn, *,
                 liveness: Liveness, admission: AdmissionConfig, forget_after_s: float, leave_timeout_s: float,
                 reject: Callable[[RejectReason, str], None], closed: Callable[[], bool],
                 listeners: list[Callable[[StatusChange], None]]) -> None:
        self.local = local
        self.table = table
        self.outbox = outbox
        self.stats = stats
        self.liveness = liveness
        self.admission = admission
        self.forget_after_s = forget_after_s
        self.leave_timeout_s = leave_timeout_s
        self.listeners = listeners  # the node's `on_peer_change`
        # run once per probe period: rejoining lost seeds
        # (`Bootstrap.tick`), a client naming its relays (`Relay.tick`); wired by the node
        self.ticks: list[Callable[[float], None]] = []
        self._spawn = spawn
        self._reject = reject
        self._closed = closed
        self._rng = random.Random()
        self._live = 0  # our liveness incarnation: raised to refute a claim that we are down
        self._meta_seq = 0  # our meta changes, the low bits of our beat counter
        self._beat_signed_at = -math.inf
        self.awareness = Awareness(liveness.awareness_max)
        self.broadcasts = Broadcasts()
        self._order = ProbeOrder(self._rng)
        self._suspicions: dict[str, Suspicion] = {}
        self.claims = ClaimLedger()  # whose claims the accused refuted: those not believed again
        self._probes_via = 0
        self._unverified: dict[str, list[tuple[Claim, str]]] = {}  # claimant -> its claims we could not check yet
        self._unknown_to: set[str] = set()  # peers that refused our probe as a stranger's
        self._reminded: dict[str, float] = {}  # peer id -> when we last sent it our beat against a stale claim
        self._rechecked: dict[str, float] = {}  # peer id -> when we last probed it, held dead, on a member's word
        # the longest this node's loop fell behind since a time (`LoopLag.worst_since`): wired by
        # the node; a probe unanswered while the loop was that late is no verdict
        self.loop_lag: Callable[[float], float] = lambda since: 0.0
        # a client's relays (`node.relay_keeping`), kept once a period
        self.relays = RelayKeeper(local, table, outbox, spawn, self._rng,
                                  touch=lambda r: self._send_quietly(r, GOSSIP, {"u": []}),
                                  probe=lambda r: self._ask(r, PROBE, {"u": self._take()},
                                                            self.awareness.scale(self.liveness.ack_timeout_s)))
        self._acked: dict[str, float] = {}  # peer id -> when we last probed it back on its asking
        self._probing: set[str] = set()  # peers whose dropped connection is being probed
        self._refused: dict[str, int] = {}  # peer id -> incarnation whose record the allowlist refused
        self._signed_beat: list[Any] | None = None  # our current beat, signed (see `_own_beat`)
        # `$sync` pages and `$want`, under each member's pull budget (`node.table_sync`)
        self.tables = TableSync(local, table, outbox, stats, spawn, self._rng, liveness=liveness, admission=admission,
                                learn=self.learn, record_from=self.record_from, reject=reject, helper=self._helper,
                                introduce=self._introduce, first_hand=self.first_hand)

    def register(self, dispatch: Dispatcher) -> None:
        """Serve the membership topics on the node's dispatcher."""
        dispatch.on_internal_request(HELLO, self.on_hello, public=True)  # a joiner is not a member yet
        # public: a member that learned of us before we learned of it (both joined a moment ago)
        # probes, or pulls our table, with its own record, which we learn as from a hello (see
        # `first_hand`)
        dispatch.on_internal_request(SYNC, self.tables.on_sync, public=True, plain_answers=True)
        dispatch.on_internal_request(PROBE, self.on_probe, public=True, plain_answers=True)
        dispatch.on_internal_request(PROBE_VIA, self.on_probe_via, plain_answers=True)
        for topic, handler in ((GOSSIP, self.on_gossip), (WANT, self.tables.on_want), (LEAVE, self.on_leave),
                               (ANNOUNCE, self.on_announce)):
            dispatch.on_internal_message(topic, handler)

    def on_hello(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """A joiner's hello (or a member's re-announce): check its versions, record and config,
        learn it, and answer with our record, the swarm config, our versions and (if asked) the
        first page of the table (`node.hello` has the messages).

        A hello whose wire versions do not meet ours is refused in one line naming both, and
        counted (`incompatible`); a joiner's hello that waited on a loop behind by more than
        `hello_busy_after_s` is turned away as busy (the dispatcher adds other members to try,
        `Bootstrap.redirect`), unless the join was turned away `MAX_TURNED_AWAY` times already
        or there is nobody else to try. Either way nothing about the joiner is kept.

        Whoever says hello is not a member yet, so the answer is at most
        `stranger_reply_factor` times the hello's own bytes: a table page that fits, and
        `next`, where the joiner's `$sync` pages go on from once it is a member."""
        hello, mine = Hello.from_wire(body), PeerVersions.local()
        if not hello.versions.meets(mine):
            line = mismatch_text(mine, hello.versions)
            self._reject(RejectReason.INCOMPATIBLE, line)
            # A 0.1.x joiner knows no `incompatible` code: a config conflict is what it stops on at once.
            raise (rpc.ConfigConflictError if hello.legacy else rpc.IncompatibleError)(line)
        if member is None and hello.want_table and hello.turned_away < MAX_TURNED_AWAY:
            behind = time.monotonic() - inbound.received_at
            if behind > self.admission.hello_busy_after_s and any(p.record.reachable for p in self.table.live()):
                self._reject(RejectReason.BUSY, f"hello: the loop is {behind:.1f} s behind")
                raise rpc.BusyError(f"this node's loop is {behind:.1f} s behind; try the members named")
        record = self.record_from(hello.record)
        if self.local.mode is SecurityMode.CURVE and inbound.user_id != z85.encode(record.curve_key).decode():
            raise WireError(RejectReason.SPOOFED_SENDER, "hello record's key does not own this connection",
                            field="record")
        # A hello's config is only checked against ours, never taken: a node takes its config
        # from its own start or from the peer it joined through. A node started without one
        # once adopted the first hello's, so any stranger could pick what it trained.
        if hello.config is not None:
            conflicts = config_conflicts(self.local.swarm_config or {}, hello.config)
            if conflicts:
                raise rpc.ConfigConflictError(config_conflict_text(conflicts))
        # A joiner (it asks for the table) is announced to the others: one message each, no
        # answer, over the sockets this node holds open (every member's, in a swarm within
        # `max_open_dealers`). One we hold no socket to, one that joined elsewhere at the same
        # time, or an announce lost to a crash, is caught by the beats in ping digests: an
        # unknown id there is asked for (WANT). Announcing to every member would open and close
        # a socket per member on every join at a seed capped below the swarm's size (a
        # 256-node swarm capped at 32 sockets took 602 s to start, 177 s capped at 64).
        transport = self.outbox.transport
        assert transport is not None and self.local.record is not None
        try:
            news = self.learn(record, origin=inbound.origin())
        except TableFull as exc:
            # full of peers from the joiner's own address: the members this busy answer names
            # may have room (`Bootstrap.join` tries them, then this node again, later)
            raise rpc.BusyError(f"{exc}; try the members named") from None
        if news and hello.want_table:
            self.spread_record(record)  # to the members no announce reaches, in O(log n) periods
            for p in self.table.live():
                if p.peer_id != record.peer_id and (transport.is_open(p.peer_id)
                                                    or (not p.record.reachable and transport.can_send(p.peer_id))):
                    self._spawn(self.outbox.send(p.peer_id, ANNOUNCE, [record.to_wire()]))
        reply: dict[str, Any] = {"record": self.local.record.to_wire(), "config": self.local.swarm_config,
                                 "peers": [], "next": None, "version": mine.to_wire()}
        if hello.want_table:  # a re-announce asks for no table
            budget = (self.admission.stranger_reply_factor * frame_nbytes(inbound.frames)
                      - len(msgpack.packb(reply, use_bin_type=True)) - ENVELOPE_BYTES)
            reply["peers"], reply["next"], _ = self.tables.page(None, budget, but=record.peer_id)
        return reply

    def on_announce(self, msg: Message) -> None:
        if not isinstance(msg.body, list) or len(msg.body) > MAX_ANNOUNCE:
            raise WireError(RejectReason.BAD_FIELD, "announce body must be a list of records", field="body")
        for raw in msg.body:
            try:
                # Passed on as news, as from gossip: the members a seed announces to are the
                # ones it holds sockets to, and so the ones its own gossip goes to; kept to
                # themselves, the epidemic would stop at its first hop. News has its own share of
                # every message, so a mass join's records do not hold back refutations.
                record = self.record_from(raw)
                if self.learn(record, told_by=msg.sender):
                    self.spread_record(record)
            except RefusedAgain:
                continue  # counted when it was first refused
            except WireError as exc:
                self._reject(exc.reason, str(exc))

    def record_from(self, raw: Any) -> PeerRecord:
        """Parse a relayed record; check the allowlist, then its signature unless we hold this
        exact record already (joins relay whole tables, so re-verifying would cost O(n^2) per
        join)."""
        record = PeerRecord.from_wire(raw, verify=False)
        known = self.table.get(record.peer_id)
        if known is not None and known.record is record:
            return record  # this very record passed every check when we took it
        self._check_inproc(record)
        self._check_allowed(record)
        if known is None or known.record != record:
            record = record.verified()
        return record

    def _check_inproc(self, record: PeerRecord) -> None:
        """An inproc endpoint names a socket inside one process, an ipc endpoint a unix socket on
        this machine: a record may carry one only to a node that itself listens on that
        transport (peers simulated in one process, or on one box). From anyone else it would
        make this node dial sockets of its own process, or any local unix socket."""
        transport = self.outbox.transport
        for scheme in ("inproc://", "ipc://"):
            if any(a.startswith(scheme) for a in record.addresses) and (
                    transport is None or scheme not in transport.bound_schemes):
                raise WireError(RejectReason.BAD_FIELD, f"record of {record.peer_id}: an {scheme[:-3]} address "
                                f"reaches only local peers, and this node listens on no {scheme[:-3]} endpoint",
                                field="record")

    def _check_allowed(self, record: PeerRecord) -> None:
        """Refuse (WireError NOT_ALLOWED) a record whose key is not on this node's allowlist.

        ZAP checks only who connects to us; records also arrive relayed (a join's table,
        announces, answers to WANT), and a record in the table is a peer we dial and accept
        messages from. Each refused (id, incarnation) is logged once and not asked for again
        when beats mention it."""
        policy = self.local.policy
        if policy is None or record.peer_id == self.local.peer_id or policy.admits(record.curve_key):
            return
        if self._refused.get(record.peer_id) == record.incarnation:
            raise RefusedAgain(RejectReason.NOT_ALLOWED, f"peer record for {record.peer_id}: its key is not on this "
                               "node's allowlist (refused before)", field="record")
        log.warning("%s: refused the record of %s: its key %s is not on the allowlist", self.local.peer_id,
                    record.peer_id, z85.encode(record.curve_key).decode())
        self._refused.pop(record.peer_id, None)
        if len(self._refused) >= MAX_REFUSED:
            del self._refused[next(iter(self._refused))]  # the oldest refusal
        self._refused[record.peer_id] = record.incarnation
        raise WireError(RejectReason.NOT_ALLOWED,
                        f"peer record for {record.peer_id}: its key is not on this node's allowlist", field="record")

    def learn(self, record: PeerRecord, told_by: str | None = None, origin: str | None = None) -> bool:
        """Add or refresh a verified record; connect to a new peer. True if it was news.
        `told_by` is the member that relayed it (None if the peer gave it itself, over a
        connection from `origin`, `Inbound.origin`); a table
        that is full, or full of that member's records, refuses it (TableFull, a WireError).
        The one way into the peer table: a record the allowlist refuses never gets there."""
        self._check_allowed(record)
        before = self.table.get(record.peer_id)
        held = None if before is None else before.record
        change = self.table.upsert(record, time.monotonic(), told_by, origin)
        transport = self.outbox.transport
        assert transport is not None
        if self.table.evicted:  # made room: their sockets go too
            for gone in self.table.evicted:
                transport.disconnect(gone)
                self.tables.forget(gone)
            self.table.evicted.clear()
        known = self.table.get(record.peer_id)
        if known is not None and held is record and told_by is not None and known.status is PeerStatus.DEAD:
            self._recheck(record.peer_id)  # a member holds it alive: see for ourselves
        if known is None or known.record is not record or held is record:
            return False  # refused, older, or the record we hold already (its socket stays)
        if transport.has(record.peer_id):
            transport.disconnect(record.peer_id)  # addresses may have changed
        server_key = z85.encode(record.curve_key) if self.local.mode is SecurityMode.CURVE else None
        try:
            transport.connect(record.peer_id, record.addresses, server_key)
        except SendError:
            if told_by is None:
                raise  # the peer itself is asking (its hello): it hears why
            # out of descriptors: the route is kept, and its socket opens when it is next needed
            log.debug("%s: no socket for %s yet (a relayed record)", self.local.peer_id, record.peer_id)
        if self.local.record is not None and not self.local.record.reachable and record.reachable:
            # so it learns our connection at once (and our record, if it has not yet)
            self._spawn(self._ask(record.peer_id, PROBE, {"u": self._introduce(record.peer_id)},
                                  self.awareness.scale(self.liveness.ack_timeout_s)))
        if change is not None:
            self.notify(change)
        return True

    def notify(self, change: StatusChange, *, refuted: bool = False) -> None:
        """A peer's status changed: fail what waits on a peer that is gone, tell listeners.

        A peer the swarm holds dead that talks to us again (a partition healed, a process
        that was stopped goes on) is alive to us, but not to the others until it refutes: it
        is told of the claim against it, unless the change came from its refutation."""
        log.info("%s: peer %s %s -> %s", self.local.peer_id, change.peer_id,
                 change.old.value if change.old else "new", change.new.value)
        if change.old is PeerStatus.DEAD and change.new is PeerStatus.ALIVE and not refuted:
            at = self.table.live_at(change.peer_id)
            if at is not None:
                claim = Claim.sign(self.local.identity, SUSPECT, change.peer_id, *at)
                self._spawn(self._send_quietly(change.peer_id, GOSSIP, {"u": [claim.to_wire()]}))
        if change.new in (PeerStatus.ALIVE, PeerStatus.SUSPECT) and change.old in (None, PeerStatus.DEAD):
            self._order.add(change.peer_id)  # probed this pass too
        waiting = self._unverified.pop(change.peer_id, None) if change.old is None else None
        for claim, sender in waiting or ():  # claims it made before we knew it
            try:
                self._apply_claim(claim, mine=False, sender=sender)
            except WireError as exc:
                self._reject(exc.reason, str(exc))
        if change.new in (PeerStatus.DEAD, PeerStatus.LEFT):
            self.outbox.pending.fail_peer(change.peer_id, rpc.RpcError(f"peer {change.peer_id} is {change.new.value}"))
        if change.new is PeerStatus.LEFT and self.outbox.transport is not None:
            self.outbox.transport.disconnect(change.peer_id)
        for cb in self.listeners:
            try:
                cb(change)
            except Exception:
                log.exception("peer-change listener failed")

    # ---------------------------------------------------------------- leaving
    async def leave(self) -> None:
        """Tell every live peer, in a statement signed by us, that we leave."""
        assert self.local.record is not None
        timeout_s = self.leave_timeout_s
        stmt = leave_statement(self.local.peer_id, self.local.record.incarnation)
        body = [self.local.record.incarnation, self.local.identity.sign(stmt)]
        async def tell(peer_id: str) -> bool:
            # Each send's outcome is read here: a task left holding a SendError as the node
            # closes (a thousand leaving peers) is logged by asyncio as never retrieved.
            try:
                await self.outbox.send(peer_id, LEAVE, body, timeout_s=timeout_s)
                return True
            except Exception as exc:  # a SendError, or an unknown peer as the table changes
                log.debug("%s: leave to %s not sent: %s", self.local.peer_id, peer_id, exc)
                return False

        sends = [asyncio.ensure_future(tell(p.peer_id)) for p in self.table.live()]
        if sends:
            try:
                done, pending = await asyncio.wait(sends, timeout=timeout_s)
            finally:
                for t in sends:
                    t.cancel()
            failed = len(pending) + sum(1 for t in done if t.cancelled() or not t.result())
            if failed:
                log.warning("%s: leave not delivered to %d of %d peers", self.local.peer_id, failed, len(sends))

    def on_leave(self, msg: Message) -> None:
        body = msg.body
        if (not isinstance(body, list) or len(body) != 2 or not isinstance(body[0], int)
                or not isinstance(body[1], bytes)):
            raise WireError(RejectReason.BAD_FIELD, "leave body must be [incarnation, signature]", field="body")
        info = self.table.get(msg.sender)
        if info is None or not verify_signature(info.record.verify_key, leave_statement(msg.sender, body[0]), body[1]):
            raise WireError(RejectReason.BAD_SIGNATURE, f"leave for {msg.sender} is not signed by it", field="body")
        change = self.table.left(msg.sender, body[0])
        if change is not None:
            self.notify(change)
            self._spread(Leave(msg.sender, body[0], body[1]), URGENT)  # for members it missed

    # ---------------------------------------------------------------- dropped connections
    def connection_lost(self, peer_id: str) -> None:
        """Our connection to a peer dropped (transport's socket monitor). A live peer becomes
        suspect at once, on this node's own evidence, and is probed; if nothing is heard from
        it within the probe timeout it is dead, and this node tells the swarm (a dead claim it
        signs), so a crash seen by the few members with a connection is known to all in the
        time the claim takes to spread. A peer whose connection merely blipped answers the
        probe once ZeroMQ has reconnected."""
        info = self.table.get(peer_id)
        if self._closed() or info is None or info.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
            return
        if peer_id in self._probing:
            return  # one probe per peer at a time: a peer that flaps cannot pile them up
        dropped_at = time.monotonic()
        log.info("%s: connection to %s dropped; probing it", self.local.peer_id, peer_id)
        change = self.table.suspect(peer_id)
        if change is not None:
            self.notify(change)
        self._probing.add(peer_id)
        self._spawn(self._probe_dropped(peer_id, dropped_at))

    async def _probe_dropped(self, peer_id: str, dropped_at: float) -> None:
        try:
            await self._probe_and_judge(peer_id, dropped_at)
        finally:
            self._probing.discard(peer_id)

    async def _probe_and_judge(self, peer_id: str, dropped_at: float) -> None:
        timeout_s = self.liveness.probe_timeout_s
        # Counted in awake time: a stall of this process is not the peer's silence.
        deadline = AwakeDeadline(timeout_s, tick_s=min(0.05, timeout_s / 4))
        try:  # sent once ZeroMQ has reconnected, if it can; the wait counts against the budget
            await deadline.wait(self.outbox.send(peer_id, GOSSIP, {"u": [], "ack": True}, timeout_s=timeout_s))
        except (SendError, UnknownPeerError, asyncio.TimeoutError):
            pass  # not reconnected: the silence decides
        while not deadline.expired():
            info = self.table.get(peer_id)
            if info is None or info.status is not PeerStatus.SUSPECT or info.last_seen > dropped_at:
                return  # heard from it (or it left, or a claim got there first)
            await deadline.sleep(min(0.05, max(deadline.left, 0.0)))
        at = self.table.live_at(peer_id)
        change = self.table.declare_dead(peer_id, dropped_at)
        if change is not None and at is not None:
            log.info("%s: %s did not answer a probe within %.2g s of its connection dropping",
                     self.local.peer_id, peer_id, timeout_s)
            self.notify(change)
            self._spread(Claim.sign(self.local.identity, DEAD, peer_id, *at), URGENT)

    # ---------------------------------------------------------------- failure detection (SWIM)
    async def run(self) -> None:
        """The node's liveness: probes, suspicions, gossip and anti-entropy, until the node
        closes. Anti-entropy has a loop of its own, not a turn in the probe loop's: a probe that
        goes to indirect probes takes seconds, and a forming swarm's pulls must keep to their
        period (while the table grows, one a period whatever the load; at rest they back off,
        scaled by awareness)."""
        self._spawn(self._gossip_loop())
        self._spawn(self.tables.run(lambda: self.awareness.scale(self.liveness.sync_interval(self.members()))))
        await self._probe_loop()

    def members(self) -> int:
        """The swarm's size as this node sees it (itself included)."""
        return len(self.table.live_ids) + 1

    async def _probe_loop(self) -> None:
        lv = self.liveness
        wake_at: float | None = None
        periods = 0
        while True:
            now = time.monotonic()
            # Woke a period or more late: the loop (or the whole process) was stalled, and the
            # answers and refutations that came meanwhile may still be unread. Peers are not
            # blamed for it: running suspicions wait that much longer.
            late = 0.0 if wake_at is None else now - wake_at
            if late > lv.probe_interval_s:
                self.stats.count_stall(late)  # running suspicions are pardoned by the gossip loop
                log.log(logging.INFO if late >= 3 * lv.probe_interval_s else logging.DEBUG,
                        "%s: liveness loop stalled %.2f s; not counted against peers", self.local.peer_id, late)
            self._sign_meta(now)
            target = self._next_target()
            if target is not None:
                await self._probe(target)
            self.relays.keep()
            now = time.monotonic()
            for tick in self.ticks:
                tick(now)
            periods += 1
            if periods % 16 == 0:  # walks the table: not every period
                self.tables.expire(now, self.forget_after_s)
                self._unverified.clear()  # claimants whose records never came: made up, or gone
                for gone in self.table.forget(self.forget_after_s, now):
                    self.tables.forget(gone)
                    if self.outbox.transport is not None:
                        self.outbox.transport.disconnect(gone)
            period = self.awareness.scale(lv.probe_interval_s)
            wait = max(0.0, period - (time.monotonic() - now))
            wake_at = time.monotonic() + wait
            await asyncio.sleep(wait)

    def _can_probe(self, info: PeerInfo) -> bool:
        transport = self.outbox.transport
        return info.record.reachable or (transport is not None and transport.can_send(info.peer_id))

    def _next_target(self) -> str | None:
        """The next member in probe order that we can reach (a client only a relay reaches is
        probed by its relays, and its death comes to us as their claim)."""
        live = self.table.live_ids
        for _ in range(min(len(live), 8)):
            peer_id = self._order.next(live)
            if peer_id is None:
                return None
            info = self.table.get(peer_id)
            if info is not None and self._can_probe(info):
                return peer_id
        return None

    async def _probe(self, target: str) -> None:
        """One SWIM probe: directly, then through `indirect_probes` others; suspect the target
        if nobody reached it and nothing was heard from it meanwhile."""
        lv, awareness = self.liveness, self.awareness
        started = time.monotonic()
        timeout = awareness.scale(lv.ack_timeout_s)
        direct = await self._ask(target, PROBE, {"u": self._introduce(target) + self._take()}, timeout)
        if direct is NO_SOCKET:
            return  # could not even send it: no verdict this period
        if direct is not None:
            awareness.apply(-1)
            return
        info = self.table.get(target)
        if info is None or info.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
            return
        helpers = [h for h in self._sample_members(lv.indirect_probes + 2, but=target)
                   if self._helper(h)][:lv.indirect_probes]
        answers = await asyncio.gather(*(self._ask(h, PROBE_VIA, {"t": target, "u": self._take()}, 2 * timeout)
                                         for h in helpers))
        if answers and all(a is NO_SOCKET for a in answers):
            return  # nobody could be asked: no verdict this period
        acked = any(isinstance(a, dict) and a.get("ack") is True for a in answers)
        nacks = sum(1 for a in answers if isinstance(a, dict) and a.get("ack") is False)
        # Lifeguard: a helper that sent no nack either is a sign this node is the slow one
        awareness.apply(len(helpers) - nacks - (len(helpers) if acked else 0))
        info = self.table.get(target)
        if acked or info is None or info.last_seen > started:
            return
        lag = self.loop_lag(started)
        if lag > timeout / 2:
            # our own loop fell behind by half an ack timeout or more while we waited: an answer
            # may be sitting unread, so the silence says nothing of the target (and we are slow)
            awareness.apply(1)
            log.info("%s: no answer from %s while this process ran %.2g s behind; no verdict",
                     self.local.peer_id, target, lag)
            return
        if helpers and not nacks:
            # nobody answered at all, helpers included: this node cannot tell its own slowness
            # (a starved process, a link down) from the target's, so it blames itself
            log.info("%s: no answer from %s nor from any of %d members asked about it; no verdict",
                     self.local.peer_id, target, len(helpers))
            return
        if info.status is PeerStatus.ALIVE or (info.status is PeerStatus.SUSPECT and info.claim_at < 0):
            log.info("%s: no answer from %s in %.2g s, nor through %d of %d members asked; suspect",
                     self.local.peer_id, target, time.monotonic() - started, nacks, len(helpers))
            self._suspect(target)

    def _sample_members(self, k: int, *, but: str | None = None, open_share: float = 0.0) -> list[str]:
        """Up to `k` random live members other than `but`. Past the socket cap, a send to one we
        hold no socket to opens one and closes another (or is refused while all are busy), so
        `open_share` of the draws (all of them once the process ran out of descriptors) pick
        from the members we hold a socket to; which those are changes with every probe, so the
        picks stay spread over the swarm."""
        transport, live = self.outbox.transport, self.table.live_ids
        if transport is not None and len(live) > transport.dealer_cap and (
                transport.starved or self._rng.random() < open_share):
            picked = [p for p in transport.sample_open(self._rng, k + 1) if p != but and p in live][:k]
            if picked:
                return picked
        return list(live.sample(self._rng, k, but=(but,) if but is not None else ()))

    def _introduce(self, peer_id: str) -> list[list[Any]]:
        """Our record, for a peer we have not heard from first-hand yet: it may not know us."""
        info, record = self.table.get(peer_id), self.local.record
        if info is None or record is None or (info.told_by is None and peer_id not in self._unknown_to):
            return []
        self._unknown_to.discard(peer_id)
        return [Record(record.to_wire()).to_wire()]

    def _helper(self, peer_id: str) -> bool:
        info = self.table.get(peer_id)
        return info is not None and info.status is PeerStatus.ALIVE and self._can_probe(info)

    async def _ask(self, peer_id: str, topic: str, body: Any, timeout_s: float) -> Any:
        """A request's answer body, with its updates applied; None if none came in time."""
        try:
            reply = await self.outbox.request(peer_id, topic, body, timeout_s=timeout_s)
        except rpc.BadRequestError:
            if topic == PROBE and len(self._unknown_to) < MAX_WANTED:
                self._unknown_to.add(peer_id)  # it may not know us (it lost our record): introduce us next time
            return {}  # it answered (a refusal): alive
        except rpc.RemoteError:
            return {}  # it answered (a refusal): alive
        except NoSocket:
            return NO_SOCKET  # our own shortage: nothing learned of the peer
        except (rpc.RpcError, SendError, UnknownPeerError, asyncio.TimeoutError, TimeoutError):
            return None
        try:
            self._apply(reply.sender, self._updates_of(reply.body))
        except WireError as exc:  # an answer we cannot read still proves its sender alive
            self._reject(exc.reason, f"{topic} answer from {peer_id}: {exc}")
            return {}
        return reply.body

    def on_probe(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """A member probes us: apply what it carries, answer with ours.

        A peer we hold no record of may probe too, if it carries its own record first (it
        learned of us from others before its record reached us): we learn it as from a hello
        (the record's key must own the connection) and answer as to a member. Anything else
        from a stranger is refused, and nothing of it applied."""
        updates = self._updates_of(body)
        if member is None:
            if not updates or not isinstance(updates[0], Record):
                raise WireError(RejectReason.UNKNOWN_PEER, "a probe from a peer we do not know must carry its record",
                                field="sender")
            member, updates = self.first_hand(inbound, updates[0].body, "probe"), updates[1:]
        self._apply(member, updates)
        return {"u": self._take()}

    def first_hand(self, inbound: Inbound, raw: Any, what: str) -> str:
        """Learn the record a peer we hold none of sent us of itself (with a probe or a table
        pull), as from a hello: checked, and its key must own the connection. Its id."""
        record = self.record_from(raw)
        if self.local.mode is SecurityMode.CURVE and inbound.user_id != z85.encode(record.curve_key).decode():
            raise WireError(RejectReason.SPOOFED_SENDER, f"{what} record's key does not own this connection",
                            field="record")
        self.learn(record, origin=inbound.origin())
        return record.peer_id

    async def on_probe_via(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """A member could not reach `t` and asks us to try: ack True if it answered us, False
        (Lifeguard's nack: we are alive and tried) if not. At most `MAX_PROBES_VIA` at once."""
        if not isinstance(body, dict) or not isinstance(body.get("t"), str):
            raise WireError(RejectReason.BAD_FIELD, "probe-via body must be {t: peer id, u: updates}", field="body")
        self._apply(member, self._updates_of(body))
        target = self.table.get(body["t"])
        if target is None or target.peer_id == member or target.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT) \
                or not self._can_probe(target) or self._probes_via >= MAX_PROBES_VIA:
            return {"ack": False, "u": self._take()}
        self._probes_via += 1
        try:
            answer = await self._ask(target.peer_id, PROBE, {"u": self._take()},
                                     self.awareness.scale(self.liveness.ack_timeout_s))
        finally:
            self._probes_via -= 1
        if answer is NO_SOCKET:
            raise rpc.BusyError("no socket to spare for the probe")  # an answer that says nothing of the target
        return {"ack": answer is not None, "u": self._take()}

    def on_gossip(self, msg: Message) -> None:
        """Updates pushed to us; `ack` asks for a probe of the sender at once (its connection to
        us dropped and it wants to know we are alive)."""
        body = msg.body
        self._apply(msg.sender, self._updates_of(body))
        if body.get("ack") is True:
            now = time.monotonic()
            if now - self._acked.get(msg.sender, -math.inf) >= self.liveness.probe_interval_s / 2:
                if len(self._acked) >= MAX_WANTED:
                    self._acked.clear()
                self._acked[msg.sender] = now
                self._spawn(self._ask(msg.sender, PROBE, {"u": self._take()},
                                      self.awareness.scale(self.liveness.ack_timeout_s)))

    @staticmethod
    def _updates_of(body: Any) -> list[Update]:
        if not isinstance(body, dict) or set(body) - {"u", "t", "ack"}:
            raise WireError(RejectReason.BAD_FIELD, "membership body must be a map {u: updates, ...}", field="body")
        return parse_updates(body.get("u", []))

    def _take(self, eager_only: bool = False) -> list[list[Any]]:
        lv = self.liveness
        return self.broadcasts.take(lv.piggyback_bytes, lv.retransmit_limit(self.members()), eager_only=eager_only)

    def _spread(self, update: Update, priority: int) -> None:
        """Queue an update to be sent on (each key holds the newest update about one thing):
        `URGENT` claims, refutations and leaves, `NEWS` joins and our own new meta, `ROUTINE`
        beats passed on (`node.swim.Broadcasts`)."""
        self.broadcasts.add(update.key, update.to_wire(), priority)

    async def _gossip_loop(self) -> None:
        """Urgent changes (claims, refutations, joins, leaves) to a few random members every
        gossip interval, on top of what rides on probes; and the suspicions' timeouts."""
        lv = self.liveness
        while True:
            wake_at = time.monotonic() + lv.gossip_interval_s
            await asyncio.sleep(lv.gossip_interval_s)
            now = time.monotonic()
            late = now - wake_at
            if late > lv.gossip_interval_s:
                # This process could not run: a refutation may be waiting unread. Suspicions are
                # pardoned before any of them may expire (this loop wakes first and most often).
                for suspicion in self._suspicions.values():
                    suspicion.pardon(late)
            self._expire_suspicions(now)
            self._sign_meta(now)  # here too: a probe can take several timeouts under load
            if not self.broadcasts.eager:
                continue
            # Past the socket cap, to members we hold a socket to: a send to anyone else opens a
            # socket and its monitor and closes another (the costliest thing a simulated box's
            # membership does), or is refused while all are busy. Which sockets are open changes
            # with every probe, which goes round the whole swarm, so the targets stay spread.
            targets = self._sample_members(lv.gossip_fanout + 2, open_share=1.0)
            sent = 0
            for peer_id in targets:
                if sent >= lv.gossip_fanout or not self._helper(peer_id):
                    continue
                updates = self._take(eager_only=True)
                if not updates:
                    break
                sent += 1
                self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": updates}))

    async def _send_quietly(self, peer_id: str, topic: str, body: Any) -> None:
        try:
            await self.outbox.send(peer_id, topic, body, timeout_s=self.liveness.probe_interval_s, check_body=False)
        except (SendError, UnknownPeerError, asyncio.TimeoutError):
            pass  # the failure detector decides, not one lost message

    # ---------------------------------------------------------------- suspicion, refutation, death
    def _suspect(self, peer_id: str) -> None:
        """Nobody reached `peer_id`: claim it suspect (signed), start its timer, tell the swarm
        and the peer itself (so it can refute at once)."""
        at = self.table.live_at(peer_id)
        if at is None:
            return
        claim = Claim.sign(self.local.identity, SUSPECT, peer_id, *at)
        self._apply_claim(claim, mine=True)
        self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [claim.to_wire()]}))

    def _expire_suspicions(self, now: float) -> None:
        for peer_id, suspicion in list(self._suspicions.items()):
            info = self.table.get(peer_id)
            if info is None or info.status is not PeerStatus.SUSPECT or info.claim_at < 0:
                del self._suspicions[peer_id]
                continue
            if now < suspicion.expires_at():
                continue
            at = (info.record.incarnation, info.claim_at)
            if info.last_seen > suspicion.start:
                # heard from it since: it is alive to us, only slow to refute (or its refutation
                # passed us by); remind it, and give it another timeout
                log.info("%s: %s outlived its suspicion here; asking it to refute", self.local.peer_id, peer_id)
                suspicion.start = now
                self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [
                    Claim.sign(self.local.identity, SUSPECT, peer_id, *at).to_wire()]}))
                continue
            if not suspicion.last_probe:
                # one probe of our own before the verdict: a suspect whose refutation has not
                # reached us (dissemination saturated by a burst of joins) answers it, and the
                # answer leads to its refutation (see `_remind`); a dead one costs one timeout more
                suspicion.last_probe = True
                timeout = self.awareness.scale(self.liveness.ack_timeout_s)
                suspicion.start = now - suspicion.timeout_s + 2 * timeout  # it now expires in 2 timeouts
                self._spawn(self._ask(peer_id, PROBE, {"u": self._introduce(peer_id)}, timeout))
                continue
            del self._suspicions[peer_id]
            claim = Claim.sign(self.local.identity, DEAD, peer_id, *at)
            self._apply_claim(claim, mine=True)
            self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [claim.to_wire()]}))  # if it lives, it refutes

    def _refute(self, live: int) -> None:
        """A member claims we are suspect or dead at liveness incarnation `live`: sign a beat
        of a higher one and tell the swarm. Having to refute is also a sign we were slow."""
        if live < self._live or live >= MAX_LIVE:
            return  # stale, or past what a beat counter holds (parse_updates refuses those)
        self._live = live + 1
        self.awareness.apply(1)
        log.info("%s: refuting a claim that it is down (liveness incarnation %d)", self.local.peer_id, self._live)
        self._spread(Beat(self._own_beat()), URGENT)

    def _remind(self, peer_id: str) -> None:
        """Send `peer_id` our current beat (it holds a claim we refuted already), at most once
        per half probe period per peer."""
        now = time.monotonic()
        if now - self._reminded.get(peer_id, -math.inf) < self.liveness.probe_interval_s / 2:
            return
        if len(self._reminded) >= MAX_WANTED:
            self._reminded.clear()
        self._reminded[peer_id] = now
        self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [Beat(self._own_beat()).to_wire()]}))

    def _recheck(self, peer_id: str) -> None:
        """Probe a peer we hold dead whose record a member just passed us as alive (a table
        pull, records handed on): if it answers it is alive to us again. A false death whose
        refutation passed us by otherwise lasts until that peer next talks to us, which in a
        swarm past the socket cap can be an hour of round-robin probes away. At most once per
        suspicion timeout per peer."""
        now = time.monotonic()
        if now - self._rechecked.get(peer_id, -math.inf) < self.liveness.suspicion_base_s:
            return
        if len(self._rechecked) >= MAX_WANTED:
            self._rechecked.clear()
        self._rechecked[peer_id] = now
        self._spawn(self._ask(peer_id, PROBE, {"u": self._introduce(peer_id)},
                              self.awareness.scale(self.liveness.ack_timeout_s)))

    def _sign_meta(self, now: float) -> None:
        """A changed meta becomes a new beat, at most once per `meta_interval_s`."""
        signed = self._signed_beat
        if signed is None or (signed[3] is not self.local.meta
                              and now - self._beat_signed_at >= self.liveness.meta_interval_s):
            self._meta_seq += 1
            # A new meta is news at its source: the member gossips it to a few others at once
            # (to the whole of a small swarm); they pass it on with their probes and answers.
            self._spread(Beat(self._own_beat()), NEWS if signed is not None else ROUTINE)

    def _own_beat(self) -> list[Any]:
        """Our beat, signed once per counter and meta (a node replaces its meta, never edits it)."""
        local, signed = self.local, self._signed_beat
        assert local.record is not None
        beat = (self._live << LIVE_SHIFT) | (self._meta_seq & (2**LIVE_SHIFT - 1))
        if signed is None or signed[1] != local.record.incarnation or signed[2] != beat or signed[3] is not local.meta:
            if signed is not None and signed[2] == beat:
                self._meta_seq += 1  # a new meta never reuses a signed counter
                beat = (self._live << LIVE_SHIFT) | (self._meta_seq & (2**LIVE_SHIFT - 1))
            signed = self._signed_beat = sign_beat(local.identity, local.record.incarnation, beat, local.meta)
            self._beat_signed_at = time.monotonic()
        return signed

    def spread_record(self, record: PeerRecord) -> None:
        """A peer joined through us: its record goes out with the next probes and gossip, as
        news, which every member that learns it from them passes on in turn."""
        self._spread(Record(record.to_wire()), NEWS)

    # ---------------------------------------------------------------- applying updates
    def _apply(self, sender: str | None, updates: list[Update]) -> None:
        for update in updates:
            try:
                self._apply_one(update, sender)
            except RefusedAgain:
                continue  # gossip passes a join on several times: its refusal was counted once
            except WireError as exc:  # a forged or malformed update: that one only
                self._reject(exc.reason, str(exc))

    def _apply_one(self, update: Update, sender: str | None) -> None:
        table, me = self.table, self.local.peer_id
        if isinstance(update, Beat):
            entry = parse_beat(update.body)
            if entry[0] == me:
                return
            news = table.is_news(entry)
            if news is None:
                if sender is not None and self._refused.get(entry[0]) != entry[1]:
                    self.tables.want_from(sender, entry[0])
                return
            if news:
                now = time.monotonic()
                change = table.heartbeat(entry, now)
                if change is not None:
                    self._suspicions.pop(entry[0], None)
                    if change.old in (PeerStatus.SUSPECT, PeerStatus.DEAD):
                        self.claims.refuted(entry[0], now)
                    self.notify(change, refuted=True)
                self._spread(Beat(entry), URGENT if change is not None else ROUTINE)
        elif isinstance(update, Record):
            if self.learn(self.record_from(update.body), told_by=sender):
                self._spread(update, NEWS)
        elif isinstance(update, Claim):
            self._apply_claim(update, mine=False, sender=sender)
        else:
            if update.peer_id == me:
                return
            info = table.get(update.peer_id)
            if info is None or info.status is PeerStatus.LEFT or update.incarnation < info.record.incarnation:
                return
            if not verify_signature(info.record.verify_key, leave_statement(update.peer_id, update.incarnation),
                                    update.signature):
                raise WireError(RejectReason.BAD_SIGNATURE, f"leave of {update.peer_id} is not signed by it",
                                field="body")
            change = table.left(update.peer_id, update.incarnation)
            if change is not None:
                self.notify(change)
                self._spread(update, URGENT)

    def _apply_claim(self, claim: Claim, *, mine: bool, sender: str | None = None) -> None:
        """A signed suspect or dead claim [kind, peer, incarnation, live, claimant, signature]:
        one this node just made (`mine`), or one heard, checked against its claimant's key
        (ours too: a member cannot pass a claim off as this node's own)."""
        kind, peer_id, incarnation, live, claimant = claim.kind, claim.peer_id, claim.incarnation, claim.live, \
            claim.claimant
        me, table = self.local.peer_id, self.table
        if not mine:
            key = self.local.identity.verify_key if claimant == me else None
            if key is None:
                author = table.get(claimant)
                if author is None:
                    # a claimant we do not know yet (it joined a moment ago): ask for its record,
                    # and check the claim when it comes, above all one about us that we must refute
                    waiting = self._unverified.get(claimant)
                    if sender is not None and (waiting is not None or len(self._unverified) < MAX_UNVERIFIED):
                        waiting = self._unverified.setdefault(claimant, [])
                        if len(waiting) < 8:
                            waiting.append((claim, sender))
                        self.tables.want_from(sender, claimant)
                    return
                key = author.record.verify_key
            if not claim.is_signed(key):
                raise WireError(RejectReason.BAD_SIGNATURE, f"{kind!r} claim about {peer_id} is not signed by "
                                f"{claimant}", field="body")
        if peer_id == me:
            assert self.local.record is not None
            if incarnation == self.local.record.incarnation:
                if live < self._live and sender is not None:
                    self._remind(sender)  # refuted already; the refutation has not reached the sender
                else:
                    self._refute(live)
            return
        if not mine and not self.claims.believed(claimant, peer_id, time.monotonic()):
            return  # its claims about this peer were refuted too often (`ClaimLedger`)
        status = PeerStatus.SUSPECT if kind == SUSPECT else PeerStatus.DEAD
        held, change = table.claim(status, peer_id, incarnation, live)
        if held:
            self.claims.held(peer_id, claimant)
            if status is PeerStatus.SUSPECT:
                low, high = self.liveness.suspicion_bounds(self.members())
                expected = max(0, min(self.liveness.confirmations, self.members() - 2))
                self._suspicions[peer_id] = Suspicion((incarnation, live), claimant, time.monotonic(), low, high,
                                                      expected)
            else:
                self._suspicions.pop(peer_id, None)
                log.info("%s: %s declared %s dead", self.local.peer_id, claimant, peer_id)
            if change is not None:
                self.notify(change)
            self._spread(claim, URGENT)
            if not mine and self._rng.random() < self.liveness.gossip_fanout / self.members():
                # Gossip to the accused: a member that holds it suspect or dead no longer sends it
                # anything, so if the claimant's one message to it was lost it would never refute.
                # Each holder sends it the claim with probability fanout / n: about `fanout` copies.
                self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [claim.to_wire()]}))
        elif status is PeerStatus.SUSPECT:
            suspicion = self._suspicions.get(peer_id)
            if suspicion is not None and suspicion.at == (incarnation, live) and suspicion.confirm(claimant):
                self._spread(claim, URGENT)
