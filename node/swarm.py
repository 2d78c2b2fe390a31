"""The membership protocol: how a node joins a swarm, stays known in it, and leaves it.

Joining is a hello to one known peer (sent by `node.bootstrap`, which also tries addresses in
turn, checks that the joiner can be dialled, and rejoins a split swarm); the peer answers with
its table (records signed by their owners) and the swarm config, and the joiner connects to
every peer it learned of.
A node's swarm config comes from its own start or from that answer, never from a hello it
receives (a hello's config is only checked against its own).
Liveness comes from heartbeats: every interval a node pings a few random peers (all of them
in a small swarm) with the beat counters it heard from everyone, so the swarm's cost is
n * fanout pings, not n^2; an id in a digest that a node has no record of is asked for
(WANT), which also finds peers that joined elsewhere at the same time. A graceful leave is
a signed broadcast.

Records, beats and heartbeat metadata are signed by their owners and relayed verbatim, so a
member can pass on what another peer said about itself (its liveness, its relays in `$via`)
but cannot make it up: a forged beat is refused and counted.

The table itself (records, statuses, the failure detector's arithmetic) is
`node.membership`; this module is the messages that keep it current.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

import msgpack
from zmq.utils import z85

from starling.node import rpc
from starling.node.admission import AdmissionConfig, TokenBucket
from starling.node.dispatch import Dispatcher
from starling.node.hello import MAX_TURNED_AWAY, Hello, PeerVersions, mismatch_text
from starling.node.identity import verify_signature
from starling.node.local import LocalPeer
from starling.node.loop import AwakeDeadline
from starling.node.membership import (
    Liveness,
    PeerRecord,
    PeerStatus,
    PeerTable,
    StatusChange,
    leave_statement,
    parse_digest,
    sign_beat,
)
from starling.node.outbox import Outbox, Spawn, UnknownPeerError
from starling.node.security import SecurityMode
from starling.node.stats import NodeStats
from starling.node.transport import Inbound, SendError
from starling.node.wire import ENVELOPE_BYTES, Message, RejectReason, WireError, frame_nbytes

log = logging.getLogger(__name__)

HELLO, ANNOUNCE, PING, LEAVE = "$hello", "$announce", "$ping", "$leave"
WANT = "$want"  # asks a member for records it gossiped that we lack; answered with ANNOUNCE
# A member asks another for its whole table (anti-entropy, as memberlist's push-pull): peers
# that joined through one seed at the same time learn each other in one round trip, not over
# the many heartbeat intervals their digests take to spread in a big swarm.
SYNC = "$sync"
MAX_WANT = 256
MAX_WANTED = 4096  # ids asked for and not yet forgotten (see `want_from`)
MAX_ANNOUNCE = 256
MAX_REFUSED = 1024  # refused records remembered, so that beats naming them are not asked about
MAX_SYNC_PAGES = 4096  # pages one `sync` reads before it stops (a table past that is not honest)
SYNC_BUSY_RETRIES = 5  # pulls a peer turned down over its budget, waited out and sent again


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
        # run once per wake of the heartbeat loop, after the sweep: rejoining lost seeds
        # (`Bootstrap.tick`), a client naming its relays (`Relay.tick`); wired by the node
        self.ticks: list[Callable[[float], None]] = []
        self._spawn = spawn
        self._reject = reject
        self._closed = closed
        self._beat = 0  # our heartbeat counter, relayed by others as proof we are alive
        self._rng = random.Random()
        self._wanted: dict[str, float] = {}  # peer id -> when we last asked for its record
        self._acked: dict[str, float] = {}  # peer id -> when we last answered its probe
        self._probing: set[str] = set()  # peers whose dropped connection is being probed
        self._refused: dict[str, int] = {}  # peer id -> incarnation whose record the allowlist refused
        self._signed_beat: list[Any] | None = None  # our current beat, signed (see `_digest`)
        self._pulls: dict[str, TokenBucket] = {}  # member id -> the bytes its table pulls may still take

    def register(self, dispatch: Dispatcher) -> None:
        """Serve the membership topics on the node's dispatcher."""
        dispatch.on_internal_request(HELLO, self.on_hello, public=True)  # a joiner is not a member yet
        dispatch.on_internal_request(SYNC, self.on_sync)
        for topic, handler in ((PING, self.on_ping), (WANT, self.on_want), (LEAVE, self.on_leave),
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
        if self.learn(record) and hello.want_table:
            for p in self.table.live():
                if p.peer_id != record.peer_id and (transport.is_open(p.peer_id)
                                                    or (not p.record.reachable and transport.can_send(p.peer_id))):
                    self._spawn(self.outbox.send(p.peer_id, ANNOUNCE, [record.to_wire()]))
        reply: dict[str, Any] = {"record": self.local.record.to_wire(), "config": self.local.swarm_config,
                                 "peers": [], "next": None, "version": mine.to_wire()}
        if hello.want_table:  # a re-announce asks for no table
            budget = (self.admission.stranger_reply_factor * frame_nbytes(inbound.frames)
                      - len(msgpack.packb(reply, use_bin_type=True)) - ENVELOPE_BYTES)
            reply["peers"], reply["next"], _ = self._page(None, budget, but=record.peer_id)
        return reply

    def on_sync(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """A member asks for a page of our table: the records of peers alive to us, in id order
        from after `after`, at most `table_page_bytes` of them, and `next` to go on from (None
        at the end). Each member's pulls share `member_pull_bytes_per_s`; past it the pull is
        turned down (busy) and may be sent again later."""
        if body is None:
            after = None
        elif isinstance(body, dict) and set(body) == {"after"} and isinstance(body["after"], str) \
                and len(body["after"]) <= 64:
            after = body["after"]
        else:
            raise WireError(RejectReason.BAD_FIELD, "sync body must be empty or {after: peer id}", field="body")
        assert member is not None  # `$sync` is answered to members only
        admission, now = self.admission, time.monotonic()
        bucket = self._pull_bucket(member, now)
        if bucket.available(now) < -admission.table_page_bytes:
            raise rpc.Unanswered(f"{member} pulls on past its budget's refusals")
        budget = min(admission.table_page_bytes, bucket.available(now) - ENVELOPE_BYTES)
        peers, following, nbytes = self._page(after, budget)
        if not peers and (following is not None or budget < 0):
            # the refusal is charged too, so pulling faster only puts the next page further off;
            # a member deep in that debt is not answered at all
            bucket.charge(ENVELOPE_BYTES, now)
            raise rpc.BusyError(f"table pulls over {admission.member_pull_bytes_per_s:.0f} bytes/s; try again later")
        bucket.charge(nbytes + ENVELOPE_BYTES, now)  # an empty page costs its envelope too
        return {"peers": peers, "next": following}

    def _pull_bucket(self, member: str, now: float) -> TokenBucket:
        bucket = self._pulls.get(member)
        if bucket is None:
            admission = self.admission
            bucket = self._pulls[member] = TokenBucket(admission.member_pull_bytes_per_s,
                                                       admission.member_pull_burst_bytes, now)
        return bucket

    def _page(self, after: str | None, budget: float, but: str | None = None) -> tuple[list[Any], str | None, int]:
        """Records of live peers with ids above `after` (all, for None), in id order, that fit in
        `budget` bytes; the id to go on from (None if none are left); and their bytes."""
        live = sorted((p for p in self.table.live() if p.peer_id != but and (after is None or p.peer_id > after)),
                      key=lambda p: p.peer_id)
        page: list[Any] = []
        nbytes = 0
        for p in live:
            size = _record_bytes(p.record)
            if nbytes + size > budget:
                return page, (page[-1][0] if page else after or ""), nbytes
            page.append(p.record.to_wire())
            nbytes += size
        return page, None, nbytes

    async def sync(self, peer_id: str, after: str | None = None) -> int:
        """Learn the table of `peer_id` (a member), page by page from after `after`: the number
        of records that were news. A page turned down as over our pull budget is waited for."""
        learned, busy = 0, 0
        for _ in range(MAX_SYNC_PAGES):
            try:
                reply = await self.outbox.request(peer_id, SYNC, None if after is None else {"after": after})
            except rpc.BusyError:
                busy += 1
                if busy > SYNC_BUSY_RETRIES:
                    raise
                await asyncio.sleep(1.0)
                continue
            body = reply.body
            if not isinstance(body, dict) or not isinstance(body.get("peers"), list):
                raise WireError(RejectReason.BAD_FIELD, "malformed sync reply", field="body")
            for raw in body["peers"]:
                try:
                    learned += self.learn(self.record_from(raw), told_by=peer_id)
                except WireError as exc:
                    self.stats.count_rejected(exc.reason.value)
            following = body.get("next")
            if following is None:
                return learned
            if not isinstance(following, str) or (after is not None and following <= after):
                raise WireError(RejectReason.BAD_FIELD, "sync reply: next must come after the page asked for",
                                field="body")
            after = following
        return learned

    def on_announce(self, msg: Message) -> None:
        if not isinstance(msg.body, list) or len(msg.body) > MAX_ANNOUNCE:
            raise WireError(RejectReason.BAD_FIELD, "announce body must be a list of records", field="body")
        for raw in msg.body:
            try:
                self.learn(self.record_from(raw), told_by=msg.sender)
            except WireError as exc:
                self._reject(exc.reason, str(exc))

    def record_from(self, raw: Any) -> PeerRecord:
        """Parse a relayed record; check the allowlist, then its signature unless we hold this
        exact record already (joins relay whole tables, so re-verifying would cost O(n^2) per
        join)."""
        record = PeerRecord.from_wire(raw, verify=False)
        self._check_inproc(record)
        self._check_allowed(record)
        known = self.table.get(record.peer_id)
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
                    transport is None or not any(b.startswith(scheme) for b in transport.bound)):
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
        if self._refused.get(record.peer_id) != record.incarnation:
            log.warning("%s: refused the record of %s: its key %s is not on the allowlist", self.local.peer_id,
                        record.peer_id, z85.encode(record.curve_key).decode())
            self._refused.pop(record.peer_id, None)
            if len(self._refused) >= MAX_REFUSED:
                del self._refused[next(iter(self._refused))]  # the oldest refusal
            self._refused[record.peer_id] = record.incarnation
        raise WireError(RejectReason.NOT_ALLOWED,
                        f"peer record for {record.peer_id}: its key is not on this node's allowlist", field="record")

    def learn(self, record: PeerRecord, told_by: str | None = None) -> bool:
        """Add or refresh a verified record; connect to a new peer. True if it was news.
        `told_by` is the member that relayed it (None if the peer gave it itself); a table
        that is full, or full of that member's records, refuses it (TableFull, a WireError).
        The one way into the peer table: a record the allowlist refuses never gets there."""
        self._check_allowed(record)
        before = self.table.get(record.peer_id)
        held = None if before is None else before.record
        change = self.table.upsert(record, time.monotonic(), told_by)
        transport = self.outbox.transport
        assert transport is not None
        if self.table.evicted:  # made room: their sockets go too
            for gone in self.table.evicted:
                transport.disconnect(gone)
                self._pulls.pop(gone, None)
            self.table.evicted.clear()
        known = self.table.get(record.peer_id)
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
            self._spawn(self._ping(record.peer_id, False))  # so it learns our connection at once
        if change is not None:
            self.notify(change)
        return True

    def notify(self, change: StatusChange) -> None:
        """A peer's status changed: fail what waits on a peer that is gone, tell listeners."""
        log.info("%s: peer %s %s -> %s", self.local.peer_id, change.peer_id,
                 change.old.value if change.old else "new", change.new.value)
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
        sends = [asyncio.ensure_future(self.outbox.send(p.peer_id, LEAVE, body, timeout_s=timeout_s))
                 for p in self.table.live()]
        if sends:
            done, pending = await asyncio.wait(sends, timeout=timeout_s)
            for t in pending:
                t.cancel()
                # a send that times out as it is cancelled ends with its SendError: read it
                # here, not logged as never retrieved (a thousand leaving peers logged dozens)
                t.add_done_callback(lambda t: t.cancelled() or t.exception())
            failed = len(pending) + sum(1 for t in done if t.exception() is not None)
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

    # ---------------------------------------------------------------- dropped connections
    def connection_lost(self, peer_id: str) -> None:
        """Our connection to a peer dropped (transport's socket monitor). A live peer becomes
        suspect at once and is probed; if nothing is heard from it within the probe timeout
        it is dead, and whatever waits on it (a round, a request) stops waiting. A peer whose
        connection merely blipped answers the probe once ZeroMQ has reconnected."""
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
            await deadline.wait(self.outbox.send(peer_id, PING, [self._digest(), True], timeout_s=timeout_s))
        except (SendError, UnknownPeerError, asyncio.TimeoutError):
            pass  # not reconnected: the silence decides
        while not deadline.expired():
            info = self.table.get(peer_id)
            if info is None or info.status is not PeerStatus.SUSPECT or info.last_seen > dropped_at:
                return  # heard from it (or it left, or the sweep got there first)
            await deadline.sleep(min(0.05, max(deadline.left, 0.0)))
        change = self.table.declare_dead(peer_id, dropped_at)
        if change is not None:
            log.info("%s: %s did not answer a probe within %.2g s of its connection dropping",
                     self.local.peer_id, peer_id, timeout_s)
            self.notify(change)

    # ---------------------------------------------------------------- heartbeats
    async def heartbeat_loop(self) -> None:
        table = self.table
        lv = self.liveness
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
                table.pardon(late, now)
                log.log(logging.INFO if late >= lv.suspect_timeout_s else logging.DEBUG,
                        "%s: liveness loop stalled %.2f s; not counted against peers", self.local.peer_id, late)
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
            for change in table.sweep(now, self._relay_delay_s()):
                self.notify(change)
            for tick in self.ticks:
                tick(now)
            for gone in table.forget(self.forget_after_s, now):
                self._pulls.pop(gone, None)
                if self.outbox.transport is not None:
                    self.outbox.transport.disconnect(gone)
            wake_at = time.monotonic() + period
            await asyncio.sleep(period)

    def _relay_delay_s(self) -> float:
        """How much later than a direct ping a relayed beat may arrive: one interval per
        gossip hop, about log(n) / log(fanout + 1) hops (0 while everyone is pinged).
        Failure detectors that gossip scale their timeouts with log(n) the same way."""
        lv = self.liveness
        live = len(self.table.live())
        if live <= lv.fanout:
            return 0.0
        return lv.heartbeat_interval_s * math.ceil(math.log(live + 1) / math.log(lv.fanout + 1))

    def _ping_targets(self, now: float, retry_dead: bool) -> list[tuple[str, bool]]:
        """Whom to ping this interval, and whether to ask for an answer (a probe).

        Up to `fanout` other peers, everyone is pinged. Beyond that, `fanout` random peers
        are, and each ping carries every beat we heard (see `_digest`), so a beat reaches
        the swarm in about log(n) / log(fanout) intervals at n * fanout pings per interval
        instead of n^2. Live peers we have not heard of for half the suspect timeout are
        probed (asked to ping us back at once), the longest silent first, a quarter of
        `fanout` per interval: an overloaded node whose view of everyone goes stale must not
        probe them all and add n answers to the load. Dead peers are retried once per dead
        timeout, in case they come back.
        """
        lv = self.liveness
        live, targets = [], []
        transport = self.outbox.transport
        for p in self.table.all():
            if not p.record.reachable and (transport is None or not transport.can_send(p.peer_id)):
                continue  # a client only a relay reaches: its beats come to us in others' digests
            if p.status is PeerStatus.DEAD:
                if retry_dead:
                    targets.append((p.peer_id, False))
            elif p.status is not PeerStatus.LEFT:
                live.append(p)
        if len(live) <= lv.fanout:
            return self._probe_unheard_relays(targets + [(p.peer_id, False) for p in live])
        # Past the socket cap, a ping to a peer whose DEALER is closed opens one and closes
        # another: most intervals ping peers we hold a socket to (every beat we heard rides
        # along, so whom we ping matters little to how fast beats spread), one in four any peer.
        pool = live
        if transport is not None and len(live) > transport.dealer_cap and self._rng.random() < 0.75:
            held = [p for p in live if transport.is_open(p.peer_id)]
            pool = held if len(held) >= lv.fanout else live
        chosen = self._rng.sample(pool, lv.fanout)
        picked = {p.peer_id for p in chosen}
        stale = now - lv.suspect_timeout_s / 2
        probes = sorted((p for p in live if p.last_seen < stale and p.peer_id not in picked),
                        key=lambda p: p.last_seen)[: max(1, lv.fanout // 4)]
        targets += [(p.peer_id, False) for p in chosen] + [(p.peer_id, True) for p in probes]
        record = self.local.record
        if record is not None and not record.reachable:
            # a client's relays must hear from it often: each message it sends them refreshes
            # the connection they send to it on (`Transport.attach`)
            picked |= {p.peer_id for p in probes}
            targets += [(p.peer_id, False) for p in live if p.record.relay and p.peer_id not in picked]
        return self._probe_unheard_relays(targets)

    def _probe_unheard_relays(self, targets: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        """A client's pings to relays that have not answered down its connection yet ask for an
        answer at once: the answer is what lets it name them in `$via` (`Relay.via`)."""
        record, transport = self.local.record, self.outbox.transport
        if record is None or record.reachable or transport is None:
            return targets
        table = self.table
        out = []
        for peer_id, probe in targets:
            info = table.get(peer_id)
            relay = info is not None and info.record.relay and info.record.reachable
            out.append((peer_id, probe or (relay and not transport.heard(peer_id))))
        return out

    def _digest(self) -> list[Any]:
        return [self._own_beat(), *self.table.digest()]

    def _own_beat(self) -> list[Any]:
        """Our beat, signed once per counter and meta (a node replaces its meta, never edits it)."""
        local, signed = self.local, self._signed_beat
        assert local.record is not None
        if signed is None or signed[1] != local.record.incarnation or signed[2] != self._beat \
                or signed[3] is not local.meta:
            signed = self._signed_beat = sign_beat(local.identity, local.record.incarnation, self._beat, local.meta)
        return signed

    async def _ping(self, peer_id: str, probe: bool, digest: list[Any] | None = None) -> None:
        body = [digest or self._digest(), probe]
        assert self.outbox.transport is not None
        if not self.outbox.transport.is_open(peer_id):
            # A DEALER opened now takes a moment to connect: wait for it, bounded, off the
            # heartbeat loop's path.
            self._spawn(self.outbox.send(peer_id, PING, body, timeout_s=self.liveness.heartbeat_interval_s,
                                         check_body=False))
            return
        try:
            # check_body=False: a digest is ids, ints and the meta `set_meta` checked, built here;
            # re-reading each ping's n entries to check them was a third of a big swarm's CPU
            await self.outbox.send(peer_id, PING, body, wait=False, check_body=False)
        except (SendError, UnknownPeerError):
            pass  # the failure detector decides, not one dropped ping

    def on_ping(self, msg: Message) -> None:
        """Apply the beats a ping carries; ask its sender for records we lack; answer a probe.

        The digest's shape is checked before anything is applied; each new beat's signature
        and meta as it is applied (the new beats are usually few), and a forged one is
        refused on its own.
        """
        body = msg.body
        if not isinstance(body, list) or len(body) != 2 or not isinstance(body[1], bool):
            raise WireError(RejectReason.BAD_FIELD, "ping body must be [digest, probe]", field="body")
        now = time.monotonic()
        news, unknown = self.table.sort_digest(parse_digest(body[0]))
        if unknown and self._refused:  # not the ones the allowlist refused (in that incarnation)
            refused = {e[0]: e[1] for e in body[0] if self._refused.get(e[0]) == e[1]}
            unknown = [peer_id for peer_id in unknown if peer_id not in refused]
        for entry in news:
            try:
                change = self.table.heartbeat(entry, now)
            except WireError as exc:  # a forged or malformed beat: that entry only
                self._reject(exc.reason, str(exc))
                continue
            if change is not None:
                self.notify(change)
        interval = self.liveness.heartbeat_interval_s
        want = [peer_id for peer_id in dict.fromkeys(unknown)
                if now - self._wanted.get(peer_id, -math.inf) >= interval]
        want = want[:max(0, min(MAX_WANT, MAX_WANTED - len(self._wanted)))]  # made-up ids must not grow it
        if want:
            self._wanted.update((peer_id, now) for peer_id in want)
            self._spawn(self.outbox.send(msg.sender, WANT, want))
        if body[1] and now - self._acked.get(msg.sender, -math.inf) >= interval / 2:
            self._acked[msg.sender] = now
            self._spawn(self._ping(msg.sender, False))

    def want_from(self, peer_id: str, unknown: str) -> None:
        """Ask `peer_id` for the record of `unknown`, at most once an interval per id, and with a
        bounded memory of ids asked for (names a peer makes up must not grow it)."""
        now = time.monotonic()
        if len(self._wanted) >= MAX_WANTED or now - self._wanted.get(unknown, -math.inf) < \
                self.liveness.heartbeat_interval_s:
            return
        self._wanted[unknown] = now
        self._spawn(self.outbox.send(peer_id, WANT, [unknown]))

    def on_want(self, msg: Message) -> None:
        """Send a member the records it asked for, out of the same budget as its `$sync` pulls:
        what does not fit now is left out (it asks again when beats name those ids)."""
        body = msg.body
        if not isinstance(body, list) or len(body) > MAX_WANT or not all(isinstance(x, str) for x in body):
            raise WireError(RejectReason.BAD_FIELD, f"want body must be a list of at most {MAX_WANT} ids",
                            field="body")
        now = time.monotonic()
        bucket = self._pull_bucket(msg.sender, now)
        records = []
        for peer_id in dict.fromkeys(body):
            info = self.table.get(peer_id)
            if info is not None and info.status in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
                if not bucket.spend(_record_bytes(info.record), now):
                    self._reject(RejectReason.RATE_LIMITED, f"want from {msg.sender}: over its budget")
                    break
                records.append(info.record.to_wire())
        if records:
            bucket.charge(ENVELOPE_BYTES, now)
            self._spawn(self.outbox.send(msg.sender, ANNOUNCE, records))


@functools.lru_cache(maxsize=16384)
def _record_bytes(record: PeerRecord) -> int:
    """Bytes of a record on the wire (records are immutable and shared: sized once each)."""
    return len(msgpack.packb(record.to_wire(), use_bin_type=True))
