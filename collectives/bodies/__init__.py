"""The message bodies of the collectives, typed: what a sharded all-reduce's members and owners,
a quorum's members and leader, secure aggregation's members and owners, and an owner's checkers
send each other, one module per family:

    fields.py    `BodyError` and the checks of the fields the bodies share (weights, member
                 lists, signatures, recipes, views)
    reduce.py    the round's: `Part`, `Skip`, `Average`, `Refused` as a member reads a refusal,
                 and a member's ask for averages it missed (`HeardAsk`, `heard_rows`)
    quorum.py    the quorum close's: `Ask`, `Ack`, `Wait`, `Closing`, `Echo`
    secure.py    secure aggregation's: `Deal`, `Reveal`, `Revealed`, `Passed`, `Held`
    checks.py    an owner's kept parts shown on: `CheckAsk`, `Checked`, `KeptAsk`, `kept_rows`

Each body is a small frozen dataclass: `to_wire()` gives the msgpack map that travels, and
`from_wire(obj)` checks one that came in and raises `BodyError` naming what is wrong. Only
what a body says by itself is checked here; what needs the receiver's state (does it own that
shard, is the sender in the member list, does it know that view) is the handler's to check.

An owner or a leader that turns a body down answers `node.rpc.refusal(...)` instead, a map
with "ok": False (`Refused` reads one on the member's side).
"""
from __future__ import annotations

from starling.collectives.bodies.checks import (
    MAX_PART_BUFFERS,
    CheckAsk,
    Checked,
    CheckedPart,
    KeptAsk,
    KeptRow,
    kept_rows,
)
from starling.collectives.bodies.fields import (
    MAX_DEAL_BYTES,
    MAX_IDS,
    MAX_RECIPE_BYTES,
    MAX_RECIPE_FIELDS,
    SIGNATURE_BYTES,
    STATE_DIGEST_BYTES,
    BodyError,
)
from starling.collectives.bodies.quorum import Ack, Ask, Closing, Echo, Wait
from starling.collectives.bodies.reduce import Average, HeardAsk, HeardRow, Part, Refused, Skip, heard_rows
from starling.collectives.bodies.secure import SECRET_BYTES, SHARE_BYTES, Deal, GaveUp, Held, Passed, Reveal, Revealed

__all__ = [
    "MAX_DEAL_BYTES", "MAX_IDS", "MAX_PART_BUFFERS", "MAX_RECIPE_BYTES", "MAX_RECIPE_FIELDS", "SECRET_BYTES",
    "SHARE_BYTES", "SIGNATURE_BYTES", "STATE_DIGEST_BYTES", "Ack", "Ask", "Average", "BodyError", "CheckAsk",
    "Checked", "CheckedPart", "Closing", "Deal", "Echo", "GaveUp", "HeardAsk", "HeardRow", "Held", "KeptAsk",
    "KeptRow", "Part", "Passed", "Refused", "Reveal", "Revealed", "Skip", "Wait", "heard_rows", "kept_rows"
]
