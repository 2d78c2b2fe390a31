"""An author's whole vector of one round, gathered from the owners that kept its parts: what a
checker of a DiLoCo pseudo-gradient moves the parameters by (`protocols/verification.py`).

    member:  for each owner of round t but me and the author, in parallel:
                 KeptAsk(t, view, author) on `<topic>.kept`
             each part that comes back is checked against the author's signature (as signed:
             round, shard, chunk, view, weight, content, recipe, state) and against the owner
             the placement gives its chunk; mine come from my own retention
    owner:   answers with the author's parts its groups of round t kept (`Retention.shown`),
             at most GATHERS_PER_ROUND times per member per round: each answer is my shards of
             one vector, about what the member sent me in that round

An owner that does not answer within the reply grace, or answers parts that do not verify
(`bad_signature`, counted against it), leaves its chunks out: the gathered vector is partial,
never wrong.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starling.collectives.bodies import KeptAsk, KeptRow, Refused, kept_rows
from starling.collectives.codec import packet_from_wire
from starling.collectives.compact import view_digest
from starling.collectives.contributions import Contributions, SignedPart
from starling.collectives.outcome import ReduceTimeouts
from starling.collectives.placement import Placement
from starling.collectives.requests import AskBudget, member_ask, request_patiently
from starling.collectives.retention import KeptPart, Retention
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, Refuser, Reply

if TYPE_CHECKING:
    from starling.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

SUFFIX = ".kept"  # a reducer's gathers travel on its topic with this suffix
GATHERS_PER_ROUND = 2  # gathers one member may make of one owner per round


class Gathering:
    """One reducer's gathers (its topic): `gather` on the caller's thread, `_serve` on the
    network thread."""

    def __init__(self, node: Node, topic: str, placement: Placement, retention: Retention,
                 contributions: Contributions, timeouts: ReduceTimeouts, refuse: Refuser,
                 resolve_view: Callable[[bytes], tuple[str, ...] | None]) -> None:
        self.node, self.topic, self.placement, self.retention = node, topic, placement, retention
        self.contributions, self.timeouts, self._refuse = contributions, timeouts, refuse
        self._resolve_view = resolve_view
        self._asked = AskBudget(GATHERS_PER_ROUND)  # gathers answered per (member, round)
        node.on(topic + SUFFIX, self._serve)

    def gather(self, t: int, members: tuple[str, ...], author: str) -> list[KeptPart]:
        """Caller's thread, after round t's `wait()` (with `keep(t, ...)` asked before it on every
        owner): `author`'s signed parts of round t from every owner that kept them, mine too,
        checked and decoded."""
        kept = self.node.run(self._gather(t, members, author))
        return self.retention.decoded(t, {author: kept}).get(author, [])

    async def _gather(self, t: int, members: tuple[str, ...], author: str) -> list[Any]:
        me, view = self.node.peer_id, view_digest(members)
        mine = [k for k in self.retention.shown(t, author) if k[4].view == view]
        deadline = AwakeDeadline(self.timeouts.reply_grace_s)
        owners = sorted(self.placement.owner_set(members, t) - {me, author})
        gathered = await asyncio.gather(*(self._ask(owner, t, members, view, author, deadline) for owner in owners))
        return mine + [k for got in gathered for k in got]

    async def _ask(self, owner: str, t: int, members: tuple[str, ...], view: bytes, author: str,
                   deadline: AwakeDeadline) -> list[Any]:
        shards = self.placement.shards(members, t)
        try:
            msg = await request_patiently(self.node, owner, self.topic + SUFFIX, KeptAsk(t, view, author).to_wire(),
                                          (), deadline, self.timeouts.retry_interval_s)
            if Refused.from_wire(msg.body) is not None:
                return []
            rows, at, out = kept_rows(msg.body), 0, []
            for row in rows:
                frames = msg.payload[at:at + row.buffers]
                at += row.buffers
                if not (row.shard < len(shards) and owner in shards[row.shard][1]
                        and row.chunk < len(shards[row.shard][0])):
                    continue  # not a chunk that owner owns in that round
                packet = packet_from_wire(row.header, frames)
                content = self.contributions.verify_part(author, t, row.shard, row.chunk, view, row.weight, packet,
                                                         row.sig, row.recipe, row.state)
                if content is None:
                    self.node.trust.note(owner, "bad_signature")
                    continue
                lo, hi = shards[row.shard][0][row.chunk]
                out.append((row.shard, row.chunk, lo, hi,
                            SignedPart(view, row.weight, packet, row.sig, content, row.recipe, row.state)))
            return out
        except Exception as exc:
            log.info("%s: %s: no parts of %s in round %d from %s: %s", self.node.peer_id, self.topic, author, t,
                     owner, exc)
            return []

    async def _serve(self, msg: Message) -> Reply | dict[str, Any]:
        """A member asks for the parts one author sent my groups in a round."""
        asked = member_ask(msg, KeptAsk.from_wire, self._resolve_view, self._refuse, "gather its parts")
        if isinstance(asked, dict):  # refused
            return asked
        ask, _members = asked
        if not self._asked.take(msg.sender, ask.round):
            return self._refuse(Refusal.BUSY, f"at most {GATHERS_PER_ROUND} gathers of round {ask.round} per member")
        rows, buffers = [], []
        for i, c, _, _, signed in self.retention.shown(ask.round, ask.author):
            if signed.view != ask.view or signed.packet is None:
                continue
            weight = 1.0 if signed.weight is None else float(signed.weight)
            rows.append(KeptRow(i, c, weight, signed.sig, signed.recipe, signed.packet.header,
                                len(signed.packet.buffers), signed.state).to_wire())
            buffers.extend(signed.packet.buffers)
        return Reply({"ok": True, "parts": rows}, tuple(buffers))
