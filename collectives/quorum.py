"""A quorum close: which members' contributions a round takes, decided by one peer and
announced, so that every member applies the same set, however different the members' speeds.

    leader(t) = members[(t + salt) % |members|]              # the member list a peer sent with
    member, when its contribution for round t is ready:
        ask leader(t): "I am in round t with weight w"       # a request; its reply is the set
    leader, for round t:
        collect asks until every expected member is in, or
            K (= quorum) are in and quorum_grace_s has passed since the K-th, or
            round_timeout_s has passed since the first
        close: reply to every waiting ask with the closing set {(peer, weight)}
        an ask that comes after the close gets the same set at once (without its sender)

A member in the set then averages with exactly those members (the sharded all-reduce with
`members` = the set); a member left out learns so from the same reply: it missed the round,
and its protocol decides what becomes of its contribution (DiLoCo folds it into the
fragment's next round). A reply that is not a well-formed set is refused, counted in the
node's stats as `<topic>.malformed_close`, and read as no set at all, as a leader that
never answered is: the asker is then out of that round.

The set is the leader's alone, so members never guess it from what each of them saw. Two
members whose member lists differ may ask different leaders; each leader's set then holds
only the members that asked it, and the all-reduce, which groups parts by member list, keeps
the two apart (the drift guard repairs what that costs).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starling.collectives.bodies import Ask, BodyError, Closing
from starling.collectives.reduce import ReduceTimeouts
from starling.collectives.requests import request_patiently
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, Refuser, refusal

if TYPE_CHECKING:
    from starling.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

__all__ = ["Closing", "QuorumClose"]

_KEEP_CLOSED_ROUNDS = 64  # closed rounds a leader remembers, to answer late asks with their set


@dataclass
class _Gathering:
    """A leader's round that is still open."""

    expected: set[str]
    weights: dict[str, float] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    closing: Closing | None = None
    grace: asyncio.TimerHandle | None = None
    timer: asyncio.Future[None] | None = None


class QuorumClose:
    """Rounds of one topic, closed at a quorum: `ask(t, members, weight)` from the caller's
    thread returns a future of the round's `Closing` (None: no valid set came back in time)."""

    def __init__(self, node: Node, topic: str, quorum: int, grace_s: float, timeouts: ReduceTimeouts,
                 is_open: Callable[[], bool] = lambda: True, salt: int = 0) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        if not (math.isfinite(grace_s) and grace_s >= 0.0):
            raise ValueError(f"quorum_grace_s must be >= 0, got {grace_s}")
        self.node, self.topic, self.quorum, self.grace_s = node, topic, quorum, grace_s
        self.timeouts, self.salt, self._is_open = timeouts, salt, is_open
        # network thread only
        self._open: dict[int, _Gathering] = {}
        self._closed: dict[int, Closing] = {}
        self._gone: set[str] = set()
        self._refuse = Refuser(node.stats, topic, node.peer_id)
        node.on(topic, self._on_ask)

    def leader(self, t: int, members: tuple[str, ...]) -> str:
        return members[(t + self.salt) % len(members)]

    # ------------------------------------------------------------------ caller's thread
    def ask(self, t: int, members: tuple[str, ...], weight: float) -> concurrent.futures.Future[Closing | None]:
        if not (math.isfinite(weight) and weight >= 0.0):
            raise ValueError(f"{self.topic}: weight must be a finite number >= 0, got {weight!r}")
        return self.node.submit(self._ask(t, tuple(members), float(weight)))

    # ------------------------------------------------------------------ network thread
    async def _ask(self, t: int, members: tuple[str, ...], weight: float) -> Closing | None:
        me = self.node.peer_id
        leader = self.leader(t, members)
        if leader == me:
            return await self._gather(t, members, me, weight)
        deadline = AwakeDeadline(self.timeouts.round_timeout_s + self.timeouts.reply_grace_s)
        try:
            msg = await request_patiently(self.node, leader, self.topic, Ask(t, members, weight).to_wire(), (),
                                          deadline, self.timeouts.retry_interval_s)
        except Exception as exc:  # dead or silent leader, or it refused: out of this round
            log.info("%s: %s round %d: no closing set from %s: %s", me, self.topic, t, leader, exc)
            return None
        try:
            return Closing.from_wire(msg.body, t)
        except BodyError as exc:
            self._refuse.count("malformed_close", f"round {t}: the closing set from {leader}: {exc}")
            return None

    async def _on_ask(self, msg: Message) -> dict[str, Any]:
        if not self._is_open():
            return refusal(Refusal.CLOSED, "protocol closed")
        try:
            ask = Ask.from_wire(msg.body)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, str(exc))
        if msg.sender not in ask.members:
            return self._refuse(Refusal.MALFORMED, "members must include the sender")
        if self.leader(ask.round, ask.members) != self.node.peer_id:
            return self._refuse(Refusal.NOT_OWNER, f"this peer does not lead round {ask.round} of that member list")
        closing = await self._gather(ask.round, ask.members, msg.sender, ask.weight)
        return closing.to_wire()

    async def _gather(self, t: int, members: tuple[str, ...], sender: str, weight: float) -> Closing:
        if t in self._closed:
            return self._closed[t]
        gathering = self._open.get(t)
        if gathering is None:
            gathering = self._open[t] = _Gathering(set(members) - self._gone)
            gathering.timer = asyncio.ensure_future(self._close_in_time(t, gathering))
        gathering.weights.setdefault(sender, weight)  # a repeated ask keeps the first weight
        self._check(t, gathering)
        await gathering.done.wait()
        assert gathering.closing is not None
        return gathering.closing

    def _check(self, t: int, gathering: _Gathering) -> None:
        """Close now when every expected member is in; start the grace window at the quorum."""
        if gathering.closing is not None:
            return
        if gathering.expected <= set(gathering.weights):
            self._close(t, gathering)
        elif len(gathering.weights) >= min(self.quorum, len(gathering.expected)) and gathering.grace is None:
            gathering.grace = asyncio.get_running_loop().call_later(self.grace_s, self._close, t, gathering)

    async def _close_in_time(self, t: int, gathering: _Gathering) -> None:
        try:
            await AwakeDeadline(self.timeouts.round_timeout_s).wait(gathering.done.wait())
        except asyncio.TimeoutError:
            self._close(t, gathering)

    def _close(self, t: int, gathering: _Gathering) -> None:
        if gathering.closing is not None:
            return
        gathering.closing = Closing(t, tuple(sorted(gathering.weights.items())))
        missing = gathering.expected - set(gathering.weights)
        if missing:
            log.info("%s: %s round %d closed without %s", self.node.peer_id, self.topic, t, sorted(missing))
        if gathering.grace is not None:
            gathering.grace.cancel()
        self._open.pop(t, None)
        self._closed[t] = gathering.closing
        while len(self._closed) > _KEEP_CLOSED_ROUNDS:
            del self._closed[min(self._closed)]
        gathering.done.set()

    # ------------------------------------------------------------------ membership hooks
    def peer_left(self, peer_id: str) -> None:
        """Network thread: open rounds stop waiting for a member that left or died."""
        self._gone.add(peer_id)
        for t, gathering in list(self._open.items()):
            gathering.expected.discard(peer_id)
            self._check(t, gathering)

    def peer_joined(self, peer_id: str) -> None:
        self._gone.discard(peer_id)

