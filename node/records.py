"""What a peer signs about itself: its record, its beats, its leave.

A record is signed by the peer it describes, so a peer relaying someone else's
record cannot forge or alter it. So is a beat: [peer id, incarnation, counter, meta] signed
by that peer and relayed verbatim, so a member can pass on another peer's liveness and route
(`$via` in its meta) but cannot make them up. The counter's high 32 bits are the peer's
liveness incarnation, which it raises only to refute a suspicion (`node.swim`); the low bits
count its meta changes. A graceful leave is a signed statement by the leaver.
Checked signatures are remembered process-wide, and each distinct record and beat is held
once, however many peer tables (`node.membership`) hold it.
"""
from __future__ import annotations

import functools
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import msgpack
from zmq.utils import z85

from starling.node.address import AddressError, parse_record_endpoint
from starling.node.identity import Identity, peer_id_from_key, verify_signature
from starling.node.wire import RejectReason, WireError

MAX_ADDRESSES = 8
MAX_ADDRESS_LEN = 512
SIGNATURE_BYTES = 64
LIVE_SHIFT = 32  # a beat counter is (liveness incarnation << 32) | meta changes


def live_incarnation(beat: int) -> int:
    """The liveness incarnation a beat counter carries (0 before any beat is heard)."""
    return max(beat, 0) >> LIVE_SHIFT


@dataclass(frozen=True)
class PeerRecord:
    """What a peer says about itself, signed with its Ed25519 key.

    `incarnation` grows with every restart of the peer, so a newer record replaces an
    older one and a stale relay cannot resurrect a peer that left.

    A peer with no addresses is a client: nobody can dial it (it listens nowhere, or the
    peer it joined through could not dial it back), so others reach it over the connections
    it opened to them, or through a relay (`node.relay`). `relay` says the peer forwards
    sealed messages between clients.
    """

    peer_id: str
    verify_key: bytes
    curve_key: bytes
    addresses: tuple[str, ...]
    incarnation: int
    signature: bytes = b""
    relay: bool = False

    @property
    def reachable(self) -> bool:
        return bool(self.addresses)

    def signed_bytes(self) -> bytes:
        return msgpack.packb(
            ["starling-record-v2", self.peer_id, self.verify_key, self.curve_key,
             list(self.addresses), self.incarnation, self.relay],
            use_bin_type=True,
        )

    @classmethod
    def create(cls, identity: Identity, addresses: list[str] | tuple[str, ...], incarnation: int, *,
               relay: bool = False) -> PeerRecord:
        unsigned = cls(identity.peer_id, identity.verify_key, identity.curve_public, tuple(addresses), incarnation,
                       relay=relay)
        return replace(unsigned, signature=identity.sign(unsigned.signed_bytes()))

    def is_valid(self) -> bool:
        return _record_is_valid(self.peer_id, self.verify_key, self.signed_bytes(), self.signature)

    def to_wire(self) -> list[Any]:
        return [self.peer_id, self.verify_key, self.curve_key, list(self.addresses), self.incarnation, self.signature,
                self.relay]

    @functools.cached_property
    def wire(self) -> tuple[Any, ...]:
        """`to_wire()` made once per record, as a tuple that msgpack writes as the same list and
        nobody can change in place. A process shares one instance of each record, so the tables
        that page it and the queues that gossip it hold this one copy, not one each (a record
        parsed off the wire is ~0.5 KB)."""
        return tuple(self.to_wire())

    @functools.cached_property
    def curve_z85(self) -> str:
        """`curve_key` in Z85, as CURVE names the key that owns a connection and a DEALER dials
        a server with: encoded once per record, not once per message checked against it."""
        return z85.encode(self.curve_key).decode()

    @functools.cached_property
    def wire_bytes(self) -> int:
        """The size of `wire` packed (what a page or a pull budget counts), sized once."""
        return len(msgpack.packb(self.wire, use_bin_type=True))

    @classmethod
    def from_wire(cls, obj: Any, *, verify: bool = True) -> PeerRecord:
        """Parse and (unless told not to) verify; raises WireError (BAD_FIELD or BAD_SIGNATURE)."""
        def bad(what: str) -> WireError:
            return WireError(RejectReason.BAD_FIELD, f"peer record: {what}", field="record")

        if not isinstance(obj, (list, tuple)) or len(obj) != 7:
            raise bad("expected a 7-item list")
        peer_id, vkey, ckey, addrs, inc, sig, relay = obj
        # A record the process verified already is equal, field for field, to one of the shared
        # instances, and is taken as that instance before the checks below: every record of a
        # forming swarm reaches each node once or twice. Equal is not the same type (1.0 == 1,
        # 1 == True), so the two fields where that could pass are checked for type first.
        if type(inc) is int and type(relay) is bool and type(addrs) in (list, tuple):
            try:
                record = _RECORDS.get((peer_id, vkey, ckey, tuple(addrs), inc, sig, relay))
            except TypeError:  # an unhashable field: the checks below name it
                record = None
            if record is not None:
                return record
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
        if not isinstance(relay, bool):
            raise bad("relay must be a bool")
        key = (peer_id, vkey, ckey, tuple(addrs), inc, sig, relay)
        try:  # parsed now (once per record): an address nobody can dial must never reach a socket
            for address in addrs:
                parse_record_endpoint(address)
        except AddressError as exc:
            raise bad(str(exc)) from None
        record = cls(*key)
        return record.verified() if verify else record

    def verified(self) -> PeerRecord:
        """Check the signature (raises WireError) and return the process's one shared
        instance of this record."""
        key = (self.peer_id, self.verify_key, self.curve_key, self.addresses, self.incarnation, self.signature,
               self.relay)
        if _RECORDS.get(key) is self:  # only verified records are shared: this one was, by some node here
            return self
        self.verify()
        return _RECORDS.setdefault(key, self)

    def verify(self) -> None:
        if not self.is_valid():
            raise WireError(RejectReason.BAD_SIGNATURE, f"peer record for {self.peer_id}: bad signature",
                            field="record")


