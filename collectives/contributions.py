"""Contributions that can be held against their author: the signatures on a sharded
all-reduce's parts and averages, and the evidence they make.

    member: part of chunk c of shard i of round t, under member list `view` (its digest):
        content = sha256(canonical packet header, buffers)
        sig     = sign("part", topic, t, i, c, view, weight, content[, recipe][, state])
                  (recipe: what the author says it computed the part from, for audits that
                  recompute it; only when the protocol states one. state: the digest of the
                  state its author began the round with, where the protocol names one)
    owner:  a part whose signature does not verify is refused (`bad_signature`) and counted
            against nobody (a relay or a stranger may have made it); one that verifies is the
            author's word, and what is wrong with it is evidence against the author
    owner:  average of (t, i, c): sig = sign("avg", topic, t, i, c, view, contributors, content),
            so a member holds what each owner told it, and owners that disagree can be shown

The round, the topic, the shard and the member list are in what is signed: a part replayed
into another round, topic or shard, or altered on the way, does not verify.

Evidence any peer can check from the evidence alone (checks registered on `node.trust`):

    part.not_finite   a signed part whose values are not all finite
    part.overweight   a signed part claiming more weight than the swarm's cap allows

A witness's word (two ban): `part.replayed`, two signed parts of one author with the same
non-zero content in two rounds, begun from states it signed as different. Not proof: a chunk
that nobody averaged keeps its parameters while the rest of the state moves on, and a loss
that is separable and deterministic there gives it the same gradient again.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from starling.compressors import Packet, decode
from starling.node.trust import Evidence, digest, statement

if TYPE_CHECKING:
    from starling.node import Node

NOT_FINITE, OVERWEIGHT, REPLAYED = "part.not_finite", "part.overweight", "part.replayed"
_MAX_EVIDENCE_BUFFERS = 8  # a packet has one to three buffers; evidence with more is no packet of ours
# Values a part in evidence may decode to: a chunk holds at most a few million (layout.py's
# DEFAULT_CHUNK_NUMEL is 1M); a sparse header could name any size and make its check allocate it.
_MAX_EVIDENCE_NUMEL = 1 << 24


def content_digest(header: dict[str, Any], buffers: Sequence[torch.Tensor]) -> bytes:
    """What a signature names for a packet: its header (canonical) and its bytes."""
    return digest(statement(header), *(b.numpy() for b in buffers))


def _weight(weight: float | None) -> float:
    return 1.0 if weight is None else float(weight)


Recipe = tuple[int | bytes, ...]  # what an author says it computed a part from (plain data)
# What an owner says of a chunk's parts against the round's reference (collectives/suspicion.py):
# |ref|^2 over the chunk's sampled coordinates, and each contributor's (<part, ref>, |part|^2),
# in contributor order.
Scores = tuple[float, tuple[tuple[float, float], ...]]


def scores_wire(scores: Scores) -> list[Any]:
    return [float(scores[0]), [[float(d), float(n)] for d, n in scores[1]]]


def vote_key(content: bytes, scores: Scores | None) -> bytes:
    """What replicated owners' answers are compared by: the packet's digest, and the scores'."""
    return content if scores is None else digest(content, statement(scores_wire(scores)))


@dataclass(frozen=True)
class SignedPart:
    """A part as its author signed it: what an owner keeps as evidence until the group closes
    (and, for audits, past it)."""

    view: bytes
    weight: float | None
    packet: Packet | None
    sig: bytes
    content: bytes
    recipe: Recipe | None = None
    state: bytes | None = None  # the digest of the state its author began the round with, signed

    def kept(self) -> SignedPart:
        """This part with bytes of its own. A received part's buffers may be the sender's
        memory (ZeroMQ's inproc transport passes a zero-copy frame as it is, and a lent part
        is a slice of its author's vector, which it writes once its round is over): what is
        kept past the round must be copied before the owner answers, while they still hold
        what was signed."""
        if self.packet is None:
            return self
        packet = Packet(copy.deepcopy(self.packet.header), tuple(b.clone() for b in self.packet.buffers))
        return dataclasses.replace(self, packet=packet)

    def detail(self, topic: str, i: int, c: int) -> dict[str, Any]:
        """The part's signed fields as evidence carries them (its bytes not included)."""
        detail = {"topic": topic, "shard": i, "chunk": c, "view": self.view, "weight": _weight(self.weight),
                  "content": self.content, "sig": self.sig}
        if self.recipe is not None:
            detail["recipe"] = list(self.recipe)
        if self.state is not None:
            detail["state"] = self.state
        return detail


