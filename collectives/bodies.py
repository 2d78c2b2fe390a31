"""The message bodies of the collectives, typed: what a sharded all-reduce's members and owners,
and a quorum's members and leader, send each other.

Each body is a small frozen dataclass: `to_wire()` gives the msgpack map that travels, and
`from_wire(obj)` checks one that came in and raises `BodyError` naming what is wrong. Only
what a body says by itself is checked here; what needs the receiver's state (does it own that
shard, is the sender in the member list, does it know that view) is the handler's to check.

On the wire (keys kept short where a body rides on every chunk of every round):

    Part      member -> owner   {"step", "shard", "chunk", "packet": header or None,
                                 "view": digest | "members": [peer ids], "weight"?, "sig"?,
                                 "recipe"?: [int or bytes, ...]}
    Skip      member -> peers   {"skip": round}                     one way, no answer
    Average   owner -> member   {"ok": True, "packet": header or None, "cm": contributor mask,
                                 "shares"?: [[peer, share], ...], "sig"?}

"sig": the sender's Ed25519 signature over what the part or average says (see
`collectives/contributions.py`), 64 bytes. "recipe": what the author says it computed the part
from (a protocol's audits read it: `protocols/audit.py`), signed with the part.
    Ask       member -> leader  {"round", "members": [peer ids], "weight"}
    Ack       leader -> member  {"ok": True, "round", "ack": signature}    the ask is in the round
    Wait      member -> leader  {"round", "wait": True}            answered when the round closes
    Closing   leader -> member  {"ok": True, "round", "closed": [[peer, weight], ...], "sig": signature}
    Echo      member -> members {"echo": round, "leader", "closed", "sig"}    one way: the set I got

An ask is answered by an Ack while its round is open, else by the Closing (see
`collectives/quorum.py`); "ack" and "sig" are the leader's Ed25519 signatures over what
they say, checked by the member against the leader's key.

An owner or a leader that turns a body down answers `node.rpc.refusal(...)` instead, a map
with "ok": False (`Refused` reads one on the member's side).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starling.collectives.compact import VIEW_DIGEST_BYTES, contributor_mask, contributors_of

STATE_DIGEST_BYTES = 8  # a part's digest of the state its author began the round with

SIGNATURE_BYTES = 64  # Ed25519


class BodyError(ValueError):
    """A body that is not what its topic takes; the message names what is wrong."""


def _map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BodyError(f"{what} must be a map, got {type(obj).__name__}")
    return obj


def _whole(obj: dict[str, Any], key: str) -> int:
    value = obj.get(key)
    if type(value) is not int or value < 0:
        raise BodyError(f"{key} must be a whole number >= 0, got {value!r}")
    return value


def _weight(value: Any) -> float:
    if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0.0):
        raise BodyError(f"weight must be a finite number >= 0, got {value!r}")
    return float(value)


def _members(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise BodyError("members must be a list of peer ids")
    if value != sorted(set(value)):
        raise BodyError("members must be sorted and unique")
    return tuple(value)


MAX_DEAL_BYTES = 256  # a sealed share: 66 bytes of field element, a 64-byte signature, a 16-byte tag


def _deal(value: Any) -> tuple[int, bytes] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and type(value[0]) is int and value[0] > 0
            and isinstance(value[1], bytes) and len(value[1]) <= MAX_DEAL_BYTES):
        raise BodyError(f"deal must be [point > 0, sealed share of at most {MAX_DEAL_BYTES} bytes]")
    return value[0], value[1]


def _state(value: Any) -> bytes | None:
    if value is not None and not (isinstance(value, bytes) and len(value) == STATE_DIGEST_BYTES):
        raise BodyError(f"state must be a {STATE_DIGEST_BYTES}-byte digest")
    return value


def _header(obj: dict[str, Any]) -> dict[str, Any] | None:
    if "packet" not in obj:
        raise BodyError("packet header missing (None where the receiver rebuilds it)")
    header = obj["packet"]
    if header is not None and not isinstance(header, dict):
        raise BodyError(f"packet header must be a map or None, got {type(header).__name__}")
    return header


def _sig(obj: dict[str, Any]) -> bytes | None:
    sig = obj.get("sig")
    if sig is not None and (not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES):
        raise BodyError(f"sig must be {SIGNATURE_BYTES} bytes, got {type(sig).__name__}")
    return sig


MAX_RECIPE_FIELDS = 8
MAX_RECIPE_BYTES = 64


def _recipe(value: Any) -> tuple[int | bytes, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_RECIPE_FIELDS:
        raise BodyError(f"recipe must be a list of at most {MAX_RECIPE_FIELDS} fields")
    for field_ in value:
        if not ((type(field_) is int and -(1 << 63) <= field_ < (1 << 63))
                or (isinstance(field_, bytes) and len(field_) <= MAX_RECIPE_BYTES)):
            raise BodyError(f"recipe fields must be 64-bit integers or at most {MAX_RECIPE_BYTES} bytes, "
                            f"got {field_!r:.40}")
    return tuple(value)


def _pairs(value: Any, what: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, list):
        raise BodyError(f"{what} must be a list of [peer, number]")
    pairs = []
    for entry in value:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
                and type(entry[1]) in (int, float) and math.isfinite(entry[1]) and entry[1] >= 0.0):
            raise BodyError(f"{what}: bad entry {entry!r}, expected [peer, number >= 0]")
        pairs.append((entry[0], float(entry[1])))
    return tuple(pairs)


# ---------------------------------------------------------------------- the sharded all-reduce
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


# ---------------------------------------------------------------------- the quorum close
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


# ---------------------------------------------------------------------- secure aggregation
# On `<topic>.secagg` (collectives/secure.py):
#
#     Deal      member -> neighbour  {"deal": round, "view", "x", "box"}       one way: a sealed share
#     Reveal    owner -> survivor    {"reveal": round, "view", "seeds": [ids], "pairs": [ids]}
#     Revealed  survivor -> owner    {"ok": True, "shares": [[dealer, x, y, sig]], "pairs": [[peer, seed]],
#                                     "commits": [pair-seed hashes]}
#     Passed    unmasker -> owners   {"unmasked": round, "view", "alive": contributor mask,
#                                     "seeds": [[peer, seed]], "pairs": [[survivor, dropped, seed]],
#                                     "lists": [[survivor, [pair-seed hashes]]]}         one way
SHARE_BYTES = 66  # a field element of 2^521 - 1, big-endian
SECRET_BYTES = 32  # a seed, or a hash of one
MAX_IDS = 1 << 16  # peer ids one secure-aggregation body may name


def _view(obj: dict[str, Any]) -> bytes:
    view = obj.get("view")
    if not isinstance(view, bytes) or len(view) != VIEW_DIGEST_BYTES:
        raise BodyError(f"view must be a {VIEW_DIGEST_BYTES}-byte digest")
    return view


def _ids(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_IDS or not all(isinstance(v, str) for v in value):
        raise BodyError(f"{what} must be a list of at most {MAX_IDS} peer ids")
    return tuple(value)


def _secret(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != SECRET_BYTES:
        raise BodyError(f"{what} must be {SECRET_BYTES} bytes")
    return value


def _rows(value: Any, what: str, width: int) -> list[list[Any]]:
    if not isinstance(value, list) or len(value) > MAX_IDS \
            or not all(isinstance(row, list) and len(row) == width for row in value):
        raise BodyError(f"{what} must be a list of at most {MAX_IDS} rows of {width}")
    return value


@dataclass(frozen=True)
class Deal:
    """A member's share of its round's self-mask seed, sealed for the neighbour it goes to."""

    round: int
    view: bytes
    x: int
    box: bytes

    @staticmethod
    def is_one(obj: Any) -> bool:
        return isinstance(obj, dict) and "deal" in obj

    def to_wire(self) -> dict[str, Any]:
        return {"deal": self.round, "view": self.view, "x": self.x, "box": self.box}

    @classmethod
    def from_wire(cls, obj: Any) -> Deal:
        body = _map(obj, "a deal")
        x, box = body.get("x"), body.get("box")
        if type(x) is not int or x < 1 or not isinstance(box, bytes) or len(box) > MAX_DEAL_BYTES:
            raise BodyError(f"a deal needs a point x >= 1 and a sealed share of at most {MAX_DEAL_BYTES} bytes")
        return cls(_whole(body, "deal"), _view(body), x, box)


@dataclass(frozen=True)
class Reveal:
    """An owner asks a survivor for its shares of `seeds`' self-mask seeds (they survived) and
    its pair seeds with `pairs` (they dropped)."""

    round: int
    view: bytes
    seeds: tuple[str, ...]
    pairs: tuple[str, ...]

    @staticmethod
    def is_one(obj: Any) -> bool:
        return isinstance(obj, dict) and "reveal" in obj

    def to_wire(self) -> dict[str, Any]:
        return {"reveal": self.round, "view": self.view, "seeds": list(self.seeds), "pairs": list(self.pairs)}

    @classmethod
    def from_wire(cls, obj: Any) -> Reveal:
        body = _map(obj, "a reveal request")
        return cls(_whole(body, "reveal"), _view(body), _ids(body.get("seeds"), "seeds"),
                   _ids(body.get("pairs"), "pairs"))


@dataclass(frozen=True)
class Revealed:
    """A survivor's answer: the shares it holds (each as its dealer signed it), its pair seeds
    with the dropped, and the hashes of all its pair seeds (which its parts committed to)."""

    shares: tuple[tuple[str, int, int, bytes], ...]  # (dealer, x, y, dealer's signature)
    pairs: tuple[tuple[str, bytes], ...]
    commits: tuple[bytes, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "shares": [[d, x, y.to_bytes(SHARE_BYTES, "big"), s] for d, x, y, s in self.shares],
                "pairs": [[p, seed] for p, seed in self.pairs], "commits": list(self.commits)}

    @classmethod
    def from_wire(cls, obj: Any) -> Revealed:
        body = _map(obj, "a reveal")
        if body.get("ok") is not True:
            raise BodyError(f"refused: {body.get('reason', body.get('code'))}")
        shares = []
        for dealer, x, y, sig in _rows(body.get("shares"), "shares", 4):
            if not (isinstance(dealer, str) and type(x) is int and isinstance(y, bytes) and len(y) == SHARE_BYTES
                    and isinstance(sig, bytes) and len(sig) == SIGNATURE_BYTES):
                raise BodyError("a share must be [dealer, x, 66-byte y, 64-byte signature]")
            shares.append((dealer, x, int.from_bytes(y, "big"), sig))
        pairs = []
        for peer, seed in _rows(body.get("pairs"), "pairs", 2):
            if not isinstance(peer, str):
                raise BodyError("a pair seed must be [peer id, seed]")
            pairs.append((peer, _secret(seed, "a pair seed")))
        commits = body.get("commits")
        if not isinstance(commits, list) or len(commits) > MAX_IDS:
            raise BodyError(f"commits must be a list of at most {MAX_IDS} hashes")
        return cls(tuple(shares), tuple(pairs), tuple(_secret(c, "a pair-seed hash") for c in commits))


@dataclass(frozen=True)
class Passed:
    """The round's unmasker passes on the secrets it gathered for the survivors `alive`."""

    round: int
    view: bytes
    alive: bytes  # contributor mask over the view's members
    seeds: tuple[tuple[str, bytes], ...]
    pairs: tuple[tuple[str, str, bytes], ...]
    lists: tuple[tuple[str, tuple[bytes, ...]], ...]

    @staticmethod
    def is_one(obj: Any) -> bool:
        return isinstance(obj, dict) and "unmasked" in obj

    def to_wire(self) -> dict[str, Any]:
        return {"unmasked": self.round, "view": self.view, "alive": self.alive,
                "seeds": [list(s) for s in self.seeds], "pairs": [list(p) for p in self.pairs],
                "lists": [[j, list(h)] for j, h in self.lists]}

    @classmethod
    def from_wire(cls, obj: Any) -> Passed:
        body = _map(obj, "passed-on secrets")
        alive = body.get("alive")
        if not isinstance(alive, bytes):
            raise BodyError("alive must be a contributor mask")
        seeds = tuple((_ids([m], "a seed's member")[0], _secret(s, "a seed"))
                      for m, s in _rows(body.get("seeds"), "seeds", 2))
        pairs = tuple((_ids([j, d], "a pair's members")[0], d, _secret(s, "a pair seed"))
                      for j, d, s in _rows(body.get("pairs"), "pairs", 3))
        lists = []
        for j, hashes in _rows(body.get("lists"), "lists", 2):
            if not isinstance(j, str) or not isinstance(hashes, list) or len(hashes) > MAX_IDS:
                raise BodyError("a list must be [survivor, [pair-seed hashes]]")
            lists.append((j, tuple(_secret(h, "a pair-seed hash") for h in hashes)))
        return cls(_whole(body, "unmasked"), _view(body), alive, seeds, pairs, tuple(lists))


