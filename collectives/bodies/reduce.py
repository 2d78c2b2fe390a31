"""The sharded all-reduce's bodies (`collectives/reduce.py`): what its members and owners send
each other.

On the wire (keys kept short where a body rides on every chunk of every round):

    Part      member -> owner   {"step", "shard", "chunk", "packet": header or None,
                                 "view": digest | "members": [peer ids], "weight"?, "sig"?,
                                 "recipe"?: [int or bytes, ...]}
    Skip      member -> peers   {"skip": round}                     one way, no answer
    Average   owner -> member   {"ok": True, "packet": header or None, "cm": contributor mask,
                                 "shares"?: [[peer, share], ...], "sig"?}
    HeardAsk  member -> member  {"heard": round, "view", "wants": [[shard, chunk, owner], ...]}
    heard rows member -> member {"ok": True, "rows": [[shard, chunk, owner, average, frames], ...]}
                                 an owner's averages the answerer received, as the owner signed
                                 them (`collectives/secondhand.py`)

"sig": the sender's Ed25519 signature over what the part or average says (see
`collectives/contributions.py`), 64 bytes. "recipe": what the author says it computed the part
from (a protocol's audits read it: `protocols/audit.py`), signed with the part.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starling.collectives.bodies.fields import (
    MAX_PART_BUFFERS,
    BodyError,
    _deal,
    _header,
    _map,
    _members,
    _pairs,
    _recipe,
    _sig,
    _state,
    _view,
    _weight,
    _whole,
)
from starling.collectives.compact import VIEW_DIGEST_BYTES, contributor_mask, contributors_of


@dataclass(frozen=True)
class Part:
    """A member's part of chunk `chunk` of shard `shard` of round `step`, for the shard's owner;
    its values travel as the message's frames. The member list is named by its digest
    (`view`) once the owner has seen it, else sent whole (`members`)."""

    step: int
    shard: int
    chunk: int
    header: dict[str, Any] | None  # the packet header; None where the owner rebuilds it from a template
    view: bytes | None = None
    members: tuple[str, ...] | None = None
    weight: float | None = None  # what the part counts for in the average; None counts 1
    sig: bytes | None = None  # the author's signature (collectives/contributions.py)
    recipe: tuple[int | bytes, ...] | None = None  # what the part was computed from, signed with it
    # secure aggregation: the author's mask-seed share for the owner, sealed to it (collectives/secure.py)
    deal: tuple[int, bytes] | None = None
    # a short digest of the state the author began the round with (what the members hold alike)
    state: bytes | None = None

    def __post_init__(self) -> None:
        if (self.view is None) == (self.members is None):
            raise ValueError("a part names its member list by view or by members, one of the two")

    def with_members(self, members: tuple[str, ...]) -> Part:
        """The same part with its member list sent whole (for an owner that did not know the view)."""
        return Part(self.step, self.shard, self.chunk, self.header, members=members, weight=self.weight, sig=self.sig,
                    recipe=self.recipe, deal=self.deal, state=self.state)

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"step": self.step, "shard": self.shard, "chunk": self.chunk}
        if self.members is not None:
            body["members"] = list(self.members)
        else:
            body["view"] = self.view
        body["packet"] = self.header
        if self.weight is not None:
            body["weight"] = self.weight
        if self.sig is not None:
            body["sig"] = self.sig
        if self.recipe is not None:
            body["recipe"] = list(self.recipe)
        if self.deal is not None:
            body["deal"] = list(self.deal)
        if self.state is not None:
            body["state"] = self.state
        return body

    @classmethod
    def from_wire(cls, obj: Any) -> Part:
        body = _map(obj, "a part")
        step, shard, chunk = _whole(body, "step"), _whole(body, "shard"), _whole(body, "chunk")
        if "members" in body:
            view, members = None, _members(body["members"])
        else:
            view, members = body.get("view"), None
            if not isinstance(view, bytes) or len(view) != VIEW_DIGEST_BYTES:
                raise BodyError(f"view must be a {VIEW_DIGEST_BYTES}-byte digest (or send members)")
        weight = _weight(body["weight"]) if "weight" in body else None
        state = _state(body.get("state"))
        return cls(step, shard, chunk, _header(body), view, members, weight, _sig(body), _recipe(body.get("recipe")),
                   _deal(body.get("deal")), state)


@dataclass(frozen=True)
class Skip:
    """The sender sends nothing in round `round`: no group of that round waits for it."""

    round: int

    def to_wire(self) -> dict[str, Any]:
        return {"skip": self.round}

    @staticmethod
    def is_one(obj: Any) -> bool:
        """Whether a body on a reducer's topic is a skip (else it is a part)."""
        return isinstance(obj, dict) and "skip" in obj

    @classmethod
    def from_wire(cls, obj: Any) -> Skip:
        body = _map(obj, "a skip")
        if type(body.get("skip")) is not int or body["skip"] < 0:
            raise BodyError(f"skip must be a round number, got {body.get('skip')!r}")
        return cls(body["skip"])


def _scores(value: Any, contributors: int) -> tuple[float, tuple[tuple[float, float], ...]] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], list)
            and len(value[1]) == contributors):
        raise BodyError("scores must be [ref, [[dot, norm2], ...]] with one row per contributor")
    rows = []
    for row in value[1]:
        if not (isinstance(row, list) and len(row) == 2 and all(type(v) is float and math.isfinite(v) for v in row)):
            raise BodyError("a score must be two finite floats")
        rows.append((row[0], row[1]))
    ref = value[0]
    if type(ref) is not float or not math.isfinite(ref) or ref < 0.0:
        raise BodyError("a score's reference must be a finite float >= 0")
    return ref, tuple(rows)


