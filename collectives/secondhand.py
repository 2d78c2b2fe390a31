"""An owner's average taken second hand: a member that heard nothing from an owner of a round
asks the round's other members for that owner's signed answer before it writes the chunk as
unaveraged.

An owner answers every contributor of a group at once, but its answers leave one by one. An
owner that dies, or is stopped, between two of them leaves some members with the chunk's
average and others without it; without this, the ones without wrote `unaveraged` (0) where the
ones with it wrote the average, and the members left the round apart until the drift guard
repaired them. Now:

    member, on each owner's verified average:   keep it, as the owner signed it
    member, once every owner has answered or timed out:
        silent = the (shard, chunk, owner) whose owner never answered (timeout, dead, no socket)
        ask up to FANOUT live members of the round (not me, not a silent owner), at once, within
            the reply grace: HeardAsk(t, view, silent)
        each answer: the averages the asked member holds, each checked against its owner's
            signature and against the placement (that owner owns that chunk in round t)
        the first average that verifies for a chunk stands in for its owner's answer
    member, asked:   only by a member of the round's list, at most ASKS_PER_ROUND times per
                     round; answers the averages it holds of the chunks named

Nothing here is taken on the word of the member that relays it: an average counts only if its
owner signed it (round, shard, chunk, member list, contributors, content, scores), so the
member writes what the owner's other contributors wrote. The owner's flags that it did not sign
(`diverged`, the contributors' shares) are not relayed.

What it costs: a member keeps the averages it received for the time a member may still wait
for them (`keep_s`), at most `max_bytes` in all (two float32 vectors by default), the oldest
dropped first; and a round in which an owner was silent takes up to one reply grace more.
Where nobody that was asked got the average, the chunk is unaveraged on every member, as
before, and where some got it that were not asked, the drift guard still repairs.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starling.collectives.bodies import Average, BodyError, HeardAsk, HeardRow, Refused, heard_rows
from starling.collectives.codec import packet_from_wire
from starling.collectives.outcome import ShardResult
from starling.collectives.requests import AskBudget, member_ask, request_patiently
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, Refuser, Reply

if TYPE_CHECKING:
    from starling.collectives.contributions import Contributions
    from starling.collectives.outcome import ReduceTimeouts
    from starling.collectives.placement import Placement
    from starling.compressors import Packet
    from starling.node import Node
    from starling.node.wire import Message

log = logging.getLogger("starling.collectives.reduce")

SUFFIX = ".heard"  # a reducer's asks for averages travel on its topic with this suffix
FANOUT = 3  # members asked at once for the averages a member missed
ASKS_PER_ROUND = 2  # asks one member may make of another per round

Key = tuple[int, bytes, int, int, str]  # (round, view, shard, chunk, owner)


@dataclass
class _Heard:
    average: Average  # as the owner signed it, its header whole
    packet: Packet
    until: float  # monotonic time after which no member waits for it any more
    nbytes: int


class SecondHand:
    """One reducer's averages kept for the members that missed them (`keep`, `take_for`), and
    the asks of those members (`_serve`). Network thread."""

    def __init__(self, node: Node, topic: str, placement: Placement, contributions: Contributions,
                 timeouts: ReduceTimeouts, refuse: Refuser, resolve_view: Callable[[bytes], tuple[str, ...] | None],
                 keep_s: float, max_bytes: int) -> None:
        self.node, self.topic, self.placement, self.contributions = node, topic, placement, contributions
        self.timeouts, self._refuse, self._resolve_view = timeouts, refuse, resolve_view
        self.keep_s, self.max_bytes = keep_s, max_bytes
        self._kept: OrderedDict[Key, _Heard] = OrderedDict()
        self._bytes = 0
        self._asked = AskBudget(ASKS_PER_ROUND)  # asks answered per (member, round)
        node.on(topic + SUFFIX, self._serve)

    # ------------------------------------------------------------------ what this member heard
    def keep(self, t: int, view: bytes, i: int, c: int, owner: str, average: Average, packet: Packet) -> None:
        """Keep an owner's verified average of (t, i, c) for members that may miss it."""
        key = (t, view, i, c, owner)
        if key in self._kept:
            return
        nbytes = sum(b.numel() * b.element_size() for b in packet.buffers)
        if nbytes > self.max_bytes:
            return
        kept = Average(packet.header, average.contributors, sig=average.sig, scores=average.scores)
        self._kept[key] = _Heard(kept, packet, time.monotonic() + self.keep_s, nbytes)
        self._bytes += nbytes
        self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._kept:
            key, heard = next(iter(self._kept.items()))
            if heard.until > now and self._bytes <= self.max_bytes:
                break
            del self._kept[key]
            self._bytes -= heard.nbytes

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    # ------------------------------------------------------------------ a member that missed some
    async def take_for(self, t: int, members: tuple[str, ...], view: bytes,
                       silent: Sequence[ShardResult]) -> dict[tuple[int, int, str], ShardResult]:
        """The averages of the silent owners' chunks that other members of round t got, each
        verified as its owner's: (shard, chunk, owner) -> the result its owner would have given."""
        me = self.node.peer_id
        wanted = {(r.shard, r.chunk, r.owner) for r in silent}
        owners = {owner for _, _, owner in wanted}
        live = set(self.node.live_peers_here())
        candidates = [m for m in members if m != me and m not in owners and m in live]
        if not wanted or not candidates:
            return {}
        asked = random.sample(candidates, min(FANOUT, len(candidates)))
        ask = HeardAsk(t, view, tuple(sorted(wanted))).to_wire()
        deadline = AwakeDeadline(self.timeouts.reply_grace_s)
        found: dict[tuple[int, int, str], ShardResult] = {}
        pending = {asyncio.ensure_future(self._ask(m, t, members, view, ask, wanted, deadline)) for m in asked}
        try:
            while pending and len(found) < len(wanted):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    for key, result in task.result().items():
                        found.setdefault(key, result)
        finally:
            for task in pending:
                task.cancel()
        if found:
            log.info("%s: %s round %d: took %d of %d unanswered averages from other members", me, self.topic, t,
                     len(found), len(wanted))
        return found

    async def _ask(self, member: str, t: int, members: tuple[str, ...], view: bytes, ask: dict[str, Any],
                   wanted: set[tuple[int, int, str]], deadline: AwakeDeadline
                   ) -> dict[tuple[int, int, str], ShardResult]:
        try:
            msg = await request_patiently(self.node, member, self.topic + SUFFIX, ask, (), deadline,
                                          self.timeouts.retry_interval_s)
            if Refused.from_wire(msg.body) is not None:
                return {}
            rows = heard_rows(msg.body)
        except BodyError as exc:
            self._refuse.count("malformed_heard", f"from {member}: {exc}")
            return {}
        except Exception as exc:  # timeout, dead or busy member: it relays nothing
            log.debug("%s: %s round %d: no averages from %s: %s", self.node.peer_id, self.topic, t, member, exc)
            return {}
        shards = self.placement.shards(members, t)
        out: dict[tuple[int, int, str], ShardResult] = {}
        at = bad = 0
        for row in rows:
            frames = msg.payload[at:at + row.frames]
            at += row.frames
            key = (row.shard, row.chunk, row.owner)
            # each chunk asked for verified once: rows beyond that cost a signature check each
            result = (self._verified(t, view, members, shards, row, frames)
                      if key in wanted and key not in out else None)
            if result is None:
                bad += 1
                continue
            out[key] = result
        if bad:  # an honest member keeps only averages that verified, and sends what was asked, once
            self.node.trust.note(member, "bad_signature")
            self._refuse.count("bad_heard_average", f"round {t}: {bad} of {len(rows)} averages from {member}")
        return out

    def _verified(self, t: int, view: bytes, members: tuple[str, ...], shards: Any, row: HeardRow,
                  frames: Sequence[Any]) -> ShardResult | None:
        """The result a relayed row stands for, if its owner owns that chunk and signed it."""
        if not (row.shard < len(shards) and row.owner in shards[row.shard][1]
                and row.chunk < len(shards[row.shard][0]) and len(frames) == row.frames):
            return None
        try:
            average = Average.from_wire(row.average, members)
            assert average.header is not None  # HeardRow checked it
            packet = packet_from_wire(average.header, frames)
        except Exception:
            return None
        content = self.contributions.verify_average(row.owner, t, row.shard, row.chunk, view, average.contributors,
                                                    packet, average.sig, average.scores)
        if content is None:
            return None
        return ShardResult(row.shard, row.chunk, row.owner, packet, average.contributors, content=content,
                           sig=average.sig, scores=average.scores)

    # ------------------------------------------------------------------ asked
    async def _serve(self, msg: Message) -> Reply | dict[str, Any]:
        """A member of a round asks for the averages of some of its chunks that I received."""
        asked = member_ask(msg, HeardAsk.from_wire, self._resolve_view, self._refuse, "ask for its averages")
        if isinstance(asked, dict):  # refused
            return asked
        ask, members = asked
        chunks = sum(len(chunks) for chunks, _ in self.placement.shards(members, ask.round))
        if len(ask.wants) > chunks:
            return self._refuse(Refusal.MALFORMED, f"round {ask.round} has {chunks} chunks, not {len(ask.wants)}")
        if not self._asked.take(msg.sender, ask.round):
            return self._refuse(Refusal.BUSY, f"at most {ASKS_PER_ROUND} asks for round {ask.round}'s averages")
        self._expire()
        rows, buffers = [], []
        for i, c, owner in dict.fromkeys(ask.wants):  # each chunk once, however often it is named
            heard = self._kept.get((ask.round, ask.view, i, c, owner))
            if heard is None:
                continue
            rows.append(HeardRow(i, c, owner, heard.average.to_wire(members), len(heard.packet.buffers)).to_wire())
            buffers.extend(heard.packet.buffers)
        return Reply({"ok": True, "rows": rows}, tuple(buffers))