@dataclass(frozen=True)
class Held:
    """An owner tells the round's unmasker whose parts one of its closed groups holds: the
    unmasker sums only members every group holds, so that no member is alive at one owner and
    dropped at another (which the holders would refuse, dropping a group)."""

    round: int
    view: bytes
    shard: int
    chunk: int
    alive: bytes  # contributor mask over the view's members

    @staticmethod
    def is_one(obj: Any) -> bool:
        return isinstance(obj, dict) and "held" in obj

    def to_wire(self) -> dict[str, Any]:
        return {"held": self.round, "view": self.view, "shard": self.shard, "chunk": self.chunk, "alive": self.alive}

    @classmethod
    def from_wire(cls, obj: Any) -> Held:
        body = _map(obj, "a held set")
        alive = body.get("alive")
        if not isinstance(alive, bytes) or len(alive) > MAX_IDS // 8:
            raise BodyError("alive must be a contributor mask")
        return cls(_whole(body, "held"), _view(body), _whole(body, "shard"), _whole(body, "chunk"), alive)


# ---------------------------------------------------------------------- checks of an owner's averages
MAX_PART_BUFFERS = 8  # a packet has one to three buffers


@dataclass(frozen=True)
class CheckAsk:
    """A member asks an owner for the parts behind one chunk's average of a round it answered
    (`collectives/checking.py`)."""

    round: int
    view: bytes
    shard: int
    chunk: int

    def to_wire(self) -> dict[str, Any]:
        return {"check": self.round, "view": self.view, "shard": self.shard, "chunk": self.chunk}

    @classmethod
    def from_wire(cls, obj: Any) -> CheckAsk:
        body = _map(obj, "a check")
        return cls(_whole(body, "check"), _view(body), _whole(body, "shard"), _whole(body, "chunk"))


