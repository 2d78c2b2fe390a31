"""The message bodies of gossip, of DiLoCo's outer-state sync and of the drift guard, typed
(spsa's are in `protocols/spsa/bodies.py`; the collectives' in `collectives/bodies/`).

Each body is a small frozen dataclass: `to_wire()` gives the msgpack map that travels, and
`from_wire(obj)` checks one that came in and raises `BodyError` naming what is wrong. Only
what a body says by itself is checked here (types, shapes, ranges); what needs the receiver's
state (does it hold that fragment, is that the round it asked for) is the handler's to check.
A handler counts a body it turns down (`node.rpc.Refuser`) and changes nothing for it.

On the wire:

    gossip, exact averaging
    Pull        requester -> neighbour  {"step", "xid"}     frames: its vector, then its integer buffers
    Pulled      neighbour -> requester  {"ok": True}        frames: the neighbour's, as they were
    Undo        requester -> neighbour  {"xid"}             one way: take back your half of exchange xid
    PullAck     requester -> neighbour  {"xid"}             one way: exchange xid is complete, forget it
    gossip, CHOCO
    Choco       peer -> neighbour       {"seq", "full", "packet"?: header, "buffers"?: frames}    one way
                (full: the whole public copy is the first frame; else a packet's frames; then
                 "buffers" lossless frames of buffers)
    Resync      peer -> neighbour       {}                  one way: send me your whole copy next

    DiLoCo's outer state ("diloco.sync")
    SyncAsk     {"fragments": [ascending], "at_least"?: version}
    SyncState   {"ok": True, "step", "versions": [one per fragment], "fragments": [as asked]}
                frames: each fragment's outer parameters, then its momentum
    NotYet      {"ok": False, "reason", "versions"}     the asker's version is not reached yet

    the drift guard ("<prefix>digest", "<prefix>sync")
    GuardAsk    {"round"}                           for either topic
    Digest      {"ok": True, "round", "digest": 32 bytes}
    GuardState  {"ok": True, "round", "state": header}  frames: the state's tensors
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starling.collectives.bodies import BodyError

__all__ = ["BodyError", "Choco", "Digest", "GuardAsk", "GuardState", "NotYet", "Pull", "PullAck", "Pulled",
           "Resync", "SyncAsk", "SyncState", "Undo"]

INT64_MAX = (1 << 63) - 1
MAX_FRAGMENTS = 4096  # fragments one sync body may name (a model is split in far fewer)
MAX_BUFFER_FRAMES = 2  # CHOCO's buffers: the floating ones, then the integers
MAX_REASON_CHARS = 1000
DIGEST_BYTES = 32  # the drift guard's digests: the whole sha256


def _map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BodyError(f"{what} must be a map, got {type(obj).__name__}")
    return obj


def _int(body: dict[str, Any], key: str, low: int = 0) -> int:
    """A whole number in [low, 2**63): bools, floats and numbers a 64-bit int cannot hold refused."""
    if key not in body:
        raise BodyError(f"{key} missing")
    value = body[key]
    if type(value) is not int or not low <= value <= INT64_MAX:
        raise BodyError(f"{key} must be an integer in [{low}, 2**63), got {value!r:.40}")
    return value


def _ok(body: dict[str, Any], what: str) -> None:
    """An answer says ok; a refusal is named by its reason."""
    if body.get("ok") is not True:
        raise BodyError(f"{what} refused: {body.get('reason')!s:.200}" if body.get("ok") is False
                        else f"{what} must say ok")


def _ints(body: dict[str, Any], key: str, most: int) -> tuple[int, ...]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > most:
        raise BodyError(f"{key} must be a list of at most {most} integers")
    if not all(type(v) is int and 0 <= v <= INT64_MAX for v in value):
        raise BodyError(f"{key} must hold integers in [0, 2**63)")
    return tuple(value)


def _fragments(body: dict[str, Any]) -> tuple[int, ...]:
    fragments = _ints(body, "fragments", MAX_FRAGMENTS)
    if list(fragments) != sorted(set(fragments)):
        raise BodyError("fragments must be ascending and unique")
    return fragments


# ---------------------------------------------------------------------- gossip
@dataclass(frozen=True)
class Pull:
    """Exchange `xid` of the requester's step `step`: average with my vector (the frames)."""

    step: int
    xid: int

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "xid": self.xid}

    @classmethod
    def from_wire(cls, obj: Any) -> Pull:
        body = _map(obj, "a pull")
        return cls(_int(body, "step"), _int(body, "xid"))


@dataclass(frozen=True)
class Pulled:
    """A neighbour's answer to a pull: it applied its half; its vector is in the frames."""

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True}

    @classmethod
    def from_wire(cls, obj: Any) -> Pulled:
        _ok(_map(obj, "a pull's answer"), "the pull")
        return cls()


@dataclass(frozen=True)
class Undo:
    """The requester got no answer to exchange `xid` in time: take your half back."""

    xid: int

    def to_wire(self) -> dict[str, Any]:
        return {"xid": self.xid}

    @classmethod
    def from_wire(cls, obj: Any) -> Undo:
        return cls(_int(_map(obj, "an undo"), "xid"))


@dataclass(frozen=True)
class PullAck:
    """The requester applied its half of exchange `xid`: forget yours."""

    xid: int

    def to_wire(self) -> dict[str, Any]:
        return {"xid": self.xid}

    @classmethod
    def from_wire(cls, obj: Any) -> PullAck:
        return cls(_int(_map(obj, "an ack"), "xid"))


