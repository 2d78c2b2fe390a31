"""Secure aggregation's bodies (`collectives/secure.py`, `collectives/unmasking.py`).

On `<topic>.secagg`:

    Deal      member -> neighbour  {"deal": round, "view", "x", "box"}       one way: a sealed share
    Reveal    owner -> survivor    {"reveal": round, "view", "seeds": [ids], "pairs": [ids]}
    Revealed  survivor -> owner    {"ok": True, "shares": [[dealer, x, y, sig]], "pairs": [[peer, seed]],
                                    "commits": [pair-seed hashes]}
    Passed    unmasker -> owners   {"unmasked": round, "view", "alive": contributor mask,
                                    "seeds": [[peer, seed]], "pairs": [[survivor, dropped, seed]],
                                    "lists": [[survivor, [pair-seed hashes]]]}         one way
    Held      owner -> unmasker    {"held": round, "view", "shard", "chunk", "alive": contributor mask}   one way
    GaveUp    unmasker -> owners   {"gave_up": round, "view"}                  one way: it could not gather the
                                                                               secrets; each owner gathers its own
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starling.collectives.bodies.fields import MAX_DEAL_BYTES, MAX_IDS, SIGNATURE_BYTES, BodyError, _map, _view, _whole

SHARE_BYTES = 66  # a field element of 2^521 - 1, big-endian
SECRET_BYTES = 32  # a seed, or a hash of one


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
class GaveUp:
    """The round's unmasker could not gather the secrets (too few shares came): the other owners
    stop waiting for what it would pass on and gather their own. It asks for nothing and is
    trusted for nothing, so a false one only makes an owner gather sooner."""

    round: int
    view: bytes

    @staticmethod
    def is_one(obj: Any) -> bool:
        return isinstance(obj, dict) and "gave_up" in obj

    def to_wire(self) -> dict[str, Any]:
        return {"gave_up": self.round, "view": self.view}

    @classmethod
    def from_wire(cls, obj: Any) -> GaveUp:
        body = _map(obj, "a gave-up notice")
        return cls(_whole(body, "gave_up"), _view(body))


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
