"""A quorum close: which members' contributions a round takes, decided by one peer and
announced, so that every member applies the same set (issue 20: peers of different speeds).

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

from starling.collectives.reduce import ReduceTimeouts
from starling.collectives.requests import request_patiently
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, refusal

if TYPE_CHECKING:
    from starling.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

_KEEP_CLOSED_ROUNDS = 64  # closed rounds a leader remembers, to answer late asks with their set


@dataclass(frozen=True)
class Closing:
    """The contributions round `round` takes: (peer, weight), sorted by peer."""

    round: int
    contributions: tuple[tuple[str, float], ...]

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(peer for peer, _ in self.contributions)

    def weight_of(self, peer: str) -> float | None:
        return next((w for p, w in self.contributions if p == peer), None)


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
        body = {"round": t, "members": list(members), "weight": weight}
        try:
            msg = await request_patiently(self.node, leader, self.topic, body, (), deadline,
                                          self.timeouts.retry_interval_s)
        except Exception as exc:  # dead or silent leader, or it refused: out of this round
            log.info("%s: %s round %d: no closing set from %s: %s", me, self.topic, t, leader, exc)
            return None
        try:
            return read_closing(msg.body, t)
        except ValueError as exc:
            self.node.stats.count_rejected(f"{self.topic}.malformed_close")
            log.warning("%s: %s round %d: refused the closing set from %s: %s", me, self.topic, t, leader, exc)
            return None

    async def _on_ask(self, msg: Message) -> dict[str, Any]:
        if not self._is_open():
            return refusal(Refusal.CLOSED, "protocol closed")
        body = msg.body
        try:
            t, weight = body["round"], body["weight"]
            members = tuple(str(m) for m in body["members"])
        except (TypeError, KeyError, ValueError, AttributeError):
            return self._reject(Refusal.MALFORMED, "body must be {round, members, weight}")
        if type(t) is not int or t < 0:
            return self._reject(Refusal.MALFORMED, f"round must be a whole number >= 0, got {t!r}")
        if type(weight) not in (int, float) or not (math.isfinite(weight) and weight >= 0.0):
            return self._reject(Refusal.MALFORMED, f"weight must be a finite number >= 0, got {weight!r}")
        if list(members) != sorted(set(members)) or msg.sender not in members:
            return self._reject(Refusal.MALFORMED, "members must be sorted, unique, and include the sender")
        if self.leader(t, members) != self.node.peer_id:
            return self._reject(Refusal.NOT_OWNER, f"this peer does not lead round {t} of that member list")
        closing = await self._gather(t, members, msg.sender, float(weight))
        return closing_body(closing)

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

    def _reject(self, reason: Refusal, detail: str) -> dict[str, Any]:
        self.node.stats.count_rejected(f"{self.topic}.{reason.value}")
        return refusal(reason, detail)

    # ------------------------------------------------------------------ membership hooks
    def peer_left(self, peer_id: str) -> None:
        """Network thread: open rounds stop waiting for a member that left or died."""
        self._gone.add(peer_id)
        for t, gathering in list(self._open.items()):
            gathering.expected.discard(peer_id)
            self._check(t, gathering)

    def peer_joined(self, peer_id: str) -> None:
        self._gone.discard(peer_id)


def closing_body(closing: Closing) -> dict[str, Any]:
    return {"ok": True, "round": closing.round, "closed": [[p, w] for p, w in closing.contributions]}


def read_closing(body: Any, t: int) -> Closing:
    """A leader's reply for round t as a `Closing`; ValueError naming what is wrong with it."""
    if not isinstance(body, dict) or body.get("ok") is not True:
        reason = body.get("reason") if isinstance(body, dict) else None
        raise ValueError(f"not a closing set: {reason or type(body).__name__}")
    if body.get("round") != t:
        raise ValueError(f"a set for round {body.get('round')!r}, not {t}")
    closed = body.get("closed")
    if not isinstance(closed, list) or not closed:
        raise ValueError("closed must be a non-empty list of [peer, weight]")
    pairs = []
    for entry in closed:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
                and type(entry[1]) in (int, float) and math.isfinite(entry[1]) and entry[1] >= 0.0):
            raise ValueError(f"bad entry {entry!r}: expected [peer, weight >= 0]")
        pairs.append((entry[0], float(entry[1])))
    peers = [p for p, _ in pairs]
    if peers != sorted(set(peers)):
        raise ValueError("peers must be sorted and unique")
    return Closing(t, tuple(pairs))