def _part_statement(topic: str, t: int, i: int, c: int, view: bytes, weight: float, content: bytes,
                    recipe: Recipe | None, state: bytes | None = None) -> bytes:
    """A part without a recipe or a state signs the same bytes as before they existed."""
    fields: list[Any] = ["part", topic, t, i, c, view, weight, content]
    if recipe is not None or state is not None:
        fields.append(None if recipe is None else list(recipe))
    if state is not None:
        fields.append(state)
    return statement(*fields)


class Contributions:
    """Signs this peer's parts and averages under `topic`, checks others', and makes and
    checks the evidence of the kinds above. `max_weight`: the most a part may claim (None:
    no cap), the same on every peer of the swarm."""

    def __init__(self, node: Node, topic: str, max_weight: float | None = None) -> None:
        if max_weight is not None and not (math.isfinite(max_weight) and max_weight > 0.0):
            raise ValueError(f"max_weight must be a finite number > 0, got {max_weight!r}")
        self.node, self.topic, self.max_weight = node, topic, max_weight
        self.trust = node.trust
        # One check per kind per node: several reducers register the same function of the
        # evidence (each check reads the topic from the evidence, and the cap is swarm config).
        self.trust.register_check(NOT_FINITE, _check_not_finite)
        if max_weight is not None:
            self.trust.register_check(OVERWEIGHT, self._check_overweight)

    # ------------------------------------------------------------------ parts
    def part_statement(self, t: int, i: int, c: int, view: bytes, weight: float | None, content: bytes,
                       recipe: Recipe | None = None, state: bytes | None = None) -> bytes:
        return _part_statement(self.topic, t, i, c, view, _weight(weight), content, recipe, state)

    def sign_part(self, t: int, i: int, c: int, view: bytes, weight: float | None, packet: Packet,
                  recipe: Recipe | None = None, state: bytes | None = None) -> bytes:
        """Any thread: the identity's key signs without shared state."""
        content = content_digest(packet.header, packet.buffers)
        return self.trust.sign(self.part_statement(t, i, c, view, weight, content, recipe, state))

    def verify_part(self, sender: str, t: int, i: int, c: int, view: bytes, weight: float | None,
                    packet: Packet, sig: Any, recipe: Recipe | None = None,
                    state: bytes | None = None) -> bytes | None:
        """The part's content digest if `sender` signed it, else None."""
        content = content_digest(packet.header, packet.buffers)
        ok = self.trust.verify(sender, self.part_statement(t, i, c, view, weight, content, recipe, state), sig)
        return content if ok else None

    def overweight(self, weight: float | None) -> bool:
        return self.max_weight is not None and _weight(weight) > self.max_weight * (1.0 + 1e-9)

    def part_evidence(self, kind: str, sender: str, t: int, i: int, c: int, view: bytes, weight: float | None,
                      packet: Packet | None, sig: bytes, content: bytes, recipe: Recipe | None = None,
                      state: bytes | None = None, **extra: Any) -> Evidence | None:
        """Evidence of `kind` against a part's author; None if its key is unknown here."""
        key = self.trust.key_of(sender)
        if key is None:
            return None
        detail = {"topic": self.topic, "shard": i, "chunk": c, "view": view, "weight": _weight(weight),
                  "content": content, "sig": sig, **extra}
        if recipe is not None:
            detail["recipe"] = list(recipe)
        if state is not None:
            detail["state"] = state
        if packet is not None:
            detail["header"] = packet.header
            detail["buffers"] = [bytes(b.numpy()) for b in packet.buffers]
        return Evidence(kind, sender, key, t, detail)

    def _check_overweight(self, evidence: Evidence) -> bool:
        d = evidence.detail
        return (_signed_part(evidence, d, evidence.round) and isinstance(d.get("weight"), float)
                and self.overweight(d["weight"]))

    # ------------------------------------------------------------------ averages
    def average_statement(self, t: int, i: int, c: int, view: bytes, contributors: Sequence[str],
                          content: bytes, scores: Scores | None = None) -> bytes:
        """An average without scores signs the same bytes as before scores existed."""
        if scores is None:
            return statement("avg", self.topic, t, i, c, view, list(contributors), content)
        return statement("avg", self.topic, t, i, c, view, list(contributors), content, scores_wire(scores))

    def sign_average(self, t: int, i: int, c: int, view: bytes, contributors: Sequence[str], packet: Packet,
                     scores: Scores | None = None) -> bytes:
        content = content_digest(packet.header, packet.buffers)
        return self.trust.sign(self.average_statement(t, i, c, view, contributors, content, scores))

    def verify_average(self, owner: str, t: int, i: int, c: int, view: bytes, contributors: Sequence[str],
                       packet: Packet, sig: Any, scores: Scores | None = None) -> bytes | None:
        """What replicated owners' answers are compared by if `owner` signed this one (the
        packet's digest, and the scores' with them), else None."""
        content = content_digest(packet.header, packet.buffers)
        ok = self.trust.verify(owner, self.average_statement(t, i, c, view, contributors, content, scores), sig)
        return vote_key(content, scores) if ok else None