# A part as its author signed it, shown on: [weight, sig, recipe, header, buffers, state], its
# bytes being the next `buffers` frames of the answer (checks, gathers).
_Signed = tuple[float, bytes, tuple[int | bytes, ...] | None, dict[str, Any], int, bytes | None]


def _signed_wire(weight: float, sig: bytes, recipe: tuple[int | bytes, ...] | None, header: dict[str, Any],
                 buffers: int, state: bytes | None) -> list[Any]:
    return [weight, sig, None if recipe is None else list(recipe), header, buffers, state]


def _signed(fields: list[Any], what: str) -> _Signed:
    weight, sig, recipe, header, buffers, state = fields
    signature = _sig({"sig": sig})
    if signature is None:
        raise BodyError(f"{what} must carry its author's signature")
    if not isinstance(header, dict):
        raise BodyError(f"{what}'s header must be a map")
    if type(buffers) is not int or not 0 <= buffers <= MAX_PART_BUFFERS:
        raise BodyError(f"{what} has 0 to {MAX_PART_BUFFERS} buffers")
    return _weight(weight), signature, _recipe(recipe), header, buffers, _state(state)


@dataclass(frozen=True)
class CheckedPart:
    """One part of a checked group, as its author signed it."""

    author: str
    weight: float
    sig: bytes
    recipe: tuple[int | bytes, ...] | None
    header: dict[str, Any]
    buffers: int
    state: bytes | None = None

    def to_wire(self) -> list[Any]:
        return [self.author, *_signed_wire(self.weight, self.sig, self.recipe, self.header, self.buffers, self.state)]

    @classmethod
    def from_wire(cls, row: Any) -> CheckedPart:
        if not (isinstance(row, list) and len(row) == 7 and isinstance(row[0], str)):
            raise BodyError("a checked part must be [author, weight, sig, recipe, header, buffers, state]")
        return cls(row[0], *_signed(row[1:], "a checked part"))