# One instance per distinct record in the process, shared by every table that holds it: in a
# simulation every node keeps a record of every other, n^2 records where n are distinct
# (~0.6 KB each: 256 nodes kept 38 MB of copies). Records are immutable; entries go when the
# last holder drops the record.
_RECORDS: weakref.WeakValueDictionary[tuple[Any, ...], PeerRecord] = weakref.WeakValueDictionary()


@functools.lru_cache(maxsize=16384)
def _record_is_valid(peer_id: str, verify_key: bytes, signed: bytes, signature: bytes) -> bool:
    """The check of one record's exact bytes, remembered process-wide: every node of a swarm
    sees each record once in a join table and once per relay, and in a simulation all of them
    share one process (an Ed25519 check costs ~0.1-0.6 ms; a hit, a hash of ~250 bytes)."""
    return peer_id == peer_id_from_key(verify_key) and verify_signature(verify_key, signed, signature)


def leave_statement(peer_id: str, incarnation: int) -> bytes:
    return msgpack.packb(["starling-leave-v1", peer_id, incarnation], use_bin_type=True)



def parse_beat(entry: Any) -> list[Any]:
    """A signed beat [peer_id, incarnation, beat, meta, signature], its types and ranges
    checked (raises WireError). Meta is checked by `finite_meta`, and the signature verified,
    only for a beat a node is about to use (`PeerTable.heartbeat`): most relayed beats are
    old news."""
    if not (type(entry) is list and len(entry) == 5 and type(entry[0]) is str and 0 < len(entry[0]) <= 64
            and type(entry[1]) is int and type(entry[2]) is int and 0 <= entry[1] < 2**63
            and 0 <= entry[2] < 2**63 and type(entry[3]) is dict and type(entry[4]) is bytes
            and len(entry[4]) == SIGNATURE_BYTES):
        raise WireError(RejectReason.BAD_FIELD, "a beat must be [peer_id (short string), incarnation (int64 >= 0), "
                        "beat (int64 >= 0), meta (map), signature (64 bytes)]", field="body")
    return entry


def beat_statement(peer_id: str, incarnation: int, beat: int, meta: dict[str, Any]) -> bytes:
    """The bytes a peer signs for one heartbeat."""
    return msgpack.packb(["starling-beat-v1", peer_id, incarnation, beat, meta], use_bin_type=True)


def sign_beat(identity: Identity, incarnation: int, beat: int, meta: dict[str, Any]) -> list[Any]:
    """This peer's heartbeat as a digest entry: [peer_id, incarnation, beat, meta, signature]."""
    return [identity.peer_id, incarnation, beat, meta,
            identity.sign(beat_statement(identity.peer_id, incarnation, beat, meta))]


# Beats whose signature was checked, by signature, process-wide: every node of a simulated
# swarm hears each beat once, and all of them share one process (an Ed25519 check costs
# ~0.1-0.6 ms). A hit holds the one shared entry, so the n tables that relay a beat hold
# one copy of it, not n.
_BEATS: OrderedDict[bytes, tuple[bytes, list[Any]]] = OrderedDict()
_MAX_BEATS = 16384


def verified_beat(entry: list[Any], verify_key: bytes) -> list[Any]:
    """`entry` (checked by `parse_digest`) if `verify_key` signed it, as the process's shared
    copy; raises WireError BAD_SIGNATURE otherwise."""
    known = _BEATS.get(entry[4])
    if known is not None and known[0] == verify_key and known[1][:4] == entry[:4]:
        _BEATS.move_to_end(entry[4])
        return known[1]
    meta = finite_meta(entry[3])
    if not verify_signature(verify_key, beat_statement(entry[0], entry[1], entry[2], meta), entry[4]):
        raise WireError(RejectReason.BAD_SIGNATURE, f"heartbeat of {entry[0]} is not signed by it", field="body")
    _BEATS[entry[4]] = (verify_key, entry)
    if len(_BEATS) > _MAX_BEATS:
        _BEATS.popitem(last=False)
    return entry


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