# ---------------------------------------------------------------------- checks of evidence
def _signed_part(evidence: Evidence, d: dict[str, Any], t: int) -> bool:
    """Whether the accused signed the part `d` describes (in round t). Never raises."""
    recipe, state = d.get("recipe"), d.get("state")
    if (recipe is not None and not isinstance(recipe, list)) or (state is not None and not isinstance(state, bytes)):
        return False
    try:
        signed = _part_statement(d["topic"], t, d["shard"], d["chunk"], d["view"], float(d["weight"]),
                                 d["content"], None if recipe is None else tuple(recipe), state)
    except (KeyError, TypeError, ValueError):
        return False
    return (isinstance(d.get("topic"), str) and isinstance(d.get("content"), bytes)
            and evidence.signed_by_accused(signed, d.get("sig")))


def _packet_of(d: dict[str, Any]) -> Packet | None:
    """The packet evidence carries, if its bytes are the signed content; else None."""
    header, buffers = d.get("header"), d.get("buffers")
    if not isinstance(header, dict) or not isinstance(buffers, list) or len(buffers) > _MAX_EVIDENCE_BUFFERS:
        return None
    if not all(isinstance(b, bytes) for b in buffers):
        return None
    try:
        packet = Packet(header, tuple(torch.frombuffer(bytearray(b), dtype=torch.uint8) if b
                                      else torch.empty(0, dtype=torch.uint8) for b in buffers))
    except Exception:
        return None
    if content_digest(packet.header, packet.buffers) != d.get("content"):
        return None
    return packet


def _values(packet: Packet) -> torch.Tensor | None:
    shape = packet.header.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 64:
        return None
    if math.prod(shape) > _MAX_EVIDENCE_NUMEL:  # decoded before it is checked: bounded first
        return None
    try:
        return decode(packet).reshape(-1)
    except Exception:
        return None


def _check_not_finite(evidence: Evidence) -> bool:
    d = evidence.detail
    if not _signed_part(evidence, d, evidence.round):
        return False
    packet = _packet_of(d)
    values = None if packet is None else _values(packet)
    return values is not None and not bool(torch.isfinite(values).all())