@dataclass(frozen=True)
class Average:
    """An owner's answer to a part: the chunk's average (its values travel as the message's
    frames), the members whose parts are in it, and each one's share when weights differed."""

    header: dict[str, Any] | None  # None where the member rebuilds it from a template
    contributors: tuple[str, ...]  # in member order
    shares: tuple[tuple[str, float], ...] = ()  # sorted by peer; () for equal weights
    sig: bytes | None = None  # the owner's signature (collectives/contributions.py)
    # the contributors began the round with different states (their parts' `state` digests differ)
    diverged: bool = False
    # |ref|^2 and each contributor's (<part, ref>, |part|^2) against the round's reference, in
    # contributor order (collectives/suspicion.py); signed with the average
    scores: tuple[float, tuple[tuple[float, float], ...]] | None = None

    def to_wire(self, members: Sequence[str]) -> dict[str, Any]:
        # "cm": a bit per member, not a list of ids, since it rides on every chunk's answer
        body: dict[str, Any] = {"ok": True, "packet": self.header, "cm": contributor_mask(members, self.contributors)}
        if self.shares:
            body["shares"] = [[peer, share] for peer, share in self.shares]
        if self.sig is not None:
            body["sig"] = self.sig
        if self.diverged:
            body["dv"] = True
        if self.scores is not None:
            body["sc"] = [self.scores[0], [[d, n] for d, n in self.scores[1]]]
        return body

    @classmethod
    def from_wire(cls, obj: Any, members: Sequence[str]) -> Average:
        """An answer to a part sent under `members`."""
        body = _map(obj, "an average")
        if body.get("ok") is not True:
            raise BodyError("an average must say ok")
        try:
            contributors = contributors_of(members, body.get("cm"))
        except ValueError as exc:
            raise BodyError(str(exc)) from None
        shares = tuple(sorted(_pairs(body.get("shares") or [], "shares")))
        return cls(_header(body), contributors, shares, _sig(body), body.get("dv") is True,
                   _scores(body.get("sc"), len(contributors)))


@dataclass(frozen=True)
class Refused:
    """A refusal as the member who sent the part reads it: the reason text, and the owner's
    latest round where it refused the part as late (-1 where it did not say)."""

    reason: str
    owner_round: int = -1

    @classmethod
    def from_wire(cls, obj: Any) -> Refused | None:
        """None for an answer that is no refusal; any other answer, however bad, is one."""
        if isinstance(obj, dict) and obj.get("ok") is True:
            return None
        if not isinstance(obj, dict):
            return cls(f"malformed reply: {type(obj).__name__}")
        step = obj.get("step")
        return cls(str(obj.get("reason")), step if type(step) is int else -1)


MAX_WANTS = 1 << 16  # chunks one ask may name: more than a round of any vector has


def _peer(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise BodyError(f"{what} must be a peer id")
    return value


@dataclass(frozen=True)
class HeardAsk:
    """A member that heard nothing from some owners of round `round` asks another member for
    those owners' averages, as they signed them (`collectives/secondhand.py`)."""

    round: int
    view: bytes
    wants: tuple[tuple[int, int, str], ...]  # (shard, chunk, owner)

    def to_wire(self) -> dict[str, Any]:
        return {"heard": self.round, "view": self.view, "wants": [list(w) for w in self.wants]}

    @classmethod
    def from_wire(cls, obj: Any) -> HeardAsk:
        body = _map(obj, "an ask for averages")
        wants = body.get("wants")
        if not isinstance(wants, list) or not 0 < len(wants) <= MAX_WANTS:
            raise BodyError(f"wants must be a list of 1 to {MAX_WANTS} [shard, chunk, owner]")
        out = []
        for want in wants:
            if not (isinstance(want, list) and len(want) == 3 and type(want[0]) is int and type(want[1]) is int
                    and want[0] >= 0 and want[1] >= 0):
                raise BodyError(f"a want must be [shard, chunk, owner], got {want!r}")
            out.append((want[0], want[1], _peer(want[2], "a want's owner")))
        return cls(_whole(body, "heard"), _view(body), tuple(out))


@dataclass(frozen=True)
class HeardRow:
    """One owner's average of one chunk, as another member received it: the owner's body (its
    contributors named by a mask over the round's member list) and how many frames carry it."""

    shard: int
    chunk: int
    owner: str
    average: dict[str, Any]  # `Average.to_wire(members)`, its header whole
    frames: int

    def to_wire(self) -> list[Any]:
        return [self.shard, self.chunk, self.owner, self.average, self.frames]

    @classmethod
    def from_wire(cls, row: Any) -> HeardRow:
        if not (isinstance(row, list) and len(row) == 5 and type(row[0]) is int and type(row[1]) is int
                and row[0] >= 0 and row[1] >= 0 and type(row[4]) is int and 0 < row[4] <= MAX_PART_BUFFERS):
            raise BodyError("a heard row must be [shard, chunk, owner, average, frames]")
        if not isinstance(row[3], dict) or row[3].get("packet") is None:
            raise BodyError("a heard average must carry its header whole")
        return cls(row[0], row[1], _peer(row[2], "a row's owner"), row[3], row[4])



def heard_rows(obj: Any) -> list[HeardRow]:
    """The rows of an answer to a `HeardAsk` (BodyError for a malformed one)."""
    body = _map(obj, "an answer of averages")
    rows = body.get("rows")
    if body.get("ok") is not True or not isinstance(rows, list) or len(rows) > MAX_WANTS:
        raise BodyError("an answer of averages must say ok and list its rows")
    return [HeardRow.from_wire(row) for row in rows]
