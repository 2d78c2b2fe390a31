"""The message bodies of `spsa`, typed (a step record's own map is `records.Record`'s).

Each body is a small frozen dataclass: `to_wire()` gives the msgpack map that travels, and
`from_wire(obj, ...)` checks one that came in and raises `BodyError` naming what is wrong.
Only what a body says by itself is checked here; whether a step fits the leader's log is the
leader's to check (`leader.Sequencer`).

On the wire:

    Contribution  peer -> leader   {"step", "g": codes (one byte per sample), "d": digest or -1}   "spsa.contrib"
    StepClosed    leader -> peer   {"ok": True, "record", "upto": latest closed step, "late"}
    LogAsk        peer -> peer     {"since": step}                                             "spsa.log"
    LogRecords    peer -> peer     {"ok": True, "records": [consecutive records], "upto"}
    StateAsk      peer -> peer     {}                                                          "spsa.state"
    SpsaState     peer -> peer     {"ok": True, "step", "scale": [scale_log2, mean_abs], "keys": int64 LE,
                                    "leader"}            frames: the trained parameters, one float32 vector

A leader or a peer that turns a request down answers `node.rpc.refusal(...)`, a map with
"ok": False and, for a step or a log it cannot place, "too_old" and "upto" (`Declined` reads one).
"""
from __future__ import annotations

import itertools
import math
import struct
from dataclasses import dataclass
from typing import Any

from starling.collectives.bodies import BodyError
from starling.protocols.spsa.arith import NO_DIGEST, codes_from_bytes
from starling.protocols.spsa.records import MAX_CONTRIBUTORS, MAX_PEER_ID_CHARS, Record

__all__ = ["LOG_BATCH", "BodyError", "Contribution", "Declined", "LogAsk", "LogRecords", "SpsaState", "StateAsk",
           "StepClosed"]

LOG_BATCH = 256  # records per "spsa.log" answer, at most
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_SCALE_LOG2 = 1100  # |log2| of any finite double's scale is below this


def _map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BodyError(f"{what} must be a map, got {type(obj).__name__}")
    return obj


def _int(body: dict[str, Any], key: str, low: int, default: int | None = None) -> int:
    if key not in body and default is not None:
        return default
    value = body.get(key)
    if type(value) is not int or not low <= value <= INT64_MAX:
        raise BodyError(f"{key} must be an integer in [{low}, 2**63), got {value!r:.40}")
    return value


def _digest(body: dict[str, Any], key: str) -> int:
    """A 63-bit digest, or NO_DIGEST (the default)."""
    return _int(body, key, NO_DIGEST, default=NO_DIGEST)


def _ok(body: dict[str, Any], what: str) -> None:
    if body.get("ok") is not True:
        raise BodyError(f"{what} refused: {body.get('reason')!s:.200}" if body.get("ok") is False
                        else f"{what} must say ok")


def _upto(body: dict[str, Any]) -> int:
    return _int(body, "upto", -1)


@dataclass(frozen=True)
class Contribution:
    """A peer's codes of step `step` for the leader, with its digest of the parameters the step
    started from (NO_DIGEST when the step takes none). A step outside the leader's log is the
    leader's to refuse (as an unknown step), not malformed."""

    step: int
    codes: bytes
    digest: int = NO_DIGEST

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "g": self.codes, "d": self.digest}

    @classmethod
    def from_wire(cls, obj: Any, samples: int) -> Contribution:
        body = _map(obj, "a contribution {step, g, d}")
        step = _int(body, "step", INT64_MIN)
        codes = body.get("g")
        if not isinstance(codes, bytes) or len(codes) != samples:
            size = len(codes) if isinstance(codes, bytes) else type(codes).__name__
            raise BodyError(f"g must be {samples} bytes, got {size}")
        try:
            codes_from_bytes(codes)
        except ValueError as exc:
            raise BodyError(f"g: {exc}") from None
        return cls(step, codes, _digest(body, "d"))


@dataclass(frozen=True)
class StepClosed:
    """The leader's answer to a contribution: the step's record, the latest step it closed, and
    whether the step closed without the contributor (`late`)."""

    record: Record
    upto: int
    late: bool

    def to_wire(self, omit: int | None = None, samples: int = 0) -> dict[str, Any]:
        """`omit`: the contributor whose codes the record leaves out (it sent them)."""
        return {"ok": True, "record": self.record.to_wire(omit, samples), "upto": self.upto, "late": self.late}

    @classmethod
    def from_wire(cls, obj: Any, samples: int, mine: tuple[int, bytes] | None = None) -> StepClosed:
        """`mine` = (my key, my codes) fills in the codes the leader left out."""
        body = _map(obj, "a closed step")
        _ok(body, "the step")
        late = body.get("late")
        if type(late) is not bool:
            raise BodyError(f"late must be true or false, got {late!r:.40}")
        return cls(Record.from_wire(body.get("record"), samples, mine), _upto(body), late)


