"""The peer table: signed peer records, liveness from heartbeats, and status changes.

A record is signed by the peer it describes, so a peer relaying someone else's
record cannot forge or alter it. Liveness is local knowledge: every message from a
peer refreshes its `last_seen`; silence makes it suspect, longer silence dead. A
graceful leave is a signed statement by the leaver and removes it at once.
Everything here is plain data and arithmetic on an injected clock, so it is tested
without sockets.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from starling.node.identity import Identity, peer_id_from_key, verify_signature
from starling.node.wire import RejectReason, WireError

MAX_ADDRESSES = 8
MAX_ADDRESS_LEN = 512


class PeerStatus(str, enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


@dataclass(frozen=True)
class Liveness:
    """Failure-detector timing, all in seconds."""

    heartbeat_interval_s: float = 1.0
    suspect_timeout_s: float = 3.0
    dead_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not (0 < self.heartbeat_interval_s <= self.suspect_timeout_s <= self.dead_timeout_s):
            raise ValueError(
                "need 0 < heartbeat_interval_s <= suspect_timeout_s <= dead_timeout_s, got "
                f"{self.heartbeat_interval_s}, {self.suspect_timeout_s}, {self.dead_timeout_s}"
            )


@dataclass(frozen=True)
class PeerRecord:
    """What a peer says about itself, signed with its Ed25519 key.

    `incarnation` grows with every restart of the peer, so a newer record replaces an
    older one and a stale relay cannot resurrect a peer that left.
    """

    peer_id: str
    verify_key: bytes
    curve_key: bytes
    addresses: tuple[str, ...]
    incarnation: int
    signature: bytes = b""

    def signed_bytes(self) -> bytes:
        return msgpack.packb(
            ["starling-record-v1", self.peer_id, self.verify_key, self.curve_key,
             list(self.addresses), self.incarnation],
            use_bin_type=True,
        )

    @classmethod
    def create(cls, identity: Identity, addresses: list[str] | tuple[str, ...], incarnation: int) -> PeerRecord:
        unsigned = cls(identity.peer_id, identity.verify_key, identity.curve_public, tuple(addresses), incarnation)
        return replace(unsigned, signature=identity.sign(unsigned.signed_bytes()))

    def is_valid(self) -> bool:
        return (
            self.peer_id == peer_id_from_key(self.verify_key)
            and verify_signature(self.verify_key, self.signed_bytes(), self.signature)
        )

    def to_wire(self) -> list[Any]:
        return [self.peer_id, self.verify_key, self.curve_key, list(self.addresses), self.incarnation, self.signature]

    @classmethod
    def from_wire(cls, obj: Any, *, verify: bool = True) -> PeerRecord:
        """Parse and (unless told not to) verify; raises WireError (BAD_FIELD or BAD_SIGNATURE)."""
        def bad(what: str) -> WireError:
            return WireError(RejectReason.BAD_FIELD, f"peer record: {what}", field="record")

        if not isinstance(obj, (list, tuple)) or len(obj) != 6:
            raise bad("expected a 6-item list")
        peer_id, vkey, ckey, addrs, inc, sig = obj
        if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 64:
            raise bad("peer_id must be a short string")
        for name, val, size in (("verify_key", vkey, 32), ("curve_key", ckey, 32), ("signature", sig, 64)):
            if not isinstance(val, bytes) or len(val) != size:
                raise bad(f"{name} must be {size} bytes")
        if (not isinstance(addrs, (list, tuple)) or len(addrs) > MAX_ADDRESSES
                or not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_LEN for a in addrs)):
            raise bad(f"addresses must be at most {MAX_ADDRESSES} strings")
        if not isinstance(inc, int) or isinstance(inc, bool) or not 0 <= inc < 2**63:
            raise bad("incarnation must be a non-negative int64")
        record = cls(peer_id, vkey, ckey, tuple(addrs), inc, sig)
        if verify:
            record.verify()
        return record

    def verify(self) -> None:
        if not self.is_valid():
            raise WireError(RejectReason.BAD_SIGNATURE, f"peer record for {self.peer_id}: bad signature", field="record")


def leave_statement(peer_id: str, incarnation: int) -> bytes:
    return msgpack.packb(["starling-leave-v1", peer_id, incarnation], use_bin_type=True)


@dataclass
class PeerInfo:
    record: PeerRecord
    status: PeerStatus
    last_seen: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.peer_id,
            "status": self.status.value,
            "addresses": list(self.record.addresses),
            "incarnation": self.record.incarnation,
            "last_seen_s": self.last_seen,
            "meta": dict(self.meta),
        }


@dataclass(frozen=True)
class StatusChange:
    peer_id: str
    old: PeerStatus | None
    new: PeerStatus


class PeerTable:
    """Known peers (never including ourselves) and their liveness. Not thread-safe:
    it lives on the network thread; other threads read snapshots."""

    def __init__(self, self_id: str, liveness: Liveness) -> None:
        self.self_id = self_id
        self.liveness = liveness
        self._peers: dict[str, PeerInfo] = {}

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def get(self, peer_id: str) -> PeerInfo | None:
        return self._peers.get(peer_id)

    def all(self) -> list[PeerInfo]:
        return list(self._peers.values())

    def live(self) -> list[PeerInfo]:
        return [p for p in self._peers.values() if p.status in (PeerStatus.ALIVE, PeerStatus.SUSPECT)]

    def upsert(self, record: PeerRecord, now: float) -> StatusChange | None:
        """Add a verified record, or replace an older incarnation. Returns the change, if any.

        A peer that left comes back only with a newer incarnation.
        """
        if record.peer_id == self.self_id:
            return None
        known = self._peers.get(record.peer_id)
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
        self._peers[record.peer_id] = PeerInfo(record, PeerStatus.ALIVE, now)
        return StatusChange(record.peer_id, None, PeerStatus.ALIVE)

    def _replace(self, known: PeerInfo, record: PeerRecord, now: float) -> StatusChange | None:
        old = known.status
        known.record, known.last_seen, known.status = record, now, PeerStatus.ALIVE
        return None if old is PeerStatus.ALIVE else StatusChange(record.peer_id, old, PeerStatus.ALIVE)

    def seen(self, peer_id: str, now: float, meta: dict[str, Any] | None = None) -> StatusChange | None:
        """Any authenticated message from a peer proves it alive (a dead peer revives;
        one that left stays gone until it rejoins with a new incarnation)."""
        info = self._peers.get(peer_id)
        if info is None or info.status is PeerStatus.LEFT:
            return None
        info.last_seen = max(info.last_seen, now)
        if meta:
            info.meta.update(meta)
        if info.status is not PeerStatus.ALIVE:
            old, info.status = info.status, PeerStatus.ALIVE
            return StatusChange(peer_id, old, PeerStatus.ALIVE)
        return None

    def left(self, peer_id: str, incarnation: int) -> StatusChange | None:
        info = self._peers.get(peer_id)
        if info is None or info.status is PeerStatus.LEFT or incarnation < info.record.incarnation:
            return None
        old, info.status = info.status, PeerStatus.LEFT
        return StatusChange(peer_id, old, PeerStatus.LEFT)

    def sweep(self, now: float) -> list[StatusChange]:
        """Apply the failure detector: silent peers become suspect, then dead."""
        changes = []
        for info in self._peers.values():
            if info.status in (PeerStatus.DEAD, PeerStatus.LEFT):
                continue
            silence = now - info.last_seen
            new = info.status
            if silence >= self.liveness.dead_timeout_s:
                new = PeerStatus.DEAD
            elif silence >= self.liveness.suspect_timeout_s:
                new = PeerStatus.SUSPECT
            if new is not info.status:
                changes.append(StatusChange(info.peer_id, info.status, new))
                info.status = new
        return changes

    def forget(self, older_than_s: float, now: float) -> list[str]:
        """Drop dead/left entries silent for longer than `older_than_s`, to bound memory."""
        gone = [p.peer_id for p in self._peers.values()
                if p.status in (PeerStatus.DEAD, PeerStatus.LEFT) and now - p.last_seen > older_than_s]
        for pid in gone:
            del self._peers[pid]
        return gone


def finite_meta(meta: Any) -> dict[str, Any]:
    """Heartbeat metadata must be a small flat map of scalars; anything else is refused."""
    if not isinstance(meta, dict) or len(meta) > 32:
        raise WireError(RejectReason.BAD_FIELD, "heartbeat meta must be a map of at most 32 entries", field="meta")
    for k, v in meta.items():
        if not isinstance(k, str) or len(k) > 64:
            raise WireError(RejectReason.BAD_FIELD, "heartbeat meta keys must be short strings", field="meta")
        if isinstance(v, float) and not math.isfinite(v):
            raise WireError(RejectReason.BAD_FIELD, f"heartbeat meta {k!r} is not finite", field="meta")
        if not isinstance(v, (int, float, str, bool, type(None))) or (isinstance(v, str) and len(v) > 256):
            raise WireError(RejectReason.BAD_FIELD, f"heartbeat meta {k!r} must be a scalar", field="meta")
    return meta
