"""The peer table: the peers a node knows, their statuses, and status changes.

It holds each peer's signed record and the last of its signed beats (`node.records`). A
suspicion or a death is a claim signed by the member that makes it, about one liveness
incarnation; a beat of a higher one refutes it. A graceful leave removes the leaver at once.

A dead or departed peer's entry keeps the signed update that ended it (its `proof`), and once
the entry is forgotten, a tombstone keeps that proof for a while longer: a member that missed
the death still holds the peer alive and pages it on, and a relayed record of a tombstoned
incarnation brings the dead entry back, not a live one. Table pulls hand the proofs to members
that still hold such a peer alive (`node.table_sync`).

Everything here is plain data and arithmetic on an injected clock, so it is tested
without sockets.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from starling.node.have import Have, prefix_code
from starling.node.records import (
    LIVE_SHIFT,
    MAX_ADDRESS_LEN,
    MAX_ADDRESSES,
    SIGNATURE_BYTES,
    PeerRecord,
    beat_statement,
    finite_meta,
    leave_statement,
    live_incarnation,
    parse_beat,
    sign_beat,
    verified_beat,
)
from starling.node.ring import id_key
from starling.node.swim import IdSet, Liveness
from starling.node.wire import RejectReason, WireError

# Importable from here as they always were: their home is `node.records`.
__all__ = [
    "LIVE_SHIFT", "MAX_ADDRESSES", "MAX_ADDRESS_LEN", "SIGNATURE_BYTES", "PeerInfo", "PeerRecord", "PeerStatus",
    "PeerTable", "PeerView", "RefusedAgain", "StatusChange", "TableFull", "TableLimits", "beat_statement",
    "finite_meta", "leave_statement", "live_incarnation", "parse_beat", "sign_beat", "verified_beat",
]


class PeerStatus(str, enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


class RefusedAgain(WireError):
    """A relayed record whose (id, incarnation) this node's allowlist refused before: refused
    again, and counted once (gossip and table pulls bring a refused joiner's record often)."""


# The meta of a peer that has told us none, shared by every entry until its first update (a
# simulation's n^2 entries each held an empty dict of their own).
_NO_META: dict[str, Any] = {}


@dataclass(slots=True)  # n^2 of these in a simulated swarm: no per-entry __dict__
class PeerInfo:
    record: PeerRecord
    status: PeerStatus
    last_seen: float
    meta: dict[str, Any] = field(default_factory=lambda: _NO_META)  # the meta of its last signed beat
    beat: int = -1  # the highest beat counter heard from this incarnation
    signed_beat: list[Any] | None = None  # that beat as its peer signed it: what we relay
    told_by: str | None = None  # the member that relayed its record, until the peer itself is heard
    claim_at: int = -1  # the liveness incarnation a suspicion or death claim named (-1: none)
    # whose share of the table it counts against for as long as it is held: the member that
    # first relayed its record, or that member's own sponsor (None: it came to us first-hand)
    sponsor: str | None = None
    # where a peer that greeted us itself came from ("ip:<address>", or "local" for ipc and
    # inproc): only which entries a full table gives up first (see TableLimits)
    origin: str | None = None
    # the signed update that made it dead or left (a death claim, its leave), while it is; what
    # table pulls hand to a member that holds it alive (`PeerTable.proofs`)
    proof: Any = None

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.peer_id,
            "status": self.status.value,
            "addresses": list(self.record.addresses),
            "reachable": self.record.reachable,
            "relay": self.record.relay,
            "incarnation": self.record.incarnation,
            "last_seen_s": self.last_seen,
            "meta": dict(self.meta),
        }


@dataclass(frozen=True)
class PeerView:
    """A read-only snapshot of one peer-table entry (what `Node.peers` lists)."""

    id: str
    status: PeerStatus
    addresses: tuple[str, ...]
    last_seen_age_s: float
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status.value, "addresses": list(self.addresses),
                "last_seen_age_s": round(self.last_seen_age_s, 3), "meta": self.meta}


