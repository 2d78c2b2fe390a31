"""Joining: the hello a joiner sends and the member that answers it, the announce that tells the
others, and the one way a record gets into the peer table (`learn`): checked against the
allowlist and the transports this node listens on, its signature verified, its key owning the
connection when the peer gives it itself.

A hello's answer is at most `stranger_reply_factor` times the hello's bytes: the first page of
the table and where the joiner's `$sync` pages go on. A hello the table has no room for is
turned away busy, naming other members to try (`node.bootstrap` tries them). Part of the
membership protocol, `node.swarm`, whose `Swarm` this is a part of.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import msgpack

from starling.node import rpc
from starling.node.dissemination import PROBE
from starling.node.hello import MAX_TURNED_AWAY, Hello, PeerVersions, mismatch_text
from starling.node.membership import (
    PeerRecord,
    PeerStatus,
    RefusedAgain,
    TableFull,
)
from starling.node.security import SecurityMode
from starling.node.swim import (
    NEWS,
)
from starling.node.table_sync import ANNOUNCE
from starling.node.transport import Inbound, SendError
from starling.node.updates import Record
from starling.node.wire import ENVELOPE_BYTES, Message, RejectReason, WireError, frame_nbytes

log = logging.getLogger(__name__)

HELLO = "$hello"
MAX_ANNOUNCE = 256
_LOCAL_SCHEMES = ("inproc://", "ipc://")  # endpoints only peers on this machine can reach
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


class Joining:
    """The hello, the announce and the records they carry (a part of `Swarm`)."""

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
        if self.local.mode is SecurityMode.CURVE and inbound.user_id != record.curve_z85:
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
        for address in record.addresses:  # every record of a formation passes here: no generators
            if address.startswith(_LOCAL_SCHEMES):
                scheme = address[: address.index("//") + 2]
                if transport is None or scheme not in transport.bound_schemes:
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
                    record.peer_id, record.curve_z85)
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
        if self.table.restored(record.peer_id, before):
            # a member pages on a peer we forgot was dead or left (it missed the news): the entry
            # is back, dead, and we see for ourselves, as below
            assert known is not None
            if known.status is PeerStatus.DEAD:
                self._connect_quietly(record)
                self._recheck(record.peer_id)
            return False
        if known is not None and held is record and told_by is not None and known.status is PeerStatus.DEAD:
            self._recheck(record.peer_id)  # a member holds it alive: see for ourselves
        if known is None or known.record is not record or held is record:
            return False  # refused, older, or the record we hold already (its socket stays)
        if transport.has(record.peer_id):
            transport.disconnect(record.peer_id)  # addresses may have changed
        if told_by is None:
            self._connect(record)  # the peer itself is asking (its hello): it hears why it fails
        else:
            self._connect_quietly(record)
        if self.local.record is not None and not self.local.record.reachable and record.reachable:
            # so it learns our connection at once (and our record, if it has not yet)
            self._spawn(self._ask(record.peer_id, PROBE, {"u": self._introduce(record.peer_id)},
                                  self.awareness.scale(self.liveness.ack_timeout_s)))
        if change is not None:
            self.notify(change)
        return True

    def _connect(self, record: PeerRecord) -> None:
        transport = self.outbox.transport
        assert transport is not None
        server_key = record.curve_z85.encode() if self.local.mode is SecurityMode.CURVE else None
        transport.connect(record.peer_id, record.addresses, server_key)

    def _connect_quietly(self, record: PeerRecord) -> None:
        try:
            self._connect(record)
        except SendError:
            # out of descriptors: the route is kept, and its socket opens when it is next needed
            log.debug("%s: no socket for %s yet (a relayed record)", self.local.peer_id, record.peer_id)

    def first_hand(self, inbound: Inbound, raw: Any, what: str) -> str:
        """Learn the record a peer we hold none of sent us of itself (with a probe or a table
        pull), as from a hello: checked, and its key must own the connection. Its id."""
        record = self.record_from(raw)
        if self.local.mode is SecurityMode.CURVE and inbound.user_id != record.curve_z85:
            raise WireError(RejectReason.SPOOFED_SENDER, f"{what} record's key does not own this connection",
                            field="record")
        self.learn(record, origin=inbound.origin())
        return record.peer_id

    def spread_record(self, record: PeerRecord) -> None:
        """A peer joined through us: its record goes out with the next probes and gossip, as
        news, which every member that learns it from them passes on in turn."""
        self._spread(Record(record.wire), NEWS)