@dataclass(frozen=True)
class Declined:
    """A refusal of a contribution or a log request as the asker reads it: the reason text,
    whether the asked step is older than the answerer's log (`too_old`: fetch a state instead),
    and the latest step it closed (-1 where it did not say). Any answer that is not ok is one."""

    reason: str
    too_old: bool = False
    upto: int = -1

    @classmethod
    def from_wire(cls, obj: Any) -> Declined | None:
        """None for an answer that says ok."""
        if isinstance(obj, dict) and obj.get("ok") is True:
            return None
        if not isinstance(obj, dict):
            return cls(f"malformed answer: {type(obj).__name__}")
        upto = obj.get("upto")
        return cls(f"{obj.get('reason')!s:.200}", obj.get("too_old") is True,
                   upto if type(upto) is int and -1 <= upto <= INT64_MAX else -1)


@dataclass(frozen=True)
class LogAsk:
    """Ask for the closed records from step `since` on."""

    since: int

    def to_wire(self) -> dict[str, Any]:
        return {"since": self.since}

    @classmethod
    def from_wire(cls, obj: Any) -> LogAsk:
        return cls(_int(_map(obj, "a log request {since}"), "since", 0))


@dataclass(frozen=True)
class LogRecords:
    """Consecutive closed records (at most LOG_BATCH) and the latest step the answerer closed."""

    records: tuple[Record, ...]
    upto: int

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "records": [r.to_wire() for r in self.records], "upto": self.upto}

    @classmethod
    def from_wire(cls, obj: Any, samples: int) -> LogRecords:
        body = _map(obj, "a log answer")
        _ok(body, "the log")
        rows = body.get("records")
        if not isinstance(rows, list) or len(rows) > LOG_BATCH:
            raise BodyError(f"records must be a list of at most {LOG_BATCH}")
        records = tuple(Record.from_wire(r, samples) for r in rows)
        if any(b.step != a.step + 1 for a, b in itertools.pairwise(records)):
            raise BodyError("records must be of consecutive steps")
        return cls(records, _upto(body))


@dataclass(frozen=True)
class StateAsk:
    """Ask a peer for its trained parameters and the step state that goes with them."""

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, obj: Any) -> StateAsk:
        if _map(obj, "a state request"):
            raise BodyError("a state request is an empty map")
        return cls()


@dataclass(frozen=True)
class SpsaState:
    """A peer's step, its code scale, the contributors of its last applied step (keys ascending)
    and the peer that closed it; the parameters travel as the one frame."""

    step: int
    scale_log2: int
    mean_abs: float
    keys: tuple[int, ...]
    leader: str

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "step": self.step, "scale": [self.scale_log2, self.mean_abs],
                "keys": struct.pack(f"<{len(self.keys)}q", *self.keys), "leader": self.leader}

    @classmethod
    def from_wire(cls, obj: Any) -> SpsaState:
        body = _map(obj, "a state answer")
        _ok(body, "the state")
        scale = body.get("scale")
        if not (isinstance(scale, list) and len(scale) == 2 and type(scale[0]) is int
                and abs(scale[0]) <= MAX_SCALE_LOG2 and type(scale[1]) in (int, float)
                and math.isfinite(scale[1]) and scale[1] > 0):
            raise BodyError(f"scale must be [log2 within +-{MAX_SCALE_LOG2}, finite mean > 0], got {scale!r:.80}")
        raw = body.get("keys")
        if not isinstance(raw, bytes) or len(raw) % 8 or len(raw) // 8 > MAX_CONTRIBUTORS:
            raise BodyError(f"keys must be at most {MAX_CONTRIBUTORS} int64 keys")
        keys = struct.unpack(f"<{len(raw) // 8}q", raw)
        if list(keys) != sorted(set(keys)) or (keys and keys[0] < 0):
            raise BodyError("keys must be ascending, unique and >= 0")
        leader = body.get("leader")
        if not isinstance(leader, str) or not 0 < len(leader) <= MAX_PEER_ID_CHARS:
            raise BodyError("leader must be a peer id")
        return cls(_int(body, "step", 0), scale[0], float(scale[1]), keys, leader)
