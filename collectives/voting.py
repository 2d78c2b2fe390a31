"""A member's vote among a chunk's replicated owners (`Defences.owner_replication`).

With one owner, its signed answer is the chunk's average. With several, the member takes the
average a majority of them signed, by content digest (with two, both must agree). No
majority among those that answered: the chunk has no average this round, and the round's
rule (`ShardedReducer._apply`) skips it on every member alike.

An owner outvoted with the same contributors as the majority averaged the same parts to
something else. One outvoted so in `accuse_after` of its rounds in a row is accused by this
member as one witness (the others of the group see the same, and two witnesses ban). A single
vote is not enough: two members that lie together outvote the honest third owner of a shard
they happen to share (owners are placed afresh each round, so it does not last).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from starling.collectives.defences import OutlierWatch
from starling.collectives.outcome import ShardResult
from starling.node.trust import Evidence

if TYPE_CHECKING:
    from starling.node.trust import Trust

log = logging.getLogger(__name__)

OUTVOTED = "owner.outvoted"  # witness evidence: an owner outvoted with the same contributors as the majority


class OwnerVote:
    """One reducer's votes (its topic), with its watch on owners outvoted round after round.
    Runs on the network thread."""

    def __init__(self, me: str, topic: str, trust: Trust, accuse_after: int) -> None:
        self.me, self.topic, self._trust = me, topic, trust
        self._outvoted = OutlierWatch(accuse_after)

    def choose(self, t: int, view: bytes, answers: Sequence[ShardResult]) -> ShardResult:
        """The chunk's answer from its owners' (one per owner, in owner order)."""
        if len(answers) == 1:
            return answers[0]
        answered = [a for a in answers if a.packet is not None and a.content is not None]
        if len(answered) <= 1:
            return answered[0] if answered else answers[0]
        votes: dict[bytes, list[ShardResult]] = {}
        for a in answered:
            votes.setdefault(a.content, []).append(a)  # type: ignore[arg-type]
        best = max(votes.values(), key=len)
        if len(best) * 2 <= len(answers) and len(votes) > 1:  # no majority of the owners (two: they differ)
            for a in answered:
                self._trust.note(a.owner, "disputed")
            log.warning("%s: %s shard %d chunk %d of round %d: owners disagree (%s): no average", self.me,
                        self.topic, answers[0].shard, answers[0].chunk, t,
                        ", ".join(f"{a.owner}: {a.content.hex()[:12] if a.content else '-'}" for a in answered))
            return replace(answers[0], packet=None, reason="owners disagree")
        chosen = best[0]
        for a in answered:
            lied = a.content != chosen.content and a.contributors == chosen.contributors  # same parts, other average
            if a.content != chosen.content:
                self._trust.note(a.owner, "disputed")
            if self._outvoted.saw(a.owner, t, lied) and lied:
                self._accuse(t, view, a, best)
        return chosen

    def _accuse(self, t: int, view: bytes, liar: ShardResult, majority: list[ShardResult]) -> None:
        key = self._trust.key_of(liar.owner)
        if key is None:
            return
        signed = [{"owner": a.owner, "contributors": list(a.contributors), "content": a.content, "sig": a.sig}
                  for a in (liar, *majority)]
        self._trust.accuse(Evidence(OUTVOTED, liar.owner, key, t, {
            "topic": self.topic, "shard": liar.shard, "chunk": liar.chunk, "view": view, "averages": signed}))
