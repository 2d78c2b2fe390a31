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

The table itself (statuses) is `node.membership`, the signed records and beats it holds
`node.records`, and the failure detector's arithmetic `node.swim`. The messages that keep
the table current are cut along the concepts memberlist separates, each a file read
top-down, and `Swarm` is built of them:

- joining: the hello, the announce, and the one way a record gets into the table
  (`node.join`);
- failure detection: probes, indirect probes, suspicion, refutation, death (`node.detector`);
- dissemination: spreading typed updates (`node.updates`) and applying what is heard
  (`node.dissemination`);
- table sync: `$sync` pages and `$want` under each member's pull budget (`node.table_sync`);
- a client's relays, which belong with NAT (`node.relay_keeping`).

This module holds what ties them: the state they share, the topics they serve, status changes
and their listeners, and leaving.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

from starling.node import rpc
from starling.node.admission import AdmissionConfig
from starling.node.detector import MAX_PROBES_VIA, NO_SOCKET, FailureDetector
from starling.node.dispatch import Dispatcher
from starling.node.dissemination import GOSSIP, MAX_UNVERIFIED, PROBE, PROBE_VIA, Dissemination
from starling.node.identity import verify_signature
from starling.node.join import (
    HELLO,
    MAX_ANNOUNCE,
    MAX_REFUSED,
    JoinError,
    Joining,
    SwarmConfigError,
    config_conflict_text,
    config_conflicts,
)
from starling.node.local import LocalPeer
from starling.node.loop import AwakeDeadline
from starling.node.membership import PeerStatus, PeerTable, StatusChange, leave_statement
from starling.node.outbox import Outbox, Spawn
from starling.node.relay_keeping import RelayKeeper
from starling.node.ring import EPOCH_PERIODS, ProbeRing
from starling.node.stats import NodeStats
from starling.node.swim import URGENT, Awareness, Broadcasts, ClaimLedger, Liveness, ProbeOrder, Suspicion
from starling.node.table_sync import ANNOUNCE, MAX_WANTED, SYNC, WANT, TableSync
from starling.node.updates import SUSPECT, Claim, Leave, Record
from starling.node.wire import Message, RejectReason, WireError

__all__ = ["ANNOUNCE", "GOSSIP", "HELLO", "LEAVE", "MAX_ANNOUNCE", "MAX_PROBES_VIA", "MAX_REFUSED", "MAX_UNVERIFIED",
           "MAX_WANTED", "NO_SOCKET", "PROBE", "PROBE_VIA", "SYNC", "WANT", "JoinError", "Swarm", "SwarmConfigError",
           "config_conflict_text", "config_conflicts"]

log = logging.getLogger(__name__)

LEAVE = "$leave"
LEFT_REPLIES_GRACE_S = 0.5  # how long replies a peer sent before its goodbye may still come after it
LEFT_REPLIES_STRETCH = 8.0  # that grace is awake time, and ends by this many times it in wall time


class Swarm(Joining, FailureDetector, Dissemination):
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
        # past the socket cap: our fingers, and the ones whose DEALERs are pinned open
        self._ring = ProbeRing(local.peer_id, EPOCH_PERIODS * liveness.probe_interval_s, time.time)
        self._pinned: frozenset[str] = frozenset()
        self._suspicions: dict[str, Suspicion] = {}
        self.claims = ClaimLedger()  # whose claims the accused refuted: those not believed again
        self._probes_via = 0
        # a peer whose record we lack -> claims that wait for it: its own, unchecked, or its death
        self._unverified: dict[str, list[tuple[Claim, str]]] = {}
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
        self._burst_tokens = float(liveness.gossip_burst)  # gossip rounds it may send at once on news (`_gossip_now`)
        self._burst_at = time.monotonic()
        self._burst_pending = False
        self.bursts = 0  # gossip rounds sent at once on news, over the node's life
        self._probing: set[str] = set()  # peers whose dropped connection is being probed
        # peer id -> when the last two attempts to connect to it failed (bounded)
        self._refusals: dict[str, tuple[float, float]] = {}
        self._refused: dict[str, int] = {}  # peer id -> incarnation whose record the allowlist refused
        self._signed_beat: list[Any] | None = None  # our current beat, signed (see `_own_beat`)
        # `$sync` pages and `$want`, under each member's pull budget (`node.table_sync`)
        self.tables = TableSync(local, table, outbox, stats, spawn, self._rng, liveness=liveness, admission=admission,
                                learn=self.learn, record_from=self.record_from, reject=reject,
                                introduce=self._introduce, first_hand=self.first_hand,
                                helpers=self._helpers,
                                apply_ended=self._apply_ended, loop_lag=lambda since: self.loop_lag(since))

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

    def notify(self, change: StatusChange, *, refuted: bool = False) -> None:
        """A peer's status changed: fail what waits on a peer that is gone, tell listeners.

        A peer the swarm holds dead that talks to us again (a partition healed, a process
        that was stopped goes on) is alive to us, but not to the others until it refutes: it
        is told of the claim against it, unless the change came from its refutation."""
        if log.isEnabledFor(logging.INFO):  # every record a forming swarm learns passes here
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
        for claim, sender in waiting or ():  # claims it made, or its death, heard before we knew it
            try:
                self._apply_claim(claim, mine=False, sender=sender)
            except WireError as exc:
                self._reject(exc.reason, str(exc))
        if change.new is PeerStatus.DEAD:
            self.outbox.pending.fail_peer(change.peer_id, rpc.RpcError(f"peer {change.peer_id} is dead"))
        elif change.new is PeerStatus.LEFT:
            self._spawn(self._after_leave(change.peer_id))
        for cb in self.listeners:
            try:
                cb(change)
            except Exception:
                log.exception("peer-change listener failed")

    async def _after_leave(self, peer_id: str) -> None:
        """Fail what still waits on a peer that left, and drop its connection, a moment after its
        goodbye: the replies it sent just before it travel on another socket than the goodbye,
        and may come after it. The grace is counted in this loop's awake time: a reply that came
        while the loop stalled (a training thread holding the GIL, a loaded host) is read
        before the request it answers is failed."""
        grace = AwakeDeadline(LEFT_REPLIES_GRACE_S, tick_s=LEFT_REPLIES_GRACE_S / 10, stretch=LEFT_REPLIES_STRETCH)
        await grace.run_out()
        info = self.table.get(peer_id)
        if info is not None and info.status is not PeerStatus.LEFT:
            return  # back meanwhile, under a new incarnation
        self.outbox.pending.fail_peer(peer_id, rpc.RpcError(f"peer {peer_id} is left"))
        if self.outbox.transport is not None:
            self.outbox.transport.disconnect(peer_id)

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
        leave = Leave(msg.sender, body[0], body[1])
        change = self.table.left(msg.sender, body[0], proof=leave)
        if change is not None:
            self.notify(change)
            self._spread(leave, URGENT)  # for members it missed

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