@dataclass(frozen=True)
class Checked:
    """An owner's answer to a check: every part its group received, in member order, and its
    signature over which parts they are ("checked", topic, round, shard, chunk, view,
    [[author, content digest], ...]), so that what it shows binds it."""

    parts: tuple[CheckedPart, ...]
    sig: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "parts": [p.to_wire() for p in self.parts], "sig": self.sig}

    @classmethod
    def from_wire(cls, obj: Any) -> Checked:
        body = _map(obj, "a checked answer")
        rows = body.get("parts")
        if not isinstance(rows, list) or len(rows) > MAX_IDS:
            raise BodyError(f"parts must be a list of at most {MAX_IDS}")
        sig = _sig(body)
        if sig is None:
            raise BodyError("a checked answer must be signed by its owner")
        return cls(tuple(CheckedPart.from_wire(r) for r in rows), sig)


# ---------------------------------------------------------------------- an author's parts, gathered
@dataclass(frozen=True)
class KeptAsk:
    """A member asks an owner for the parts one author sent its groups in a round that it kept
    (`collectives/gathering.py`): to check a whole pseudo-gradient, not the owner's shard of it."""

    round: int
    view: bytes
    author: str

    def to_wire(self) -> dict[str, Any]:
        return {"kept": self.round, "view": self.view, "author": self.author}

    @classmethod
    def from_wire(cls, obj: Any) -> KeptAsk:
        body = _map(obj, "a gather")
        author = body.get("author")
        if not isinstance(author, str) or not 0 < len(author) <= 64:
            raise BodyError("author must be a peer id")
        return cls(_whole(body, "kept"), _view(body), author)


