"""A member's half of a sharded all-reduce's round (`collectives/reduce.py`): its parts sent to
their owners (its own part summed where it owns the chunk), the owners' signed answers voted on
chunk by chunk, and the round's outcome decided from them in one method, `_apply`.

    for each chunk c of each shard i, in parallel:
        send chunk (i, c) to each of its owners            # the owner's reply is the average
    an owner that never answered: ask other members for its signed average (secondhand.py)
    choose each chunk's answer among its owners' (voting.py)
    caller's thread, `_apply`: write each averaged chunk, or `unaveraged` (or the local values)
        where none came; then who was missing

`MemberSide` is one half of `ShardedReducer`, which holds the state both halves share; the
owner's half (`OwnerSide`, `collectives/owner.py`) sums the member's own part where it owns the
chunk (`_reduce`), and hears from here which peers have moved on (`_saw_view`, `_saw_ahead`).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from starling.collectives.bodies import Average, Part, Refused
from starling.collectives.codec import decode_flat, packet_from_wire
from starling.collectives.contributions import Contributions, Recipe, SignedPart, content_digest, vote_key
from starling.collectives.masking import Masked
from starling.collectives.outcome import ReduceResult, ShardResult
from starling.collectives.owner import KEEP_CLOSED_ROUNDS
from starling.collectives.requests import request_patiently
from starling.collectives.staging import to_device
from starling.common.faults import fault_point
from starling.compressors import Compressor, Packet
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, RemoteError, refusal_of
from starling.node.trust import Evidence

if TYPE_CHECKING:
    from starling.collectives.checking import Checks
    from starling.collectives.compact import HeaderTemplates, KnownViews
    from starling.collectives.defences import Defences, RoundDefence
    from starling.collectives.outcome import ReduceTimeouts
    from starling.collectives.placement import Placement
    from starling.collectives.secondhand import SecondHand
    from starling.collectives.secure import SecureStage
    from starling.collectives.suspicion import Suspicion
    from starling.collectives.voting import OwnerVote
    from starling.node import Node
    from starling.node.rpc import Refuser
    from starling.node.trust import Trust

# the reducer's logger: both halves log as the one component they are (`collectives/reduce.py`)
log = logging.getLogger("starling.collectives.reduce")

UNBOUNDED = "avg.unbounded"  # witness evidence: an average larger than its own signed scores allow
MISSCORED = "avg.misscored"  # witness evidence: an owner signed a size of my part that is not its size
LOSSY_AVERAGE_SLACK = 1.5  # a lossy average's |values|^2 may exceed the exact one's by this (int4: ~1.23)


@dataclass
class Slot:
    """One chunk of a round as this member sends it: its owners, my own values for my own
    group (if I own it), the packet for the other owners and my signature of it."""

    shard: int
    chunk: int
    owners: tuple[str, ...]
    lo: int
    numel: int
    own: torch.Tensor | None
    packet: Packet | None
    sig: bytes | None = None


class MemberSide:
    """A member's half of a round: sends its parts, takes the owners' answers, decides the
    outcome. A base of `ShardedReducer`, whose `__init__` sets what it reads (below)."""

    node: Node
    topic: str
    placement: Placement
    defences: Defences
    timeouts: ReduceTimeouts
    unaveraged: float | None
    codec: Compressor
    average_codec: Compressor
    suspicion: Suspicion | None
    checks: Checks | None
    _part_headers: HeaderTemplates
    _avg_headers: HeaderTemplates
    _known_views: KnownViews
    _contributions: Contributions
    _seams: tuple[RoundDefence, ...]
    _votes: OwnerVote
    _trust: Trust
    _refuse: Refuser
    _secure: SecureStage | None
    secondhand: SecondHand
    _skipped: dict[int, frozenset[str]]
    _latest_round: int

    # ------------------------------------------------------------------ caller's thread
    def _apply(self, t: int, members: tuple[str, ...], vector: torch.Tensor,
               results: list[ShardResult]) -> ReduceResult:
        """The round's outcome, decided here and nowhere else. Each chunk commits or is skipped,
        the same way on every member: one that came back averaged is written over the local
        values (every member decodes the same signed packet); one that did not (its owner died
        or stalled before it answered, its owners disagreed, it could not be unmasked) takes
        `unaveraged` on every member (0 for an update: nobody applies its own), or keeps the
        local values where the reducer averages state. Then who was missing is collected."""
        me, synced, lost = self.node.peer_id, False, set()
        missing: dict[str, int] = {}  # member -> averages it is missing from
        averaged = 0
        skipped = self._skipped.get(t, frozenset())
        bounds = self.placement.bounds(members, t)
        for (lo, hi), res in zip(bounds, results):
            avg = None
            if res.packet is None:
                reason = res.reason
            else:
                try:
                    avg = decode_flat(to_device(res.packet, vector.device))  # decoded where it is used
                    if avg.numel() != hi - lo:
                        raise ValueError(f"{avg.numel()} values for a chunk of {hi - lo}")
                except Exception as exc:  # a bad reply costs one chunk's average, not the round
                    log.warning("%s: bad average for %s shard %d chunk %d from %s: %s", me, self.topic, res.shard,
                                res.chunk, res.owner, exc)
                    avg, reason = None, f"bad average: {exc}"
                if avg is not None and not self._within_bound(t, (lo, hi), res, avg, vector[lo:hi]):
                    avg, reason = None, "an average larger than its parts allow"
            if avg is None:
                log.info("%s: %s shard %d chunk %d of round %d was not averaged (%s): %s", me, self.topic, res.shard,
                         res.chunk, t, reason, "keeps its local values" if self.unaveraged is None
                         else f"every member writes {self.unaveraged:g}")
                if self.unaveraged is not None:
                    vector[lo:hi].fill_(self.unaveraged)
                lost.add(res.owner)
                continue
            vector[lo:hi].copy_(avg)
            left_out = set(members) - set(res.contributors)
            lost.update(left_out)
            averaged += 1
            for member in left_out:  # this peer too: `lost` drops it below, `absent` keeps it
                missing[member] = missing.get(member, 0) + 1
            synced = synced or len(res.contributors) > 1
        lost.discard(me)
        ahead = max([t] + [r.owner_round for r in results])
        shares = next((r.shares for r in results if r.shares), ())
        absent = {m for m, n in missing.items() if n == averaged} - skipped
        if not averaged and self.unaveraged is not None and len(members) > 1:
            absent = set(members) - skipped  # every chunk skipped: nobody's part counted
        if ahead > t:  # the owners had gone on: nothing of this peer's counted in this round
            absent.add(me)
        diverged = any(r.diverged for r in results if r.packet is not None)
        whole = averaged == len(results) and not missing and not lost and ahead == t
        return ReduceResult(t, synced, len(members) - len(lost), tuple(sorted(lost - skipped)), ahead,
                            tuple(sorted(lost & skipped)), shares, tuple(sorted(absent)), diverged, whole)

    def _within_bound(self, t: int, bounds: tuple[int, int], res: ShardResult, avg: torch.Tensor,
                      mine: torch.Tensor) -> bool:
        """Caller's thread: whether an owner's robust average stays within what its signed
        scores allow (`Suspicion.over_bound`), where its parts alone give it (checked or
        replicated owners). Every member sees the same signed answer, so every member leaves an
        answer over the bound out alike, and accuses its owner. A member whose own |part|^2 the
        owner misstated (to widen the bound) accuses it too: only that member can tell."""
        if (self.suspicion is None or not self.defences.fixed_answers or res.scores is None
                or res.owner == self.node.peer_id):
            return True
        slack = 1.0 + 1e-5 if self.average_codec.lossless else LOSSY_AVERAGE_SLACK
        me = self.node.peer_id
        if (me in res.contributors and self.codec.lossless and mine.device.type == "cpu"
                and self.suspicion.own_row_wrong(bounds, mine, res.scores[1][res.contributors.index(me)])):
            log.warning("%s: %s round %d: %s signed a size of my part that is not my part's", me, self.topic, t,
                        res.owner)
            self.node.submit(self._accuse_owner(res.owner, t, MISSCORED, res))
        if not self.suspicion.over_bound(bounds, avg, res.scores, slack):
            return True
        log.warning("%s: %s shard %d chunk %d of round %d: %s's average is larger than its parts allow; left out",
                    me, self.topic, res.shard, res.chunk, t, res.owner)
        self.node.submit(self._accuse_owner(res.owner, t, UNBOUNDED, res))
        return False

    async def _accuse_owner(self, owner: str, t: int, kind: str, res: ShardResult) -> None:
        key = self._trust.key_of(owner)
        if key is not None:
            self._trust.accuse(Evidence(kind, owner, key, t, {"topic": self.topic, "shard": res.shard,
                                                              "chunk": res.chunk}))

    # ------------------------------------------------------------------ network thread
    async def _round(self, t: int, members: tuple[str, ...], slots: list[Slot],
                     own_private: bool, weight: float | None = None,
                     recipe: Recipe | None = None, masked: Masked | None = None,
                     state: bytes | None = None) -> list[ShardResult]:
        me = self.node.peer_id
        self._latest_round = max(self._latest_round, t)
        view = self._known_views.add(members)  # my parts name it by digest; owners know it from theirs
        riding: dict[tuple[int, int, str], tuple[int, bytes]] = {}  # (shard, chunk, owner) -> my share for it
        if masked is not None and self._secure is not None:
            # My seed's shares: each rides on my first part to its holder where the holder owns a
            # shard, the others go on their own, before my parts.
            loose = dict(masked.deals)
            for slot in slots:
                for owner in slot.owners:
                    deal = loose.pop(owner, None)
                    if deal is not None:
                        riding[slot.shard, slot.chunk, owner] = (deal.x, deal.box)
            await self._secure.deal(masked, loose)
        jobs = []
        for slot in slots:
            for owner in slot.owners:
                if owner == me:
                    assert slot.own is not None
                    signed = None  # my own part as I signed it, where checkers may ask for it
                    if slot.packet is not None and slot.sig is not None and self.checks is not None:
                        signed = SignedPart(view, weight, slot.packet, slot.sig,
                                            content_digest(slot.packet.header, slot.packet.buffers), recipe, state)
                    jobs.append(self._reduce_own(t, members, view, slot.shard, slot.chunk, slot.own, own_private,
                                                 weight, state, signed))
                else:
                    assert slot.packet is not None and slot.sig is not None
                    jobs.append(self._send_part(t, members, view, slot, owner, weight, recipe,
                                                riding.get((slot.shard, slot.chunk, owner)), state))
        answers = list(await asyncio.gather(*jobs))
        silent = [r for r in answers if r.silent]
        if silent:  # an owner's answer may have reached other members before it died or stalled
            heard = await self.secondhand.take_for(t, members, view, silent)
            answers = [heard.get((r.shard, r.chunk, r.owner), r) if r.silent else r for r in answers]
        results = iter(answers)
        self._forget_before(t - KEEP_CLOSED_ROUNDS)
        chosen = [self._vote(t, view, slot, [next(results) for _ in slot.owners]) for slot in slots]
        if self.checks is not None:
            self.checks.after_round(t, members, chosen)
        if self.suspicion is not None:
            self.suspicion.verdict(t)
        return chosen

    def _vote(self, t: int, view: bytes, slot: Slot, answers: list[ShardResult]) -> ShardResult:
        """One chunk's answer from its owners' signed ones (collectives/voting.py), shown to the
        round's seams."""
        chosen = self._votes.choose(t, view, answers)
        for seam in self._seams:
            seam.on_chosen(t, (slot.lo, slot.lo + slot.numel), slot.owners, chosen)
        if self.suspicion is not None and chosen.packet is not None:
            self.suspicion.take(t, chosen.contributors, chosen.scores)
        return chosen

    async def _reduce_own(self, t: int, members: tuple[str, ...], view: bytes, i: int, c: int,
                          part: torch.Tensor, private: bool, weight: float | None,
                          state: bytes | None = None, signed: SignedPart | None = None) -> ShardResult:
        me = self.node.peer_id
        # private: start() cloned it, so it may become the sum; else a view of the caller's
        # vector, which the group reads and never writes
        reply, buffers = await self._reduce((t, members, i, c), me, part, owned=private,
                                            weight=1.0 if weight is None else weight, state=state, signed=signed)
        refused = Refused.from_wire(reply)
        if refused is not None:
            return ShardResult(i, c, me, None, reason=refused.reason)
        average = Average.from_wire(reply, members)  # my own group's answer: well formed
        # the round every other member is known to have reached: one member's word (a part of
        # any round it likes) moves nobody
        ahead = min((self._peer_round.get(p, t) for p in members if p != me), default=t)
        if ahead > t and set(average.contributors) == {me}:
            # I own this chunk alone and every other member had moved past the round: I am the
            # one behind, as an owner's refusal tells a member that sent it a stale part
            return ShardResult(i, c, me, None, reason=f"the other members are in round {ahead}", owner_round=ahead)
        packet = Packet(self._avg_headers.incoming(average.header, part.numel()), buffers)
        content = vote_key(content_digest(packet.header, packet.buffers), average.scores) if self._replicated else None
        return ShardResult(i, c, me, packet, average.contributors, shares=average.shares, content=content,
                           sig=average.sig, diverged=average.diverged, scores=average.scores)

    async def _send_part(self, t: int, members: tuple[str, ...], view: bytes, slot: Slot, owner: str,
                         weight: float | None = None, recipe: Recipe | None = None,
                         deal: tuple[int, bytes] | None = None, state: bytes | None = None) -> ShardResult:
        i, c, numel, packet = slot.shard, slot.chunk, slot.numel, slot.packet
        assert packet is not None
        # Counted in awake time: an average that came while this loop was stalled is read, not dropped.
        deadline = AwakeDeadline(self._reply_within_s)
        part = Part(t, i, c, self._part_headers.outgoing(packet.header, numel), view=view, weight=weight,
                    sig=slot.sig, recipe=recipe, deal=deal, state=state)
        try:
            msg = await request_patiently(self.node, owner, self.topic, part.to_wire(), packet.buffers, deadline,
                                          self.timeouts.retry_interval_s)
            if refusal_of(msg.body) is Refusal.UNKNOWN_VIEW:  # the owner never saw my list: send it whole
                msg = await request_patiently(self.node, owner, self.topic, part.with_members(members).to_wire(),
                                              packet.buffers, deadline, self.timeouts.retry_interval_s)
        except RemoteError as exc:
            return ShardResult(i, c, owner, None, reason=str(exc))
        except Exception as exc:  # timeout, dead or unknown owner
            return ShardResult(i, c, owner, None, reason=f"{type(exc).__name__}: {exc}", silent=True)
        refused = Refused.from_wire(msg.body)
        if refused is not None:
            if refused.owner_round > t:  # the owner has moved past this round: my groups stop waiting for it
                self._saw_ahead(owner, refused.owner_round)
                if refusal_of(msg.body) is Refusal.LATE:  # and it closed this round: so do mine
                    self._round_over(t)
            return ShardResult(i, c, owner, None, reason=f"owner refused: {refused.reason}",
                                owner_round=refused.owner_round)
        try:
            average = Average.from_wire(msg.body, members)
            result = packet_from_wire(self._avg_headers.incoming(average.header, numel), msg.payload)
        except Exception as exc:
            return ShardResult(i, c, owner, None, reason=f"malformed average: {exc}")
        content = self._contributions.verify_average(owner, t, i, c, view, average.contributors, result, average.sig,
                                                     average.scores)
        if content is None:  # altered on the way, or not the owner's word: worth nothing
            self._trust.note(owner, "bad_signature")
            self._refuse.count("bad_average_signature", f"round {t} shard {i} chunk {c} from {owner}")
            return ShardResult(i, c, owner, None, reason="average not signed by its owner")
        self.secondhand.keep(t, view, i, c, owner, average, result)  # for members its answer missed
        contributors = average.contributors
        if owner not in contributors:
            # An owner's group waits for the owner's own part unless it saw the owner take part
            # in round t under another view (or move past it): my groups of round t stop waiting
            # for it too. A joiner that counts everyone in round t, which the others began before
            # they knew it, gets no part from them and would wait out the round timeout.
            self._saw_view(t, owner, ())
        fault_point("reduce.member.first_average", t)
        return ShardResult(i, c, owner, result, contributors, shares=average.shares, content=content,
                           sig=average.sig, diverged=average.diverged, scores=average.scores)
