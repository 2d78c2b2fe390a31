"""Membership updates, typed: what rides on probes, their answers and gossip.

On the wire each update is a short list, its kind first, so that a message carries dozens:

    Beat    ["a", [peer_id, incarnation, beat, meta, signature]]    a peer's own signed beat
    Record  ["r", record]                                            a peer's signed record
    Claim   ["s" | "d", peer_id, incarnation, live, claimant, signature]
                                                     a member's signed suspicion or death claim
    Leave   ["l", peer_id, incarnation, signature]                   a peer's signed leave

`parse_updates` reads a message's list into these, checking every field's type and range (a
malformed one raises WireError BAD_FIELD naming its kind); `to_wire` gives the list back.
Signatures are checked by whoever applies an update, against the key of the peer that signed
it: most relayed updates are old news, and a check costs an Ed25519 verification.

Each update also names the thing it is about (`key`): a queue of updates to send on
(`node.swim.Broadcasts`) holds only the newest one per key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import msgpack

from starling.node.identity import verify_signature
from starling.node.wire import RejectReason, WireError

if TYPE_CHECKING:
    from starling.node.identity import Identity

SIGNATURE_BYTES = 64
# Update kinds, the first item of each update on the wire.
ALIVE, RECORD, SUSPECT, DEAD, LEFT = "a", "r", "s", "d", "l"
MAX_UPDATES = 64  # updates one message may carry (its sender bounds their bytes much lower)
MAX_LIVE = 2**31 - 1  # a liveness incarnation a claim may name: one above it still fits a beat counter


def _malformed(kind: str) -> WireError:
    return WireError(RejectReason.BAD_FIELD, f"malformed {kind!r} update", field="body")


def _is_id(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= 64


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _is_signature(value: Any) -> bool:
    return type(value) is bytes and len(value) == SIGNATURE_BYTES


@dataclass(frozen=True)
class _OwnWord:
    """An update that carries one signed list of its subject's own, relayed verbatim: its first
    item is the subject's peer id (checked, with the rest, when it is applied). A body read off
    the wire is a list; one a node passes on may be the tuple its process shares (a record's
    `wire`), which packs the same."""

    body: list[Any] | tuple[Any, ...]
    kind: ClassVar[str]

    @property
    def peer_id(self) -> Any:
        return self.body[0] if self.body else None

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.kind, self.peer_id)

    def to_wire(self) -> list[Any]:
        return [self.kind, self.body]

    @classmethod
    def from_wire(cls, update: list[Any]) -> Self:
        if len(update) != 2 or type(update[1]) is not list:
            raise _malformed(cls.kind)
        return cls(update[1])


class Beat(_OwnWord):
    """A peer's own signed beat, [peer_id, incarnation, beat, meta, signature], as
    `node.records.parse_beat` reads it when it is applied: most relayed beats are old news."""

    kind = ALIVE


class Record(_OwnWord):
    """A peer's signed record in its wire form, which `node.records.PeerRecord.from_wire`
    reads, with the allowlist, when it is applied."""

    kind = RECORD


def claim_statement(kind: str, peer_id: str, incarnation: int, live: int) -> bytes:
    """What a member signs to say it suspects (or declares dead) one incarnation of a peer."""
    return msgpack.packb(["starling-claim-v1", kind, peer_id, incarnation, live], use_bin_type=True)


# Claims checked, process-wide, by (key, statement, signature): a simulation's nodes share them.
_CHECKED: dict[tuple[bytes, bytes, bytes], bool] = {}
_MAX_CHECKED = 16384


@dataclass(frozen=True)
class Claim:
    """A member's signed claim that one liveness incarnation of a peer is suspect or dead. The
    liveness incarnation is below MAX_LIVE, so the peer's refutation still fits its counter."""

    kind: str  # SUSPECT or DEAD
    peer_id: str
    incarnation: int  # the peer's record incarnation
    live: int  # its liveness incarnation (the high bits of its beat counter)
    claimant: str
    signature: bytes

    @property
    def key(self) -> tuple[Any, ...]:
        # one suspicion per claimant: independent confirmations spread too
        return (SUSPECT, self.peer_id, self.claimant) if self.kind == SUSPECT else (self.kind, self.peer_id)

    def to_wire(self) -> list[Any]:
        return [self.kind, self.peer_id, self.incarnation, self.live, self.claimant, self.signature]

    @classmethod
    def from_wire(cls, update: list[Any]) -> Claim:
        if not (len(update) == 6 and _is_id(update[1]) and _is_count(update[2]) and _is_count(update[3])
                and update[3] < MAX_LIVE and _is_id(update[4]) and _is_signature(update[5])):
            raise _malformed(update[0])
        return cls(*update)

    @classmethod
    def sign(cls, identity: Identity, kind: str, peer_id: str, incarnation: int, live: int) -> Claim:
        if kind not in (SUSPECT, DEAD):
            raise ValueError(f"a claim is {SUSPECT!r} or {DEAD!r}, not {kind!r}")
        return cls(kind, peer_id, incarnation, live, identity.peer_id,
                   identity.sign(claim_statement(kind, peer_id, incarnation, live)))

    def is_signed(self, verify_key: bytes) -> bool:
        """Whether the claimant (whose key is `verify_key`) signed this claim; remembered per
        key, statement and signature, since every node of a simulated swarm hears each claim."""
        key = (verify_key, claim_statement(self.kind, self.peer_id, self.incarnation, self.live), self.signature)
        known = _CHECKED.get(key)
        if known is not None:
            return known
        ok = verify_signature(verify_key, key[1], key[2])
        if len(_CHECKED) >= _MAX_CHECKED:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = ok
        return ok


@dataclass(frozen=True)
class Leave:
    """A peer's signed leave of one incarnation (`node.records.leave_statement`)."""

    peer_id: str
    incarnation: int
    signature: bytes
    kind: ClassVar[str] = LEFT

    @property
    def key(self) -> tuple[Any, ...]:
        return (LEFT, self.peer_id)

    def to_wire(self) -> list[Any]:
        return [LEFT, self.peer_id, self.incarnation, self.signature]

    @classmethod
    def from_wire(cls, update: list[Any]) -> Leave:
        if not (len(update) == 4 and _is_id(update[1]) and _is_count(update[2]) and _is_signature(update[3])):
            raise _malformed(LEFT)
        return cls(update[1], update[2], update[3])


Update = Beat | Record | Claim | Leave
_READERS = {ALIVE: Beat.from_wire, RECORD: Record.from_wire, SUSPECT: Claim.from_wire, DEAD: Claim.from_wire,
            LEFT: Leave.from_wire}


def parse_updates(raw: Any) -> list[Update]:
    """The updates a message carries, each one's shape and ranges checked (raises WireError)."""
    if not isinstance(raw, list) or len(raw) > MAX_UPDATES:
        raise WireError(RejectReason.BAD_FIELD, f"updates must be a list of at most {MAX_UPDATES}", field="body")
    out: list[Update] = []
    for update in raw:
        if not (type(update) is list and update and type(update[0]) is str and update[0] in _READERS):
            raise WireError(RejectReason.BAD_FIELD, "each update must be a list starting with its kind",
                            field="body")
        out.append(_READERS[update[0]](update))
    return out


def sign_claim(identity: Identity, kind: str, peer_id: str, incarnation: int, live: int) -> list[Any]:
    """A suspect or dead update on the wire: [kind, peer_id, incarnation, live, claimant, signature]."""
    return Claim.sign(identity, kind, peer_id, incarnation, live).to_wire()