@dataclass(frozen=True)
class TableLimits:
    """How many peers a table holds. A record relayed by a member (in a join's table, an
    announce, a `$sync` page) counts against that member's share for as long as it is held,
    and so does every record relayed on by a peer that came to us through that member (its
    sponsor), heard from first-hand or not. A peer that greeted us itself counts in the group
    of the address it came from (its origin). A full table makes room by dropping dead
    entries, then the newest entry of the biggest share or group; a record is refused once its
    own share or group is the biggest. So one member cannot fill the table with made-up peers,
    however many of them talk to us, nor one address with keys that greet us: a joiner from
    another address still gets in."""

    max_peers: int = 8192
    max_sponsored_per_member: int = 4096  # a joiner takes a swarm of this many from the member it joins through

    def __post_init__(self) -> None:
        if not 1 <= self.max_sponsored_per_member <= self.max_peers:
            raise ValueError(f"need 1 <= max_sponsored_per_member <= max_peers: {self}")


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What a table keeps of a dead or departed peer it forgot: its incarnation, beat and the
    claim's liveness incarnation, and the signed update that ended it."""

    record: PeerRecord
    status: PeerStatus
    beat: int
    claim_at: int
    proof: Any
    at: float  # when the entry was forgotten


class TableFull(WireError):
    def __init__(self, message: str) -> None:
        super().__init__(RejectReason.TABLE_FULL, message, field="record")


@dataclass(frozen=True)
class StatusChange:
    peer_id: str
    old: PeerStatus | None
    new: PeerStatus


