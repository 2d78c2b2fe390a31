"""The bodies that show an owner's kept parts on: checks of its averages
(`collectives/checking.py`) and gathers of one author's parts (`collectives/gathering.py`).
Each part is shown as its author signed it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starling.collectives.bodies.fields import (
    MAX_IDS,
    MAX_PART_BUFFERS,
    BodyError,
    _map,
    _recipe,
    _sig,
    _state,
    _view,
    _weight,
    _whole,
)


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
