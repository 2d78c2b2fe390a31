"""What an owner holds against the members whose parts it sums, and the robust aggregator's
memory: the round engine's screening defence (`RoundDefence`).

On each verified part (`on_part`):
- a weight over the swarm's cap is refused, and its signature is evidence (`part.overweight`);
- with a robust aggregator, a part with the same non-zero content as one of its author's parts
  of some rounds back, begun from another signed state, is refused and makes this owner a
  witness against its author (`part.replayed`); the same part as last round, or one begun from
  the same state, is taken (an honest one repeats, see `on_part`).

On each closed group (`on_close`):
- a part that was not finite is evidence, with its signed bytes (`part.not_finite`);
- parts the aggregator screened out or clipped are counted against their authors;
- with a robust aggregator, a part screened out is one flag at this owner; `accuse_after`
  flags in a row make this owner a witness against the author (`part.outlier`). A part
  pointing against the robust average (cosine below `-opposed_cos`) is counted (`opposed`),
  not flagged: colluders pull the robust average far enough that honest parts point against
  it as often as theirs do, and that watch banned honest members. Direction is judged by the
  running test against each chunk's median instead (`collectives/suspicion.py`).

On each chunk a member takes (`on_chosen`): CenteredClip's next centre for a chunk this peer
owns is the average the members took.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from starling.collectives.contributions import NOT_FINITE, OVERWEIGHT, REPLAYED, Contributions, SignedPart
from starling.collectives.defences import OUTLIER, Defences, OutlierWatch, ReplayWatch, RoundDefence
from starling.compressors import Packet, decode
from starling.node.rpc import Refusal, Refuser
from starling.node.trust import Evidence

if TYPE_CHECKING:
    from starling.collectives.accumulator import ShardGroup, Verdict
    from starling.collectives.outcome import ShardResult
    from starling.node.trust import Trust


class Screening(RoundDefence):
    """One reducer's screening (its topic and `defences`)."""

    def __init__(self, me: str, topic: str, trust: Trust, defences: Defences, contributions: Contributions,
                 refuse: Refuser) -> None:
        self.me, self.topic, self.defences = me, topic, defences
        self._trust, self._contributions, self._refuse = trust, contributions, refuse
        self._watch = OutlierWatch(defences.accuse_after)
        self._replays = ReplayWatch()
        # my chunks' last averages, CenteredClip's next centres: [lo, hi) -> values
        self.centers: dict[tuple[int, int], torch.Tensor] = {}

    # ------------------------------------------------------------------ owner
    def on_part(self, sender: str, t: int, i: int, c: int, signed: SignedPart, packet: Packet
                ) -> dict[str, Any] | None:
        if self._contributions.overweight(signed.weight):
            self._trust.note(sender, "overweight")
            self.accuse_part(OVERWEIGHT, sender, t, i, c, signed, with_bytes=False)
            return self._refuse(Refusal.OVERWEIGHT, f"weight {signed.weight} over the swarm's cap "
                                f"{self._contributions.max_weight}")
        if not self.defences.aggregator.robust:
            # Only where parts are fresh each round (gradients): a digest check sends the same few
            # bytes every round it agrees, honestly.
            return None
        earlier = self._replays.seen(sender, t, signed.content, SignedPart(
            signed.view, signed.weight, None, signed.sig, signed.content, signed.recipe, signed.state))
        if earlier is None:
            return None
        e_t, e_signed = earlier
        if (signed.state is not None and signed.state == e_signed.state) or e_t == t - 1:
            # Begun from the state of the earlier round (nothing it trains on moved), or the same
            # part as last round: a chunk that nobody averaged keeps its parameters while the
            # rest moves on, and a loss that is separable and deterministic there (a full batch)
            # gives it the same gradient again, round after round until the chunk is averaged.
            self._trust.note(sender, "repeated")
            return None
        try:
            part = decode(packet, copy=False).reshape(-1)
        except Exception as exc:
            return self._refuse(Refusal.BAD_PART, f"bad part: {exc}")
        if not bool(part.abs().sum() > 0):  # zeros repeat honestly (a layer with no gradient)
            return None
        # A part of some rounds back, in between which the author sent others: a replay. Not
        # proof (two signed parts of one content are also an honest repeat's), so this owner
        # is one witness; a replayer repeats at every owner it sends to.
        self._trust.note(sender, "replayed")
        self.accuse_part(REPLAYED, sender, t, i, c, signed, with_bytes=False,
                         earlier={"round": e_t, **e_signed.detail(self.topic, i, c)})
        return self._refuse(Refusal.REPLAYED, f"round {t}: the same part as in round {e_t}")

    def on_close(self, t: int, i: int, c: int, bounds: tuple[int, int], group: ShardGroup, verdict: Verdict,
                 avg: torch.Tensor) -> None:
        for sender in sorted(group.bad):
            self._trust.note(sender, "not_finite")
            signed = group.signed.get(sender)
            if signed is not None:
                self.accuse_part(NOT_FINITE, sender, t, i, c, signed, with_bytes=True)
        for sender, why in verdict.screened.items():
            self._trust.note(sender, "screened")
            self._trust.note(sender, f"screened.{why}")
        for sender in verdict.clipped:
            self._trust.note(sender, "clipped")
        if not self.defences.aggregator.robust:
            return
        norm = float(avg.norm()) if avg.numel() else 0.0
        for sender, part in group.received.items():
            if sender == self.me or sender in group.bad:
                continue
            why = verdict.screened.get(sender)
            if why is None and norm > 0.0:  # a part against the swarm's direction: counted only (see above)
                cosine = float(torch.dot(part, avg)) / (float(part.norm()) * norm + 1e-30)
                if cosine < -self.defences.opposed_cos:
                    self._trust.note(sender, "opposed")
            if self._watch.saw(sender, t, why is not None) and why is not None:
                key = self._trust.key_of(sender)
                if key is not None:
                    self._trust.accuse(Evidence(OUTLIER, sender, key, t, {
                        "topic": self.topic, "shard": i, "chunk": c, "rounds": self.defences.accuse_after,
                        "why": why}))

    def accuse_part(self, kind: str, sender: str, t: int, i: int, c: int, signed: SignedPart, with_bytes: bool,
                    **extra: Any) -> None:
        """Evidence of `kind` against a part's author, from its signature. Off without defences:
        a swarm that did not ask for them is not one that bans a peer for a bf16 overflow."""
        if not self.defences.on:
            return
        evidence = self._contributions.part_evidence(kind, sender, t, i, c, signed.view, signed.weight,
                                                     signed.packet if with_bytes else None, signed.sig,
                                                     signed.content, signed.recipe, signed.state, **extra)
        if evidence is not None:
            self._trust.accuse(evidence)

    def center(self, bounds: tuple[int, int]) -> torch.Tensor | None:
        return self.centers.get(bounds)

    # ------------------------------------------------------------------ member
    def on_chosen(self, t: int, bounds: tuple[int, int], owners: tuple[str, ...], chosen: ShardResult) -> None:
        # Owners placed afresh each round (replicated) start from the median instead: their last
        # averages of a chunk would be of different rounds, and they must agree bit for bit; so
        # do checked owners, whose averages a checker computes again from the parts alone.
        if (not self.defences.aggregator.robust or self.defences.fixed_answers or chosen.packet is None
                or self.me not in owners):
            return
        try:
            center = decode(chosen.packet, copy=False).reshape(-1).clone()
        except Exception:
            return
        lo, hi = bounds
        if center.numel() != hi - lo:
            return
        for old in [b for b in self.centers if b[0] < hi and lo < b[1]]:  # another layout's
            del self.centers[old]
        self.centers[bounds] = center