@dataclass(frozen=True)
class KeptRow:
    """One part an owner kept of one author, at its chunk, as the author signed it."""

    shard: int
    chunk: int
    weight: float
    sig: bytes
    recipe: tuple[int | bytes, ...] | None
    header: dict[str, Any]
    buffers: int
    state: bytes | None = None

    def to_wire(self) -> list[Any]:
        return [self.shard, self.chunk,
                *_signed_wire(self.weight, self.sig, self.recipe, self.header, self.buffers, self.state)]

    @classmethod
    def from_wire(cls, row: Any) -> KeptRow:
        if not (isinstance(row, list) and len(row) == 8 and type(row[0]) is int and type(row[1]) is int
                and row[0] >= 0 and row[1] >= 0):
            raise BodyError("a kept part must be [shard, chunk, weight, sig, recipe, header, buffers, state]")
        return cls(row[0], row[1], *_signed(row[2:], "a kept part"))


def kept_rows(obj: Any) -> tuple[KeptRow, ...]:
    """The rows of an owner's answer to a `KeptAsk`: {"ok": True, "parts": [...]}."""
    body = _map(obj, "a gathered answer")
    rows = body.get("parts")
    if not isinstance(rows, list) or len(rows) > MAX_IDS:
        raise BodyError(f"parts must be a list of at most {MAX_IDS}")
    return tuple(KeptRow.from_wire(r) for r in rows)