@dataclass(frozen=True)
class Choco:
    """CHOCO update `seq` of a peer's public copy: the whole copy (`full`), or a packet to add
    (`header`); `buffers` lossless frames of its buffers ride after either."""

    seq: int
    full: bool
    header: dict[str, Any] | None = None  # the packet's header; None for a full copy
    buffers: int = 0

    def __post_init__(self) -> None:
        if self.full != (self.header is None):
            raise ValueError("a CHOCO update is a full copy or a packet, one of the two")

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"seq": self.seq, "full": self.full}
        if not self.full:
            body["packet"] = self.header
        if self.buffers:
            body["buffers"] = self.buffers
        return body

    @classmethod
    def from_wire(cls, obj: Any) -> Choco:
        body = _map(obj, "a CHOCO update")
        seq, full = _int(body, "seq"), body.get("full")
        if type(full) is not bool:
            raise BodyError(f"full must be true or false, got {full!r:.40}")
        header = body.get("packet")
        if full and header is not None:
            raise BodyError("a full copy carries no packet")
        if not full and not isinstance(header, dict):
            raise BodyError(f"packet header must be a map, got {type(header).__name__}")
        buffers = _int(body, "buffers") if "buffers" in body else 0
        if buffers > MAX_BUFFER_FRAMES:
            raise BodyError(f"buffers must be 0 to {MAX_BUFFER_FRAMES} frames, got {buffers}")
        return cls(seq, full, header, buffers)


@dataclass(frozen=True)
class Resync:
    """The sender lost my public copy (a gap in my updates): my next update to it is the whole copy."""

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, obj: Any) -> Resync:
        if _map(obj, "a resync"):
            raise BodyError("a resync is an empty map")
        return cls()


# ---------------------------------------------------------------------- DiLoCo's outer state
@dataclass(frozen=True)
class SyncAsk:
    """Ask a peer for the outer state of `fragments` (none: its versions only), once each of the
    fragments it holds (all, for none) is at version `at_least` or later."""

    fragments: tuple[int, ...]
    at_least: int = 0

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"fragments": list(self.fragments)}
        if self.at_least:
            body["at_least"] = self.at_least
        return body

    @classmethod
    def from_wire(cls, obj: Any) -> SyncAsk:
        body = _map(obj, "a sync request")
        return cls(_fragments(body), _int(body, "at_least") if "at_least" in body else 0)


@dataclass(frozen=True)
class SyncState:
    """A peer's answer: its step and the version of every fragment; the outer parameters and
    momentum of the fragments asked for travel as the frames."""

    step: int
    versions: tuple[int, ...]
    fragments: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "step": self.step, "versions": list(self.versions), "fragments": list(self.fragments)}

    @classmethod
    def from_wire(cls, obj: Any) -> SyncState:
        body = _map(obj, "a sync answer")
        _ok(body, "the sync")
        return cls(_int(body, "step"), _ints(body, "versions", MAX_FRAGMENTS), _fragments(body))


@dataclass(frozen=True)
class NotYet:
    """A peer's answer while a fragment it was asked for is older than `at_least`: its versions."""

    versions: tuple[int, ...]
    reason: str

    @classmethod
    def before(cls, versions: tuple[int, ...], at_least: int) -> NotYet:
        return cls(versions, f"at versions {list(versions)}, not yet {at_least}")

    def to_wire(self) -> dict[str, Any]:
        return {"ok": False, "reason": self.reason, "versions": list(self.versions)}

    @classmethod
    def from_wire(cls, obj: Any) -> NotYet:
        body = _map(obj, "a not-yet answer")
        reason = body.get("reason")
        if body.get("ok") is not False or not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
            raise BodyError(f"a not-yet answer is ok false with a reason of at most {MAX_REASON_CHARS} characters")
        return cls(_ints(body, "versions", MAX_FRAGMENTS), reason)


# ---------------------------------------------------------------------- the drift guard
@dataclass(frozen=True)
class GuardAsk:
    """Ask a member for its digest, or its state, of check round `round`. A round below 0 is
    before every check: the member answers it as past."""

    round: int

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round}

    @classmethod
    def from_wire(cls, obj: Any) -> GuardAsk:
        return cls(_int(_map(obj, "a guard request"), "round", low=-INT64_MAX))


@dataclass(frozen=True)
class Digest:
    """A member's sha256 of its tensors at check round `round`, where that check was a mismatch."""

    round: int
    digest: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "round": self.round, "digest": self.digest}

    @classmethod
    def from_wire(cls, obj: Any) -> Digest:
        body = _map(obj, "a digest answer")
        _ok(body, "the digest")
        digest = body.get("digest")
        if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
            raise BodyError(f"digest must be {DIGEST_BYTES} bytes")
        return cls(_int(body, "round"), digest)


@dataclass(frozen=True)
class GuardState:
    """A member's state as it was at check round `round`: its header; its tensors are the frames."""

    round: int
    header: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "round": self.round, "state": self.header}

    @classmethod
    def from_wire(cls, obj: Any) -> GuardState:
        body = _map(obj, "a state answer")
        _ok(body, "the state")
        header = body.get("state")
        if not isinstance(header, dict):
            raise BodyError(f"state must be a map, got {type(header).__name__}")
        return cls(_int(body, "round"), header)
