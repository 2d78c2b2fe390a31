"""The step records of `spsa` and the log of them that every peer keeps.

A record is everything needed to apply step t anywhere: who contributed (peer keys, ascending:
the canonical order), their one-byte codes, and the drift guard's reference digest. Peers apply
records, never parameters, so a joiner that holds the parameters of step s replays records
s, s+1, ... and lands on the swarm's bits.

On the wire a record is a msgpack map of a few ints and two byte strings:
``{"t": step, "l": leader id, "k": keys (int64 little-endian), "g": codes (int8, contributor-major),
"d": reference digest or -1, "s": key of a peer holding it or -1}``.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any

import torch

from starling.collectives.bodies import BodyError
from starling.protocols.spsa.arith import CODE_RESERVED, NO_DIGEST, codes_from_bytes

MAX_CONTRIBUTORS = 4096
MAX_PEER_ID_CHARS = 64
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Record:
    step: int
    leader: str  # the peer that closed the step
    keys: tuple[int, ...]  # contributors' peer keys, ascending
    codes: bytes  # len(keys) * samples codes, contributor-major
    digest: int = NO_DIGEST  # the reference digest of the parameters the step started from
    source: int = NO_DIGEST  # a contributor whose digest is the reference (a repair source)

    def codes_of(self, key: int, samples: int) -> bytes:
        i = self.keys.index(key)
        return self.codes[i * samples:(i + 1) * samples]

    def to_wire(self, omit: int | None = None, samples: int = 0) -> dict[str, Any]:
        """As a message body; `omit` drops that contributor's codes (the requester has them)."""
        codes = self.codes
        if omit is not None:
            i = self.keys.index(omit)
            codes = codes[:i * samples] + codes[(i + 1) * samples:]
        body = {"t": self.step, "l": self.leader, "k": struct.pack(f"<{len(self.keys)}q", *self.keys),
                "g": codes, "d": self.digest, "s": self.source}
        if omit is not None:
            body["o"] = True
        return body

    @classmethod
    def from_wire(cls, body: Any, samples: int, mine: tuple[int, bytes] | None = None) -> Record:
        """Parse and check a record; `mine` = (my key, my codes) fills in an omitted entry.
        Raises BodyError (a ValueError) naming what is wrong."""
        if not isinstance(body, dict):
            raise BodyError("record must be a map")
        step, leader, keys_raw, codes = body.get("t"), body.get("l"), body.get("k"), body.get("g")
        digest, source = body.get("d", NO_DIGEST), body.get("s", NO_DIGEST)
        if type(step) is not int or not 0 <= step <= INT64_MAX:
            raise BodyError(f"record step must be an integer in [0, 2**63), got {step!r:.40}")
        if not all(type(v) is int and NO_DIGEST <= v <= INT64_MAX for v in (digest, source)):
            raise BodyError(f"record digest and source must be 63-bit integers or {NO_DIGEST}")
        if not isinstance(leader, str) or not 0 < len(leader) <= MAX_PEER_ID_CHARS:
            raise BodyError("record leader must be a peer id")
        if not isinstance(keys_raw, bytes) or not isinstance(codes, bytes):
            raise BodyError("record needs byte strings k and g")
        if len(keys_raw) % 8 or not 0 < len(keys_raw) // 8 <= MAX_CONTRIBUTORS:
            raise BodyError(f"record keys: {len(keys_raw)} bytes is not 1..{MAX_CONTRIBUTORS} int64 keys")
        keys = struct.unpack(f"<{len(keys_raw) // 8}q", keys_raw)
        if list(keys) != sorted(set(keys)) or keys[0] < 0:
            raise BodyError("record keys must be ascending, unique and >= 0")
        if body.get("o"):
            if mine is None or mine[0] not in keys:
                raise BodyError("record omits the requester's codes but the requester is not in it")
            i = keys.index(mine[0])
            codes = codes[:i * samples] + mine[1] + codes[i * samples:]
        if len(codes) != len(keys) * samples:
            raise BodyError(f"record has {len(codes)} codes for {len(keys)} contributors x {samples} samples")
        try:
            codes_from_bytes(codes)
        except ValueError as exc:
            raise BodyError(f"record codes: {exc}") from None
        return cls(step, leader, tuple(keys), codes, digest, source)

    def to_state(self) -> dict[str, Any]:
        """For state_dict: tensors, ints and strs only (torch.load(weights_only=True))."""
        return {"step": self.step, "leader": self.leader, "keys": torch.tensor(self.keys, dtype=torch.int64),
                "codes": torch.frombuffer(bytearray(self.codes), dtype=torch.int8).clone() if self.codes
                else torch.zeros(0, dtype=torch.int8), "digest": self.digest, "source": self.source}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Record:
        return cls(int(state["step"]), str(state["leader"]), tuple(int(k) for k in state["keys"].tolist()),
                   state["codes"].numpy().tobytes(), int(state["digest"]), int(state["source"]))


class RecordLog:
    """Closed steps by number, the last `keep` of them; shared by the training and network threads."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._records: dict[int, Record] = {}
        self._lock = threading.Lock()

    def add(self, record: Record) -> None:
        with self._lock:
            self._records.setdefault(record.step, record)  # the first record of a step stands
            while len(self._records) > self.keep:
                del self._records[min(self._records)]

    def get(self, step: int) -> Record | None:
        with self._lock:
            return self._records.get(step)

    def since(self, step: int, limit: int) -> list[Record]:
        """Consecutive records from `step` on (stops at the first gap)."""
        out = []
        with self._lock:
            while len(out) < limit and step + len(out) in self._records:
                out.append(self._records[step + len(out)])
        return out

    @property
    def upto(self) -> int:
        """The latest closed step known here (-1 if none)."""
        with self._lock:
            return max(self._records, default=-1)

    @property
    def oldest(self) -> int:
        with self._lock:
            return min(self._records, default=-1)

    def drop_after(self, step: int) -> None:
        """Forget records past `step` (they were written by a leader this peer no longer follows)."""
        with self._lock:
            for t in [t for t in self._records if t > step]:
                del self._records[t]


__all__ = ["CODE_RESERVED", "MAX_CONTRIBUTORS", "MAX_PEER_ID_CHARS", "Record", "RecordLog"]
