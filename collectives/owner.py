"""An owner's half of a sharded all-reduce's round (`collectives/reduce.py`): the parts members
send it, grouped by (round, member list, shard, chunk), each group closed once every expected
member's part is in or at its timeout, averaged (or unmasked, or robustly aggregated off the
loop), signed, and answered to every contributor.

    owner of shard i, for each chunk c:
        sum the parts of (t, members, i, c) until every expected member has sent one,
            or round_timeout_s after the first part arrived
        reply to every contributor with (sum / count, contributors); a part that comes after
            the group closed gets the same reply (kept two rounds)

A group stops waiting for a member that it has seen contribute under a different view of the
same round, that has moved on to a later round, that said it skips the round, or that died or
left (`_saw_view`, `_saw_ahead`, `_saw_skip`, `peer_left`).

`OwnerSide` is one half of `ShardedReducer`, which holds the state both halves share; the
member's half is `MemberSide` (`collectives/member.py`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives.accumulator import ShardGroup, Verdict, all_finite
from starling.collectives.bodies import Average, BodyError, Part, Skip
from starling.collectives.codec import decode_flat, encode, packet_from_wire, shares_memory
from starling.collectives.compact import view_digest
from starling.collectives.contributions import SignedPart
from starling.common.faults import fault_point
from starling.common.text import few
from starling.node.loop import close_in_time
from starling.node.rpc import Refusal, Reply, refusal
from starling.node.wire import Message

if TYPE_CHECKING:
    from starling.collectives.compact import HeaderTemplates, KnownViews
    from starling.collectives.contributions import Contributions
    from starling.collectives.defences import Defences, RoundDefence
    from starling.collectives.outcome import ReduceTimeouts
    from starling.collectives.placement import Placement
    from starling.collectives.screening import Screening
    from starling.collectives.secure import SecureStage
    from starling.collectives.suspicion import Suspicion
    from starling.compressors import Compressor, ErrorFeedback, Packet
    from starling.node import Node
    from starling.node.rpc import Refuser
    from starling.node.trust import Trust

# the reducer's logger: both halves log as the one component they are (`collectives/reduce.py`)
log = logging.getLogger("starling.collectives.reduce")

KEEP_CLOSED_ROUNDS = 64  # how long an owner remembers finished rounds, to answer late parts
_KEEP_SKIPS = 2 * KEEP_CLOSED_ROUNDS  # rounds whose skips a reducer remembers (peers can send any round)
_KEEP_ANSWERS = 2  # rounds whose closed groups' averages an owner still gives to a late part
GroupKey = tuple[int, tuple[str, ...], int, int]  # (round, members, shard, chunk)


class OwnerSide:
    """An owner's half of a round: takes parts, closes and answers groups. A base of
    `ShardedReducer`, whose `__init__` sets what it reads (below)."""

    node: Node
    topic: str
    placement: Placement
    defences: Defences
    timeouts: ReduceTimeouts
    average_codec: Compressor
    screening: Screening
    suspicion: Suspicion | None
    _is_open: Callable[[], bool]
    _avg_feedback: ErrorFeedback | None
    _part_headers: HeaderTemplates
    _avg_headers: HeaderTemplates
    _known_views: KnownViews
    _contributions: Contributions
    _seams: tuple[RoundDefence, ...]
    _trust: Trust
    _refuse: Refuser
    _secure: SecureStage | None
    _averaging: set[asyncio.Future[None]]
    # Network-thread state: open groups, finished keys, who used which view when.
    _groups: dict[GroupKey, ShardGroup]
    _closed: dict[GroupKey, int]
    _answers: dict[GroupKey, tuple[dict[str, Any], tuple[torch.Tensor, ...]]]
    _views: dict[tuple[int, str], tuple[str, ...]]
    _peer_round: dict[str, int]
    _gone: set[str]
    _latest_round: int
    _skipped: dict[int, frozenset[str]]

    # ------------------------------------------------------------------ network thread
    async def _on_part(self, msg: Message) -> Reply | dict[str, Any]:
        """An owner receives one member's part; its answer is the shard's average."""
        me = self.node.peer_id
        if not self._is_open():
            return refusal(Refusal.CLOSED, "protocol closed")
        try:
            if Skip.is_one(msg.body):  # the sender sends nothing in that round
                self._saw_skip(Skip.from_wire(msg.body).round, msg.sender)
                return {"ok": True}
            body = Part.from_wire(msg.body)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, str(exc))
        members = body.members
        if members is None:  # named by digest: a list I know, or none
            members = self._known_views.resolve(body.view, self._current_view)
        if members is None:  # not bad input: my view changed, or the sender's; it sends the list
            return refusal(Refusal.UNKNOWN_VIEW, "no member list of that digest here: send it whole")
        if msg.sender not in members:
            return self._refuse(Refusal.MALFORMED, "members must include the sender")
        t, i, c = body.step, body.shard, body.chunk
        if body.deal is not None and self._secure is not None:  # the sender's share of its mask seed, for me
            self._secure.take_deal(msg.sender, t, view_digest(members), *body.deal)
        shards = self.placement.shards(members, t)
        if i >= len(shards) or me not in shards[i][1]:
            return self._refuse(Refusal.NOT_OWNER, f"this peer does not own shard {i} of that member list")
        chunks = shards[i][0]
        if c >= len(chunks):
            return self._refuse(Refusal.BAD_CHUNK, f"shard {i} has {len(chunks)} chunks, not a chunk {c}")
        if body.members is not None:
            self._known_views.add(members)
        key = (t, members, i, c)
        answer = self._answers.get(key)  # the group closed: a late part gets its average, once signed
        if answer is None and (key in self._closed or t < self._latest_round):
            return refusal(Refusal.LATE, "the round already closed", step=self._latest_round)
        lo, hi = chunks[c]
        try:
            packet = packet_from_wire(self._part_headers.incoming(body.header, hi - lo), msg.payload)
        except Exception as exc:
            return self._refuse(Refusal.BAD_PART, f"bad part: {exc}")
        view = body.view if body.view is not None else view_digest(members)
        content = self._contributions.verify_part(msg.sender, t, i, c, view, body.weight, packet, body.sig,
                                                  body.recipe, body.state)
        if content is None:  # altered on the way, or not its sender's: held against nobody
            self._trust.note(msg.sender, "bad_signature")
            return self._refuse(Refusal.BAD_SIGNATURE, f"round {t} shard {i} chunk {c}: not signed by its sender")
        if answer is not None:  # late: the average the group's contributors got, without this part
            self._saw_view(t, msg.sender, members)
            try:
                return Reply(*self._late(answer, self._decode(packet, hi - lo)))
            except ValueError as exc:
                return self._refuse(Refusal.BAD_PART, f"bad part: {exc}")
        signed = SignedPart(view, body.weight, packet, body.sig, content, body.recipe,  # type: ignore[arg-type]
                            body.state)
        for seam in self._seams:  # a defence may turn the part away (and take its signature as evidence)
            turned_away = seam.on_part(msg.sender, t, i, c, signed, packet)
            if turned_away is not None:
                return turned_away
        try:
            part = self._decode(packet, hi - lo)
        except ValueError as exc:
            return self._refuse(Refusal.BAD_PART, f"bad part: {exc}")
        reply, buffers = await self._reduce(key, msg.sender, part, owned=not shares_memory(part, packet),
                                            weight=1.0 if body.weight is None else body.weight, signed=signed,
                                            state=body.state)
        return Reply(reply, buffers)

    @staticmethod
    def _decode(packet: Packet, numel: int) -> torch.Tensor:
        """A part's values; ValueError for a packet that does not decode to `numel` of them."""
        try:
            part = decode_flat(packet)
        except Exception as exc:
            raise ValueError(str(exc)) from None
        if part.numel() != numel:
            raise ValueError(f"{part.numel()} values for a chunk of {numel}")
        return part

    def _late(self, answer: tuple[dict[str, Any], tuple[torch.Tensor, ...]], part: torch.Tensor
              ) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
        """A part that came after its group closed gets the average the group's contributors
        got, as they got it, unless its values are not finite: a member whose part would have
        been left out of the sum takes no average, on time or late. (A masked part's values
        say nothing of the member's: the secure stage checks those.)

        A late part is common where a member's own part went bad: its other owners stop
        waiting for it the moment an average of its own chunk comes back without it."""
        if self._secure is None and not all_finite(part):
            return self._refuse(Refusal.NOT_FINITE, "bad part: values that are not finite (NaN or Inf)"), ()
        return answer

    def _current_view(self) -> tuple[str, ...]:
        return tuple(sorted({*self.node.live_peers_here(), self.node.peer_id}))

    async def _reduce(self, key: GroupKey, sender: str, part: torch.Tensor, owned: bool = False,
                      weight: float = 1.0, signed: SignedPart | None = None, state: bytes | None = None
                      ) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
        """Add a part to its group and wait for the group to close (all in, or timeout)."""
        t, members = key[0], key[1]
        group = self._groups.get(key)
        late = group is not None and group.closing and sender not in group.contributors
        if late:
            await group.replied.wait()  # late for a group being averaged: it gets what the others get
        if late or key in self._closed:
            answer = group.reply if late else self._answers.get(key)
            if answer is None:
                return refusal(Refusal.LATE, "the round already closed"), ()
            return self._late(answer, part)
        if group is None:
            others = {p for p in members if self._views.get((t, p), members) != members
                      or self._peer_round.get(p, t) > t}
            group = ShardGroup(members, set(members) - self._gone - others - self._skipped.get(t, frozenset()),
                               summing=self._secure is None)
            self._groups[key] = group
            # closes it round_timeout_s after its first part, in awake time: a part that came
            # while the loop was stalled is read before the group gives up on it
            group.timer = asyncio.ensure_future(close_in_time(self.timeouts.round_timeout_s, group.done,
                                                              lambda: self._finish(key, group)))
        if sender in group.contributors:
            return self._refuse(Refusal.DUPLICATE, "duplicate part"), ()
        group.add(sender, part, owned, weight)
        if signed is not None:  # kept until the group closes: the evidence, if the part turns out bad
            group.signed[sender] = signed
        if state is not None:
            group.states[sender] = state
        self._saw_view(t, sender, members)
        if group.complete():
            self._finish(key, group)
        if not group.done.is_set():
            await group.done.wait()  # set by _finish: all parts in, or the group's timer
        if group.reply is None and group.closing:  # a robust average still on its worker thread
            await group.replied.wait()
        assert group.reply is not None
        if sender in group.bad:
            return self._refuse(Refusal.NOT_FINITE, "bad part: values that are not finite (NaN or Inf)"), ()
        return group.reply

    def _finish(self, key: GroupKey, group: ShardGroup) -> None:
        """Close a group: average it and answer every contributor. The plain mean is one pass,
        done here. A robust aggregator is many (sorts, clipping iterations: about a second for
        64 parts of 1M values), so it runs on a worker thread; secure aggregation first asks the
        survivors for the shares that unmask the sum. Meanwhile this loop keeps moving other
        rounds' bytes, and the group takes no part."""
        if group.reply is not None or group.closing:
            return
        group.closing = True
        t, members, i, c = key
        if any(s != self.node.peer_id for s in group.contributors):
            fault_point("reduce.owner.closing", t)
        bounds = self.placement.shards(members, t)[i][0][c]
        aggregator = self.defences.aggregator
        if self._secure is not None:
            self._answer_later(key, group, bounds, self._secure.close(t, members, view_digest(members), i, c, bounds,
                                                                      group))
        elif aggregator.robust:
            # checked or replicated owners start from the median: their average is their parts' alone
            center = None if self.defences.fixed_answers else self.screening.center(bounds)
            self._answer_later(key, group, bounds, asyncio.get_running_loop().run_in_executor(
                None, group.average, aggregator, center))
        else:
            self._answer(key, group, bounds, group.average)

    def _answer_later(self, key: GroupKey, group: ShardGroup, bounds: tuple[int, int], averaging: Any) -> None:
        """Answer once `averaging` (an awaitable of what `group.average` returns) is done; one
        that fails answers its failure, so that no group stays open."""
        async def then() -> None:
            try:
                result = await averaging
            except Exception as exc:
                failure = exc

                def failed() -> Any:
                    raise failure
                self._answer(key, group, bounds, failed)
            else:
                self._answer(key, group, bounds, lambda: result)
        task = asyncio.ensure_future(then())
        self._averaging.add(task)
        task.add_done_callback(self._averaging.discard)

    def _answer(self, key: GroupKey, group: ShardGroup, bounds: tuple[int, int],
                average: Callable[[], tuple[torch.Tensor, dict[str, float] | None, Verdict]]) -> None:
        """Judge the group's parts, sign its average and answer every contributor (network thread)."""
        t, members, i, c = key
        try:
            avg, shares, verdict = average()
            for seam in self._seams:
                seam.on_close(t, i, c, bounds, group, verdict, avg)
            if not group.contributors:
                group.reply = (refusal(Refusal.NOT_FINITE, "no part was finite"), ())
            else:
                if self.average_codec.zero_copy:  # lossless too, and the sum is private and final: send it
                    packet = self.average_codec.encode(avg, copy=False)
                else:
                    packet = encode(self.average_codec, self._avg_feedback, avg, f"avg{i}.{c}/{len(members)}")
                contributors = tuple(sorted(group.contributors))
                scores = (self.suspicion.scores(bounds, [group.received.get(m) for m in contributors])
                          if self.suspicion is not None else None)
                sig = self._contributions.sign_average(t, i, c, view_digest(members), contributors, packet, scores)
                # shares only when weights differed: equal ones send what they always did
                diverged = len({s for m in contributors if (s := group.states.get(m)) is not None}) > 1
                answer = Average(self._avg_headers.outgoing(packet.header, avg.numel()), contributors,
                                 tuple(sorted(shares.items())) if shares is not None else (), sig, diverged, scores)
                group.reply = (answer.to_wire(members), packet.buffers)
                self._answers[key] = group.reply
                for old in [k for k in self._answers if k[0] <= t - _KEEP_ANSWERS]:
                    del self._answers[old]
        except Exception as exc:  # every contributor gets an answer, never a group that stays open
            log.exception("%s: %s shard %d chunk %d of round %d: averaging failed", self.node.peer_id,
                          self.topic, i, c, t)
            group.reply = (refusal(Refusal.CLOSE_FAILED, f"the owner could not average: {type(exc).__name__}: {exc}"),
                           ())
        missing = group.expected - set(group.contributors)
        if missing:
            log.info("%s: %s shard %d chunk %d of round %d closed without %s", self.node.peer_id, self.topic,
                     i, c, t, few(sorted(missing)))
        group.done.set()
        group.replied.set()
        self._groups.pop(key, None)
        self._closed[key] = t

    def _saw_skip(self, t: int, peer: str) -> None:
        """`peer` sends nothing in round t: no group of round t waits for it, nor will one made later."""
        self._skipped[t] = self._skipped.get(t, frozenset()) | {peer}
        if len(self._skipped) > _KEEP_SKIPS:
            del self._skipped[min(self._skipped)]
        for key, group in list(self._groups.items()):
            if key[0] == t:
                self._stop_waiting_for(key, group, peer)

    def _saw_view(self, t: int, sender: str, members: tuple[str, ...]) -> None:
        """A sender used `members` in round t: groups of other views of that round, and groups
        of earlier rounds (it has moved past them), stop waiting for it."""
        self._views[(t, sender)] = members
        self._peer_round[sender] = max(self._peer_round.get(sender, t), t)
        for key, group in list(self._groups.items()):
            if key[0] < t or (key[0] == t and key[1] != members):
                self._stop_waiting_for(key, group, sender)

    def _saw_ahead(self, peer: str, t: int) -> None:
        """A peer said it is in round t: groups of earlier rounds stop waiting for it."""
        self._peer_round[peer] = max(self._peer_round.get(peer, t), t)
        for key, group in list(self._groups.items()):
            if key[0] < t:
                self._stop_waiting_for(key, group, peer)

    def _round_over(self, t: int) -> None:
        """Another owner refused my part of round t as late: it closed the round and went on,
        so the members it counted have too, and my own groups of round t (or earlier) would wait
        out their timeout for parts that go elsewhere. They close now, with the parts they hold."""
        for key, group in list(self._groups.items()):
            if key[0] <= t and group.contributors and not group.done.is_set():
                group.expected.clear()
                self._finish(key, group)

    def _stop_waiting_for(self, key: GroupKey, group: ShardGroup, peer: str) -> None:
        group.expected.discard(peer)
        if group.contributors and group.complete():
            self._finish(key, group)

    def _forget_before(self, t: int) -> None:
        self._closed = {k: r for k, r in self._closed.items() if r >= t}
        self._views = {k: v for k, v in self._views.items() if k[0] >= t}
        self._skipped = {r: p for r, p in self._skipped.items() if r >= t}
