"""The quorum close's bodies (`collectives/quorum.py`): what a round's members and its leader
send each other.

    Ask       member -> leader  {"round", "members": [peer ids], "weight"}
    Ack       leader -> member  {"ok": True, "round", "ack": signature}    the ask is in the round
    Wait      member -> leader  {"round", "wait": True}            answered when the round closes
    Closing   leader -> member  {"ok": True, "round", "closed": [[peer, weight], ...], "sig": signature}
    Echo      member -> members {"echo": round, "leader", "closed", "sig"}    one way: the set I got

An ask is answered by an Ack while its round is open, else by the Closing (see
`collectives/quorum.py`); "ack" and "sig" are the leader's Ed25519 signatures over what
they say, checked by the member against the leader's key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starling.collectives.bodies.fields import BodyError, _map, _members, _pairs, _weight, _whole


def _signature(body: dict[str, Any], key: str) -> bytes:
    sig = body.get(key)
    if not isinstance(sig, bytes):  # its length is the verifier's to check
        raise BodyError(f"{key} must be a signature (bytes), got {type(sig).__name__}")
    return sig


@dataclass(frozen=True)
class Ask:
    """A member asks round `round`'s leader to count it in: its member list and weight."""

    round: int
    members: tuple[str, ...]
    weight: float

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "members": list(self.members), "weight": self.weight}

    @classmethod
    def from_wire(cls, obj: Any) -> Ask:
        body = _map(obj, "an ask")
        if not {"round", "members", "weight"} <= body.keys():
            raise BodyError("an ask must be {round, members, weight}")
        return cls(_whole(body, "round"), _members(body["members"]), _weight(body["weight"]))


@dataclass(frozen=True)
class Ack:
    """The leader's answer to an ask while round `round` is open: its signature over
    ("quorum.ack", topic, round, asker, weight), a promise that the asker is in the set."""

    round: int
    signature: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "round": self.round, "ack": self.signature}

    @staticmethod
    def is_one(obj: Any) -> bool:
        """Whether an answer to an ask is an ack (else it is a closing set, or bad)."""
        return isinstance(obj, dict) and obj.get("ok") is True and "ack" in obj

    @classmethod
    def from_wire(cls, obj: Any, t: int) -> Ack:
        """A leader's ack of an ask for round t."""
        body = _map(obj, "an ack")
        if body.get("ok") is not True:
            raise BodyError("an ack must say ok")
        if body.get("round") != t:
            raise BodyError(f"an ack for round {body.get('round')!r}, not {t}")
        return cls(t, _signature(body, "ack"))


@dataclass(frozen=True)
class Wait:
    """A member whose ask the leader acknowledged waits for round `round`'s closing set."""

    round: int

    def to_wire(self) -> dict[str, Any]:
        return {"round": self.round, "wait": True}

    @staticmethod
    def is_one(obj: Any) -> bool:
        """Whether a body on a quorum's topic is a wait (else it is an ask)."""
        return isinstance(obj, dict) and "wait" in obj

    @classmethod
    def from_wire(cls, obj: Any) -> Wait:
        body = _map(obj, "a wait")
        if body.get("wait") is not True:
            raise BodyError(f"wait must be true, got {body.get('wait')!r}")
        return cls(_whole(body, "round"))


@dataclass(frozen=True)
class Closing:
    """The contributions round `round` takes: (peer, weight), sorted by peer, and the
    leader's signature over ("quorum.close", topic, round, [[peer, weight], ...])."""

    round: int
    contributions: tuple[tuple[str, float], ...]
    signature: bytes = b""

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(peer for peer, _ in self.contributions)

    def weight_of(self, peer: str) -> float | None:
        return next((w for p, w in self.contributions if p == peer), None)

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "round": self.round, "closed": [[p, w] for p, w in self.contributions],
                "sig": self.signature}

    @classmethod
    def from_wire(cls, obj: Any, t: int) -> Closing:
        """A leader's answer for round t."""
        if not isinstance(obj, dict) or obj.get("ok") is not True:
            reason = obj.get("reason") if isinstance(obj, dict) else None
            raise BodyError(f"not a closing set: {reason or type(obj).__name__}")
        if obj.get("round") != t:
            raise BodyError(f"a set for round {obj.get('round')!r}, not {t}")
        closed = obj.get("closed")
        if not isinstance(closed, list) or not closed:
            raise BodyError("closed must be a non-empty list of [peer, weight]")
        pairs = _pairs(closed, "closed")
        peers = [p for p, _ in pairs]
        if peers != sorted(set(peers)):
            raise BodyError("peers must be sorted and unique")
        return cls(t, pairs, _signature(obj, "sig"))


@dataclass(frozen=True)
class Echo:
    """A member shows others the closing set it got for a round, and from which leader
    (`collectives/quorum.py`): two sets one leader signed for one round are evidence."""

    leader: str
    closing: Closing

    @staticmethod
    def is_one(obj: Any) -> bool:
        return isinstance(obj, dict) and "echo" in obj

    def to_wire(self) -> dict[str, Any]:
        return {"echo": self.closing.round, "leader": self.leader,
                "closed": [[p, w] for p, w in self.closing.contributions], "sig": self.closing.signature}

    @classmethod
    def from_wire(cls, obj: Any) -> Echo:
        body = _map(obj, "an echo")
        leader = body.get("leader")
        if not isinstance(leader, str) or not 0 < len(leader) <= 64:
            raise BodyError("leader must be a peer id")
        t = _whole(body, "echo")
        return cls(leader, Closing.from_wire({"ok": True, "round": t, "closed": body.get("closed"),
                                              "sig": body.get("sig")}, t))