class PeerTable:
    """Known peers (never including ourselves) and their liveness. Not thread-safe:
    it lives on the network thread; other threads read snapshots."""

    def __init__(self, self_id: str, liveness: Liveness, limits: TableLimits | None = None) -> None:
        self.self_id = self_id
        self.liveness = liveness
        self.limits = limits or TableLimits()
        self._peers: dict[str, PeerInfo] = {}
        self._sponsored: dict[str, dict[str, None]] = {}  # member -> ids held on its word (TableLimits), oldest first
        self._greeted: dict[str, dict[str, None]] = {}  # origin -> ids that greeted us from there, oldest first
        self.evicted: list[str] = []  # dropped to make room; the owner of the table closes their sockets
        # peers alive or suspect, kept as statuses change (probing must not walk the table),
        # with their keys on the probe ring, and in id order with their prefixes' codes (for
        # table pages and pulls)
        self.live_ids = IdSet(id_key, ordered=True, code=prefix_code)
        self.unaddressed: dict[str, None] = {}  # peers whose record gives no address (clients)
        self._ended: dict[str, None] = {}  # peers held dead or left (forgetting must not walk the table)
        # forgotten dead and departed peers, oldest first, at most `limits.max_peers`
        self.tombstones: dict[str, Tombstone] = {}

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def get(self, peer_id: str) -> PeerInfo | None:
        return self._peers.get(peer_id)

    def all(self) -> list[PeerInfo]:
        return list(self._peers.values())

    def views(self, now: float) -> list[PeerView]:
        return [PeerView(p.peer_id, p.status, p.record.addresses, now - p.last_seen, dict(p.meta))
                for p in self._peers.values()]

    def live(self) -> list[PeerInfo]:
        peers = self._peers
        return [peers[i] for i in self.live_ids]

    def _set(self, info: PeerInfo, status: PeerStatus) -> StatusChange | None:
        """The one place a status changes, so `live_ids` follows it."""
        old = info.status
        info.status = status
        if status in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
            self.live_ids.add(info.peer_id)
        else:
            self.live_ids.remove(info.peer_id)
        if status is PeerStatus.ALIVE:
            info.claim_at = -1  # whatever claim there was no longer holds
        if status in (PeerStatus.DEAD, PeerStatus.LEFT):
            self._ended[info.peer_id] = None
        else:
            info.proof = None
            self._ended.pop(info.peer_id, None)
        return None if old is status else StatusChange(info.peer_id, old, status)

    def upsert(self, record: PeerRecord, now: float, told_by: str | None = None,
               origin: str | None = None) -> StatusChange | None:
        """Add a verified record, or replace an older incarnation. Returns the change, if any.
        `told_by` is the member that relayed it (None: the peer itself gave it, from `origin`,
        see PeerInfo); a new record past `limits` raises TableFull, and nothing changes.

        A peer that left comes back only with a newer incarnation. A record of an incarnation
        this table holds a tombstone of brings back the dead or departed entry (no change:
        `restored` says so), proof and all, unless the dead peer itself gives it; an older one
        is refused.
        """
        if record.peer_id == self.self_id:
            return None
        known = self._peers.get(record.peer_id)
        if known is None and self.tombstones:
            tomb = self.tombstones.get(record.peer_id)
            if tomb is not None and tomb.record.verify_key == record.verify_key:
                if record.incarnation < tomb.record.incarnation:
                    return None
                if record.incarnation == tomb.record.incarnation and (
                        told_by is not None or tomb.status is PeerStatus.LEFT):
                    self._restore(tomb, now)
                    return None
                del self.tombstones[record.peer_id]  # a newer life, or the peer itself greets us
        if known is not None:
            if record.verify_key != known.record.verify_key:
                return None  # ids derive from keys, so this is a collision or forgery
            if record.incarnation < known.record.incarnation:
                return None
            if record.incarnation == known.record.incarnation:
                if known.status is PeerStatus.LEFT:
                    return None
                return None if record == known.record else self._replace(known, record, now)
            return self._replace(known, record, now)
        if told_by == record.peer_id:
            told_by = None
        sponsor = None
        if told_by is not None:
            relayer = self._peers.get(told_by)
            sponsor = told_by if relayer is None or relayer.sponsor is None else relayer.sponsor
            origin = None
        self._make_room(record.peer_id, sponsor, origin)
        self._peers[record.peer_id] = PeerInfo(record, PeerStatus.ALIVE, now, told_by=told_by, sponsor=sponsor,
                                               origin=origin)
        if not record.addresses:
            self.unaddressed[record.peer_id] = None
        self.live_ids.add(record.peer_id)
        if sponsor is not None:
            self._sponsored.setdefault(sponsor, {})[record.peer_id] = None
        if origin is not None:
            self._greeted.setdefault(origin, {})[record.peer_id] = None
        return StatusChange(record.peer_id, None, PeerStatus.ALIVE)

    def _restore(self, tomb: Tombstone, now: float) -> None:
        """Bring a tombstoned entry back as it was (it counts against nobody's share: no
        member vouches for a dead peer), unless the table is full. It is forgotten again
        `forget_after_s` from now."""
        if len(self._peers) >= self.limits.max_peers:
            return
        info = PeerInfo(tomb.record, tomb.status, now, beat=tomb.beat, claim_at=tomb.claim_at, proof=tomb.proof)
        del self.tombstones[tomb.record.peer_id]
        self._peers[info.peer_id] = info
        self._ended[info.peer_id] = None
        if not info.record.addresses:
            self.unaddressed[info.peer_id] = None

    def restored(self, peer_id: str, before: PeerInfo | None) -> bool:
        """Whether `upsert` just brought `peer_id` back from its tombstone (it held no entry
        `before`, and holds one now that is dead or left)."""
        info = self._peers.get(peer_id)
        return before is None and info is not None and info.status in (PeerStatus.DEAD, PeerStatus.LEFT)

    def _make_room(self, peer_id: str, sponsor: str | None, origin: str | None) -> None:
        limits = self.limits
        if sponsor is not None and len(self._sponsored.get(sponsor, ())) >= limits.max_sponsored_per_member:
            raise TableFull(f"record of {peer_id}: {sponsor} already vouches for {limits.max_sponsored_per_member} "
                            "peers of the table")
        if len(self._peers) < limits.max_peers:
            return
        gone = next((p for p in self._peers.values() if p.status in (PeerStatus.DEAD, PeerStatus.LEFT)), None)
        if gone is None:
            groups = [*self._sponsored.values(), *self._greeted.values()]
            top = max(groups, key=len, default=None)
            most = len(top) if top is not None else 0
            mine = (len(self._sponsored.get(sponsor, ())) if sponsor is not None
                    else len(self._greeted.get(origin, ())) if origin is not None else -1)
            if top is None or most == 0 or mine + 1 >= most:
                raise TableFull(f"record of {peer_id}: the peer table holds {limits.max_peers} peers")
            gone = self._peers[next(reversed(top))]  # its newest: the oldest are the established
        self._drop(gone.peer_id)
        self.evicted.append(gone.peer_id)

    def _drop(self, peer_id: str, now: float | None = None) -> None:
        info = self._peers.pop(peer_id)
        self.live_ids.remove(peer_id)
        self.unaddressed.pop(peer_id, None)
        self._ended.pop(peer_id, None)
        if info.proof is not None and info.status in (PeerStatus.DEAD, PeerStatus.LEFT):
            tombs = self.tombstones
            tombs.pop(peer_id, None)
            while len(tombs) >= self.limits.max_peers:
                del tombs[next(iter(tombs))]
            tombs[peer_id] = Tombstone(info.record, info.status, info.beat, info.claim_at, info.proof,
                                       info.last_seen if now is None else now)
        for groups, key in ((self._sponsored, info.sponsor), (self._greeted, info.origin)):
            if key is not None:
                held = groups.get(key)
                if held is not None:
                    held.pop(peer_id, None)
                    if not held:
                        del groups[key]

    def sponsored(self, member: str) -> int:
        """Peers this table holds on `member`'s word (see TableLimits)."""
        return len(self._sponsored.get(member, ()))

    def _replace(self, known: PeerInfo, record: PeerRecord, now: float) -> StatusChange | None:
        if record.incarnation != known.record.incarnation:
            # a restarted peer counts its beats from zero again, and no claim about its last life holds
            known.beat, known.signed_beat, known.claim_at = -1, None, -1
        known.record, known.last_seen = record, now
        if record.addresses:
            self.unaddressed.pop(record.peer_id, None)
        else:
            self.unaddressed[record.peer_id] = None
        return self._set(known, PeerStatus.ALIVE)

    def seen(self, peer_id: str, now: float, *, first_hand: bool = True) -> StatusChange | None:
        """An authenticated message from the peer itself proves it alive now: a dead peer
        revives (one that left stays gone until it rejoins with a new incarnation), and a
        suspect one that no member's claim made suspect (its connection dropped) is alive
        again. A suspicion some member claimed stays until the peer refutes it with a newer
        beat (see `heartbeat`) or it times out; whoever acts on this message tells the peer
        (`node.swarm`). Heard first-hand (not in a relayed beat: whoever made up a peer can sign
        its beats too), it is no longer one we only heard of (its record still counts against
        its sponsor: a made-up peer can talk too)."""
        info = self._peers.get(peer_id)
        if info is None or info.status is PeerStatus.LEFT:
            return None
        info.last_seen = max(info.last_seen, now)
        if not first_hand:
            return None
        info.told_by = None
        if info.status is PeerStatus.DEAD or (info.status is PeerStatus.SUSPECT and info.claim_at < 0):
            return self._set(info, PeerStatus.ALIVE)
        return None

    def is_news(self, entry: list[Any]) -> bool | None:
        """Whether a checked beat entry (`parse_beat`) is newer than what we hold of a known
        peer; None if we hold no current record of that peer (ask for it)."""
        info = self._peers.get(entry[0])
        if info is None:
            return None if entry[0] != self.self_id else False
        if info.record.incarnation < entry[1]:
            return None
        return _beat_is_news(info, entry[1], entry[2])

    def heartbeat(self, entry: list[Any], now: float) -> StatusChange | None:
        """A signed beat [peer_id, incarnation, beat, meta, signature] (see `parse_beat`),
        heard directly or relayed by another peer.

        A peer counts its beats up within one incarnation, so a beat above the last one
        heard proves the peer was alive after that; a stale relay refreshes nothing. A beat of
        a liveness incarnation above the one a suspicion or death claim named refutes the
        claim. The beat must carry its peer's signature (raises WireError BAD_SIGNATURE, and
        nothing changes): whoever relays it cannot raise its counter, revive a dead peer, or
        change its meta.
        """
        info = self._peers.get(entry[0])
        if info is None or not _beat_is_news(info, entry[1], entry[2]):
            return None
        entry = verified_beat(entry, info.record.verify_key)
        info.beat, info.signed_beat = entry[2], entry
        info.meta = entry[3] or _NO_META
        info.last_seen = max(info.last_seen, now)
        if info.status is not PeerStatus.ALIVE and live_incarnation(entry[2]) > info.claim_at:
            info.claim_at = -1
            return self._set(info, PeerStatus.ALIVE)
        return None

    def claim(self, kind: PeerStatus, peer_id: str, incarnation: int, live: int,
              proof: Any = None) -> tuple[bool, StatusChange | None]:
        """A member's signed claim (checked by the caller, and given as `proof` for a death)
        that a peer is suspect or dead at (record incarnation, liveness incarnation). It holds
        unless the peer left, is dead already, or we know a newer incarnation than the one it
        names (the peer refuted it). Returns whether it holds, and the status change (None when
        a peer that was suspect on this node's own evidence becomes suspect by claim)."""
        info = self._peers.get(peer_id)
        if (info is None or info.status in (PeerStatus.LEFT, PeerStatus.DEAD)
                or info.record.incarnation != incarnation or live < live_incarnation(info.beat)):
            return False, None
        if kind is PeerStatus.SUSPECT and info.status is PeerStatus.SUSPECT and info.claim_at >= 0:
            return False, None  # suspected already: the caller counts the confirmation
        info.claim_at = max(info.claim_at, live)
        if kind is PeerStatus.DEAD:
            info.proof = proof
        return True, self._set(info, kind)

    def live_at(self, peer_id: str) -> tuple[int, int] | None:
        """(record incarnation, liveness incarnation) we know of a peer: what a claim names."""
        info = self._peers.get(peer_id)
        if info is None:
            return None
        return info.record.incarnation, max(live_incarnation(info.beat), info.claim_at)

    def left(self, peer_id: str, incarnation: int, proof: Any = None) -> StatusChange | None:
        """The peer's signed leave of `incarnation` (checked by the caller, given as `proof`)."""
        info = self._peers.get(peer_id)
        if info is None or info.status is PeerStatus.LEFT or incarnation < info.record.incarnation:
            return None
        info.proof = proof
        return self._set(info, PeerStatus.LEFT)

    def suspect(self, peer_id: str) -> StatusChange | None:
        """An alive peer becomes suspect now (its connection dropped), on this node's own
        evidence: no claim, so a message from the peer itself clears it."""
        info = self._peers.get(peer_id)
        if info is None or info.status is not PeerStatus.ALIVE:
            return None
        return self._set(info, PeerStatus.SUSPECT)

    def declare_dead(self, peer_id: str, silent_since: float, proof: Any = None) -> StatusChange | None:
        """A suspect peer that has not been heard from since `silent_since` is dead now, on
        this node's own claim (`proof`, signed at `live_at`)."""
        info = self._peers.get(peer_id)
        if info is None or info.status is not PeerStatus.SUSPECT or info.last_seen > silent_since:
            return None
        info.claim_at = max(info.claim_at, live_incarnation(info.beat))
        info.proof = proof
        return self._set(info, PeerStatus.DEAD)

    def forget(self, older_than_s: float, now: float, tombstones_s: float = 0.0) -> list[str]:
        """Drop dead/left entries silent for longer than `older_than_s`, to bound memory: those
        with a proof leave a tombstone, kept `tombstones_s` (and at most `limits.max_peers`)."""
        peers = self._peers
        gone = [pid for pid in self._ended if now - peers[pid].last_seen > older_than_s]
        for pid in gone:
            self._drop(pid, now)
        tombs = self.tombstones
        while tombs:
            oldest = next(iter(tombs.values()))
            if now - oldest.at < tombstones_s:
                break
            del tombs[oldest.record.peer_id]
        return gone

    def proofs(self, have: Have) -> list[Any]:
        """The proofs this table holds (entries and tombstones) of the deaths and leaves of
        peers that `have` names: what a member that holds them alive missed."""
        ended, buried = list(self._ended), list(self.tombstones)
        named = have.names([*ended, *buried])
        found = [self._peers[pid].proof for pid, yes in zip(ended, named) if yes]
        found += [self.tombstones[pid].proof for pid, yes in zip(buried, named[len(ended):]) if yes]
        return [p for p in found if p is not None]



def _beat_is_news(info: PeerInfo, incarnation: int, beat: int) -> bool:
    """A beat above the last one heard in the peer's current incarnation, from a peer that
    has not left: proof it was alive after what we knew."""
    return info.status is not PeerStatus.LEFT and info.record.incarnation == incarnation and beat > info.beat
